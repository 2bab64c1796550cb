# Process and readiness helpers for the CI cluster scripts. Sourced after common.sh.

running() { [[ -f $PIDS/$1.pid ]] && kill -0 "$(cat "$PIDS/$1.pid")" 2>/dev/null; }

# start NAME COMMAND...: start a daemon in its own session, remember its PID, log to LOGS/NAME.log
start() {
  local name=$1; shift
  if running "$name"; then return 0; fi
  mkdir -p "$PIDS" "$LOGS"
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$PIDS/$name.pid"
}

stop_daemon() {
  local name=$1 pid
  [[ -f $PIDS/$name.pid ]] || return 0
  pid=$(cat "$PIDS/$name.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$PIDS/$name.pid"
}

# wait_for SECONDS WHAT COMMAND...: poll COMMAND until it succeeds or the deadline passes
wait_for() {
  local seconds=$1 what=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "timed out after ${seconds}s waiting for $what"
      return 1
    fi
    sleep 0.2
  done
}

kc() { kubectl --kubeconfig "$KUBECONFIG_PATH" "$@"; }
ctr_() { ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

# Every node's containerd socket: the control-plane node's, then each worker's that is running.
node_sockets() {
  echo "$CONTAINERD_SOCK"
  local dir
  for dir in "$CLUSTER_DIR"/nodes/w*/; do
    [[ -S $dir/containerd/containerd.sock ]] && running "$(basename "$dir")-containerd" && echo "$dir/containerd/containerd.sock"
  done
  return 0
}

# import_image ARCHIVE [EXTRA_TAG_FROM EXTRA_TAG_TO]: into every node's containerd at once (each
# node has its own image store, as kind's nodes do), optionally tagging it a second time.
import_image() {
  local archive=$1 from=${2:-} to=${3:-} sock pids=()
  while read -r sock; do
    {
      ctr --address "$sock" --namespace k8s.io images import "$archive" >/dev/null
      [[ -z $to ]] || ctr --address "$sock" --namespace k8s.io images tag --force "$from" "$to" >/dev/null
    } &
    pids+=($!)
  done < <(node_sockets)
  local pid rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  return $rc
}

start_kubelet() {
  start kubelet kubelet --config="$CLUSTER_DIR/kubelet/config.yaml" --kubeconfig="$CLUSTER_DIR/kubelet.kubeconfig" \
    --root-dir="$CLUSTER_DIR/kubelet" --node-ip="$NODE_IP" --hostname-override="$NODE_NAME" --v=1
}
