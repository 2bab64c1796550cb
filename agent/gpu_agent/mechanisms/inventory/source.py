"""The interface every GPU source implements.

`read()` never raises for expected conditions: it returns a `Reading` that is either an
inventory (possibly empty, with the reason it is empty) or an error that says what broke.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gpu_agent.foundations.gpus import Inventory


@dataclass(frozen=True)
class Reading:
    inventory: Inventory
    error: str | None = None  # set when the source could not be read; inventory is then empty
    note: str | None = None  # why an otherwise healthy reading holds zero GPUs (e.g. "no NVIDIA driver loaded")


class GPUSource(Protocol):
    name: str

    def read(self) -> Reading: ...

    def close(self) -> None: ...
