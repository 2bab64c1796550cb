"""The inventory shape every GPU source produces (NVML, fake file, cluster)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GPU:
    uuid: str
    name: str
    memory_total_bytes: int
    mig_mode: bool = False
    index: int = 0

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
    def uuids(self) -> frozenset[str]:
        return frozenset(g.uuid for g in self.gpus)

    def to_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.gpus]
