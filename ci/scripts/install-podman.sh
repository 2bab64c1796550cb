#!/usr/bin/env bash
# The container engine of the kind stage (ci/scripts/kind-stage.sh): Debian's podman, and the CNI plugin that
# lets kind's nodes find each other by name (the workers join the control plane by its name). Idempotent:
# installs only what is missing; packages are the host's baseline, as install-deps.sh's are (installed before
# the "before" snapshot of the teardown check).
#
# Why podman and not Docker: these machines' bounding set lacks CAP_SYS_RESOURCE; Docker asks for every
# capability for a --privileged container and fails, podman asks only for those of the bounding set.
set -euo pipefail
source "$(dirname "$0")/common.sh"
packages=(podman golang-github-containernetworking-plugin-dnsname)
install_missing_packages "${packages[@]}"
