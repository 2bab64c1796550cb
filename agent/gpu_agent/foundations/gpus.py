"""The inventory shape every GPU source produces (NVML, fake file, cluster).

Every GPU a source lists carries its health: `Healthy`, `Unhealthy` (a critical Xid or an ECC
error, named in `health_reason`) or `Lost` (listed but not answering: fallen off the bus).
A listed GPU that is not healthy is still in the inventory, so that status can name it; only
the healthy ones count for work (`Inventory.healthy`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
LOST = "Lost"
HEALTH_STATES = (HEALTHY, UNHEALTHY, LOST)


@dataclass(frozen=True)
class GPU:
    uuid: str
    name: str
    memory_total_bytes: int
    mig_mode: bool = False
    index: int = 0
    health: str = HEALTHY  # one of HEALTH_STATES
    health_reason: str = ""  # why it is not healthy, e.g. "Xid 79 (GPU has fallen off the bus)"; "" when healthy
    health_since: float = 0.0  # wall-clock seconds when `health` last changed; 0 when never known to change

    @property
    def is_healthy(self) -> bool:
        return self.health == HEALTHY

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {"uuid": d["uuid"], "name": d["name"], "memoryTotalBytes": d["memory_total_bytes"],
                "migMode": d["mig_mode"], "index": d["index"]}


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[GPU, ...] = ()
    clique: str = ""  # the node's NVLink clique ("<clusterUuid>.<cliqueId>"); "" when it has none
    fabric: str = ""  # what the fabric says (why there is no clique), where the source knows

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def healthy(self) -> tuple[GPU, ...]:
        """The GPUs that can take work."""
        return tuple(g for g in self.gpus if g.is_healthy)

    @property
    def unhealthy(self) -> tuple[GPU, ...]:
        return tuple(g for g in self.gpus if not g.is_healthy)

    @property
    def uuids(self) -> frozenset[str]:
        return frozenset(g.uuid for g in self.gpus)

    def to_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.gpus]


def short_uuid(uuid: str) -> str:
    """A UUID cut for a one-line reason ("GPU-ab12cd34…"); /healthz details carry the whole one."""
    return uuid if len(uuid) <= 13 else uuid[:12] + "…"


def describe_unhealthy(gpus: Iterable[GPU], limit: int = 400) -> str:
    """The GPUs that are not healthy, for a reason a person reads: "GPU-ab12cd34… Lost (Xid 79 ...),
    GPU-cd34ef56… Unhealthy (Xid 48 ...)". GPUs that share a state and a reason are named once
    ("4 GPUs Unhealthy (node n1: ...)" past three of them), and the text stops near `limit`
    characters with how many were left out, so a reason stays one readable line however many GPUs
    a cluster has."""
    groups: dict[tuple[str, str], list[str]] = {}
    for g in gpus:
        if not g.is_healthy:
            groups.setdefault((g.health, g.health_reason), []).append(g.uuid)
    parts = []
    for (health, reason), uuids in groups.items():
        who = ", ".join(short_uuid(u) for u in uuids) if len(uuids) <= 3 else f"{len(uuids)} GPUs"
        parts.append(f"{who} {health}" + (f" ({reason[:160]})" if reason else ""))
    out = ""
    for i, part in enumerate(parts):
        if out and len(out) + len(part) + 2 > limit:
            rest = sum(len(uuids) for uuids in list(groups.values())[i:])
            return f"{out}, and {rest} more GPU{'s' if rest != 1 else ''} not healthy"
        out = f"{out}, {part}" if out else part
    return out
