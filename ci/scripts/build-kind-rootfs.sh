#!/usr/bin/env bash
# The kind node's root filesystem (Debian bookworm with systemd, containerd, runc, the CNI plugins and the
# network tools kind's own base image carries; see ci/scripts/build-kind-node.sh), built with debootstrap
# because no kindest/base image can be pulled here. Cached under CI_CACHE, keyed by KIND_ROOTFS_VERSION.
# Prints nothing; the tarball is $KIND_ROOTFS.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
if [[ -f $KIND_ROOTFS ]]; then log "kind node rootfs cached: $KIND_ROOTFS"; exit 0; fi
mkdir -p "$(dirname "$KIND_ROOTFS")"
work=$(mktemp -d "$(dirname "$KIND_ROOTFS")/kind-rootfs.XXXXXX")
trap 'rm -rf "$work"' EXIT
t=$SECONDS
log "debootstrap bookworm for the kind node (cold: a few minutes)"
# kind's images/base installs the same tools (systemd, conntrack, iptables, nftables, iproute2, ethtool, mount,
# kmod, libseccomp2, pigz, ca-certificates, curl, jq, procps) and builds containerd, runc and the CNI plugins
# from source; Debian's packages of those three serve here (build-kind-node.sh lays the CI cluster's containerd 2.x,
# with CDI, over Debian's 1.6; it reads kind's version-2 config as kind's own node images do).
debootstrap --variant=minbase \
  --include=systemd,conntrack,iptables,nftables,iproute2,ethtool,mount,kmod,libseccomp2,pigz,ca-certificates,curl,jq,procps,containerd,runc,containernetworking-plugins \
  bookworm "$work/root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log"; exit 1; }
root=$work/root
chroot "$root" apt-get clean
# As kind's base image: no unit starts unless the node image enables it (build-kind-node.sh enables
# containerd, kubelet and its own), systemd does not read the kernel log, /sbin/init is systemd.
find "$root/lib/systemd/system/sysinit.target.wants/" -name "systemd-tmpfiles-setup.service" -delete
rm -f "$root"/lib/systemd/system/multi-user.target.wants/* "$root"/etc/systemd/system/*.wants/* \
  "$root"/lib/systemd/system/local-fs.target.wants/* "$root"/lib/systemd/system/sockets.target.wants/*udev* \
  "$root"/lib/systemd/system/sockets.target.wants/*initctl* "$root"/lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >> "$root/etc/systemd/journald.conf"
ln -sf /usr/lib/systemd/systemd "$root/sbin/init"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
  "$root"/usr/share/locale/* "$root"/var/log/*
tar -C "$root" --numeric-owner -cf "$KIND_ROOTFS.tmp" .
mv "$KIND_ROOTFS.tmp" "$KIND_ROOTFS"
log "kind node rootfs built in $((SECONDS - t))s: $KIND_ROOTFS ($(du -h "$KIND_ROOTFS" | cut -f1))"
