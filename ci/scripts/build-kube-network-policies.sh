#!/usr/bin/env bash
# kube-network-policies (the CI cluster's NetworkPolicy enforcer) from the Go module proxy, static,
# cached under CI_CACHE by version; ci/kube-network-policies/go.sum pins every module it is built from.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
out=$NETPOL_BIN
if [[ -x $out ]]; then log "kube-network-policies $NETPOL_VERSION cached"; exit 0; fi
grep -qx "require sigs.k8s.io/kube-network-policies $NETPOL_VERSION" "$here/kube-network-policies/go.mod" || {
  echo "build-kube-network-policies.sh: ci/kube-network-policies/go.mod does not pin NETPOL_VERSION=$NETPOL_VERSION" >&2; exit 1; }
mkdir -p "$(dirname "$out")" "$GOMODCACHE" "$GOCACHE"
log "building kube-network-policies $NETPOL_VERSION (cold: ~2.5 min on 2 cores; warm: seconds)"
cd "$here/kube-network-policies"
GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp" sigs.k8s.io/kube-network-policies/cmd
mv "$out.tmp" "$out"
