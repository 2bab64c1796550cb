#!/usr/bin/env bash
# Stops everything cluster-up started, by PID, and removes what it made: pod processes and
# their cgroups, mounts (the DRA plugin folders' binds onto /var/lib/kubelet too), network namespaces,
# the pod bridge, iptables rules (the fence, the NetworkPolicy shim, kube-proxy's), the node address,
# changed sysctls, the CDI folder it made and the cluster's state folder. Caches (CI_CACHE) stay.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
source "$here/scripts/lib.sh"
t0=$SECONDS

# Node agents first, so nothing restarts the pods being removed; workers with all they own. The
# control-plane node's NetworkPolicy enforcer and its rules meanwhile (its clean exit takes 5 s).
step() { log "down: $1 (+$((SECONDS - t0))s)"; }
# The CI registry first (ci/scripts/e2e.sh starts it on the first node's address, which goes below): its process, its
# storage in TMPDIR and the nodes' hosts.toml for it. Idempotent: nothing when none runs.
bash "$here/scripts/registry.sh" stop
bash "$here/scripts/netpol.sh" down &
netpol=$!
workers=()
for dir in "$CLUSTER_DIR"/nodes/w*/; do
  [[ -d $dir ]] || continue
  bash "$here/scripts/node.sh" down "$(basename "$dir")" &
  workers+=($!)
done
for pid in "${workers[@]}"; do wait "$pid"; done
[[ -d $CLUSTER_DIR/nodes ]] && step "workers removed"
ip link show "$NODES_BRIDGE" >/dev/null 2>&1 && ip link delete "$NODES_BRIDGE"
stop_daemon kubelet
stop_daemon kube-proxy
step "node agents stopped"
[[ -x $K8S_BIN/kube-proxy ]] && "$K8S_BIN/kube-proxy" --cleanup >/dev/null 2>&1

# Every pod process lives in a kubepods cgroup (cgroupfs driver): kill them, then the shims.
for controller in /sys/fs/cgroup/*/; do
  [[ -d $controller/kubepods ]] || continue
  find "$controller/kubepods" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null
done
pkill -KILL -f "containerd-shim-runc-v2 .*-address $CONTAINERD_SOCK" 2>/dev/null
stop_daemon containerd
step "pods and containerd stopped"
for controller in /sys/fs/cgroup/*/; do
  [[ -d $controller/kubepods ]] || continue
  find "$controller/kubepods" -depth -type d -exec rmdir {} + 2>/dev/null
done

wait "$netpol"
step "NetworkPolicy enforcer stopped"
for name in kube-scheduler kube-controller-manager kube-apiserver; do stop_daemon "$name" & done
wait
stop_daemon etcd
step "control plane stopped"

# The control-plane node's DRA plugin folders, bound onto /var/lib/kubelet/plugins_registry and .../plugins
# (lib.sh bind_plugin_dirs; the workers' went with their mount namespaces): unmounted while the folder there is
# still ours, so a bind made twice goes too and the host's own folder, if it had one, is never touched.
for d in $KUBELET_PLUGIN_DIRS; do
  [[ -d $CLUSTER_DIR/kubelet/$d ]] || continue
  while [[ $(stat -c %d:%i "$CLUSTER_DIR/kubelet/$d") == $(stat -c %d:%i "/var/lib/kubelet/$d" 2>/dev/null) ]]; do
    umount "/var/lib/kubelet/$d" && continue
    log "down: /var/lib/kubelet/$d busy, detached lazily"
    umount -l "/var/lib/kubelet/$d" || break
  done
done
# Mounts under the cluster folder (pod volumes, overlay snapshots, sandbox shm), deepest first.
if [[ -d $CLUSTER_DIR ]]; then
  awk -v d="$CLUSTER_DIR" '$2 ~ "^"d {print $2}' /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
fi
if [[ -f $CLUSTER_DIR/made-run-netns-mount ]]; then
  while mountpoint -q /run/netns; do umount -l /run/netns || break; done
fi
for ns in /run/netns/cni-*; do
  [[ -e $ns ]] || continue
  ip netns delete "$(basename "$ns")" 2>/dev/null || { umount -l "$ns" 2>/dev/null; rm -f "$ns"; }
done
ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE"
for bridge in "$BRIDGE" "$NODES_BRIDGE"; do
  while iptables -t mangle -D FORWARD -i "$bridge" -j GPUCI-FENCE 2>/dev/null; do :; done
done
iptables -t mangle -F GPUCI-FENCE 2>/dev/null && iptables -t mangle -X GPUCI-FENCE
# Whatever chains kubelet, kube-proxy and the portmap plugin left (KUBE-*, CNI-*), with the
# jumps into them. iptables-save quotes its output for a shell, hence the eval.
for cmd in iptables ip6tables; do
  for table in filter nat mangle; do
    "$cmd-save" -t $table 2>/dev/null | grep -E '^-A .*-j (KUBE|CNI)-' | sed 's/^-A/-D/' | while read -r rule; do
      eval "$cmd -t $table $rule" 2>/dev/null
    done
    chains=$("$cmd-save" -t $table 2>/dev/null | grep -oE '^:(KUBE|CNI)-[^ ]+' | tr -d :)
    for c in $chains; do "$cmd" -t $table -F "$c" 2>/dev/null; done
    for c in $chains; do "$cmd" -t $table -X "$c" 2>/dev/null; done
  done
done
ip -o addr show dev lo | grep -F " $NODE_IP/32" >/dev/null && ip addr del "$NODE_IP/32" dev lo
if [[ -f $CLUSTER_DIR/sysctl.saved ]]; then
  while IFS= read -r line; do sysctl -qw "$line" 2>/dev/null; done < "$CLUSTER_DIR/sysctl.saved"
fi
if [[ -f $CLUSTER_DIR/made-var-lib-kubelet ]]; then rm -rf /var/lib/kubelet
else
  rm -rf /var/lib/kubelet/device-plugins/kubelet.sock /var/lib/kubelet/device-plugins/fake-gpu.sock /var/lib/kubelet/fake-gpu
  for d in $KUBELET_PLUGIN_DIRS; do [[ -f $CLUSTER_DIR/made-var-lib-kubelet-$d ]] && rmdir "/var/lib/kubelet/$d"; done
fi
[[ -f $CLUSTER_DIR/made-run-cdi ]] && rm -rf /var/run/cdi
rm -rf "$CLUSTER_DIR"
log "cluster down in $((SECONDS - t0))s"
