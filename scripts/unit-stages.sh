#!/usr/bin/env bash
# unit-stages.sh [--beside]: the unit and integration stages of `make test` (scripts/test.sh), one after the other,
# each through scripts/stage.sh (its log in $TEST_OUT, its line in the ledger). The integration stage runs only if the
# unit stage passed. Exits 1 if either failed.
#
# --beside: run beside the e2e stage's serial phase, on the CPU it leaves idle. scripts/test.sh starts it before the
# e2e stage; it waits until ci/scripts/e2e.sh writes its first phase to $E2E_PHASE_FILE (the cluster is up, its images
# built: on a fresh machine minutes of builds on both cores, which it must not meet) or test.sh writes "ended" there. The serial phase mostly waits on its cluster (about a third of both cores busy)
# and these stages are about four minutes of CPU. This process takes a session of its own (setsid), whose autogroup,
# and each process in it, is niced to 19: the CPU scheduler gives them a core only when nothing of the e2e stage and
# its cluster wants it (weight 15 against 1024), so the e2e tests' time bounds meet the load they met alone. Their
# output goes to their logs alone; scripts/test.sh prints it once the e2e stage has ended.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
: "${TEST_OUT:?unit-stages.sh needs TEST_OUT: the output folder of the run}"
BIN=${BIN:-$repo/.venv/bin}
TEST_JOBS=${TEST_JOBS:-auto}
if [[ ${1:-} == --beside ]]; then
  if [[ ${UNIT_STAGES_SETSID:-} != 1 ]]; then  # once, in a session of its own (-w: its exit code is this one's)
    UNIT_STAGES_SETSID=1 exec setsid -w bash "$0" --beside
  fi
  echo 19 > /proc/self/autogroup 2>/dev/null || true  # absent where the kernel has no autogroups: the nice below does
  renice -n 19 $$ > /dev/null
  export STAGE_BESIDE=e2e
  phases=${E2E_PHASE_FILE:?unit-stages.sh --beside needs E2E_PHASE_FILE: the file the e2e stage writes its phases to}
  until [[ -s $phases ]]; do sleep 2; done  # test.sh writes "ended" there once the e2e stage has ended, however
  echo "$(date -u +%H:%M:%S) unit-stages: starting beside the e2e stage (its phase: $(tail -1 "$phases"))"
fi

pytest_stage() {  # pytest_stage NAME PYTEST_ARGS...
  local name=$1; shift
  bash scripts/stage.sh "$name" "$BIN/pytest" --junitxml="$TEST_OUT/junit/$name.xml" "$@"
}
pytest_stage unit -n "$TEST_JOBS" agent/tests/unit fake-gpu/tests hooks/tests ci/tests charts/tests || exit 1
pytest_stage integration -n "$TEST_JOBS" agent/tests/integration || exit 1
