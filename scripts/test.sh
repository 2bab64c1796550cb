#!/usr/bin/env bash
# make test: every test, stage by stage, and at the end one report however the run ends (scripts/test_report.py):
# each stage's time, each part ci/ built or found cached, the slowest tests, every skipped test, and the
# run's own time budget. It fails when a stage fails, when any test skipped (every test must run on the CI
# machine; TEST_ALLOW_SKIPS=1 lets a partial machine through), or when the run took more than
# TEST_BUDGET_MINUTES (default 80: CI kills a run at 90 and says nothing, so the run fails itself first).
#
# Stages: tools (what the unit stage's chart and GitOps tests run: helm, kubectl, kubeconform, checkov,
# kstatus; ci/ builds them once per version, the CI cluster reuses them), lint, unit, integration, e2e on
# the CI cluster (make -C ci e2e: the cluster's qualification, then the suite), the kind stage (beside the e2e
# stage's parallel phase, below).
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
export TEST_OUT=$out
started=$SECONDS
failed=0

stage() {  # stage NAME CMD...: scripts/stage.sh (its output in $out/NAME.log, its time and code in the ledger)
  bash "$repo/scripts/stage.sh" "$@" && return 0
  local rc=$?; failed=1; return "$rc"
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
stage lint bash -c "$BIN/lint-imports && $BIN/ruff check . && $BIN/mypy && $BIN/python scripts/check-doc-links.py && \
  $BIN/python scripts/check-runtime-rules.py" || exit 1
pytest_stage unit -n "$TEST_JOBS" agent/tests/unit fake-gpu/tests hooks/tests ci/tests charts/tests || exit 1
pytest_stage integration -n "$TEST_JOBS" agent/tests/integration || exit 1
# The e2e stages: the CI cluster runs every test but the `fast` ones (`make e2e` alone runs them all); the kind
# stage runs the `fast` ones, so that `make e2e CLUSTER=kind` is proven on every run without running a test twice.
# The kind stage is a cluster of its own (podman) whose tests mostly wait: it runs beside the CI cluster's parallel
# phase once the lane has ended (E2E_BESIDE, ci/scripts/e2e.sh; its output follows the lane's), on a pod network
# apart from the CI cluster's. TEST_KIND_BESIDE=0: after the e2e stage, alone.
kind_stage=(make -C "$repo/ci" kind-stage PYTEST="$BIN/pytest")
if [[ ${TEST_KIND_BESIDE:-1} == 1 ]]; then
  # What the kind stage builds (on a fresh machine: podman, kind, the node image; minutes of CPU) is built first,
  # alone, so that beside the parallel phase it only runs its cluster and tests.
  stage kind-image bash -c "bash ci/scripts/install-deps.sh && bash ci/scripts/install-podman.sh && \
    KIND_ENGINE=podman bash ci/scripts/build-kind-node.sh" || exit 1
  # started from inside `make -C ci e2e ... PYTEST_ARGS=...`, whose command-line variables reach it through the
  # environment and MAKEFLAGS: without them the kind stage runs its own selection, as when test.sh runs it
  export E2E_BESIDE="$(printf '%q ' env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u MAKEOVERRIDES -u PYTEST_ARGS -u CLUSTER \
    STAGE_BESIDE=e2e bash "$repo/scripts/stage.sh" kind "${kind_stage[@]}")"
fi
stage e2e make -C ci e2e CLUSTER=ci PYTEST="$BIN/pytest" PYTEST_ARGS="-m 'not fast'"; e2e=$?
if cut -f1 "$ledger" | grep -qx kind; then
  printf '%s test: the kind stage ran beside the e2e stage; its output (%s):\n' "$(date -u +%H:%M:%S)" "$out/kind.log" >&2
  cat "$out/kind.log" >&2
fi
((e2e == 0)) || exit 1
if ! cut -f1 "$ledger" | grep -qx kind; then
  unset E2E_BESIDE; stage kind "${kind_stage[@]}" || exit 1
elif awk -F'\t' '$1 == "kind" && $3 != 0 {bad = 1} END {exit !bad}' "$ledger"; then
  failed=1; exit 1
fi
