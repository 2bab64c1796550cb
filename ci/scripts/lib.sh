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

# host_mkdir MARKER DIR: make DIR on the host if it is missing, remembering ($CLUSTER_DIR/made-MARKER) that the
# cluster made it, so that cluster-down removes only what is ours. The marker is written first: two callers at
# once (workers start side by side) may both write it, never neither.
host_mkdir() { [[ -d $2 ]] || { touch "$CLUSTER_DIR/made-$1"; mkdir -p "$2"; }; }

# The DRA plugin folders. A kubelet watches <its --root-dir>/plugins_registry for plugin registration sockets and
# keeps plugin sockets and data in <root-dir>/plugins, but a DaemonSet has one hostPath for all nodes:
# /var/lib/kubelet/plugins_registry and /var/lib/kubelet/plugins, as where the root dir is the default. So on
# every node those two folders of its kubelet's root dir are bind-mounted onto /var/lib/kubelet/... in the node's
# mount namespace (a worker's /var/lib/kubelet is its own folder, node.sh; the control-plane node's is the host's):
# one folder under both names, and each node's its own. The folder lives in the root dir and the bind goes onto
# /var/lib/kubelet, not the other way: at its first start kubelet bind-mounts its root dir onto itself to make it
# rshared (MakeRShared, not recursive), which would hide a mount made below the root dir. Bind mounts, not
# symlinks: at its start the plugin watcher walks its registry with WalkDir, which does not enter a symlinked
# root, so the sockets already there at a kubelet restart would be missed.
# bind_plugin_dirs ROOT_DIR [ENTER...]: idempotent (a folder that is already the same is left alone), run before
# every start of the node's kubelet; ENTER is the command that enters the node's mount namespace (none: the host's).
# cluster-down unmounts the control-plane node's binds; a worker's go with its mount namespace.
KUBELET_PLUGIN_DIRS="plugins_registry plugins"
bind_plugin_dirs() {
  local root=$1; shift
  "$@" bash -c 'set -e
    for d in '"$KUBELET_PLUGIN_DIRS"'; do
      mkdir -p "$1/$d" "/var/lib/kubelet/$d"
      [[ $(stat -c %d:%i "$1/$d") == $(stat -c %d:%i "/var/lib/kubelet/$d") ]] || mount --bind "$1/$d" "/var/lib/kubelet/$d"
    done' bind-plugin-dirs "$root"
}

start_kubelet() {
  local d
  for d in $KUBELET_PLUGIN_DIRS; do host_mkdir "var-lib-kubelet-$d" "/var/lib/kubelet/$d"; done
  bind_plugin_dirs "$CLUSTER_DIR/kubelet"
  start kubelet kubelet --config="$CLUSTER_DIR/kubelet/config.yaml" --kubeconfig="$CLUSTER_DIR/kubelet.kubeconfig" \
    --root-dir="$CLUSTER_DIR/kubelet" --node-ip="$NODE_IP" --hostname-override="$NODE_NAME" --v=1
}
