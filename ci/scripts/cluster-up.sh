#!/usr/bin/env bash
# A real single-node Kubernetes on a plain machine: etcd, kube-apiserver, controller-manager,
# scheduler, containerd + runc + CNI bridge, kubelet, kube-proxy, CoreDNS, and a NetworkPolicy
# enforcer on every node (ci/scripts/netpol.sh). No systemd: every daemon is started here and
# remembered by PID. Idempotent: a second run leaves one cluster.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
source "$here/scripts/lib.sh"
source "$here/scripts/node-config.sh"
t0=$SECONDS
need_root "the CI cluster (make cluster-up, make e2e CLUSTER=ci)" "it installs Debian packages, adds $NODE_IP to lo, \
sets sysctls and iptables rules, makes bridges, network and mount namespaces, and runs containerd and kubelet as root"

bash "$here/scripts/install-deps.sh"
bash "$here/scripts/build-kubernetes.sh"
bash "$here/scripts/build-coredns.sh"
bash "$here/scripts/build-containerd.sh"
bash "$here/scripts/build-kube-network-policies.sh"
bash "$here/scripts/build-kstatus.sh"
bash "$here/scripts/install-tools.sh"
bash "$here/scripts/build-base-rootfs.sh"
bash "$here/scripts/build-images.sh" system
mkdir -p "$CLUSTER_DIR" "$PIDS" "$LOGS"
bash "$here/scripts/pki.sh"

# --- host network: node address, forwarding, and a fence around the pod network -------------
ip -o addr show dev lo | grep -F " $NODE_IP/32" >/dev/null || ip addr add "$NODE_IP/32" dev lo
if [[ ! -f $CLUSTER_DIR/sysctl.saved ]]; then
  for key in net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables; do
    echo "$key=$(sysctl -n "$key")"
  done > "$CLUSTER_DIR/sysctl.saved"
fi
sysctl -qw net.ipv4.ip_forward=1
# Pod traffic must never leave this machine: whatever the host forwards from the pod bridge or
# from the worker nodes' bridge goes only to the pod network or the nodes' network (in mangle,
# which kube-proxy never rewrites, so its ACCEPTs cannot bypass it).
iptables -t mangle -N GPUCI-FENCE 2>/dev/null || true
iptables -t mangle -F GPUCI-FENCE
iptables -t mangle -A GPUCI-FENCE -d "$CLUSTER_CIDR" -j RETURN
iptables -t mangle -A GPUCI-FENCE -d "$NODE_NETWORK" -j RETURN
iptables -t mangle -A GPUCI-FENCE -m comment --comment gpu-agent-ci-fence -j DROP
for bridge in "$BRIDGE" "$NODES_BRIDGE"; do
  iptables -t mangle -C FORWARD -i "$bridge" -j GPUCI-FENCE 2>/dev/null || iptables -t mangle -I FORWARD -i "$bridge" -j GPUCI-FENCE
done

# The workers' network namespaces, before any pod exists: `ip netns add` bind-mounts /run/netns
# onto itself the first time, and a pod's namespace mounted under that mount could not be removed
# through it. Remember whether the mount is ours, so that teardown removes only ours.
if ((NODES > 1)) && ! mountpoint -q /run/netns && [[ ! -f $CLUSTER_DIR/made-run-netns-mount ]]; then
  touch "$CLUSTER_DIR/made-run-netns-mount"
fi
for ((i = 1; i < NODES; i++)); do
  [[ -e /run/netns/gpuci-w$i ]] || ip netns add "gpuci-w$i"
done

# --- control plane ---------------------------------------------------------------------------
start etcd etcd --name ci --data-dir "$CLUSTER_DIR/etcd" \
  --listen-client-urls http://127.0.0.1:12379 --advertise-client-urls http://127.0.0.1:12379 \
  --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
  --initial-cluster ci=http://127.0.0.1:12380 --listen-metrics-urls http://127.0.0.1:12381
wait_for 30 etcd curl -sf http://127.0.0.1:12381/health

start kube-apiserver kube-apiserver --etcd-servers=http://127.0.0.1:12379 \
  --advertise-address="$NODE_IP" --bind-address="$NODE_IP" --secure-port="$API_PORT" \
  --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --client-ca-file="$PKI/ca.crt" --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
  --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority="$PKI/ca.crt" --kubelet-preferred-address-types=InternalIP,Hostname \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
  --default-not-ready-toleration-seconds="$POD_EVICTION_SECONDS" --default-unreachable-toleration-seconds="$POD_EVICTION_SECONDS" \
  --profiling=false --v=1
wait_for 60 kube-apiserver curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
  "https://$NODE_IP:$API_PORT/readyz"

start kube-controller-manager kube-controller-manager --kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
  --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
  --use-service-account-credentials=true --leader-elect=false --bind-address=127.0.0.1 --profiling=false \
  --node-monitor-grace-period="$NODE_GRACE_PERIOD" --node-monitor-period=1s --v=1
start kube-scheduler kube-scheduler --kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" \
  --authentication-kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" --authorization-kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" \
  --leader-elect=false --bind-address=127.0.0.1 --profiling=false --v=1

# --- NetworkPolicy enforcer of this node, before any pod runs ---------------------------------
bash "$here/scripts/netpol.sh" rbac
bash "$here/scripts/netpol.sh" up

# --- node: containerd, CNI, kubelet, kube-proxy ---------------------------------------------
write_node_config "$CLUSTER_DIR" "$NODE_NAME" "$POD_CIDR" / kubelet-serving
start containerd containerd --config "$CLUSTER_DIR/containerd/config.toml"
wait_for 30 containerd ctr --address "$CONTAINERD_SOCK" version
for image in pause coredns; do
  ctr_ images import "$CI_CACHE/images/$image.oci.tar" >/dev/null
done

# kubelet's device-plugin folder is fixed at /var/lib/kubelet/device-plugins, outside its
# root dir: remember whether we made /var/lib/kubelet so that teardown removes only ours.
[[ -d /var/lib/kubelet || -f $CLUSTER_DIR/made-var-lib-kubelet ]] || touch "$CLUSTER_DIR/made-var-lib-kubelet"
# This node's CDI folder is the host's /var/run/cdi (a worker binds its own there, node.sh); made here if missing,
# so that cluster-down removes it with whatever specs a DRA driver left.
host_mkdir run-cdi /var/run/cdi
# start_kubelet binds <root-dir>/plugins_registry and <root-dir>/plugins onto /var/lib/kubelet/... (lib.sh bind_plugin_dirs)
start_kubelet

start kube-proxy kube-proxy --config="$CLUSTER_DIR/kube-proxy.yaml" --v=1

wait_for 90 "node $NODE_NAME Ready" sh -c "kubectl --kubeconfig '$KUBECONFIG_PATH' get node '$NODE_NAME' -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
# kubelet's own sysctl for bridged traffic, once the bridge exists (it appears with the first pod)
sysctl -qw net.bridge.bridge-nf-call-iptables=1 || true

# --- cluster DNS ---------------------------------------------------------------------------
kc apply -f "$here/manifests/coredns.yaml" >/dev/null
kc -n kube-system rollout status deploy/coredns --timeout=90s >/dev/null
wait_for 30 "cluster DNS" python3 "$here/tools/dns_query.py" "$DNS_SERVICE_IP" kubernetes.default.svc.cluster.local "$API_SERVICE_IP"
# --- worker nodes (NODES-1 of them), started side by side ---------------------------------
workers=()
for ((i = 1; i < NODES; i++)); do
  bash "$here/scripts/pki.sh" node "gpu-ci-w$i" "$(worker_ip "$i")"  # one at a time: openssl's serial file
  workers+=("$i")
done
pids=()
for i in "${workers[@]}"; do bash "$here/scripts/node.sh" up "$i" & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid"; done
# Counted, not taken from NODES: an earlier cluster-up with more nodes leaves its workers running.
ready_nodes=$(kc get nodes --no-headers | awk '$2 == "Ready"' | wc -l)
log "cluster up in $((SECONDS - t0))s: kubeconfig $KUBECONFIG_PATH, $ready_nodes node(s) Ready, DNS answering, NetworkPolicies enforced"
