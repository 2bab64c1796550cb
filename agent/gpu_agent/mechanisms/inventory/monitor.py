"""One monitor polls one source and turns changes into generation-numbered events.

A change is a change of the UUID set (which covers the count) or of the source's error
state. Each change bumps the generation and is handed to every subscriber as an
`InventoryEvent`; registration uses the generation to discard responses to a stale view.
An unreadable source counts as zero GPUs: the agent never serves work on GPUs it cannot see.

Losses are debounced, arrivals are not. A reading that loses GPUs (a UUID gone, or the source
turning unreadable) is held back for `loss_debounce` seconds, timed from the first poll that
saw it:

    steady ──(loss seen)──> drop pending ──(window passed, loss still there)──> act on the latest reading
                              │   ▲
                              │   └──(a different lossy reading: keep the window's start, remember it)
                              ├──(the same inventory as before comes back)──> steady, nothing published
                              └──(only additions relative to before)──────> act at once

A kubelet restart makes the cluster's allocatable GPUs read 0 for about a second while the
device plugin registers again; without the window every restart would pause the queues and
register again. With `loss_debounce` 0 every change is acted on at the next poll.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from gpu_agent.foundations.clock import Clock
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.mechanisms.inventory.source import GPUSource, Reading

log = get_logger(__name__)


@dataclass(frozen=True)
class InventoryEvent:
    generation: int
    inventory: Inventory
    error: str | None
    note: str | None


@dataclass
class PendingDrop:
    reading: Reading  # the latest lossy reading: what is acted on when the window ends
    since_monotonic: float
    since_wall: float


def _loses_gpus(before: InventoryEvent, reading: Reading) -> bool:
    return bool(before.inventory.uuids - reading.inventory.uuids) or (reading.error is not None and before.error is None)


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, tz=UTC).isoformat(timespec="milliseconds")


class InventoryMonitor:
    def __init__(self, source: GPUSource, *, clock: Clock, health: HealthRegistry, poll_interval: float,
                 on_change: Callable[[InventoryEvent], Awaitable[None]], component: str = "gpus",
                 zero_is_ready: bool = False, loss_debounce: float = 0.0,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.source = source
        self.clock = clock
        self.health = health
        self.poll_interval = poll_interval
        self.on_change = on_change
        self.component = component
        # A node agent is ready on a node with no GPUs (it reports the truth: zero); the cluster
        # agent is not (it must not serve work without GPUs).
        self.zero_is_ready = zero_is_ready
        self.loss_debounce = loss_debounce
        self.on_drop = on_drop or (lambda outcome: None)  # "absorbed" | "acted": for metrics
        self.generation = 0
        self.current: InventoryEvent | None = None
        self.pending: PendingDrop | None = None

    async def poll_once(self) -> InventoryEvent | None:
        try:
            reading: Reading = await asyncio.to_thread(self.source.read)
        except Exception as e:  # noqa: BLE001 - a source that breaks is a source that cannot be read
            reading = Reading(Inventory(), error=f"GPU source {self.source.name} failed: {type(e).__name__}: {e}"[:500])
        return await self.observe(reading)

    async def observe(self, reading: Reading) -> InventoryEvent | None:
        prev = self.current
        if (prev is not None and prev.inventory.uuids == reading.inventory.uuids and prev.error == reading.error
                and (prev.inventory.clique, prev.inventory.fabric) == (reading.inventory.clique, reading.inventory.fabric)):
            if self.pending is not None:
                held = self.clock.monotonic() - self.pending.since_monotonic
                self.pending = None
                self.on_drop("absorbed")
                log.info("GPU drop absorbed: the %d GPUs came back after %.2fs (within the %gs window); nothing changes",
                         prev.inventory.count, held, self.loss_debounce)
                self._report(prev, announce=False)
            return None
        if prev is not None and self.loss_debounce > 0 and _loses_gpus(prev, reading):
            now = self.clock.monotonic()
            if self.pending is None:
                self.pending = PendingDrop(reading, now, self.clock.wall())
                log.info("GPU drop seen (%s); acting on it at %s unless the GPUs come back", self._describe(reading),
                         _iso(self.pending.since_wall + self.loss_debounce))
                self._report(prev, announce=False)
                return None
            self.pending.reading = reading
            if now - self.pending.since_monotonic < self.loss_debounce:
                self._report(prev, announce=False)
                return None
            log.info("GPU drop held for %.2fs (window %gs): acting on it", now - self.pending.since_monotonic,
                     self.loss_debounce)
        self.pending = None
        if prev is not None and _loses_gpus(prev, reading):
            self.on_drop("acted")
        self.generation += 1
        event = InventoryEvent(self.generation, reading.inventory, reading.error, reading.note)
        self.current = event
        self._report(event)
        await self.on_change(event)
        return event

    @staticmethod
    def _describe(reading: Reading) -> str:
        return f"source unreadable: {reading.error}" if reading.error else f"{reading.inventory.count} GPUs"

    def _report(self, e: InventoryEvent, announce: bool = True) -> None:
        """Health from `e` (plus any pending drop); `announce` logs the inventory as a change."""
        details = {"count": e.inventory.count, "generation": e.generation, "source": self.source.name,
                   "uuids": sorted(e.inventory.uuids)}
        if e.inventory.fabric:  # the NVML source knows the node's NVLink fabric
            details.update(clique=e.inventory.clique, fabric=e.inventory.fabric)
        pending = ""
        if self.pending is not None:
            act_at = self.pending.since_wall + self.loss_debounce
            details["pendingDrop"] = {"seen": self._describe(self.pending.reading),
                                      "seenCount": self.pending.reading.inventory.count,
                                      "since": _iso(self.pending.since_wall), "actAt": _iso(act_at),
                                      "windowSeconds": self.loss_debounce}
            pending = (f"; drop pending: {self._describe(self.pending.reading)} seen since "
                       f"{_iso(self.pending.since_wall)}, acted on at {_iso(act_at)} unless the GPUs come back")
        if e.error:
            self.health.set(self.component, False, e.error, **details)
            if announce:
                log.error("GPU source %s cannot be read: %s (treating as 0 GPUs, generation %d)", self.source.name, e.error,
                          e.generation)
        elif e.inventory.count == 0:
            reason = "no GPUs available" + (f": {e.note}" if e.note else "")
            self.health.set(self.component, self.zero_is_ready, reason + pending, **details)
            if announce:
                log.info("GPU inventory: 0 GPUs (%s), generation %d", e.note or "none found", e.generation)
        else:
            self.health.set(self.component, True, f"{e.inventory.count} GPUs available{pending}", **details)
            if announce:
                log.info("GPU inventory: %d GPUs, generation %d", e.inventory.count, e.generation)
                log.v(2, "GPU UUIDs: %s", ", ".join(sorted(e.inventory.uuids)))

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as e:  # the monitor must outlive any one bad read
                log.error("GPU inventory poll failed unexpectedly: %s", e, exc_info=True)
            await self.clock.sleep(self.poll_interval)
