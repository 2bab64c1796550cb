#!/usr/bin/env bash
# The Python base image's root filesystem, built with debootstrap (no registry to pull from).
# Cached under CI_CACHE, keyed by BASE_ROOTFS_VERSION: bump it to rebuild.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
out=$CI_CACHE/images/base-rootfs-$BASE_ROOTFS_VERSION.tar
if [[ -f $out ]]; then log "base rootfs cached: $out"; exit 0; fi
mkdir -p "$CI_CACHE/images"
t=$SECONDS
work=$(mktemp -d "$CI_CACHE/images/rootfs.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "debootstrap bookworm minbase + python3 (about a minute)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$work/root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log"; exit 1; }
chroot "$work/root" apt-get clean
rm -rf "$work/root"/var/lib/apt/lists/* "$work/root"/var/cache/* "$work/root"/usr/share/doc/* "$work/root"/usr/share/man/*
tar -C "$work/root" --numeric-owner -cf "$out.tmp" .
mv "$out.tmp" "$out"
log "base rootfs built in $((SECONDS - t))s: $out ($(du -h "$out" | cut -f1))"

