#!/usr/bin/env bash
# unit-stages.sh first | beside: the unit and integration stages of `make test` (scripts/test.sh), each through
# scripts/stage.sh (its log in $TEST_OUT, its line in the ledger). Exits 1 if one failed.
#
#   first   the unit tests that meet the wall clock (real threads, sockets and processes with time bounds: slow
#           clients, TLS lingering, leader election, the device plugin's gRPC, ...), then the integration tests (real
#           processes on loopback, bounds of 100 ms to a few seconds), before the e2e stage, alone: a bound measured
#           on a loaded machine would be false. The integration stage runs only if the unit stage passed.
#   beside  the unit tests that only compute (BESIDE below: the chart's renders and linters, the simulation on its
#           virtual clock; about half the unit stage's CPU), beside the e2e stage's serial phase, on the CPU it leaves
#           idle (a third of both cores is busy there). scripts/test.sh starts it before the e2e stage; it waits until
#           ci/scripts/e2e.sh writes its first phase to $E2E_PHASE_FILE (the cluster up and its images built: on a
#           fresh machine minutes of builds on both cores) or test.sh writes "ended" there. It takes a session of its
#           own (setsid), whose autogroup, and each process in it, is niced to 19: the CPU scheduler gives it a core
#           only when nothing of the e2e stage and its cluster wants one (weight 15 against 1024), so the e2e tests'
#           time bounds meet the load they met alone. Its output goes to its log alone; test.sh prints it once the e2e
#           stage has ended.
# A test added to BESIDE must hold no wall-clock bound: starved for seconds at a time, it would fail.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
: "${TEST_OUT:?unit-stages.sh needs TEST_OUT: the output folder of the run}"
BIN=${BIN:-$repo/.venv/bin}
TEST_JOBS=${TEST_JOBS:-auto}
BESIDE=(charts/tests agent/tests/unit/test_sim.py)
UNIT=(agent/tests/unit fake-gpu/tests hooks/tests ci/tests)

pytest_stage() {  # pytest_stage NAME PYTEST_ARGS...
  local name=$1; shift
  bash scripts/stage.sh "$name" "$BIN/pytest" --junitxml="$TEST_OUT/junit/$name.xml" "$@"
}

case ${1:-} in
  first)
    ignore=()
    for path in "${BESIDE[@]}"; do [[ $path != agent/tests/unit/* ]] || ignore+=(--ignore="$path"); done
    if [[ ${UNIT_BESIDE:-1} == 1 ]]; then
      pytest_stage unit -n "$TEST_JOBS" "${UNIT[@]}" "${ignore[@]}" || exit 1
    else
      pytest_stage unit -n "$TEST_JOBS" "${UNIT[@]}" "${BESIDE[@]}" || exit 1
    fi
    pytest_stage integration -n "$TEST_JOBS" agent/tests/integration || exit 1
    ;;
  beside)
    if [[ ${UNIT_STAGES_SETSID:-} != 1 ]]; then  # once, in a session of its own (-w: its exit code is this one's)
      UNIT_STAGES_SETSID=1 exec setsid -w bash "$0" beside
    fi
    echo 19 > /proc/self/autogroup 2>/dev/null || true  # absent where the kernel has no autogroups: the nice below does
    renice -n 19 $$ > /dev/null
    phases=${E2E_PHASE_FILE:?unit-stages.sh beside needs E2E_PHASE_FILE: the file the e2e stage writes its phases to}
    until [[ -s $phases ]]; do sleep 2; done  # test.sh writes "ended" there once the e2e stage has ended, however
    echo "$(date -u +%H:%M:%S) unit-stages: starting beside the e2e stage (its phase: $(tail -1 "$phases"))"
    STAGE_BESIDE=e2e pytest_stage unit-compute -n "$TEST_JOBS" "${BESIDE[@]}" || exit 1
    ;;
  *) echo "usage: unit-stages.sh first|beside" >&2; exit 2 ;;
esac
