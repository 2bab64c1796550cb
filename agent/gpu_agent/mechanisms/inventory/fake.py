"""The fake source: a per-node state file rewritten atomically by `fake-gpu`.

A GPU the file marks Unhealthy or Lost (`fake-gpu fault`) is a condition that holds while the file
says so, fed to the same health tracker the NVML source uses; with the fake's recovery of 0 s a
cleared fault reads Healthy at the next read.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gpu_agent.foundations import fake_state
from gpu_agent.foundations.clock import SystemClock
from gpu_agent.foundations.gpus import HEALTHY, Inventory
from gpu_agent.mechanisms.inventory.gpu_health import HealthTracker
from gpu_agent.mechanisms.inventory.source import Reading


class FakeFileSource:
    name = "fake"

    def __init__(self, path: Path, tracker: HealthTracker | None = None) -> None:
        self.path = path
        self.tracker = tracker or HealthTracker(clock=SystemClock(), recovery=0.0, source=self.name)
        self._last: tuple[tuple[int, int, int], Inventory | str] | None = None

    def _parsed(self) -> Inventory | str:
        """The file's inventory, or the error that says why it cannot be read."""
        # The writer replaces the file by rename, so an unchanged (inode, mtime, size) means
        # unchanged content: skip the read and parse (most polls, and most of the idle CPU).
        try:
            st = self.path.stat()
            key: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key is not None and self._last is not None and self._last[0] == key:
            return self._last[1]
        parsed: Inventory | str
        try:
            parsed = fake_state.read(self.path)
        except fake_state.FakeStateError as e:
            parsed = str(e)
        self._last = (key, parsed) if key is not None else None
        return parsed

    def read(self) -> Reading:
        parsed = self._parsed()
        if isinstance(parsed, str):
            return Reading(Inventory(), error=parsed)
        conditions = {g.uuid: (g.health, g.health_reason) for g in parsed.gpus if not g.is_healthy}
        gpus = self.tracker.observe((replace(g, health=HEALTHY, health_reason="") for g in parsed.gpus), conditions)
        inventory = replace(parsed, gpus=gpus)
        return Reading(inventory, note=None if inventory.count else f"fake GPU state file {self.path} lists no GPUs")

    def close(self) -> None:
        return None
