#!/usr/bin/env bash
# Host packages the CI cluster needs (Debian 12). Idempotent: installs only what is missing.
# skopeo: the project image pushed to the CI registry from its OCI archive (registry.sh push-image).
set -euo pipefail
source "$(dirname "$0")/common.sh"
packages=(etcd-server containerd runc containernetworking-plugins iptables conntrack debootstrap openssl iproute2 kmod procps psmisc curl skopeo)
install_missing_packages "${packages[@]}"
