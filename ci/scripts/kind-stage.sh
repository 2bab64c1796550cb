#!/usr/bin/env bash
# The kind stage of the test command (`make e2e-kind-podman`): `make e2e CLUSTER=kind` proven on this machine.
# podman (install-podman.sh) runs kind's nodes; a kind node image for K8S_VERSION is assembled here
# (build-kind-node.sh: no registry to pull kindest/node from); kind comes from the Go module proxy. Then
# ci/scripts/e2e.sh kind creates a cluster of KIND_STAGE_WORKERS+1 nodes (default 2: one control plane, one
# worker), imports the project's image into both, runs the e2e tests of PYTEST_ARGS (default the `fast`
# ones, the fake-GPU 0 -> 4 -> 0 readiness test among them) and deletes the cluster.
#
# The host is checked as after the CI cluster: what host-state.sh lists must be the same before and after (only what
# this stage touches, host-state.sh --kind, while the CI cluster is up: make test runs this stage beside it).
# The stage adds, and removes at the end: an empty /lib/modules where the host has none (kind mounts it into
# every node), /etc/containers/containers.conf (runc cannot raise RLIMIT_NOFILE or
# RLIMIT_NPROC above the host's hard limits without CAP_SYS_RESOURCE, which these machines' bounding set
# lacks, so podman's default ulimits must stay at or below them), podman's "kind" network (its CNI
# configuration, bridge and host-local leases), the iptables chains podman's CNI plugins create and leave
# (CNI-FORWARD, CNI-ADMIN, CNI-HOSTPORT-*), the sysctls they set, and the /run/netns mount podman makes.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/scripts/common.sh"
t0=$SECONDS
# Root only: everything below builds root filesystems or changes the host. As a normal user, stop before any of it,
# naming each part that needs root, then what kind itself would say of this host through rootless podman (the
# preflight of `make e2e CLUSTER=kind`, which is a normal user's way to run kind; it makes nothing).
if [[ $EUID != 0 ]]; then
  cat >&2 <<EOF
ci: make e2e-kind-podman (ci/scripts/kind-stage.sh) runs as root only; running as $(id -un 2>/dev/null || echo "uid $EUID") (uid $EUID), so nothing was done. What needs root here:
  - the kind node image's root filesystem and the project image's base: debootstrap and chroot (ci/scripts/build-kind-rootfs.sh, build-base-rootfs.sh; no registry to pull kindest/node from)
  - podman and its dnsname CNI plugin where missing: apt-get install (ci/scripts/install-podman.sh, install-deps.sh)
  - /etc/containers/containers.conf (podman's default ulimits at or below the host's hard limits) and an empty /lib/modules where the host has none (kind mounts it into every node); both removed after
  - the teardown and its check: podman's CNI chains in iptables and ip6tables, the sysctls they set, the /run/netns mount, the kind bridge (ip link), and iptables-save for the before/after host check (ci/scripts/host-state.sh)
  - KIND_CPU_SHARES: the kind nodes' CPU weight in /sys/fs/cgroup/cpu/libpod_parent
Without root: make e2e CLUSTER=kind (kind's own node image, on Docker this user may use or on rootless podman with KIND_EXPERIMENTAL_PROVIDER=podman), caches in $CI_CACHE. Its preflight on this host, through rootless podman:
EOF
  KIND_EXPERIMENTAL_PROVIDER=podman python3 "$repo/e2e/local_cluster.py" kind preflight || true
  exit 2
fi
t=$SECONDS; bash "$here/scripts/install-deps.sh"; bash "$here/scripts/install-podman.sh"; log "timing: kind stage host packages $((SECONDS - t))s"

state=$(mktemp -d)
# Beside the CI cluster (make test starts this stage while its parallel phase runs), whose pods, links and rules
# change meanwhile, the check covers what this stage touches; the CI cluster's own check after its cluster-down covers
# the whole host, this stage's time included.
scope=()
if [[ -d $CLUSTER_DIR ]]; then scope=(--kind); log "the CI cluster is up: the host check covers what the kind stage touches"; fi
bash "$here/scripts/host-state.sh" "${scope[@]}" > "$state/before"
mountpoint -q /run/netns 2>/dev/null && touch "$state/run-netns-was-mounted"
for key in net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables; do
  echo "$key=$(sysctl -n "$key" 2>/dev/null || echo absent)"
done > "$state/sysctl"
cni_chains() {  # cni_chains CMD TABLE: the CNI-* chains of that table, one a line (none is not an error)
  "$1-save" -t "$2" 2>/dev/null | sed -n 's/^:\(CNI-[^ ]*\) .*/\1/p' || true
}
for cmd in iptables ip6tables; do
  for table in filter nat mangle; do cni_chains "$cmd" "$table"; done
done | sort -u > "$state/cni-chains"

podman volume ls --quiet | sort > "$state/volumes"
[[ ! -d /var/lib/cni/networks ]] || touch "$state/had-cni-networks"
# kind mounts the host's /lib/modules read-only into every node; these machines have no kernel modules on disk
if [[ ! -e /lib/modules ]]; then mkdir /lib/modules; touch "$state/made-lib-modules"; fi

conf=/etc/containers/containers.conf
if [[ ! -e $conf ]]; then
  hard_nofile=$(ulimit -Hn) hard_nproc=$(ulimit -Hu)
  [[ $hard_nofile == unlimited ]] && hard_nofile=1048576
  [[ $hard_nproc == unlimited ]] && hard_nproc=1048576
  mkdir -p /etc/containers
  printf '%s\n' "# written by gpu-agent ci/scripts/kind-stage.sh, removed when it ends" "[containers]" \
    "default_ulimits = [\"nofile=$hard_nofile:$hard_nofile\", \"nproc=$((hard_nproc < 4096 ? hard_nproc : 4096)):$((hard_nproc < 4096 ? hard_nproc : 4096))\"]" > "$conf"
  touch "$state/wrote-containers-conf"
elif ! grep -q '^default_ulimits' "$conf"; then
  echo "ci: $conf exists without default_ulimits: add default_ulimits = [\"nofile=N:N\", \"nproc=M:M\"] at or below" \
       "the host's hard limits (ulimit -Hn, ulimit -Hu), or move the file away for this run" >&2
  exit 1
fi

# KIND_CPU_SHARES: the CPU weight of podman's containers (the kind nodes, cgroupfs under libpod_parent) while the stage
# runs, restored after: scripts/test.sh runs this stage beside the CI cluster's serial phase, whose time bounds must
# meet the load they met alone (1024 is a cgroup's default, a node of the CI cluster's own; 512 lets the kind nodes
# take half what one of those would, when both want the CPU).
shares=/sys/fs/cgroup/cpu/libpod_parent/cpu.shares
if [[ -n ${KIND_CPU_SHARES:-} && -d /sys/fs/cgroup/cpu ]]; then
  if [[ ! -d ${shares%/*} ]]; then mkdir "${shares%/*}" && touch "$state/made-libpod-parent"; fi
  cat "$shares" > "$state/cpu-shares" && echo "$KIND_CPU_SHARES" > "$shares" \
    && log "kind nodes' CPU weight $KIND_CPU_SHARES (was $(cat "$state/cpu-shares")) while the stage runs"
fi

teardown() {
  local code=$1 t=$SECONDS
  # e2e.sh deleted the cluster; kind leaves its network, podman's CNI plugins their chains and sysctls
  if podman network exists kind 2>/dev/null; then
    bridge=$(podman network inspect kind --format '{{.NetworkInterface}}' 2>/dev/null || true)
    podman network rm -f kind >/dev/null || code=1
    [[ -z ${bridge:-} ]] || ! ip link show "$bridge" >/dev/null 2>&1 || ip link del "$bridge" || code=1
    if [[ -n ${bridge:-} ]]; then  # dnsname's rule admitting DNS from the bridge (INPUT, filter) stays behind
      for cmd in iptables ip6tables; do
        while read -r rule; do
          eval "$cmd -t filter $rule" || code=1
        done < <("$cmd-save" -t filter 2>/dev/null | { grep -E "^-A [A-Za-z0-9_-]+ -i $bridge " || true; } | sed 's/^-A /-D /')
      done
    fi
  fi
  rm -rf /var/lib/cni/networks/kind
  [[ -f $state/had-cni-networks ]] || rmdir /var/lib/cni/networks 2>/dev/null || true
  # the nodes' /var volumes: kind deletes them with the cluster, but not after a create that failed half-way
  while read -r volume; do
    podman volume rm --force "$volume" >/dev/null || code=1
  done < <(podman volume ls --quiet | sort | comm -13 "$state/volumes" -)
  [[ ! -f $state/made-lib-modules ]] || rmdir /lib/modules || code=1
  # dnsname's dnsmasq for the network, if its last container's removal did not stop it
  dns=/run/containers/cni/dnsname/kind
  if [[ -f $dns/pidfile ]] && kill -0 "$(cat "$dns/pidfile")" 2>/dev/null; then kill "$(cat "$dns/pidfile")" || code=1; fi
  rm -rf "$dns"
  for cmd in iptables ip6tables; do
    for table in filter nat mangle; do
      # jumps into chains this stage created, then the chains themselves
      for chain in $(cni_chains "$cmd" "$table"); do
        grep -qx "$chain" "$state/cni-chains" && continue
        "$cmd-save" -t "$table" | { grep -E "^-A [A-Za-z0-9_-]+ .*-j $chain( |\$)" || true; } | sed 's/^-A /-D /' | while read -r rule; do
          eval "$cmd -t $table $rule" || true
        done
        "$cmd" -t "$table" -F "$chain" 2>/dev/null || true
      done
      for chain in $(cni_chains "$cmd" "$table"); do
        grep -qx "$chain" "$state/cni-chains" || "$cmd" -t "$table" -X "$chain" 2>/dev/null || code=1
      done
    done
  done
  while IFS== read -r key value; do
    [[ $value == absent ]] || sysctl -qw "$key=$value" || code=1
  done < "$state/sysctl"
  if [[ ! -f $state/run-netns-was-mounted ]] && mountpoint -q /run/netns 2>/dev/null && [[ -z $(ls -A /run/netns) ]]; then
    umount /run/netns || code=1
  fi
  [[ ! -f $state/wrote-containers-conf ]] || rm -f "$conf"
  [[ ! -s $state/cpu-shares ]] || cat "$state/cpu-shares" > "$shares" || code=1
  [[ ! -f $state/made-libpod-parent ]] || rmdir "${shares%/*}" 2>/dev/null || true  # podman's, if it made containers
  bash "$here/scripts/host-state.sh" "${scope[@]}" > "$state/after"
  if ! diff -u "$state/before" "$state/after"; then
    log "FAILED: the kind stage left the host changed (diff above)"; code=1
  else
    log "kind stage teardown check passed: host state identical to before"
  fi
  rm -rf "$state"
  log "timing: kind stage teardown $((SECONDS - t))s"
  log "timing: kind stage $((SECONDS - t0))s"
  return "$code"
}
trap 'code=$?; teardown "$code" || code=1; exit $code' EXIT

t=$SECONDS
KIND_ENGINE=podman bash "$here/scripts/build-kind-node.sh" > "$state/node-image"
node_image=$(tail -1 "$state/node-image")
log "timing: kind node image (and kind) $((SECONDS - t))s: $node_image"

export KIND="$KIND_BIN" KIND_EXPERIMENTAL_PROVIDER=podman E2E_NODE_IMAGE=$node_image E2E_IMAGE_BUILD=ci
export E2E_WORKERS=${KIND_STAGE_WORKERS:-1} E2E_CLUSTER_NAME=${KIND_STAGE_NAME:-gpu-agent-kind}
# Pod and Service ranges apart from the CI cluster's (common.sh): kind's pods talk across podman's bridge, where the
# host's iptables see bridged packets (bridge-nf-call-iptables=1), and the CI cluster's NetworkPolicy enforcer on
# the host queues every flow of its own pod range.
export E2E_POD_SUBNET=${KIND_STAGE_POD_SUBNET:-10.245.0.0/16} E2E_SERVICE_SUBNET=${KIND_STAGE_SERVICE_SUBNET:-10.97.0.0/16}
export E2E_KUBECONFIG=$CI_CACHE/kind-$E2E_CLUSTER_NAME.kubeconfig
# The `fast` tests, and those every cluster runs (a user's first install): PYTEST_ARGS replaces the selection, one
# word per argument.
if [[ -n ${PYTEST_ARGS:-} ]]; then
  # shellcheck disable=SC2086
  bash "$here/scripts/e2e.sh" kind $PYTEST_ARGS
else
  bash "$here/scripts/e2e.sh" kind -m "fast or every_cluster"
fi
