#!/usr/bin/env bash
# A real single-node Kubernetes on a plain machine: etcd, kube-apiserver, controller-manager,
# scheduler, containerd + runc + CNI bridge, kubelet, kube-proxy, CoreDNS. No systemd: every
# daemon is started here and remembered by PID. Idempotent: a second run leaves one cluster.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
source "$here/scripts/lib.sh"
t0=$SECONDS

bash "$here/scripts/install-deps.sh"
bash "$here/scripts/build-kubernetes.sh"
bash "$here/scripts/build-coredns.sh"
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
# Pod traffic must never leave this machine: drop anything from the pod bridge not addressed to
# the pod network (in mangle, which kube-proxy never rewrites, so its ACCEPTs cannot bypass it).
fence=(FORWARD -i "$BRIDGE" ! -d "$CLUSTER_CIDR" -m comment --comment gpu-agent-ci-fence -j DROP)
iptables -t mangle -C "${fence[@]}" 2>/dev/null || iptables -t mangle -I "${fence[@]}"

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
  --profiling=false --v=1
wait_for 60 kube-apiserver curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
  "https://$NODE_IP:$API_PORT/readyz"

start kube-controller-manager kube-controller-manager --kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$CLUSTER_DIR/controller-manager.kubeconfig" \
  --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
  --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
  --use-service-account-credentials=true --leader-elect=false --bind-address=127.0.0.1 --profiling=false --v=1
start kube-scheduler kube-scheduler --kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" \
  --authentication-kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" --authorization-kubeconfig="$CLUSTER_DIR/scheduler.kubeconfig" \
  --leader-elect=false --bind-address=127.0.0.1 --profiling=false --v=1

# --- node: containerd, CNI, kubelet, kube-proxy ---------------------------------------------
mkdir -p "$CLUSTER_DIR/containerd" "$CLUSTER_DIR/cni/net.d" "$CLUSTER_DIR/kubelet"
cat > "$CLUSTER_DIR/containerd/config.toml" <<TOML
version = 2
root = "$CLUSTER_DIR/containerd/root"
state = "$CLUSTER_DIR/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:ci"
  # Without CAP_SYS_RESOURCE runc cannot lower oom_score_adj: every pod fails otherwise.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$CLUSTER_DIR/cni/net.d"
TOML
cat > "$CLUSTER_DIR/cni/net.d/10-gpuci.conflist" <<JSON
{"cniVersion": "0.4.0", "name": "gpuci", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$CLUSTER_DIR/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
JSON
start containerd containerd --config "$CLUSTER_DIR/containerd/config.toml"
wait_for 30 containerd ctr --address "$CONTAINERD_SOCK" version
for image in pause coredns; do
  ctr_ images import "$CI_CACHE/images/$image.oci.tar" >/dev/null
done

cat > "$CLUSTER_DIR/kubelet/config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
clusterDNS: [$DNS_SERVICE_IP]
clusterDomain: cluster.local
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
tlsCertFile: $PKI/kubelet-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-serving.key
podCIDR: $POD_CIDR
serializeImagePulls: false
# Report node status every second (default 10 s), so allocatable follows fake GPUs within 2 s.
nodeStatusUpdateFrequency: 1s
# Images cannot be pulled again here: never garbage-collect them, never evict for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
YAML
# kubelet's device-plugin folder is fixed at /var/lib/kubelet/device-plugins, outside its
# root dir: remember whether we made /var/lib/kubelet so that teardown removes only ours.
[[ -d /var/lib/kubelet || -f $CLUSTER_DIR/made-var-lib-kubelet ]] || touch "$CLUSTER_DIR/made-var-lib-kubelet"
start_kubelet

cat > "$CLUSTER_DIR/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: $CLUSTER_CIDR
hostnameOverride: $NODE_NAME
bindAddress: 127.0.0.1
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
clientConnection: {kubeconfig: $CLUSTER_DIR/kube-proxy.kubeconfig}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
YAML
start kube-proxy kube-proxy --config="$CLUSTER_DIR/kube-proxy.yaml" --v=1

wait_for 90 "node $NODE_NAME Ready" sh -c "kubectl --kubeconfig '$KUBECONFIG_PATH' get node '$NODE_NAME' -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
# kubelet's own sysctl for bridged traffic, once the bridge exists (it appears with the first pod)
sysctl -qw net.bridge.bridge-nf-call-iptables=1 || true

# --- cluster DNS ---------------------------------------------------------------------------
kc apply -f "$here/manifests/coredns.yaml" >/dev/null
kc -n kube-system rollout status deploy/coredns --timeout=90s >/dev/null
wait_for 30 "cluster DNS" python3 "$here/tools/dns_query.py" "$DNS_SERVICE_IP" kubernetes.default.svc.cluster.local "$API_SERVICE_IP"
log "cluster up in $((SECONDS - t0))s: kubeconfig $KUBECONFIG_PATH, node $NODE_NAME Ready, DNS answering"
