"""Turning a desired layout (count, product, memory, faults) into an inventory, keeping the UUIDs
of GPUs that stay: growing from 2 to 4 adds two GPUs, shrinking drops the last ones.

A fault is what `fake-gpu fault` injects into one GPU, by index, classified with the agent's own
tables (gpu_agent.foundations.xids): an ignored Xid (an application error) or a single-bit ECC error
changes nothing, as on a real node; Xid 79 (fallen off the bus) and `--lost` make the GPU Lost (NVML
answers GPU_IS_LOST for it); every other critical Xid and a double-bit ECC error make it Unhealthy.
"""

from __future__ import annotations

import random
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gpu_agent.foundations import fake_state
from gpu_agent.foundations.gpus import GPU, HEALTHY, LOST, UNHEALTHY, Inventory
from gpu_agent.foundations.xids import (
    ECC_DOUBLE_REASON,
    FALLEN_OFF_THE_BUS,
    LOST_REASON,
    MAX_XID,
    describe_xid,
    xid_acts,
)

DEFAULT_PRODUCT = "NVIDIA H100 80GB HBM3"
DEFAULT_MEMORY_MIB = 81559
MAX_GPUS = 64


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    health: str  # UNHEALTHY or LOST
    reason: str


FAULT_STATES = (UNHEALTHY, LOST)


def classify(xid: int | None = None, ecc: str | None = None, lost: bool = False) -> tuple[Fault | None, str]:
    """The fault one injected error causes (None: the GPU stays as it is), and a sentence saying why where the fault
    alone does not."""
    if lost:
        return Fault(LOST, LOST_REASON), ""
    if ecc is not None:
        if ecc == "double":
            return Fault(UNHEALTHY, ECC_DOUBLE_REASON), ""
        if ecc == "single":
            return None, "a single-bit ECC error is corrected by the hardware: counted, not acted on"
        raise LayoutError(f"--ecc must be single or double, got {ecc!r}")
    if xid is None or not 1 <= xid <= MAX_XID:
        raise LayoutError(f"--xid must be an Xid number between 1 and {MAX_XID}, got {xid!r}")
    if not xid_acts(xid):
        return None, f"{describe_xid(xid)} is an application error, ignored as the device plugin does"
    if xid == FALLEN_OFF_THE_BUS:
        return Fault(LOST, describe_xid(xid)), "NVML answers GPU_IS_LOST for a GPU off the bus"
    return Fault(UNHEALTHY, describe_xid(xid)), ""


def faults_of(inventory: Inventory) -> dict[int, Fault]:
    """The faults an inventory's GPUs carry, by index."""
    return {g.index: Fault(g.health, g.health_reason) for g in inventory.gpus if not g.is_healthy}


def check_clique(clique: object, field: str = "--clique") -> str:
    if clique == "":
        return ""
    # real cliques read "<clusterUuid>.<cliqueId>"; any short name will do for a fake rack
    if not isinstance(clique, str) or not fake_state.CLIQUE_RE.match(clique):
        raise LayoutError(f"{field} must be empty (no clique) or 1-64 letters, digits, '.', '_' or '-' starting with a "
                          f"letter or digit, like rack-a or 6f9619ff-8b86-d011-b42d-00c04fc964ff.1; got {clique!r}")
    return clique


def new_uuid(rng: random.Random) -> str:
    return "GPU-" + str(uuidlib.UUID(int=rng.getrandbits(128), version=4))


def build(current: Inventory, count: int, product: str, memory_mib: int, rng: random.Random,
          max_gpus: int = MAX_GPUS, clique: str = "", faults: Mapping[int, Fault] | None = None) -> Inventory:
    """`faults`: the GPUs (by index) that are not healthy; every other GPU is Healthy."""
    if count < 0:
        raise LayoutError(f"--count must be 0 or more, got {count}")
    if count > max_gpus:
        raise LayoutError(f"--count must be at most {max_gpus} (raise it with --max), got {count}")
    if memory_mib <= 0:
        raise LayoutError(f"--memory-mib must be positive, got {memory_mib}")
    if not product.strip():
        raise LayoutError("--product must not be empty")
    kept = [g for g in current.gpus[:count] if g.name == product and g.memory_total_bytes == memory_mib * 2**20]
    gpus = [GPU(g.uuid, g.name, g.memory_total_bytes, g.mig_mode, i) for i, g in enumerate(kept)]
    while len(gpus) < count:
        gpus.append(GPU(new_uuid(rng), product, memory_mib * 2**20, False, len(gpus)))
    for i, fault in (faults or {}).items():
        if 0 <= i < count and fault.health != HEALTHY:
            gpus[i] = replace(gpus[i], health=fault.health, health_reason=fault.reason)
    check_clique(clique)
    fabric = f"fake fabric: clique {clique}" if clique else "fake fabric: no clique"
    return Inventory(tuple(gpus), clique=clique, fabric=fabric)
