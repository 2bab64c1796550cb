#!/usr/bin/env bash
# kstatus (ci/kstatus: sigs.k8s.io/cli-utils' kstatus over JSON on stdin, for e2e/gitops.py) from the
# Go module proxy, static, cached under CI_CACHE by version and source digest; ci/kstatus/go.sum pins
# every module it is built from.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
out=$KSTATUS_BIN
if [[ -x $out ]]; then log "kstatus (cli-utils $KSTATUS_VERSION) cached"; exit 0; fi
grep -qxF "	sigs.k8s.io/cli-utils $KSTATUS_VERSION" "$here/kstatus/go.mod" || {
  echo "build-kstatus.sh: ci/kstatus/go.mod does not pin KSTATUS_VERSION=$KSTATUS_VERSION" >&2; exit 1; }
mkdir -p "$(dirname "$out")" "$GOMODCACHE" "$GOCACHE"
t=$SECONDS
log "building kstatus (cli-utils $KSTATUS_VERSION; cold: ~1 min on 2 cores; warm: seconds)"
cd "$here/kstatus"
GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp" .
mv "$out.tmp" "$out"
log "kstatus built in $((SECONDS - t))s: $out"
