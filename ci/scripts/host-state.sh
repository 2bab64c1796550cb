#!/usr/bin/env bash
# Prints what the CI cluster may touch on the host, so a run can prove that teardown left
# nothing behind: compare the output before cluster-up with the output after cluster-down.
#
# host-state.sh --kind: what the kind stage alone touches (podman's containers, networks and volumes, the CNI
# configurations and leases its networks leave, the CNI-* iptables chains and rules, podman's bridges, dnsmasq,
# containers.conf): the check of a kind stage run while the CI cluster is up (make test runs it beside the
# parallel phase), whose pods, links and rules change meanwhile. The CI cluster's own check, after its
# cluster-down, then covers the whole host, the kind stage's time included.
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
kind_state() {
  echo "## podman bridges"; ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^(cni-)?podman[0-9]+$' | sort
  for cmd in iptables ip6tables; do
    for table in filter nat mangle; do
      echo "## $cmd $table CNI"; "$cmd-save" -t $table 2>/dev/null | grep -vE '^#|^\*|^COMMIT' | grep -E 'CNI-' | sort
    done
  done
}
if [[ ${1:-} == --kind ]]; then
  kind_state
else
  echo "## links"; ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort
  echo "## addresses"; ip -o addr show | awk '{print $2, $4}' | sort
  echo "## routes"; ip route show | sort
  echo "## netns"; ls /run/netns 2>/dev/null | sort
  # Rules, and chains of our own (GPUCI-FENCE, GPUCI-NETPOL, KUBE-*, CNI-*: a user chain's policy is "-"),
  # empty ones too; not the built-in chains: an empty table is not state (it appears the first time any
  # tool lists it).
  for cmd in iptables ip6tables; do
    for table in filter nat mangle; do
      echo "## $cmd $table"; "$cmd-save" -t $table 2>/dev/null | grep -vE '^#|^:|^\*|^COMMIT' | sort
      "$cmd-save" -t $table 2>/dev/null | grep -E '^:[^ ]+ - ' | cut -d' ' -f1 | sort
    done
  done
  # NFQUEUE listeners of the host's network namespace (the control-plane node's NetworkPolicy enforcer
  # listens on queue 100), and nftables tables other than iptables-nft's (the enforcer's own,
  # kube-network-policies, where a kernel loads it; listed only where the nft tool is installed).
  echo "## nfqueue"; awk '{print "queue", $1}' /proc/net/netfilter/nfnetlink_queue 2>/dev/null
  if command -v nft >/dev/null; then
    echo "## nftables"; nft list tables 2>/dev/null | grep -vE '^table (ip|ip6|arp|bridge) (filter|nat|mangle|raw|security)$' | sort
  fi
  echo "## sysctls"; sysctl net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables 2>/dev/null
  echo "## mounts"; awk '{print $2}' /proc/mounts | grep -E "gpu-agent-ci|/run/netns|kubelet|containerd|/run/cdi" | sort
  # kube-network-policies is "kube-network-po" here (a command name keeps 15 characters); docker-registry: the CI
  # registry (ci/scripts/registry.sh), which cluster-down stops; prometheus: the one e2e/test_alerts.py starts for
  # its duration
  echo "## processes"; ps -eo comm= | grep -E '^(etcd|kube-|kubelet|containerd|coredns|pause|docker-registry|prometheus)' | sort | uniq -c
  ps -eo args= | grep -c '^gpuci-node-holder' | sed 's/^/worker node holders: /'
  echo "## cgroups"; ls -d /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/gpuci-* 2>/dev/null
  echo "## state"; ls -d "$CLUSTER_DIR" /run/secrets/kubernetes.io /var/run/cdi 2>/dev/null; find /var/lib/kubelet 2>/dev/null | sort
fi
# The kind stage (ci/scripts/kind-stage.sh): podman's containers, networks and volumes (its images are a cache,
# as CI_CACHE is), the CNI configurations and host-local leases podman's networks leave, dnsname's dnsmasq, and
# the containers.conf the stage writes.
if command -v podman >/dev/null; then
  echo "## podman"; podman ps -a --format '{{.Names}}' 2>/dev/null | sort | sed 's/^/container /'
  podman network ls --format '{{.Name}}' 2>/dev/null | sort | sed 's/^/network /'
  podman volume ls -q 2>/dev/null | sort | sed 's/^/volume /'
fi
echo "## cni"; ls /etc/cni/net.d /var/lib/cni/networks 2>/dev/null
ps -eo comm= | grep -c '^dnsmasq' | sed 's/^/dnsmasq processes: /'
echo "## containers.conf"; sha256sum /etc/containers/containers.conf 2>/dev/null || echo absent
exit 0
