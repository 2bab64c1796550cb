"""A node's GPUs as the devices of its ResourceSlice.

A device is named by its GPU's index (`gpu-0`): a device name must be a DNS label and a UUID is
not one. Attributes are what a user selects on in CEL (`device.attributes["<driver>"].uuid`):
`uuid`, `index`, `productName`, `cliqueId` (only when the node has an NVLink clique), `migMode`;
capacity `memory`. A GPU that is not healthy stays in the slice (so a user sees it) with a
NoSchedule taint `<driver>/unhealthy` whose value is its state (Unhealthy or Lost): no new claim
is allocated to it, a running pod keeps it, and the taint goes when the GPU recovers.

Beside its GPUs a node offers one channel device, `channel-0` (`type: channel`, `id: 0`), as NVIDIA's
ComputeDomain driver does: a GPUDomain's channel claim is allocated it, and preparing it brings the node
into the domain (prepare.py). The scheduler hands a device to one claim at a time, so a node serves one
channel claim, of one domain, at once. Every device says its `type` (gpu or channel); the GPU DeviceClass
selects `type == gpu` (or no type: slices published before channels existed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpu_agent.foundations.gpus import GPU, Inventory

# What a slice may hold (resource.k8s.io/v1 validation): 128 devices, 64 once any device has taints.
MAX_DEVICES_WITH_TAINTS = 64
STRING_ATTRIBUTE_LIMIT = 64
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]")


CHANNEL_DEVICE = "channel-0"


def device_name(gpu: GPU) -> str:
    return f"gpu-{gpu.index}"


def channel_device() -> dict[str, Any]:
    return {"name": CHANNEL_DEVICE, "attributes": {"type": {"string": "channel"}, "id": {"int": 0}}}


def taint_key(driver: str) -> str:
    return f"{driver}/unhealthy"


def _string(value: str) -> dict[str, str]:
    return {"string": value[:STRING_ATTRIBUTE_LIMIT]}


def device(gpu: GPU, driver: str, clique: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "type": {"string": "gpu"},
        "uuid": _string(gpu.uuid),
        "index": {"int": gpu.index},
        "productName": _string(gpu.name),
        "migMode": {"bool": gpu.mig_mode},
    }
    if clique:
        attributes["cliqueId"] = _string(clique)
    out: dict[str, Any] = {"name": device_name(gpu), "attributes": attributes,
                           "capacity": {"memory": {"value": str(gpu.memory_total_bytes)}}}
    if not gpu.is_healthy:
        # a taint's value is a label value: the state, not the free-text reason (that is in /healthz)
        out["taints"] = [{"key": taint_key(driver), "value": _LABEL_VALUE.sub("_", gpu.health)[:63], "effect": "NoSchedule"}]
    return out


@dataclass(frozen=True)
class NodeDevices:
    """What this node offers: the slice's devices, each device's GPU (for prepare), whether it offers a channel
    and its NVLink clique."""
    devices: tuple[dict[str, Any], ...]
    gpus: dict[str, GPU]  # device name -> GPU
    channel: bool = False
    clique: str = ""

    @classmethod
    def of(cls, inventory: Inventory, driver: str, *, channel: bool = False) -> NodeDevices:
        gpus = sorted(inventory.gpus, key=lambda g: (g.index, g.uuid))
        seen: dict[str, GPU] = {}
        for gpu in gpus:
            seen.setdefault(device_name(gpu), gpu)  # two GPUs claiming one index: the first keeps the name
        room = MAX_DEVICES_WITH_TAINTS - (1 if channel else 0)  # the channel is always offered, GPUs fill the rest
        kept = list(seen.values())[:room]
        devices = tuple(device(g, driver, inventory.clique) for g in kept) + ((channel_device(),) if channel else ())
        return cls(devices, {device_name(g): g for g in kept}, channel, inventory.clique)


def slice_body(*, name: str | None, node: str, driver: str, generation: int, devices: tuple[dict[str, Any], ...],
               owner: dict[str, str] | None, resource_version: str | None = None) -> dict[str, Any]:
    """One slice holding the node's whole pool (named after the node). Without a `name` the API server
    makes one from `generateName`, as the kubelet plugin helper does."""
    metadata: dict[str, Any] = {"name": name} if name else {"generateName": f"{node}-{driver}-"[:200]}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    if owner:
        # with the Node: a deleted node takes its slices with it
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": owner["name"], "uid": owner["uid"],
                                        "controller": True}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata,
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": list(devices)}}
