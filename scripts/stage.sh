#!/usr/bin/env bash
# stage.sh NAME CMD...: one stage of `make test` (scripts/test.sh). Runs CMD with its output kept in
# $TEST_OUT/NAME.log (and shown as it runs), then records its seconds and exit code as a line of
# $TEST_OUT/stages.tsv, which scripts/test_report.py reads. STAGE_BESIDE="e2e": the stage ran beside that
# one (started through scripts/beside-e2e.sh), so its time overlaps it; the report says so, and its
# output goes to the log alone (scripts/test.sh prints it once that stage has ended).
# Exits with CMD's code.
set -uo pipefail
name=${1:?usage: stage.sh NAME CMD...}; shift
out=${TEST_OUT:?stage.sh needs TEST_OUT: the output folder of the run}
t=$SECONDS
printf '%s test: stage %s%s\n' "$(date -u +%H:%M:%S)" "$name" "${STAGE_BESIDE:+ (beside $STAGE_BESIDE)}" >&2
if [[ -n ${STAGE_BESIDE:-} ]]; then  # its output would interleave with the other's: test.sh shows it after
  "$@" > "$out/$name.log" 2>&1
  rc=$?
else
  "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
fi
# one short write: a line appended beside another stage's stays whole
printf '%s\t%s\t%s\t%s\n' "$name" "$((SECONDS - t))" "$rc" "${STAGE_BESIDE:-}" >> "$out/stages.tsv"
exit "$rc"
