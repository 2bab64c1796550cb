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

from kubernetes import client, watch

from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.foundations.klog import get_logger
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
    gpus = []
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

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                nodes = self.core.list_node()
                with self._lock:
                    self._table = {n.metadata.name: node_gpus(n) for n in nodes.items}
                    self._error = None
                    self._listed = True
                w = watch.Watch()
                for event in w.stream(self.core.list_node, resource_version=nodes.metadata.resource_version,
                                      timeout_seconds=self.resync_seconds):
                    node = event["object"]
                    with self._lock:
                        if event["type"] == "DELETED":
                            self._table.pop(node.metadata.name, None)
                        else:
                            self._table[node.metadata.name] = node_gpus(node)
                    if self._stop.is_set():
                        w.stop()
            except Exception as e:  # noqa: BLE001 - an API outage: report it, list again shortly
                with self._lock:
                    self._error = f"watching nodes failed: {type(e).__name__}: {str(e)[:200]}"
                log.warning("%s; retrying in 2s", self._error)
                self._stop.wait(2.0)

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
