"""The cluster source: the cluster's GPUs as the sum of allocatable `nvidia.com/gpu` over
Ready nodes, kept current by a watch on Nodes (not by polling the API).

A watch thread folds Node events into an in-memory table; `read()` only reads that table,
so the monitor's frequent reads cost no API calls. The inventory carries one entry per
GPU, named by node and index: allocatable counts carry no UUIDs (per-GPU UUIDs are the node
agents' to report).

Health, as kubelet reports it: a device plugin that marks a GPU Unhealthy (critical Xid, ECC,
fallen off the bus) makes kubelet lower the node's allocatable but not its capacity. So a Ready
node's GPUs in capacity beyond its allocatable are listed as Unhealthy entries, whose reason says
where they went ("node n1: 4 nvidia.com/gpu in capacity, 0 allocatable ..."): they count for
nothing (registration takes the healthy ones), and when none is healthy the agent's NotReady
reason names the nodes. Kubelet reads the same way for a second or so after it restarts (the
plugin's devices are unhealthy until it registers again), which the monitor's loss window absorbs.
A node that is not Ready, or cordoned, lists nothing: its GPUs are not the cluster's to use.

A node selector (the cluster agent's gpuNodeSelector) narrows the watch to the nodes with those labels: a
cluster whose GPU pools are served by different releases (a pool per team, per control plane) gives each
release its own pool's GPUs, and the API server filters, so the other nodes' changes never reach this agent.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from gpu_agent.foundations.gpus import GPU, HEALTHY, UNHEALTHY, Inventory
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import items_of, list_then_watch
from gpu_agent.foundations.threads import start_thread
from gpu_agent.mechanisms.inventory.source import Reading

log = get_logger(__name__)
RESOURCE = "nvidia.com/gpu"
_NS = uuid.UUID("6f1c8c1e-6a53-4a8e-9d55-0f5b1d8b9a10")


@dataclass(frozen=True)
class NodeGPUs:
    allocatable: int  # what the device plugin reports Healthy
    capacity: int  # every device it reports; at least `allocatable`


def _count(resources: Any) -> int:
    try:
        return max(0, int((resources or {}).get(RESOURCE, "0")))
    except ValueError:
        return 0


def node_gpus(node: Any) -> NodeGPUs:
    ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
    if not ready or node.spec.unschedulable:
        return NodeGPUs(0, 0)
    allocatable = _count(node.status.allocatable)
    return NodeGPUs(allocatable, max(allocatable, _count(node.status.capacity)))


def unallocatable_reason(node: str, gpus: NodeGPUs) -> str:
    return (f"node {node}: {gpus.capacity} {RESOURCE} in capacity, {gpus.allocatable} allocatable "
            "(marked unhealthy by its device plugin, or the plugin is not registered)")


def inventory_of(table: dict[str, NodeGPUs]) -> Inventory:
    """Each node's allocatable GPUs Healthy (indices 0..allocatable-1), the rest of its capacity Unhealthy."""
    gpus: list[GPU] = []
    for node in sorted(table):
        counts = table[node]
        reason = unallocatable_reason(node, counts) if counts.capacity > counts.allocatable else ""
        for i in range(counts.capacity):
            healthy = i < counts.allocatable
            gpus.append(GPU(uuid="GPU-" + str(uuid.uuid5(_NS, f"{node}/{i}")), name=f"{RESOURCE} {i} on {node}",
                            memory_total_bytes=1, index=len(gpus), health=HEALTHY if healthy else UNHEALTHY,
                            health_reason="" if healthy else reason))
    return Inventory(tuple(gpus))


class ClusterSource:
    name = "cluster"

    def __init__(self, api: client.ApiClient, resync_seconds: int = 300, node_selector: str = "") -> None:
        self.core = client.CoreV1Api(api)
        self.resync_seconds = resync_seconds
        self.node_selector = node_selector  # a label selector; "": every node
        self._lock = threading.Lock()
        self._table: dict[str, NodeGPUs] = {}
        self._error: str | None = None
        self._listed = False
        self._stop = threading.Event()
        self._thread = start_thread("node-watch", self._run, self._stop)

    def _listed_nodes(self, nodes: Any) -> None:
        with self._lock:
            self._table = {n.metadata.name: node_gpus(n) for n in items_of(nodes)}
            self._error = None
            self._listed = True

    def _node_event(self, kind: str, node: Any) -> None:
        with self._lock:
            if kind == "DELETED":
                self._table.pop(node.metadata.name, None)
            else:
                self._table[node.metadata.name] = node_gpus(node)

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self._error = f"watching nodes failed: {type(e).__name__}: {str(e)[:200]}"
        log.warning("%s; retrying in 2s", self._error)

    def _run(self) -> None:
        selector: dict[str, Any] = {"label_selector": self.node_selector} if self.node_selector else {}
        list_then_watch(
self.core.list_node, on_list=self._listed_nodes, on_event=self._node_event, on_error=self._failed,
                        stop=self._stop, retry_seconds=2.0, resync_seconds=self.resync_seconds, **selector)

    def read(self) -> Reading:
        with self._lock:
            table, error, listed = dict(self._table), self._error, self._listed
        if not listed and not error:
            return Reading(Inventory(), note="waiting for the first list of nodes")
        if error:
            return Reading(Inventory(), error=error)
        inventory = inventory_of(table)
        where = f" among the nodes labelled {self.node_selector}" if self.node_selector else ""
        return Reading(inventory, note=None if inventory.count else f"no Ready node{where} has {RESOURCE}")


    def close(self) -> None:
        self._stop.set()
