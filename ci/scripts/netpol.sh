#!/usr/bin/env bash
# The CI cluster's NetworkPolicy enforcer: kube-network-policies (built by build-kube-network-policies.sh)
# as a plain process on every node, judging the node's pod traffic. cluster-up and node.sh call this.
#   netpol.sh rbac       its ServiceAccount and ClusterRole (ci/manifests/kube-network-policies.yaml) and a token
#   netpol.sh up [wN]    start the enforcer of the control-plane node (no argument) or of worker wN, then the shim
#   netpol.sh kill [wN]  kill it, rules left in place (a dead node: its pods' new flows are dropped)
#   netpol.sh down [wN]  remove the shim, stop the enforcer
#
# The shim. kube-network-policies v0.8.0 hands each new flow of a policed pod to itself with the nftables
# `queue` statement (in a table of its own) and answers with a verdict from the NetworkPolicies it watches.
# A kernel without CONFIG_NFT_QUEUE, such as this CI machine's, refuses that whole table: the enforcer then
# keeps listening on its queue and silently enforces nothing. So each node's network namespace feeds the
# same queue from iptables (xt_NFQUEUE, through iptables-nft's compat layer), in a mangle chain hooked where
# its table hooks (POSTROUTING, before SNAT; bridged pod-to-pod traffic too, bridge-nf-call-iptables=1), with
# the exemptions of its table: the node's own root processes (kubelet's probes, the API server's pod proxy;
# a pod's packets reach the node without their socket, so a pod running as root is not exempt) and packets
# of flows already judged. What differs: its table queues the local pods some policy selects; the shim
# queues every new flow from or to the node's pod CIDR (a packet no policy concerns is accepted, so the
# verdicts are the same; every new flow costs a trip to userspace). DNS goes through the shim like any
# flow (--netfilter-bug-1766-fix=false; its table would accept udp/53 here and judge it in PREROUTING).
#
# Fail closed: the NFQUEUE rules have no --queue-bypass, so while a node's enforcer is not running, the new
# flows of its pods are dropped: an enforcer that died shows as failures, never as a cluster that enforces
# nothing. `up` starts it, waits for it to listen on the queue, and only then adds the rules.
#
# It has no --kubeconfig flag (rest.InClusterConfig only): it runs in a mount namespace of its own where a
# tmpfs over /run (/var/run is a link to it) holds the token and CA at the in-cluster path, so nothing is
# written to the host and everything goes with the process.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
source "$here/scripts/lib.sh"

what=${1:?usage: netpol.sh rbac | up|kill|down [wN]}
QUEUE=100
CHAIN=GPUCI-NETPOL
SECRETS=$CLUSTER_DIR/netpol  # the token; the CA is $PKI/ca.crt

if [[ $what == rbac ]]; then
  wait_for 30 "namespace kube-system" kc get namespace kube-system
  kc apply -f "$here/manifests/kube-network-policies.yaml" >/dev/null
  mkdir -p "$SECRETS"
  # A year: the cluster is gone long before (a TokenRequest token is bound to its ServiceAccount only).
  kc -n kube-system create token kube-network-policies --duration=8760h > "$SECRETS/token.tmp"
  mv "$SECRETS/token.tmp" "$SECRETS/token"
  exit 0
fi

arg=${2:-}
if [[ -z $arg ]]; then
  name=netpol node=$NODE_NAME pod_cidr=$POD_CIDR
  in_net=() in_node=()
else
  n=${arg#gpu-ci-}; n=${n#w}
  [[ $n =~ ^[1-9][0-9]?$ ]] || { echo "netpol.sh: '$arg' is not a worker (w1..w99)" >&2; exit 2; }
  name=w$n-netpol node=gpu-ci-w$n pod_cidr=10.244.$n.0/24
  in_net=(nsenter --net="/run/netns/gpuci-w$n" --)
fi

listening() { "${in_net[@]}" awk -v q="$QUEUE" '$1 == q {found = 1} END {exit !found}' /proc/net/netfilter/nfnetlink_queue; }

shim_up() {
  local ipt=("${in_net[@]}" iptables -w -t mangle)
  "${ipt[@]}" -N "$CHAIN" 2>/dev/null || true
  "${ipt[@]}" -F "$CHAIN"
  "${ipt[@]}" -A "$CHAIN" -m owner --uid-owner 0 -j RETURN
  "${ipt[@]}" -A "$CHAIN" -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
  "${ipt[@]}" -A "$CHAIN" -s "$pod_cidr" -m comment --comment gpu-agent-ci-netpol -j NFQUEUE --queue-num "$QUEUE"
  "${ipt[@]}" -A "$CHAIN" -d "$pod_cidr" -m comment --comment gpu-agent-ci-netpol -j NFQUEUE --queue-num "$QUEUE"
  "${ipt[@]}" -C POSTROUTING -j "$CHAIN" 2>/dev/null || "${ipt[@]}" -I POSTROUTING -j "$CHAIN"
}

shim_down() {
  local ipt=("${in_net[@]}" iptables -w -t mangle)
  while "${ipt[@]}" -D POSTROUTING -j "$CHAIN" 2>/dev/null; do :; done
  "${ipt[@]}" -F "$CHAIN" 2>/dev/null && "${ipt[@]}" -X "$CHAIN"
  return 0
}

case $what in
  up)
    t=$SECONDS
    [[ -f $SECRETS/token ]] || { echo "netpol.sh: no token in $SECRETS (netpol.sh rbac first)" >&2; exit 1; }
    [[ -x $NETPOL_BIN ]] || bash "$here/scripts/build-kube-network-policies.sh"
    sa=/run/secrets/kubernetes.io/serviceaccount
    # a worker's enforcer runs in the node's network and mount namespaces (its holder's), as its other daemons
    [[ -z $arg ]] || in_node=(nsenter -t "$(cat "$PIDS/w$n-holder.pid")" -m -n --)
    start "$name" "${in_node[@]}" unshare --mount --propagation private -- sh -c "
      mount -t tmpfs -o size=1m,mode=0755 gpuci-netpol /run && mkdir -p $sa &&
      cp '$SECRETS/token' $sa/token && cp '$PKI/ca.crt' $sa/ca.crt &&
      exec env KUBERNETES_SERVICE_HOST=$NODE_IP KUBERNETES_SERVICE_PORT=$API_PORT '$NETPOL_BIN' \
        --hostname-override='$node' --nfqueue-id=$QUEUE --metrics-bind-address=127.0.0.1:19080 \
        --netfilter-bug-1766-fix=false --v=1"
    wait_for 30 "$node's NetworkPolicy enforcer listening on NFQUEUE $QUEUE (log: $LOGS/$name.log)" listening
    shim_up
    log "NetworkPolicy enforcer of $node (pods $pod_cidr) judging in $((SECONDS - t))s"
    ;;
  kill)
    [[ -f $PIDS/$name.pid ]] && kill -KILL "$(cat "$PIDS/$name.pid")" 2>/dev/null
    rm -f "$PIDS/$name.pid"
    ;;
  down)
    # Rules first: the node's pods are never left queued to nobody. On the control-plane node (the host's
    # network namespace) SIGINT, the enforcer's own way out: it removes its nftables table where a kernel
    # loaded it, then waits 5 s. A worker's table goes with its network namespace.
    [[ -z $arg || -e /run/netns/gpuci-w$n ]] && shim_down
    if [[ -z $arg ]] && running "$name"; then
      pid=$(cat "$PIDS/$name.pid")
      kill -INT "$pid" 2>/dev/null || true
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    stop_daemon "$name"
    ;;
  *) echo "netpol.sh: unknown command '$what'" >&2; exit 2 ;;
esac
