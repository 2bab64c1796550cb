#!/usr/bin/env bash
# containerd 2.x (CRI with CDI: Debian's 1.6 has none) from the Go module proxy: containerd, its runc shim and
# ctr in one `go build` (they share most of their compile work), static, cached in CI_CACHE; runc is Debian's.
# Tags: containerd's Makefile's, less the snapshotters not used here (btrfs needs cgo anyway; devmapper, zfs).
# containerd looks its shim up in PATH first: put CONTAINERD_BIN before /usr/bin (Debian's 1.6 shim), or set
# the CRI runtime's runtime_path to CONTAINERD_BIN/containerd-shim-runc-v2.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"

stamp="$CONTAINERD_BIN/.built-$CONTAINERD_VERSION"
if [[ -f "$stamp" ]]; then
  log "containerd $CONTAINERD_VERSION cached in $CONTAINERD_BIN"
  exit 0
fi
pin="require github.com/containerd/containerd/v2 $CONTAINERD_VERSION"
grep -qxF -- "$pin" "$here/containerd/go.mod" || { echo "ci: ci/containerd/go.mod does not pin '$pin'" >&2; exit 1; }
mkdir -p "$CONTAINERD_BIN" "$GOMODCACHE" "$GOCACHE"
t=$SECONDS
log "building containerd $CONTAINERD_VERSION (cold: ~2 min on 2 cores; warm Go caches: seconds)"
cd "$here/containerd"
pkg=github.com/containerd/containerd/v2
GOFLAGS=-mod=mod CGO_ENABLED=0 \
  go build -trimpath -tags "urfave_cli_no_docs no_btrfs no_devmapper no_zfs" \
  -ldflags "-s -w -X $pkg/version.Version=$CONTAINERD_VERSION -X $pkg/version.Package=$pkg" -o "$CONTAINERD_BIN/" \
  $pkg/cmd/containerd $pkg/cmd/containerd-shim-runc-v2 $pkg/cmd/ctr
touch "$stamp"
log "containerd $CONTAINERD_VERSION built in $((SECONDS - t))s: $(ls "$CONTAINERD_BIN" | tr '\n' ' ')"
