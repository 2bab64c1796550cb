"""Trust only what can be checked: each member against its owner Pod, and its GPUs against its Node.

A node agent writes its own GPUDomainMember, and the member's `ip` reaches every peer list of its domain. The
admission policy (the chart's validatingadmissionpolicy-members.yaml) binds `spec.node` to the node of the token
that writes it, but nothing binds `spec.ip`: a compromised node agent could point its peers at any address. So the
folder checks each member against facts the node agent cannot write:

- its owner Pod (the member's ownerReferences Pod, name and UID, which the node agent sets to its own Pod), among
  the namespace's node agent Pods: it must exist, run on the member's `spec.node` (the Pod's `spec.nodeName`), and
  the member's `spec.ip` must be one of the Pod's addresses (`status.hostIP(s)`, what the chart hands the agent as
  NODE_IP, or `status.podIP(s)`); an empty `spec.ip` claims no address and passes. 0.1's node agents named no
  owner: a member of 0.1's name (`<domain>-<node>`, members.py) without one is checked against the node agent Pods
  that run on its node instead (an upgrade from 0.1 keeps its domains Ready while the old agents still run; a
  node agent may update, never create, its own node's 0.1 member, and the chart's policy binds its node);
- its GPUs, where the node reports them independently of the node agent: a member listing more GPU UUIDs than the
  Node's `capacity` of nvidia.com/gpu (the device plugin's count, read from the cluster agent's own Node watch) is
  doubted once that has lasted GPU_CLAIM_GRACE (the kubelet reports a device plugin's new GPUs at its next node
  status update, up to 10 s after the node agent sees them). No report (no such capacity, 0, a node outside the
  cluster agent's gpuNodeSelector, a cluster agent with another GPU source): no GPU check.

A member that fails is folded NotReady, its address withheld from the status (and so from every peer list), with a
reason the Ready condition's message and an Event name (MemberAddressMismatch, MemberNodeMismatch,
MemberOwnerMissing, MemberGPUMismatch). One watch of the namespace's node agent Pods (NodeAgentPods) serves every
domain's aggregator; until it has listed once nobody is doubted (no false alarm while the folder starts), and while
it fails the last view is kept.

The Pod watch keeps only what the check reads (name, UID, node, addresses), not the Pods.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import items_of, list_then_watch
from gpu_agent.foundations.threads import StopEvent
from gpu_agent.mechanisms.domain.entries import MemberSpec
from gpu_agent.mechanisms.domain.members import Owner

log = get_logger(__name__)

# The label the chart puts on the node agent Pods (templates/daemonset-node-agent.yaml, gpu-agent.componentLabels).
NODE_AGENT_SELECTOR = "app.kubernetes.io/component=node-agent"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_CLAIM_GRACE = 30.0  # seconds a member may list more GPUs than its Node's capacity before it is doubted

@dataclass(frozen=True)
class PodFacts:
    uid: str
    node: str  # spec.nodeName; "" while unscheduled
    addresses: tuple[str, ...]  # hostIP(s), then podIP(s), as the Pod's status gives them


def _addresses(status: Mapping[str, Any]) -> tuple[str, ...]:
    out: list[str] = []
    for single, plural in (("hostIP", "hostIPs"), ("podIP", "podIPs")):
        for ip in [status.get(single), *(a.get("ip") for a in status.get(plural) or [] if isinstance(a, Mapping))]:
            if isinstance(ip, str) and ip and ip not in out:
                out.append(ip)
    return tuple(out)


def pod_facts(obj: Mapping[str, Any]) -> tuple[str, PodFacts]:
    """A Pod (a plain dict, as core_v1_list gives it) as (name, what the check reads)."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    return str(meta.get("name") or ""), PodFacts(str(meta.get("uid") or ""), str(spec.get("nodeName") or ""),
                                                 _addresses(status))


class NodeAgentPods:
    """The node agent Pods of one namespace, by name, kept current by one watch (`run`, on the caller's thread)."""

    def __init__(self, list_pods: Callable[..., Any], namespace: str, *, selector: str = NODE_AGENT_SELECTOR,
                 clock: Clock | None = None) -> None:
        self.list_pods = list_pods  # a list call list_then_watch can watch (foundations/kube.py's core_v1_list)
        self.namespace = namespace
        self.selector = selector
        self.clock = clock or SystemClock()
        self.listed = False  # set by the first list: before it nothing is doubted
        self._pods: dict[str, PodFacts] = {}
        self._lock = threading.Lock()
        self.stop_event = StopEvent()  # its set also shuts the watch's connection (foundations/threads.py)

    def listed_pods(self, listed: Any) -> None:
        pods = dict(pod_facts(p) for p in items_of(listed))
        with self._lock:
            self._pods = pods
            self.listed = True

    def pod_event(self, kind: str, obj: Any) -> None:
        name, facts = pod_facts(obj)
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(name, None)
            else:
                self._pods[name] = facts

    def get(self, name: str) -> PodFacts | None:
        with self._lock:
            return self._pods.get(name)

    def on_node(self, node: str) -> list[tuple[str, PodFacts]]:
        """The node agent Pods (name, facts) that run on `node`."""
        with self._lock:
            return [(name, pod) for name, pod in sorted(self._pods.items()) if pod.node == node]

    def run(self) -> None:
        list_then_watch(self.list_pods, self.namespace, label_selector=self.selector, on_list=self.listed_pods,
                        on_event=self.pod_event, stop=self.stop_event, clock=self.clock, retry_seconds=2.0,
                        on_error=lambda e: log.warning("watching the node agent Pods of %s failed: %s (member checks "
                                                       "keep the last view)", self.namespace, e))

    def stop(self) -> None:
        self.stop_event.set()


def address_problem(spec: MemberSpec, owner: Owner | None, pods: NodeAgentPods, legacy: bool = False) -> str | None:
    """Why the member's owner Pod does not vouch for its node and address, or None when it does. `legacy`: the member
    has 0.1's name, whose node agents named no owner: without one, the node agent Pods on its node vouch instead."""
    if owner is None and legacy:
        node, ip = spec.get("node", ""), spec.get("ip") or ""
        here = pods.on_node(node)
        if not here:
            return f"MemberOwnerMissing: 0.1's member names no owner Pod, and no node agent Pod of {pods.namespace} runs on {node}"
        addresses = [a for _, pod in here for a in pod.addresses]
        if ip and ip not in addresses:
            return (f"MemberAddressMismatch: member says {ip}, the node agent Pods on {node} "
                    f"({', '.join(name for name, _ in here)}) have {', '.join(addresses) or 'no address yet'}")
        return None
    if owner is None:
        return "MemberOwnerMissing: the member names no owner Pod"
    name, uid = owner
    pod = pods.get(name)
    if pod is None or (uid and pod.uid != uid):
        return f"MemberOwnerMissing: its owner Pod {name} is not a node agent Pod of {pods.namespace} (gone?)"
    node = spec.get("node", "")
    if pod.node != node:
        return f"MemberNodeMismatch: member says node {node}, its Pod {name} runs on {pod.node or 'no node yet'}"
    ip = spec.get("ip") or ""
    if ip and ip not in pod.addresses:
        return f"MemberAddressMismatch: member says {ip}, its Pod {name} has {', '.join(pod.addresses) or 'no address yet'}"
    return None


class MemberTrust:
    """One domain's checks (an aggregator's): `doubts` gives node -> reason for each member that fails them."""

    def __init__(self, pods: NodeAgentPods, gpu_capacity: Callable[[str], int | None] | None = None, *,
                 monotonic: Callable[[], float], grace: float = GPU_CLAIM_GRACE) -> None:
        self.pods = pods
        self.gpu_capacity = gpu_capacity  # node -> its Node's GPU capacity; None: not reported
        self.monotonic = monotonic
        self.grace = grace
        self.over_since: dict[str, tuple[int, float]] = {}  # node -> (GPUs listed, first seen beyond capacity)

    def doubts(self, members: Mapping[str, MemberSpec], owners: Mapping[str, Owner | None],
               legacy: frozenset[str] = frozenset()) -> dict[str, str]:
        """node -> why, for each member that fails the checks; `legacy`: the nodes whose member has 0.1's name."""
        if not self.pods.listed:
            return {}
        now = self.monotonic()
        out: dict[str, str] = {}
        over: dict[str, tuple[int, float]] = {}
        for node, spec in members.items():
            why = address_problem(spec, owners.get(node), self.pods, node in legacy)
            listed = len(spec.get("gpuUUIDs") or [])
            capacity = self.gpu_capacity(node) if self.gpu_capacity is not None else None
            if capacity and listed > capacity:
                seen = self.over_since.get(node)
                over[node] = seen if seen is not None and seen[0] == listed else (listed, now)
                if why is None and now - over[node][1] >= self.grace:
                    why = (f"MemberGPUMismatch: member lists {listed} GPUs, node {node} reports {capacity} "
                           f"{GPU_RESOURCE} in capacity")
            if why is not None:
                out[node] = why
        self.over_since = over
        return out
