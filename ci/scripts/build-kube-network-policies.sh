#!/usr/bin/env bash
# kube-network-policies (the CI cluster's NetworkPolicy enforcer), cached under CI_CACHE by version
# (NETPOL_BIN); cold about 2.5 min on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
go_build_cached "kube-network-policies $NETPOL_VERSION" "$NETPOL_BIN" "$here/kube-network-policies" \
  sigs.k8s.io/kube-network-policies/cmd "require sigs.k8s.io/kube-network-policies $NETPOL_VERSION"
