#!/usr/bin/env bash
# unit-stages.sh first | beside: the unit and integration stages of `make test` (scripts/test.sh), each through
# scripts/stage.sh (its log in $TEST_OUT, its line in the ledger). Exits 1 if one failed.
#
#   first   the unit tests that meet the wall clock (real threads, sockets and processes with time bounds: slow
#           clients, TLS lingering, leader election, the device plugin's gRPC, ...), then the integration tests (real
#           processes on loopback, bounds of 100 ms to a few seconds), before the e2e stage, alone: a bound measured
#           on a loaded machine would be false. The integration stage runs only if the unit stage passed.
#   beside  the unit tests that only compute (BESIDE below: the chart's renders and linters, the simulation on its
#           virtual clock; about half the unit stage's CPU) as the stage unit-compute, beside the e2e stage's serial
#           phase, on the CPU it leaves idle (scripts/beside-e2e.sh: when it starts, how it yields).
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
    [[ ${UNIT_BESIDE:-1} == 1 ]] && rest=("${ignore[@]}") || rest=("${BESIDE[@]}")  # left out, or run here too
    pytest_stage unit -n "$TEST_JOBS" "${UNIT[@]}" "${rest[@]}" || exit 1
    pytest_stage integration -n "$TEST_JOBS" agent/tests/integration || exit 1
    ;;
  beside)  # through scripts/beside-e2e.sh (the wait, the session, the nice)
    exec bash scripts/beside-e2e.sh unit-compute "$BIN/pytest" --junitxml="$TEST_OUT/junit/unit-compute.xml" \
      -n "$TEST_JOBS" "${BESIDE[@]}"
    ;;
  *) echo "usage: unit-stages.sh first|beside" >&2; exit 2 ;;
esac
