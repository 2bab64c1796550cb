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

On a cluster that offers GPUs through DRA (a DRA driver name given: the cluster agent's draDriverName), the
GPUs are the devices of that driver's ResourceSlices instead, watched the same way (fieldSelector spec.driver):
the GPUs this agent's work Pods can get, since they ask for them through a claim of that driver's class. Per
node pool only the slices of its newest generation count (an older one is being replaced, as the scheduler
reads it); a device with a NoSchedule or NoExecute taint (the node agent's `<driver>/unhealthy`: Xid, ECC,
lost) is listed Unhealthy with its taint as the reason, so it counts for nothing and comes back when the taint
goes; a node that is not Ready, or cordoned, lists nothing, as with the device plugin. Device-plugin capacity
is not added on top: a node is offered one way or the other, and a work Pod that claims through DRA cannot use
a device plugin's GPU. The GPUs' UUIDs are the slice's own `uuid` attributes, so /healthz names the real GPU.

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
from gpu_agent.foundations.kube import device_count, items_of, list_then_watch
from gpu_agent.foundations.slices import (
    MADE_UP_UUIDS,
    PoolSlice,
    field,
    inventory_of_slices,
    node_usable,
    pool_slice,
)
from gpu_agent.foundations.threads import StopEvent, start_thread
from gpu_agent.mechanisms.inventory.source import Reading

log = get_logger(__name__)
RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeGPUs:
    allocatable: int  # what the device plugin reports Healthy
    capacity: int  # every device it reports; at least `allocatable`


def node_gpus(node: Any) -> NodeGPUs:
    if not node_usable(node):
        return NodeGPUs(0, 0)
    allocatable = device_count(node.status.allocatable, RESOURCE)
    return NodeGPUs(allocatable, max(allocatable, device_count(node.status.capacity, RESOURCE)))


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
            gpus.append(GPU(uuid="GPU-" + str(uuid.uuid5(MADE_UP_UUIDS, f"{node}/{i}")), name=f"{RESOURCE} {i} on {node}",
                            memory_total_bytes=1, index=len(gpus), health=HEALTHY if healthy else UNHEALTHY,
                            health_reason="" if healthy else reason))
    return Inventory(tuple(gpus))


class ClusterSource:
    name = "cluster"

    def __init__(self, api: client.ApiClient | None, resync_seconds: int = 300, node_selector: str = "",
                 dra_driver: str = "", resource: Any = None, start: bool = True) -> None:
        # `resource`: a stand-in for ResourceV1Api (a unit test's scripted API server); `start=False`: no watch
        # threads (a unit test feeds the handlers itself)
        self.core = client.CoreV1Api(api)
        self.resync_seconds = resync_seconds
        self.node_selector = node_selector  # a label selector; "": every node
        self.dra_driver = dra_driver  # "": GPUs from device plugins (node allocatable); else this DRA driver's devices
        self._lock = threading.Lock()
        self._table: dict[str, NodeGPUs] = {}
        self._usable: set[str] = set()  # Ready, uncordoned nodes (those whose slices count)
        self._slices: dict[str, PoolSlice] = {}  # by slice name
        self._errors: dict[str, str] = {}  # "nodes" / "slices" -> what failed, until the next list
        self._listed: set[str] = set()
        self._stop = StopEvent()  # its set also shuts the watches' connections (foundations/threads.py)
        # The last device-plugin inventory and the table it was built from: a poll (every gpuPollInterval) of an
        # unchanged table returns it instead of building one GPU per device again (20,000 of them took 0.27 s).
        self._built: tuple[tuple[tuple[str, NodeGPUs], ...], Inventory] | None = None
        self.resource = (resource if resource is not None else client.ResourceV1Api(api)) if dra_driver else None
        self._thread = start_thread("node-watch", self._run_nodes, self._stop) if start else None
        self._slice_thread = start_thread("slice-watch", self._run_slices, self._stop) if start and dra_driver else None

    def _listed_nodes(self, nodes: Any) -> None:
        with self._lock:
            listed = items_of(nodes)
            self._table = {n.metadata.name: node_gpus(n) for n in listed}
            self._usable = {n.metadata.name for n in listed if node_usable(n)}
            self._errors.pop("nodes", None)
            self._listed.add("nodes")

    def _node_event(self, kind: str, node: Any) -> None:
        with self._lock:
            name = node.metadata.name
            if kind == "DELETED":
                self._table.pop(name, None)
                self._usable.discard(name)
            else:
                self._table[name] = node_gpus(node)
                if node_usable(node):
                    self._usable.add(name)
                else:
                    self._usable.discard(name)

    def _listed_slices(self, slices: Any) -> None:
        with self._lock:
            self._slices = {}
            for obj in items_of(slices):
                kept = pool_slice(obj)
                if kept is not None:
                    self._slices[str(field(obj, "metadata", "name"))] = kept
            self._errors.pop("slices", None)
            self._listed.add("slices")

    def _slice_event(self, kind: str, obj: Any) -> None:
        name = str(field(obj, "metadata", "name"))
        kept = None if kind == "DELETED" else pool_slice(obj)
        with self._lock:
            if kept is None:
                self._slices.pop(name, None)
            else:
                self._slices[name] = kept

    def _failed(self, key: str, what: str) -> Any:
        def failed(e: Exception) -> None:
            with self._lock:
                self._errors[key] = error = f"watching {what} failed: {type(e).__name__}: {str(e)[:200]}"
            log.warning("%s; retrying in 2s", error)
        return failed

    def _run_nodes(self) -> None:
        selector: dict[str, Any] = {"label_selector": self.node_selector} if self.node_selector else {}
        list_then_watch(self.core.list_node, on_list=self._listed_nodes, on_event=self._node_event,
                        on_error=self._failed("nodes", "nodes"), stop=self._stop, retry_seconds=2.0,
                        resync_seconds=self.resync_seconds, **selector)

    def _run_slices(self) -> None:
        list_then_watch(self.resource.list_resource_slice,  # type: ignore[union-attr]
                        on_list=self._listed_slices, on_event=self._slice_event,
                        on_error=self._failed("slices", f"{self.dra_driver} ResourceSlices"), stop=self._stop, retry_seconds=2.0,
                        resync_seconds=self.resync_seconds, field_selector=f"spec.driver={self.dra_driver}")

    def gpu_capacity(self, node: str) -> int | None:
        """The node's capacity of nvidia.com/gpu as its Node reports it (the device plugin's count, independent
        of any node agent), for the domain folder's member check; None when not reported: a node this watch does
        not see (outside node_selector), not usable (not Ready, cordoned), or with no such capacity."""
        with self._lock:
            counts = self._table.get(node)
        return counts.capacity if counts is not None and counts.capacity > 0 else None

    def read(self) -> Reading:
        wanted = {"nodes", "slices"} if self.dra_driver else {"nodes"}
        with self._lock:
            table, usable, slices = dict(self._table), set(self._usable), dict(self._slices)
            errors, listed = dict(self._errors), set(self._listed)
        if errors:
            return Reading(Inventory(), error="; ".join(errors[k] for k in sorted(errors)))
        if listed < wanted:
            return Reading(Inventory(), complete=False, note="waiting for the first list of " + " and ".join(
                "nodes" if w == "nodes" else f"{self.dra_driver} ResourceSlices" for w in sorted(wanted - listed)))
        where = f" among the nodes labelled {self.node_selector}" if self.node_selector else ""
        if self.dra_driver:
            inventory = inventory_of_slices(usable, slices, self.dra_driver)
            return Reading(inventory, note=None if inventory.count else
                           f"no Ready node{where} has a device of DRA driver {self.dra_driver} in its ResourceSlices")
        key = tuple(sorted(table.items()))
        if self._built is None or self._built[0] != key:
            self._built = (key, inventory_of(table))
        inventory = self._built[1]
        return Reading(inventory, note=None if inventory.count else f"no Ready node{where} has {RESOURCE}")


    def close(self) -> None:
        self._stop.set()
