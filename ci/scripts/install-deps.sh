#!/usr/bin/env bash
# Host packages the CI cluster needs (Debian 12). Idempotent: installs only what is missing.
set -euo pipefail
packages=(etcd-server containerd runc containernetworking-plugins iptables conntrack debootstrap openssl iproute2 kmod procps psmisc curl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "ci: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Debian's packaging would start the daemons through init scripts; we start them ourselves.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  rm -f /usr/sbin/policy-rc.d
fi
