#!/usr/bin/env bash
# beside-e2e.sh NAME CMD...: a stage of `make test` (scripts/stage.sh NAME CMD...) run beside the e2e stage's serial
# phase, on the CPU that phase leaves idle (it mostly waits on its cluster: about a third of both cores is busy).
#
# scripts/test.sh starts it in the background before the e2e stage. It waits until ci/scripts/e2e.sh writes its first
# phase to $E2E_PHASE_FILE (the CI cluster up and its images built: on a fresh machine minutes of builds on both
# cores), or test.sh writes "ended" there (the e2e stage ended without a phase). It takes a session of its own
# (setsid), whose autogroup, and each process in it, is niced to 19: the CPU scheduler gives it a core only when
# nothing of the e2e stage and its cluster wants one (weight 15 against 1024), so the e2e tests' time bounds meet the
# load they met alone. (Containers it starts live in cgroups of their own, outside the autogroups: the kind stage
# lowers its nodes' CPU weight itself, KIND_CPU_SHARES.) Its output goes to $TEST_OUT/NAME.log alone (STAGE_BESIDE);
# test.sh prints it once the e2e stage has ended. Exits with CMD's code.
#
# What runs here must hold no tight wall-clock bound: it may be starved for seconds at a time.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
if [[ ${BESIDE_E2E_SETSID:-} != 1 ]]; then  # once, in a session of its own (-w: its exit code is this one's)
  BESIDE_E2E_SETSID=1 exec setsid -w bash "$0" "$@"
fi
unset BESIDE_E2E_SETSID
echo 19 > /proc/self/autogroup 2>/dev/null || true  # absent where the kernel has no autogroups: the nice below does
renice -n 19 $$ > /dev/null
phases=${E2E_PHASE_FILE:?beside-e2e.sh needs E2E_PHASE_FILE: the file the e2e stage writes its phases to}
until [[ -s $phases ]]; do sleep 2; done
printf '%s test: %s starts beside the e2e stage (its phase: %s)\n' "$(date -u +%H:%M:%S)" "$1" "$(tail -1 "$phases")"
STAGE_BESIDE=e2e exec bash "$repo/scripts/stage.sh" "$@"
