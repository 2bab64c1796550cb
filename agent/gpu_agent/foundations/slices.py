"""ResourceSlices as the cluster agent reads them: which devices of a DRA driver a node offers now.

Both the cluster source (how many GPUs the cluster has) and the work Pods' claims (how many one node has)
read slices this way. The rules are the scheduler's: per node pool only the slices of its newest generation
count (an older one is being replaced); a device with a NoSchedule or NoExecute taint gets no new claim; a
slice bound to no node (a network-attached pool) is no node's GPU. A device whose `type` attribute names
something else than a GPU (the `channel-0` device each node agent publishes for GPUDomain channels) is no GPU
either; one without `type` (slices published before node agents set it) is. Objects may come as the client's
models or as dicts (a custom-object call or a scripted answer): `field` reads either.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from gpu_agent.foundations.gpus import GPU, HEALTHY, UNHEALTHY, Inventory

# The namespace of the UUIDs made up for GPUs that carry none (a device plugin's count, a slice without `uuid`):
# stable across reads, so that a fault is a health change and not a new GPU.
MADE_UP_UUIDS = uuid.UUID("6f1c8c1e-6a53-4a8e-9d55-0f5b1d8b9a10")


@dataclass(frozen=True)
class SliceDevice:
    name: str
    uuid: str  # its `uuid` attribute; "" when the slice has none
    taint: str  # "key=value:Effect" of the first taint that keeps new claims off it; "" when untainted


@dataclass(frozen=True)
class PoolSlice:
    """What the cluster source keeps of one ResourceSlice."""
    node: str
    pool: str
    generation: int
    devices: tuple[SliceDevice, ...]


def field(obj: Any, *path: str) -> Any:
    """A field of an API object whether the client returned a model or a dict (a custom-object or a scripted
    answer): `field(slice, "spec", "pool", "generation")`."""
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, _snake(key), None)
    return obj


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
GPU_TYPE = "gpu"  # a GPU device's `type` attribute; a channel device's is "channel"


def node_usable(node: Any) -> bool:
    """Ready and not cordoned: its GPUs are the cluster's to use, by either way of offering them."""
    ready = any(field(c, "type") == "Ready" and field(c, "status") == "True"
                for c in (field(node, "status", "conditions") or []))
    return ready and not field(node, "spec", "unschedulable")


def pool_slice(obj: Any) -> PoolSlice | None:
    """A slice as the source keeps it; None for one bound to no node (a network-attached pool is not a node's GPU)."""
    node = field(obj, "spec", "nodeName")
    if not node:
        return None
    devices = []
    for d in field(obj, "spec", "devices") or []:
        if field(d, "attributes", "type", "string") not in (None, "", GPU_TYPE):
            continue  # a channel device: no GPU to count, nor to claim for work
        taint = next((t for t in (field(d, "taints") or []) if field(t, "effect") in BLOCKING_EFFECTS), None)
        devices.append(SliceDevice(
            name=str(field(d, "name") or ""), uuid=str(field(d, "attributes", "uuid", "string") or ""),
            taint="" if taint is None else f"{field(taint, 'key')}={field(taint, 'value') or ''}:{field(taint, 'effect')}"))
    try:
        generation = int(field(obj, "spec", "pool", "generation") or 0)
    except (TypeError, ValueError):
        generation = 0
    return PoolSlice(node=str(node), pool=str(field(obj, "spec", "pool", "name") or node), generation=generation,
                     devices=tuple(devices))


def _device_order(name: str) -> tuple[int, str]:
    digits = name.rsplit("-", 1)[-1]
    return (int(digits) if digits.isdigit() else 1 << 30, name)  # gpu-2 before gpu-10


def devices_per_node(usable: set[str], slices: dict[str, PoolSlice]) -> dict[str, list[SliceDevice]]:
    """Each usable node's devices, per pool only from the slices of its newest generation, in index order."""
    newest: dict[tuple[str, str], int] = {}
    for s in slices.values():
        key = (s.node, s.pool)
        newest[key] = max(newest.get(key, s.generation), s.generation)
    per_node: dict[str, list[SliceDevice]] = {}
    for name in sorted(slices):
        s = slices[name]
        if s.node in usable and s.generation == newest[(s.node, s.pool)]:
            per_node.setdefault(s.node, []).extend(s.devices)
    return {node: sorted(devices, key=lambda d: _device_order(d.name)) for node, devices in sorted(per_node.items())}


def inventory_of_slices(usable: set[str], slices: dict[str, PoolSlice], driver: str) -> Inventory:
    """The devices of `driver` on usable nodes as GPUs (their `uuid` attribute; a made-up stable one where it is
    missing or repeated); tainted ones Unhealthy with the taint as the reason."""
    gpus: list[GPU] = []
    seen: set[str] = set()
    for node, devices in devices_per_node(usable, slices).items():
        for d in devices:
            uuid_ = d.uuid if d.uuid and d.uuid not in seen else "GPU-" + str(uuid.uuid5(MADE_UP_UUIDS, f"{driver}/{node}/{d.name}"))
            seen.add(uuid_)
            gpus.append(GPU(uuid=uuid_, name=f"{d.name} on {node}", memory_total_bytes=1, index=len(gpus),
                            health=UNHEALTHY if d.taint else HEALTHY,
                            health_reason=f"node {node}: device {d.name} of {driver} tainted {d.taint}" if d.taint else ""))
    return Inventory(tuple(gpus))


def untainted_per_node(usable: set[str], slices: dict[str, PoolSlice]) -> dict[str, int]:
    """How many devices each usable node offers a new claim now."""
    return {node: sum(1 for d in devices if not d.taint) for node, devices in devices_per_node(usable, slices).items()}
