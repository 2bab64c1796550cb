#!/usr/bin/env bash
# make test: every test, stage by stage, and at the end one report however the run ends (scripts/test_report.py):
# each stage's time, each part ci/ built or found cached, the slowest tests, every skipped test, and the
# run's own time budget. It fails when a stage fails, when any test skipped (every test must run on the CI
# machine; TEST_ALLOW_SKIPS=1 lets a partial machine through), or when the run took more than
# TEST_BUDGET_MINUTES (default 80: CI kills a run at 90 and says nothing, so the run fails itself first).
#
# Stages: tools (what the unit stage's chart and GitOps tests run: helm, kubectl, kubeconform, checkov,
# kstatus; ci/ builds them once per version, the CI cluster reuses them), lint, unit, integration, e2e on the CI
# cluster (make -C ci e2e: the cluster's qualification, then the suite), the kind stage. The unit stage runs
# after lint, or beside the e2e serial phase with TEST_UNIT_BESIDE_E2E=1 (unit_beside_e2e below).
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

unit=(-n "$TEST_JOBS" agent/tests/unit fake-gpu/tests hooks/tests ci/tests charts/tests)

# The unit stage beside the e2e stage's serial phase: the serial tests wait on the cluster most of their time (the
# phase's timing line says how busy the CPU was), so the unit tests at the lowest CPU priority (nice 19: they take
# what the cluster leaves) cost that phase next to nothing, and the run their own minutes. They start once
# ci/scripts/e2e.sh says the serial phase began (it touches E2E_SERIAL_FLAG), or once the e2e stage ended without
# that; not before: cluster-up and the image builds keep both cores busy, and a unit test's deadline (a thread's,
# polled) would starve. Their output goes to unit.log, their verdict to the console when they end. Unit tests use
# injected clocks; the integration tests, some of them timed on loopback, keep a stage of their own before.
# Off unless TEST_UNIT_BESIDE_E2E=1: measured twice on the CI machine, it saved the unit stage's 2.5 min once, and
# the other time fake-gpu's kubelet-restart test (a 15 s deadline on a real gRPC re-registration) starved at nice
# 19 while the serial phase kept both cores busy for a moment. Until the unit tests with real-time deadlines are
# told apart from the rest, the unit stage runs first, in the foreground, as any other.
unit_beside_e2e() {
  export E2E_SERIAL_FLAG=$out/e2e-serial-started
  (
    until [[ -e $E2E_SERIAL_FLAG || -e $out/e2e-ended ]]; do sleep 1; done
    t=$SECONDS
    printf '%s test: stage unit, beside the e2e stage at nice 19 (its output: %s)\n' "$(date -u +%H:%M:%S)" "$out/unit.log" >&2
    nice -n 19 "$BIN/pytest" --junitxml="$out/junit/unit.xml" "${unit[@]}" > "$out/unit.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' unit "$((SECONDS - t))" "$rc" >> "$ledger"
    printf '%s test: stage unit (beside the e2e stage) %s in %ss: %s\n' "$(date -u +%H:%M:%S)" \
      "$( ((rc == 0)) && echo passed || echo FAILED)" "$((SECONDS - t))" "$(tail -n 1 "$out/unit.log")" >&2
    ((rc == 0)) || tail -n 60 "$out/unit.log" >&2
    exit "$rc"
  ) &
  unit_pid=$!
}

stage tools bash -c 'bash ci/scripts/build-kstatus.sh && bash ci/scripts/install-tools.sh' || exit 1
stage lint bash -c "$BIN/lint-imports && $BIN/ruff check . && $BIN/mypy && $BIN/python scripts/check-doc-links.py" || exit 1
if [[ ${TEST_UNIT_BESIDE_E2E:-0} != 1 ]]; then pytest_stage unit "${unit[@]}" || exit 1; fi
if ! pytest_stage integration -n "$TEST_JOBS" agent/tests/integration; then
  [[ ${TEST_UNIT_BESIDE_E2E:-0} != 1 ]] || pytest_stage unit "${unit[@]}"  # the report says how the unit tests stand too
  exit 1
fi
# The e2e stages: the CI cluster runs every test but the `fast` ones (`make e2e` alone runs them all); the kind
# stage runs the `fast` ones, so that `make e2e CLUSTER=kind` is proven on every run without running a test twice.
[[ ${TEST_UNIT_BESIDE_E2E:-0} != 1 ]] || unit_beside_e2e
stage e2e make -C ci e2e CLUSTER=ci PYTEST="$BIN/pytest" PYTEST_ARGS="-m 'not fast'"
e2e_rc=$?
if [[ -n ${unit_pid:-} ]]; then
  touch "$out/e2e-ended"
  wait "$unit_pid" || { failed=1; exit 1; }
fi
((e2e_rc == 0)) || exit 1
stage kind make -C ci kind-stage PYTEST="$BIN/pytest" || exit 1
