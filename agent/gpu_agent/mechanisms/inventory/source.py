"""The interface every GPU source implements.

`read()` never raises for expected conditions: it returns a `Reading` that is either an
inventory (possibly empty, with the reason it is empty) or an error that says what broke. A source
that has not yet looked at everything it counts (the cluster source before the first list of its
watches) says so with `complete=False`: its empty inventory means "not known yet", not "no GPUs".
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
    complete: bool = True  # False: the source has not looked in full yet (its count is no answer yet)

    @property
    def answered(self) -> bool:
        """The source answered in full: no error, nothing still to look at. Only such a reading's count of
        zero means "no GPUs" (the cluster agent's start without gracefulNoGPU acts on it)."""
        return self.error is None and self.complete


class GPUSource(Protocol):
    name: str

    def read(self) -> Reading: ...

    def close(self) -> None: ...
