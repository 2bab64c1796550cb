"""Pure functions over a GPUDomain's status: the only place entries are changed.

Indices are per NVLink clique: on multi-node NVLink systems a node can only be a peer of nodes
in its own clique, so each clique numbers its nodes from 0 (nodes without a clique, plain
servers, form one group of their own, as every node did before cliques).

Every write starts from the object as last read (with its resourceVersion) and changes one
entry, this node's; other nodes' entries are carried over untouched, so a write from a stale
view is refused by the API server (409) instead of silently dropping a peer.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from gpu_agent.mechanisms.domain.conditions import (
    READY,
    Condition,
    find,
    generation_of,
    ready_condition,
    set_condition,
    timestamp,
)


# The GPUDomain as the agents read and write it (crds/gpudomain.yaml; every field may be absent).
class DomainNode(TypedDict, total=False):
    name: str
    ip: str
    index: int
    status: str  # Ready | NotReady
    gpuUUIDs: list[str]
    clique: str


class DomainClique(TypedDict, total=False):
    id: str
    nodes: int
    readyNodes: int
    waiting: list[str]


class DomainSpec(TypedDict, total=False):
    expectedNodes: int
    nodeSelector: dict[str, str]
    maxNodesPerClique: int


class DomainStatus(TypedDict, total=False):
    status: str  # Ready | NotReady (0.2 readers; the Ready condition says the same, with why)
    readyNodes: int
    nodes: list[DomainNode]
    cliques: list[DomainClique]
    conditions: list[Condition]
    observedGeneration: int


class GPUDomain(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: dict[str, Any]
    spec: DomainSpec
    status: DomainStatus


class MemberSpec(TypedDict, total=False):
    """A GPUDomainMember's spec (crds/gpudomainmember.yaml): one node's entry, for the aggregator to fold."""
    domain: str
    node: str
    ip: str
    ready: bool
    gpuUUIDs: list[str]
    clique: str
    heartbeat: str
    heartbeatIntervalSeconds: float
    healthyGPUs: int  # of gpuUUIDs, those that can take work (absent: an agent from before GPU health)
    message: str  # why the node is NotReady or not every GPU is healthy; absent when all is well


def spec_of(obj: GPUDomain) -> DomainSpec:
    return obj.get("spec") or {}


def status_of(obj: GPUDomain) -> DomainStatus:
    return obj.get("status") or {}


# Optimistic-concurrency write strategies (writer.py); "aggregate" is aggregate.py's.
OCC_STRATEGIES = ("dra", "fulljitter")


@dataclass(frozen=True)
class Entry:
    """One node's entry. `gpu_uuids` lists every GPU the node has, healthy or not (the peers are the
    node's whatever its GPUs' health); `healthy_gpus` counts those that can take work and `message`
    says why the node is NotReady or which GPUs are not healthy. Those two reach the node's
    GPUDomainMember, not the domain's status (`as_status`), whose shape 0.1 readers know."""
    name: str
    ip: str
    gpu_uuids: tuple[str, ...]
    ready: bool
    clique: str = ""  # the node's NVLink clique; "" for none
    healthy_gpus: int | None = None  # None: not known (the optimistic writers never write it)
    message: str = ""

    def as_status(self, index: int) -> DomainNode:
        return status_entry(self.name, self.ip, index, self.ready, self.gpu_uuids, self.clique)


def status_entry(name: str, ip: str, index: int, ready: bool, gpu_uuids: Iterable[str], clique: str = "") -> DomainNode:
    """One node of a GPUDomain's status; `clique` appears only when the node has one (the 0.1 shape otherwise)."""
    out: DomainNode = {"name": name, "ip": ip, "index": index, "status": "Ready" if ready else "NotReady",
                       "gpuUUIDs": list(gpu_uuids)}
    if clique:
        out["clique"] = clique
    return out


def in_clique(nodes: list[DomainNode], clique: str) -> list[DomainNode]:
    return [n for n in nodes if (n.get("clique") or "") == clique]


def nodes_of(obj: GPUDomain) -> list[DomainNode]:
    return list(status_of(obj).get("nodes") or [])


def lowest_free_index(nodes: list[DomainNode], me: str, held: Mapping[str, int] | None = None) -> int:
    """This node's index: its current one if it has one; else the one `held` for it (the index it had before it
    left lately: node -> index), if nobody uses that; else the lowest neither in use nor held for another node
    (gaps fill)."""
    for n in nodes:
        if n.get("name") == me and isinstance(index := n.get("index"), int):
            return index
    used = {n.get("index") for n in nodes if n.get("name") != me}
    held = held or {}
    if (mine := held.get(me)) is not None and mine not in used:
        return mine
    taken = used | {i for node, i in held.items() if node != me}
    index = 0
    while index in taken:
        index += 1
    return index


def overall(nodes: list[DomainNode], expected: int) -> tuple[str, int]:
    ready = sum(1 for n in nodes if n.get("status") == "Ready")
    return ("Ready" if expected > 0 and ready >= expected else "NotReady"), ready


def with_entry(obj: GPUDomain, entry: Entry) -> GPUDomain | None:
    """The object with this node's entry set, or None when it is already exactly so."""
    nodes = nodes_of(obj)
    index = lowest_free_index(in_clique(nodes, entry.clique), entry.name)
    wanted = entry.as_status(index)
    current = next((n for n in nodes if n.get("name") == entry.name), None)
    expected = int(spec_of(obj).get("expectedNodes") or 0)
    others = [n for n in nodes if n.get("name") != entry.name]
    new_nodes = sorted([*others, wanted], key=lambda n: (n.get("clique") or "", n["index"]))
    status, ready = overall(new_nodes, expected)
    old_status = status_of(obj)
    new_status = with_ready_condition(obj, {**old_status, "nodes": new_nodes, "status": status, "readyNodes": ready})
    if current == wanted and new_status == old_status:
        return None
    out = copy.deepcopy(obj)
    out["status"] = new_status
    return out


def without_entry(obj: GPUDomain, name: str) -> GPUDomain | None:
    nodes = nodes_of(obj)
    if not any(n.get("name") == name for n in nodes):
        return None
    remaining = [n for n in nodes if n.get("name") != name]
    expected = int(spec_of(obj).get("expectedNodes") or 0)
    status, ready = overall(remaining, expected)
    out = copy.deepcopy(obj)
    out["status"] = with_ready_condition(obj, {**status_of(obj), "nodes": remaining, "status": status, "readyNodes": ready})
    return out


def with_ready_condition(obj: GPUDomain, status: DomainStatus, now: str | None = None, *,
                         waiting: dict[str, list[str]] | None = None, silent: Iterable[str] = (),
                         limit: int | None = None, doubted: Mapping[str, str] | None = None) -> DomainStatus:
    """`status` (the next status of `obj`) with its Ready condition and observedGeneration. `waiting`,
    `silent`, `limit` and `doubted` are the folder's (aggregate.py): the optimistic writers enforce no clique
    bound, track no heartbeat and check no member, so for them no node ever waits, is silent or is doubted."""
    old = status_of(obj).get("conditions")
    generation = generation_of(obj)
    cond = ready_condition(expected=int(spec_of(obj).get("expectedNodes") or 0),
                           joined={n["name"]: n.get("status") == "Ready" for n in status.get("nodes") or []},
                           waiting=waiting or {}, silent=silent, limit=limit, previous=find(old), doubted=doubted)
    out: DomainStatus = {**status, "conditions": set_condition(old, READY, *cond, generation,
                                                               now or timestamp(time.time()))}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def has_entry(obj: GPUDomain, entry: Entry) -> bool:
    return with_entry(obj, entry) is None
