"""Turning a desired layout (count, product, memory) into an inventory, keeping the UUIDs
of GPUs that stay: growing from 2 to 4 adds two GPUs, shrinking drops the last ones."""

from __future__ import annotations

import random
import uuid as uuidlib

from gpu_agent.foundations import fake_state
from gpu_agent.foundations.gpus import GPU, Inventory

DEFAULT_PRODUCT = "NVIDIA H100 80GB HBM3"
DEFAULT_MEMORY_MIB = 81559
MAX_GPUS = 64


class LayoutError(ValueError):
    pass


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
          max_gpus: int = MAX_GPUS, clique: str = "") -> Inventory:
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
    check_clique(clique)
    fabric = f"fake fabric: clique {clique}" if clique else "fake fabric: no clique"
    return Inventory(tuple(gpus), clique=clique, fabric=fabric)
