#!/usr/bin/env bash
# CoreDNS from the Go module proxy, static, cached under CI_CACHE.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
out=$CI_CACHE/coredns-$COREDNS_VERSION/coredns
if [[ -x $out ]]; then log "coredns $COREDNS_VERSION cached"; exit 0; fi
mkdir -p "$(dirname "$out")" "$GOMODCACHE" "$GOCACHE"
t=$SECONDS
log "building coredns $COREDNS_VERSION"
cd "$here/coredns"
GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp" github.com/coredns/coredns
mv "$out.tmp" "$out"
log "coredns $COREDNS_VERSION built in $((SECONDS - t))s"

