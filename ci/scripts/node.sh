#!/usr/bin/env bash
# Worker nodes of the CI cluster, and the faults a node can have.
#   node.sh up N          start worker wN (idempotent): its own network namespace, mount namespace,
#                         cgroup root, NetworkPolicy enforcer (netpol.sh), containerd, kubelet and
#                         kube-proxy; joins the cluster
#   node.sh stop wN       the node dies: its kubelet, kube-proxy, containerd, enforcer and every pod
#                         process are killed; the API still shows its pods as they were (what a dead node leaves)
#   node.sh start wN      the node boots again: its daemons start, kubelet restarts its pods
#   node.sh partition wN  its link goes down: everything runs, nothing reaches it or leaves it
#   node.sh heal wN       its link comes back
#   node.sh down wN       remove the node and every trace of it (cluster-down calls this)
#
# A worker is what a kind node container is, made of namespaces by hand (no container engine
# runs here): a network namespace joined to the host bridge $NODES_BRIDGE by a veth pair, with its
# own pod bridge and pod CIDR (10.244.N.0/24, routed by the host); a mount namespace, held open by
# a sleeping "holder" process, in which /var/lib/kubelet is the node's own folder (kubelet fixes
# the device-plugin folder there, whatever its root dir), and so are /var/log/pods and
# /var/log/containers (each kubelet deletes the pod logs of pods it does not run), and /var/run/cdi (CDI specs a DRA
# driver writes for its node only); <root-dir>/plugins_registry and <root-dir>/plugins of its kubelet are bound
# onto /var/lib/kubelet/plugins_registry and /var/lib/kubelet/plugins there (lib.sh bind_plugin_dirs), the paths a
# DRA plugin's DaemonSet pod uses; and a cgroup root gpuci-wN so that its
# pods never share the kubepods tree of another node. Every daemon of the node is entered into
# the holder's namespaces with nsenter, so it sees exactly what the node sees.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
source "$here/scripts/lib.sh"
source "$here/scripts/node-config.sh"

what=${1:?usage: node.sh up N | stop|start|partition|heal|down wN}
arg=${2:?which node: a number for up, a worker name (w1 or gpu-ci-w1) otherwise}
n=${arg#gpu-ci-}; n=${n#w}
[[ $n =~ ^[1-9][0-9]?$ ]] || { echo "node.sh: '$arg' is not a worker (w1..w99, or gpu-ci-w1..)" >&2; exit 2; }
w=w$n
name=gpu-ci-$w
ip=$(worker_ip "$n")
netns=gpuci-$w
veth=gpuci$w
dir=$CLUSTER_DIR/nodes/$w
cgroup=gpuci-$w
pod_cidr=10.244.$n.0/24
sock=$dir/containerd/containerd.sock

# The node's cgroup root in every hierarchy, the unified one too (kubelet makes its tree there as well).
cgroup_dirs() { for c in /sys/fs/cgroup/*/; do echo "$c$cgroup"; done; }

network_up() {
  ip link show "$NODES_BRIDGE" >/dev/null 2>&1 || {
    ip link add "$NODES_BRIDGE" type bridge
    ip addr add "$NODES_GATEWAY/24" dev "$NODES_BRIDGE"
    ip link set "$NODES_BRIDGE" up
  }
  [[ -e /run/netns/$netns ]] || ip netns add "$netns"
  if ! ip link show "$veth" >/dev/null 2>&1; then
    ip link add "$veth" type veth peer name "$veth-n"
    ip link set "$veth-n" netns "$netns"
    ip -n "$netns" link set "$veth-n" name eth0
    ip link set "$veth" master "$NODES_BRIDGE" up
    ip -n "$netns" addr add "$ip/24" dev eth0
    ip -n "$netns" link set lo up
    ip -n "$netns" link set eth0 up
    ip -n "$netns" route add default via "$NODES_GATEWAY"
  fi
  ip route replace "$pod_cidr" via "$ip" dev "$NODES_BRIDGE"
  nsenter --net="/run/netns/$netns" sysctl -qw net.ipv4.ip_forward=1
  nsenter --net="/run/netns/$netns" sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
}

holder_up() {
  running "$w-holder" && return 0
  mkdir -p "$dir/var-lib-kubelet" /var/lib/kubelet "$dir/var-log-pods" /var/log/pods "$dir/var-log-containers" /var/log/containers "$dir/cdi"
  # the mount point of each node's CDI folder; the control-plane node's is the host's own (cluster-up makes it)
  host_mkdir run-cdi /var/run/cdi
  # slave: the host's mounts reach the node, the node's (pod volumes, snapshots) never reach the host.
  # The pod logs are the node's own as well: a kubelet's log GC removes every folder of /var/log/pods whose
  # pod it does not run, so on a shared folder each node deleted the others' logs (kubectl logs then lost
  # every line written before that minute's sweep). The CDI folder too: a DRA driver on each node writes its own
  # node's specs there (a same-named device in two nodes' specs would be refused), which a containerd that reads
  # CDI (cdi_spec_dirs, containerd 1.7 and later) then finds. The new namespace starts as a copy of the host's,
  # the control-plane node's plugin-folder binds on /var/lib/kubelet included: dropped first, not left beneath.
  start "$w-holder" unshare --mount --propagation slave -- nsenter --net="/run/netns/$netns" -- \
    bash -c "for d in $KUBELET_PLUGIN_DIRS; do ! mountpoint -q /var/lib/kubelet/\$d || umount /var/lib/kubelet/\$d; done
      mount --bind '$dir/var-lib-kubelet' /var/lib/kubelet && mount --bind '$dir/var-log-pods' /var/log/pods \
      && mount --bind '$dir/var-log-containers' /var/log/containers && mount --bind '$dir/cdi' /var/run/cdi \
      && exec -a gpuci-node-holder sleep infinity"
  # the last of its mounts (/var/run is a link to /run here)
  wait_for 10 "$w's mount namespace" grep -qE " (/var)?/run/cdi " "/proc/$(cat "$PIDS/$w-holder.pid")/mountinfo"
}

daemons_up() {
  local c
  for c in $(cgroup_dirs); do
    mkdir -p "$c"
    # cpuset children start empty, and a process cannot join an empty cpuset
    if [[ -f $c/cpuset.cpus && -z $(cat "$c/cpuset.cpus") ]]; then
      cat "$(dirname "$c")/cpuset.cpus" > "$c/cpuset.cpus"; cat "$(dirname "$c")/cpuset.mems" > "$c/cpuset.mems"
    fi
  done
  local in_node=(nsenter -t "$(cat "$PIDS/$w-holder.pid")" -m -n --)
  bash "$here/scripts/netpol.sh" up "$w"  # before any pod of the node runs
  start "$w-containerd" "${in_node[@]}" containerd --config "$dir/containerd/config.toml"
  wait_for 30 "$w's containerd" ctr --address "$sock" version
  bind_plugin_dirs "$dir/kubelet" "${in_node[@]}"  # before every start of the kubelet (node start too)
  start "$w-kubelet" "${in_node[@]}" kubelet --config="$dir/kubelet/config.yaml" --kubeconfig="$CLUSTER_DIR/kubelet-$name.kubeconfig" \
    --root-dir="$dir/kubelet" --node-ip="$ip" --hostname-override="$name" --v=1
  start "$w-kube-proxy" "${in_node[@]}" kube-proxy --config="$dir/kube-proxy.yaml" --v=1
}

ready() { kc get node "$name" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True; }

# Every process of the node's pods (its cgroup root) and of its containerd's shims.
kill_node_processes() {
  local c
  for c in $(cgroup_dirs); do
    [[ -d $c ]] || continue
    # a process may be gone between the listing and the kill: that is not a failure
    find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
  done
  pkill -KILL -f "containerd-shim-runc-v2 .*-address $sock" 2>/dev/null || true
}

case $what in
  up)
    t=$SECONDS
    bash "$here/scripts/pki.sh" node "$name" "$ip"
    write_node_config "$dir" "$name" "$pod_cidr" "/$cgroup" "kubelet-serving-$name"
    # Workers start side by side, and the first makes the shared bridge (and `ip netns add` its
    # /run/netns mount; two at once would stack two): one node's network at a time.
    exec 9>"$CLUSTER_DIR/network.lock"
    flock 9
    network_up
    flock -u 9
    holder_up
    daemons_up
    for image in pause coredns gpu-agent; do
      [[ -f $CI_CACHE/images/$image.oci.tar ]] || continue  # the project's image once built (make images)
      ctr --address "$sock" --namespace k8s.io images import "$CI_CACHE/images/$image.oci.tar" >/dev/null
    done
    wait_for 90 "node $name Ready" ready
    log "node $name ($ip, pods $pod_cidr) Ready in $((SECONDS - t))s"
    ;;
  stop)
    running "$w-holder" || { echo "node.sh: $name does not exist (make cluster-up NODES=...)" >&2; exit 1; }
    kill_daemon() { [[ -f $PIDS/$w-$1.pid ]] && kill -KILL "$(cat "$PIDS/$w-$1.pid")" 2>/dev/null; rm -f "$PIDS/$w-$1.pid"; }
    kill_daemon kubelet
    kill_daemon kube-proxy
    kill_node_processes
    kill_daemon containerd
    bash "$here/scripts/netpol.sh" kill "$w"
    log "node $name stopped (kubelet, kube-proxy, containerd, its NetworkPolicy enforcer and its pods killed)"
    ;;
  start)
    running "$w-holder" || { echo "node.sh: $name does not exist (make cluster-up NODES=...)" >&2; exit 1; }
    daemons_up
    log "node $name started"
    ;;
  partition)
    ip link set "$veth" down
    log "node $name partitioned (link $veth down)"
    ;;
  heal)
    ip link set "$veth" up
    log "node $name healed (link $veth up)"
    ;;
  down)
    for d in kubelet kube-proxy; do stop_daemon "$w-$d"; done
    kill_node_processes
    stop_daemon "$w-containerd"
    bash "$here/scripts/netpol.sh" down "$w"  # the enforcer, in the node's namespaces: before they go
    for c in $(cgroup_dirs); do [[ -d $c ]] && { find "$c" -depth -type d -exec rmdir {} + 2>/dev/null || true; }; done
    # the holder's namespace takes the node's mounts with it
    stop_daemon "$w-holder"
    ip netns delete "$netns" 2>/dev/null || true
    ip link delete "$veth" 2>/dev/null || true
    ip route del "$pod_cidr" 2>/dev/null || true
    rm -f "$CLUSTER_DIR/kubelet-$name.kubeconfig"
    rm -rf "$dir"
    ;;
  *) echo "node.sh: unknown command '$what'" >&2; exit 2 ;;
esac
