# One node's configuration files: containerd, the CNI bridge, kubelet and kube-proxy. Sourced.
# Every node of the CI cluster (the control-plane node and each worker) is described by the same
# files under its own folder, so a worker differs only in the values passed here.

# write_if_changed PATH < CONTENT: kube-proxy exits when its configuration file is written, even
# with the same content, so an idempotent cluster-up must leave unchanged files alone.
write_if_changed() {
  local new
  new=$(cat)
  [[ -f $1 && $(cat "$1") == "$new" ]] || printf '%s\n' "$new" > "$1"
}

# write_node_config DIR NAME POD_CIDR CGROUP_ROOT SERVING_CERT
#   DIR/containerd/config.toml, DIR/cni/net.d/10-gpuci.conflist, DIR/kubelet/config.yaml, DIR/kube-proxy.yaml
write_node_config() {
  local dir=$1 name=$2 pod_cidr=$3 cgroup_root=$4 serving=$5
  mkdir -p "$dir/containerd" "$dir/cni/net.d" "$dir/kubelet"
  # containerd 2.x (build-containerd.sh): CDI is always on there, and kubelet 1.36 hands a DRA claim's CDI devices
  # only to a runtime that reads them (1.6 had none). cdi_spec_dirs: the node's own /var/run/cdi (a worker binds
  # its own folder there, node.sh), where the DRA driver writes each claim's spec.
  write_if_changed "$dir/containerd/config.toml" <<TOML
version = 3
root = "$dir/containerd/root"
state = "$dir/containerd/state"
[grpc]
  address = "$dir/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "localhost/pause:ci"
  # The CI registry's hosts.toml (its CA), written there by ci/scripts/registry.sh start and read at each pull.
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "$REGISTRY_HOSTS_DIR"
[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = ["/var/run/cdi"]
  # Without CAP_SYS_RESOURCE runc cannot lower oom_score_adj: every pod fails otherwise.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$dir/cni/net.d"
# NRI (on by default in 2.x) would listen on the host's one /var/run/nri/nri.sock for every node: nothing here uses it.
[plugins.'io.containerd.nri.v1.nri']
  disable = true
TOML
  write_if_changed "$dir/cni/net.d/10-gpuci.conflist" <<JSON
{"cniVersion": "0.4.0", "name": "gpuci", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$pod_cidr"}]], "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$dir/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
JSON
  write_if_changed "$dir/kubelet/config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
# Each node's pods live under their own root (kubepods below it), so no two nodes share a tree.
cgroupRoot: $cgroup_root
failCgroupV1: false
failSwapOn: false
clusterDNS: [$DNS_SERVICE_IP]
clusterDomain: cluster.local
containerRuntimeEndpoint: unix://$dir/containerd/containerd.sock
tlsCertFile: $PKI/$serving.crt
tlsPrivateKeyFile: $PKI/$serving.key
podCIDR: $pod_cidr
serializeImagePulls: false
# Report node status every second (default 10 s), so allocatable follows fake GPUs within 2 s.
nodeStatusUpdateFrequency: 1s
# The node's Lease is renewed every quarter of its duration: 2 s here, so that the controller
# manager's short grace period (NODE_GRACE_PERIOD) never mistakes a live node for a dead one.
nodeLeaseDurationSeconds: 8
# Images cannot be pulled again here: never garbage-collect them, never evict for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
YAML
  write_if_changed "$dir/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: $CLUSTER_CIDR
hostnameOverride: $name
bindAddress: 127.0.0.1
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
clientConnection: {kubeconfig: $CLUSTER_DIR/kube-proxy.kubeconfig}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
YAML
}
