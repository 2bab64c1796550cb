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
        self._last: tuple[tuple[int, int, int], Reading] | None = None

    def read(self) -> Reading:
        # The writer replaces the file by rename, so an unchanged (inode, mtime, size) means
        # unchanged content: skip the read and parse (most polls, and most of the idle CPU).
        try:
            st = self.path.stat()
            key: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key is not None and self._last is not None and self._last[0] == key:
            return self._last[1]
        try:
            inventory = fake_state.read(self.path)
        except fake_state.FakeStateError as e:
            reading = Reading(Inventory(), error=str(e))
        else:
            reading = Reading(inventory, note=None if inventory.count else f"fake GPU state file {self.path} lists no GPUs")
        self._last = (key, reading) if key is not None else None
        return reading

    def close(self) -> None:
        return None
