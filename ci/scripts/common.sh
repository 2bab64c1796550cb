# Shared settings for the CI cluster scripts. Sourced, never run.
# Everything that should survive between runs on one machine lives under CI_CACHE,
# outside the clone; everything a running cluster owns lives under CLUSTER_DIR. Both are chosen in paths.sh: root's
# are the system folders under /var, another user's under ~/.cache and ~/.local/state.
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
export K8S_VERSION=${K8S_VERSION:-v1.36.2}
export COREDNS_VERSION=${COREDNS_VERSION:-v1.12.4}
# The NetworkPolicy enforcer every node runs (ci/scripts/netpol.sh), built from ci/kube-network-policies.
export NETPOL_VERSION=${NETPOL_VERSION:-v0.8.0}
export GOMODCACHE=${GOMODCACHE:-$CI_CACHE/gomod}
export GOCACHE=${GOCACHE:-$CI_CACHE/gocache}
export K8S_BIN=$CI_CACHE/kubernetes-$K8S_VERSION
export TOOLS_BIN=$CI_CACHE/tools
export NETPOL_BIN=$CI_CACHE/kube-network-policies-$NETPOL_VERSION/kube-network-policies
# containerd 2.x with CDI for the nodes (ci/containerd, ci/scripts/build-containerd.sh): containerd, its runc shim, ctr.
export CONTAINERD_VERSION=${CONTAINERD_VERSION:-v2.4.2}
export CONTAINERD_BIN=$CI_CACHE/containerd-$CONTAINERD_VERSION/bin
# kstatus (ci/kstatus): Flux's and cli-utils' verdict on live objects, for the e2e suite (e2e/gitops.py).
# Its main.go is ours, so the cache key is cli-utils' version plus a digest of ci/kstatus: an edit
# there is a new path, which e2e/gitops.py then finds absent rather than running a stale build.
export KSTATUS_VERSION=${KSTATUS_VERSION:-v0.37.2}
_kstatus_src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../kstatus" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-12)
export KSTATUS_BIN=$CI_CACHE/kstatus-$KSTATUS_VERSION-$_kstatus_src/kstatus
export KUBECONFIG_PATH=${KUBECONFIG_PATH:-$CLUSTER_DIR/admin.kubeconfig}
# The CI's OCI registry (ci/scripts/registry.sh): Debian's docker-registry (distribution 2.8), cached by version; its
# state (config, htpasswd, credentials, pid) under REGISTRY_DIR, its serving certificate from the cluster's CA (PKI).
export REGISTRY_VERSION=${REGISTRY_VERSION:-2.8.2}
export REGISTRY_BIN=$CI_CACHE/docker-registry-$REGISTRY_VERSION/docker-registry
export REGISTRY_DIR=${REGISTRY_DIR:-$CLUSTER_DIR/registry}
export REGISTRY_ADDR=${REGISTRY_ADDR:-127.0.0.1:5443}
# Where every node's containerd looks for a registry's hosts.toml (config_path, node-config.sh): registry.sh start
# writes the registry's there, stop removes it. One folder for every node: they share the host's filesystem.
export REGISTRY_HOSTS_DIR=${REGISTRY_HOSTS_DIR:-$CLUSTER_DIR/containerd-certs.d}
log() { printf '%s ci: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
# need_root WHAT WHY: as anyone but root, stop (exit 2) before anything is built or changed, saying that WHAT needs
# root because WHY, and what a normal user runs instead. Root: nothing.
need_root() {
  [[ $EUID != 0 ]] || return 0
  echo "ci: $1 needs root: $2. Running as $(id -un 2>/dev/null || echo "uid $EUID") (uid $EUID): nothing was done." \
       "Without root: make e2e CLUSTER=kind (kind on Docker or rootless podman; docs/testing.md," \
       "\"Run it on your laptop\"), whose caches go to $CI_CACHE." >&2
  exit 2
}
# The host's CPU time since boot, busy and all (jiffies, every core: /proc/stat's first line), for cpu_busy.
cpu_mark() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $2+$3+$4+$5+$6+$7+$8+$9; exit}' /proc/stat; }
# cpu_busy MARK: the share of every core's time spent busy since MARK, "cpu N%": a step at 95% waits on the CPU
# (more side by side slows it), one at 20% waits on the cluster (more side by side is nearly free).
cpu_busy() { local b0 t0 b1 t1; read -r b0 t0 <<< "$1"; read -r b1 t1 <<< "$(cpu_mark)"
  echo "cpu $(( t1 > t0 ? 100 * (b1 - b0) / (t1 - t0) : 0 ))%"; }
export BASE_ROOTFS_VERSION=${BASE_ROOTFS_VERSION:-bookworm-py3-1}
export NODE_NAME=${NODE_NAME:-gpu-ci-node}
# The node's address lives on lo as a /32: local to this machine only, so nothing the
# cluster advertises routes anywhere else.
export NODE_IP=${NODE_IP:-10.250.0.1}
# The CI cluster's registry (ci/scripts/e2e.sh starts it after cluster-up): on the first node's address, which every
# node reaches (the workers through their bridge's gateway, as they reach the API server on it) and which nothing
# off this machine can.
export REGISTRY_CLUSTER_ADDR=${REGISTRY_CLUSTER_ADDR:-$NODE_IP:5443}
export API_PORT=${API_PORT:-6443}
export CLUSTER_CIDR=10.244.0.0/16
export POD_CIDR=10.244.0.0/24
export SERVICE_CIDR=10.96.0.0/16
export API_SERVICE_IP=10.96.0.1
export DNS_SERVICE_IP=10.96.0.10
export BRIDGE=gpuci0
# How many nodes: the control-plane node plus NODES-1 workers (gpu-ci-w1, ...), each in its own
# network namespace on the host bridge NODES_BRIDGE (NODE_NETWORK, the host at NODES_GATEWAY).
export NODES=${NODES:-1}
export NODE_NETWORK=10.250.0.0/16
export NODES_BRIDGE=gpucin0
export NODES_GATEWAY=10.250.1.1
worker_ip() { echo "10.250.1.$((10 + $1))"; }
# How soon the controller manager calls a silent node NotReady, and how long its pods then stay
# bound before they are evicted (Kubernetes' defaults are 50 s and 300 s: minutes in a test).
export NODE_GRACE_PERIOD=${NODE_GRACE_PERIOD:-12s}
export POD_EVICTION_SECONDS=${POD_EVICTION_SECONDS:-30}
export PKI=$CLUSTER_DIR/pki
export PIDS=$CLUSTER_DIR/pids
export LOGS=$CLUSTER_DIR/logs
export CONTAINERD_SOCK=$CLUSTER_DIR/containerd/containerd.sock
# CONTAINERD_BIN before /usr/bin: containerd finds its runc shim in PATH, and Debian's (1.6) is in /usr/bin.
export PATH=$K8S_BIN:$CONTAINERD_BIN:$TOOLS_BIN:$PATH:/usr/local/sbin:/usr/sbin:/sbin

# A Go tool from the Go module proxy, built static into CI_CACHE once and reused: NAME (for the log), OUT (its
# cached path; a new version or source digest is a new path), MODDIR (a folder of ci/ whose go.mod must hold
# the whole line PIN, and whose go.sum pins every module), PACKAGE (what to build there).
go_build_cached() {
  local name=$1 out=$2 moddir=$3 package=$4 pin=$5 started=$SECONDS
  if [[ -x $out ]]; then log "$name cached"; return 0; fi
  grep -qxF -- "$pin" "$moddir/go.mod" || { echo "ci: $moddir/go.mod does not pin '$pin'" >&2; return 1; }
  mkdir -p "$(dirname "$out")" "$GOMODCACHE" "$GOCACHE"
  log "building $name (cold: minutes on 2 cores; warm Go caches: seconds)"
  (cd "$moddir" && GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out.tmp" "$package")
  mv "$out.tmp" "$out"
  log "$name built in $((SECONDS - started))s: $out"
}
# kind on this machine (ci/scripts/kind.sh): kind from the Go module proxy, and a node image for K8S_VERSION
# assembled here (ci/scripts/build-kind-node.sh) from a debootstrap root filesystem and what ci/ builds.
export KIND_VERSION=${KIND_VERSION:-v0.33.0}
export KIND_BIN=$CI_CACHE/kind-$KIND_VERSION/kind
export KIND_ROOTFS_VERSION=${KIND_ROOTFS_VERSION:-bookworm-kind-1}
export KIND_ROOTFS=$CI_CACHE/images/kind-rootfs-$KIND_ROOTFS_VERSION.tar
# Not ETCD_*: etcd reads every ETCD_<FLAG> variable of its environment as a flag, and the CI cluster's etcd (3.4)
# refused ETCD_VERSION=v3.6.8 ("invalid value ... for ETCD_VERSION"), so cluster-up never got past etcd.
# etcd for the kind node (ci/etcd), and kubeadm (the node's, built beside the server binaries)
export KIND_ETCD_VERSION=${KIND_ETCD_VERSION:-v3.6.8}
_etcd_src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../etcd" && cat go.mod go.sum ./*.go | sha256sum | cut -c1-12)
export KIND_ETCD_BIN=$CI_CACHE/etcd-$KIND_ETCD_VERSION-$_etcd_src/etcd
export KUBEADM_BIN=$CI_CACHE/kubeadm-$K8S_VERSION/kubeadm
# The version stamps of a Kubernetes build (what `kubeadm version`, `kubelet --version` report).
kube_ldflags() {
  local major=${K8S_VERSION#v} minor=${K8S_VERSION#v*.} pkg flags="" build_date
  major=${major%%.*}; minor=${minor%%.*}; build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    flags+=" -X $pkg.gitCommit=0000000000000000000000000000000000000000 -X $pkg.gitTreeState=clean"
    flags+=" -X $pkg.buildDate=$build_date"
  done
  echo "$flags"
}
# install_missing_packages PKG...: Debian packages not yet installed, installed without their daemons started
# (Debian's packaging would start them through init scripts; the scripts here start what they need themselves).
# Idempotent; what it installs is the host's new baseline (installed before the teardown check's snapshot).
install_missing_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  rm -f /usr/sbin/policy-rc.d
}
