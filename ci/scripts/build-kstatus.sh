#!/usr/bin/env bash
# kstatus (ci/kstatus: sigs.k8s.io/cli-utils' kstatus over JSON on stdin, for e2e/gitops.py), cached under
# CI_CACHE by version and source digest (KSTATUS_BIN); cold about 1 min on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
go_build_cached "kstatus (cli-utils $KSTATUS_VERSION)" "$KSTATUS_BIN" "$here/kstatus" . \
  "	sigs.k8s.io/cli-utils $KSTATUS_VERSION"
