#!/usr/bin/env bash
# kind from the Go module proxy (sigs.k8s.io/kind at KIND_VERSION), cached in CI_CACHE; its module stays in
# GOMODCACHE, where build-kind-node.sh reads kind's node files. Cold: about 15 s.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
if [[ -x $KIND_BIN && -d $GOMODCACHE/sigs.k8s.io/kind@$KIND_VERSION ]]; then log "kind $KIND_VERSION cached"; exit 0; fi
mkdir -p "$(dirname "$KIND_BIN")" "$GOMODCACHE" "$GOCACHE"
t=$SECONDS
GOBIN=$(dirname "$KIND_BIN") CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION"
log "kind $KIND_VERSION built in $((SECONDS - t))s: $("$KIND_BIN" version)"
