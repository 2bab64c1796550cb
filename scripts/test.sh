#!/usr/bin/env bash
# make test: every test, stage by stage, and at the end one report however the run ends (scripts/test_report.py):
# each stage's time, each part ci/ built or found cached, the slowest tests, every skipped test, and the
# run's own time budget. It fails when a stage fails, when any test skipped (every test must run on the CI
# machine; TEST_ALLOW_SKIPS=1 lets a partial machine through), or when the run took more than
# TEST_BUDGET_MINUTES (default 80: CI kills a run at 90 and says nothing, so the run fails itself first).
#
# Stages: tools (what the unit stage's chart and GitOps tests run: helm, kubectl, kubeconform, checkov,
# kstatus; ci/ builds them once per version, the CI cluster reuses them), lint, unit, integration, e2e on
# the CI cluster (make -C ci e2e: the cluster's qualification, then the suite), the kind stage.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
BIN=${BIN:-$repo/.venv/bin}
TEST_JOBS=${TEST_JOBS:-auto}
out=${TEST_OUT:-/tmp/gpu-agent-test/$(date -u +%Y%m%dT%H%M%S)}
mkdir -p "$out/junit"
ledger=$out/stages.tsv
: > "$ledger"
export TEST_JUNIT_DIR=$out/junit  # the e2e stages write theirs here too (ci/scripts/e2e.sh)
started=$SECONDS
failed=0

stage() {  # stage NAME CMD...: runs CMD with its output kept in $out/NAME.log, and records its time and exit code
  local name=$1 t=$SECONDS rc; shift
  printf '%s test: stage %s\n' "$(date -u +%H:%M:%S)" "$name" >&2
  "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - t))" "$rc" >> "$ledger"
  ((rc == 0)) || failed=1
  return "$rc"
}

report() {
  "$BIN/python" scripts/test_report.py --out "$out" --elapsed "$((SECONDS - started))" \
    --budget-minutes "${TEST_BUDGET_MINUTES:-80}" ${TEST_ALLOW_SKIPS:+--allow-skips} || failed=1
  exit "$failed"
}
trap report EXIT

pytest_stage() {  # pytest_stage NAME PYTEST_ARGS...
  local name=$1; shift
  stage "$name" "$BIN/pytest" --junitxml="$out/junit/$name.xml" "$@"
}

stage tools bash -c 'bash ci/scripts/build-kstatus.sh && bash ci/scripts/install-tools.sh' || exit 1
stage lint bash -c "$BIN/lint-imports && $BIN/ruff check . && $BIN/mypy && $BIN/python scripts/check-doc-links.py" || exit 1
pytest_stage unit -n "$TEST_JOBS" agent/tests/unit fake-gpu/tests hooks/tests ci/tests charts/tests || exit 1
pytest_stage integration -n "$TEST_JOBS" agent/tests/integration || exit 1
# The e2e stages: the CI cluster runs every test but the `fast` ones (`make e2e` alone runs them all); the kind
# stage runs the `fast` ones, so that `make e2e CLUSTER=kind` is proven on every run without running a test twice.
stage e2e make -C ci e2e CLUSTER=ci PYTEST="$BIN/pytest" PYTEST_ARGS="-m 'not fast'" || exit 1
stage kind make -C ci kind-stage PYTEST="$BIN/pytest" || exit 1
