"""One monitor polls one source and turns changes into generation-numbered events.

A change is a change of the UUID set (which covers the count) or of the source's error
state. Each change bumps the generation and is handed to every subscriber as an
`InventoryEvent`; registration uses the generation to discard responses to a stale view.
An unreadable source counts as zero GPUs: the agent never serves work on GPUs it cannot see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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


class InventoryMonitor:
    def __init__(self, source: GPUSource, clock: Clock, health: HealthRegistry, poll_interval: float,
                 on_change: Callable[[InventoryEvent], Awaitable[None]], component: str = "gpus",
                 zero_is_ready: bool = False) -> None:
        self.source = source
        self.clock = clock
        self.health = health
        self.poll_interval = poll_interval
        self.on_change = on_change
        self.component = component
        # A node agent is ready on a node with no GPUs (it reports the truth: zero); the cluster
        # agent is not (it must not serve work without GPUs).
        self.zero_is_ready = zero_is_ready
        self.generation = 0
        self.current: InventoryEvent | None = None

    async def poll_once(self) -> InventoryEvent | None:
        reading: Reading = await asyncio.to_thread(self.source.read)
        prev = self.current
        if prev is not None and prev.inventory.uuids == reading.inventory.uuids and prev.error == reading.error:
            return None
        self.generation += 1
        event = InventoryEvent(self.generation, reading.inventory, reading.error, reading.note)
        self.current = event
        self._report(event)
        await self.on_change(event)
        return event

    def _report(self, e: InventoryEvent) -> None:
        details = {"count": e.inventory.count, "generation": e.generation, "source": self.source.name,
                   "uuids": sorted(e.inventory.uuids)}
        if e.error:
            self.health.set(self.component, False, e.error, **details)
            log.error("GPU source %s cannot be read: %s (treating as 0 GPUs, generation %d)", self.source.name, e.error, e.generation)
        elif e.inventory.count == 0:
            reason = "no GPUs available" + (f": {e.note}" if e.note else "")
            self.health.set(self.component, self.zero_is_ready, reason, **details)
            log.info("GPU inventory: 0 GPUs (%s), generation %d", e.note or "none found", e.generation)
        else:
            self.health.set(self.component, True, f"{e.inventory.count} GPUs available", **details)
            log.info("GPU inventory: %d GPUs, generation %d", e.inventory.count, e.generation)
            log.v(2, "GPU UUIDs: %s", ", ".join(sorted(e.inventory.uuids)))

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as e:  # noqa: BLE001 - the monitor must outlive any one bad read
                log.error("GPU inventory poll failed unexpectedly: %s", e, exc_info=True)
            await self.clock.sleep(self.poll_interval)
