"""The fake source: a per-node state file rewritten atomically by `fake-gpu`."""

from __future__ import annotations

from pathlib import Path

from gpu_agent.foundations import fake_state
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.mechanisms.inventory.source import Reading


class FakeFileSource:
    name = "fake"

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> Reading:
        try:
            inventory = fake_state.read(self.path)
        except fake_state.FakeStateError as e:
            return Reading(Inventory(), error=str(e))
        return Reading(inventory, note=None if inventory.count else f"fake GPU state file {self.path} lists no GPUs")

    def close(self) -> None:
        return None
