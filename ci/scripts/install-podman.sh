#!/usr/bin/env bash
# The container engine of the kind stage (ci/scripts/kind-stage.sh): Debian's podman, and the CNI plugin that
# lets kind's nodes find each other by name (the workers join the control plane by its name). Idempotent:
# installs only what is missing; packages are the host's baseline, as install-deps.sh's are (installed before
# the "before" snapshot of the teardown check).
#
# Why podman and not Docker: these machines' bounding set lacks CAP_SYS_RESOURCE; Docker asks for every
# capability for a --privileged container and fails, podman asks only for those of the bounding set.
set -euo pipefail
packages=(podman golang-github-containernetworking-plugin-dnsname)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "ci: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  rm -f /usr/sbin/policy-rc.d
fi
