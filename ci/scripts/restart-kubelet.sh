#!/usr/bin/env bash
# Kill the CI cluster's kubelet and start it again (the e2e suite's device-plugin test).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
source "$here/scripts/lib.sh"
running kubelet || { echo "kubelet is not running (is the CI cluster up?)" >&2; exit 1; }
kill -KILL "$(cat "$PIDS/kubelet.pid")"
rm -f "$PIDS/kubelet.pid"
start_kubelet
log "kubelet restarted (pid $(cat "$PIDS/kubelet.pid"))"
