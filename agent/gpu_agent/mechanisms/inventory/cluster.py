"""The cluster source: the cluster's GPUs as the sum of allocatable `nvidia.com/gpu` over
Ready nodes, kept current by a watch on Nodes (not by polling the API).

A watch thread folds Node events into an in-memory table; `read()` only reads that table,
so the monitor's frequent reads cost no API calls. The inventory carries one entry per
allocatable GPU, named by node and index: allocatable counts carry no UUIDs (per-GPU UUIDs
are the node agents' to report).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from kubernetes import client

from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import items_of, list_then_watch
from gpu_agent.mechanisms.inventory.source import Reading

log = get_logger(__name__)
RESOURCE = "nvidia.com/gpu"
_NS = uuid.UUID("6f1c8c1e-6a53-4a8e-9d55-0f5b1d8b9a10")


def node_gpus(node: Any) -> int:
    ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
    if not ready or node.spec.unschedulable:
        return 0
    try:
        return int((node.status.allocatable or {}).get(RESOURCE, "0"))
    except ValueError:
        return 0


def inventory_of(table: dict[str, int]) -> Inventory:
    gpus: list[GPU] = []
    for node in sorted(table):
        for i in range(table[node]):
            gpus.append(GPU(uuid="GPU-" + str(uuid.uuid5(_NS, f"{node}/{i}")), name=f"{RESOURCE} {i} on {node}",
                            memory_total_bytes=1, index=len(gpus)))
    return Inventory(tuple(gpus))


class ClusterSource:
    name = "cluster"

    def __init__(self, api: client.ApiClient, resync_seconds: int = 300) -> None:
        self.core = client.CoreV1Api(api)
        self.resync_seconds = resync_seconds
        self._lock = threading.Lock()
        self._table: dict[str, int] = {}
        self._error: str | None = None
        self._listed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._thread.start()

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
        list_then_watch(self.core.list_node, on_list=self._listed_nodes, on_event=self._node_event, on_error=self._failed,
                        stop=self._stop, retry_seconds=2.0, resync_seconds=self.resync_seconds)

    def read(self) -> Reading:
        with self._lock:
            table, error, listed = dict(self._table), self._error, self._listed
        if not listed and not error:
            return Reading(Inventory(), note="waiting for the first list of nodes")
        if error:
            return Reading(Inventory(), error=error)
        inventory = inventory_of(table)
        return Reading(inventory, note=None if inventory.count else f"no Ready node has allocatable {RESOURCE}")

    def close(self) -> None:
        self._stop.set()
