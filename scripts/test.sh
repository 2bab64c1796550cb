#!/usr/bin/env bash
# make test: every test, stage by stage, and at the end one report however the run ends (scripts/test_report.py):
# each stage's time, each part ci/ built or found cached, the slowest tests, every skipped test, and the
# run's own time budget. It fails when a stage fails, when any test skipped (every test must run on the CI
# machine; TEST_ALLOW_SKIPS=1 lets a partial machine through), or when the run took more than
# TEST_BUDGET_MINUTES (default 80: CI kills a run at 90 and says nothing, so the run fails itself first).
#
# Stages: tools (what the unit stage's chart and GitOps tests run: helm, kubectl, kubeconform, checkov,
# kstatus, promtool; the host packages, ci/scripts/install-deps.sh, since the unit stage's image tests run skopeo (a
# fresh machine skipped them when the kind-image stage installed it later); and the integration stage's OCI registry
# and Prometheus; ci/ builds them once per version, the CI cluster reuses them), lint, unit, integration, unit-compute
# (the unit tests that only compute, beside the e2e stage's serial phase, below), e2e on the CI cluster (make -C ci
# e2e: the cluster's qualification, then the suite), the kind stage (beside the e2e stage's serial phase, below).
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
beside_pids=()  # the stages beside the e2e stage, each in a session of its own (its pid leads its process group)

stage() {  # stage NAME CMD...: scripts/stage.sh (its output in $out/NAME.log, its time and code in the ledger)
  bash "$repo/scripts/stage.sh" "$@" && return 0
  local rc=$?; failed=1; return "$rc"
}

finish_beside() {  # the stages beside the e2e stage (unit-compute, kind): started if they wait still, waited for, judged
  ((${#beside_pids[@]})) || return 0
  local pids=("${beside_pids[@]}") pid name
  beside_pids=()
  echo ended >> "$E2E_PHASE_FILE"
  printf '%s test: waiting for the stages beside the e2e stage (their output follows)\n' "$(date -u +%H:%M:%S)" >&2
  for pid in "${pids[@]}"; do wait "$pid"; done
  for name in unit-compute-beside unit-compute kind-beside kind; do
    [[ ! -s $out/$name.log ]] || { printf '%s test: %s.log:\n' "$(date -u +%H:%M:%S)" "$name" >&2; cat "$out/$name.log" >&2; }
  done
  # judged by the ledger, which stage.sh writes as each stage ends: a stage missing from it did not run or end
  local want=()
  [[ ${TEST_UNIT_BESIDE:-1} != 1 ]] || want+=(unit-compute)
  [[ ${TEST_KIND_BESIDE:-1} != 1 ]] || want+=(kind)
  for name in "${want[@]}"; do
    if ! awk -F'\t' -v n="$name" '$1 == n {ran = 1; if ($3 != 0) bad = 1} END {exit bad || !ran}' "$ledger"; then
      failed=1
    fi
  done
}

report() {
  finish_beside
  [[ -z ${sampler:-} ]] || kill "$sampler" 2>/dev/null
  rm -f "$out/gpu-agent.oci.tar"  # the CI cluster's image archive, linked here for the kind stage (ci/scripts/e2e.sh)
  "$BIN/python" scripts/test_report.py --out "$out" --elapsed "$((SECONDS - started))" \
    --budget-minutes "${TEST_BUDGET_MINUTES:-80}" ${TEST_ALLOW_SKIPS:+--allow-skips} || failed=1
  exit "$failed"
}
trap report EXIT

stage tools bash -c 'bash ci/scripts/install-deps.sh && bash ci/scripts/build-kstatus.sh && bash ci/scripts/install-tools.sh && \
  bash ci/scripts/registry.sh install' \
  || exit 1
stage lint bash -c "$BIN/lint-imports && $BIN/ruff check . && $BIN/mypy && $BIN/python scripts/check-doc-links.py && \
  $BIN/python scripts/check-runtime-rules.py" || exit 1
# The unit and integration stages (scripts/unit-stages.sh): first, alone, the tests that meet the wall clock; the unit
# tests that only compute (the chart's renders and linters, the simulation) as the stage unit-compute, beside the e2e
# stage's serial phase (TEST_UNIT_BESIDE=1, the default; scripts/beside-e2e.sh). TEST_UNIT_BESIDE=0: every unit test
# first, alone.
export E2E_PHASE_FILE=$out/e2e-phases
: > "$E2E_PHASE_FILE"
# Where the CPU goes, per e2e phase, for the report (ci/tools/cpu_sampler.py): beside the whole run, stopped by report()
# or by its own check that this script is gone; it never fails the run.
python3 ci/tools/cpu_sampler.py "$out/cpu.jsonl" --phase-file "$E2E_PHASE_FILE" --parent $$ 2>> "$out/cpu-sampler.log" &
sampler=$!
trap 'for pid in "${beside_pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done; exit 130' INT TERM
UNIT_BESIDE=${TEST_UNIT_BESIDE:-1} bash scripts/unit-stages.sh first || { failed=1; exit 1; }
unit_beside=()  # started below: after the kind stage where that runs beside the serial phase too, else alone
[[ ${TEST_UNIT_BESIDE:-1} != 1 ]] || unit_beside=(bash scripts/unit-stages.sh beside)
# The e2e stages: the CI cluster runs every test but the `fast` ones (`make e2e` alone runs them all); the kind
# stage runs the `fast` ones, so that `make e2e CLUSTER=kind` is proven on every run without running a test twice.
# The kind stage is a cluster of its own (podman) whose tests mostly wait: it runs beside the CI cluster's serial
# phase (scripts/beside-e2e.sh), its nodes' CPU weight lowered while it runs (KIND_CPU_SHARES, ci/scripts/kind-stage.sh),
# on a pod network apart from the CI cluster's; its output follows the e2e stage's. TEST_KIND_BESIDE=0: after the e2e
# stage, alone.
kind_stage=(make -C "$repo/ci" kind-stage PYTEST="$BIN/pytest")
if [[ ${TEST_KIND_BESIDE:-1} == 1 ]]; then
  # What the kind stage builds (on a fresh machine: podman, kind, the node image; minutes of CPU) is built first,
  # alone, so that beside the serial phase it only runs its cluster and tests.
  stage kind-image bash -c "bash ci/scripts/install-deps.sh && bash ci/scripts/install-podman.sh && \
    KIND_ENGINE=podman bash ci/scripts/build-kind-node.sh" || exit 1
  # The unit-compute stage after it, not beside it: the kind stage's tests hold time bounds (a DRA pod Running within
  # 8 s, as the bats suite has it), measured by its pytest at nice 19, which the compute-only tests beside it starved
  # (9.6 s in one run, with both cores busy). One after the other they still end long before the serial phase.
  (KIND_CPU_SHARES=${KIND_CPU_SHARES:-512} bash scripts/beside-e2e.sh kind "${kind_stage[@]}" > "$out/kind-beside.log" 2>&1
   ((${#unit_beside[@]} == 0)) || "${unit_beside[@]}" > "$out/unit-compute-beside.log" 2>&1) &
  beside_pids+=($!)
elif ((${#unit_beside[@]})); then
  "${unit_beside[@]}" > "$out/unit-compute-beside.log" 2>&1 &
  beside_pids+=($!)
fi
stage e2e make -C ci e2e CLUSTER=ci PYTEST="$BIN/pytest" PYTEST_ARGS="-m 'not fast'"; e2e=$?
finish_beside
((e2e == 0)) || exit 1
if ! cut -f1 "$ledger" | grep -qx kind; then
  stage kind "${kind_stage[@]}" || exit 1
fi
