#!/usr/bin/env bash
# make e2e CLUSTER=ci|existing|kind|k3d: one entry point for the end-to-end suite.
#   ci        bring the CI cluster up (idempotent), build and import images, run, tear down
#             (KEEP_CLUSTER=1 leaves it running for the next run or for poking at)
#   existing  the current KUBECONFIG; images must already be loadable by its nodes
#   kind|k3d  a cluster made by pytest-kind-ng / the k3d CLI (need Docker; not on CI machines)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/scripts/common.sh"
cluster=${1:-ci}
pytest=${PYTEST:-$repo/.venv/bin/pytest}
export E2E_CLUSTER=$cluster
case $cluster in
  ci)
    if [[ ${KEEP_CLUSTER:-0} != 1 ]]; then
      # Teardown is checked too: the host must look exactly as it did before cluster-up.
      before=$(mktemp); after=$(mktemp)
      # Packages first: what an install step adds (iptables' empty tables, say) is the host's new
      # baseline, not something the cluster left behind.
      t=$SECONDS; bash "$here/scripts/install-deps.sh"; log "timing: host packages $((SECONDS - t))s"
      if [[ ! -d $CLUSTER_DIR ]]; then bash "$here/scripts/host-state.sh" > "$before"; else : > "$before"; fi
      teardown() {
        local rc=$?
        t=$SECONDS; bash "$here/scripts/cluster-down.sh"; log "timing: cluster-down $((SECONDS - t))s"
        if [[ -s $before ]]; then
          bash "$here/scripts/host-state.sh" > "$after"
          if ! diff -u "$before" "$after"; then log "FAILED: cluster-down left the host changed (diff above)"; rc=1
          else log "teardown check passed: host state identical to before cluster-up"; fi
        fi
        rm -f "$before" "$after"
        exit $rc
      }
      trap teardown EXIT
    fi
    t=$SECONDS; bash "$here/scripts/cluster-up.sh"; log "timing: cluster-up $((SECONDS - t))s"
    t=$SECONDS; bash "$here/scripts/build-images.sh" project; log "timing: images $((SECONDS - t))s"
    ;;
  existing|kind|k3d) ;;
  *) echo "CLUSTER must be one of ci, existing, kind, k3d (got '$cluster')" >&2; exit 2 ;;
esac
t=$SECONDS
export E2E_ARTIFACTS=${E2E_ARTIFACTS:-/tmp/gpu-agent-e2e-artifacts/$(date -u +%Y%m%dT%H%M%S)}
rc=0
"$pytest" -p no:cacheprovider "$repo/e2e" "${@:2}" || rc=$?
log "timing: e2e suite $((SECONDS - t))s"
if [[ -d $E2E_ARTIFACTS ]]; then log "what the failed tests touched (pods, logs, events, domains, helm history): $E2E_ARTIFACTS"; fi
exit $rc
