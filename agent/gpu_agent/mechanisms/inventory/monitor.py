"""One monitor polls one source and turns changes into generation-numbered events.

A change is a change of the UUID set (which covers the count), of any GPU's health (its state
or its reason: Healthy, Unhealthy with the Xid or error, Lost), or of the source's error state.
Each change bumps the generation and is handed to every subscriber as an `InventoryEvent`;
registration uses the generation to discard responses to a stale view (and registers only the
healthy GPUs of the new one). An unreadable source counts as zero GPUs: the agent never serves
work on GPUs it cannot see. Each event says whether its reading was an answer (`complete`: no
error, a hung read included, and the source has looked in full); a source turning from "not looked
yet" to an answer is a change even when both count zero, so the first answer is always an event.

Losses are debounced, arrivals and recoveries are not. A reading that loses GPUs is held back
for `loss_debounce` seconds, timed from the first poll that saw it. A loss is any of: a UUID
gone, a GPU that was healthy and is not (Unhealthy, Lost, or gone), the source turning unreadable.

    steady ──(loss seen)──> drop pending ──(window passed, loss still there)──> act on the latest reading
                              │   ▲
                              │   └──(a different lossy reading: keep the window's start, remember it)
                              ├──(the same inventory and health as before come back)──> steady, nothing published
                              └──(no loss relative to before: arrivals, recoveries)──> act at once

A kubelet restart makes the cluster's allocatable GPUs read 0 for about a second while the
device plugin registers again (the cluster source reads that as the node's GPUs turning
Unhealthy: in capacity, not allocatable); without the window every restart would pause the
queues and register again. A GPU that recovers (Unhealthy or Lost to Healthy) counts again at
the next poll, as an arrival does. With `loss_debounce` 0 every change is acted on at the next poll.

A read that does not answer within `read_timeout` (a wedged driver: NVML calls can hang after an Xid
79) reads as an unreadable source, so the GPUs count as none and the agent turns NotReady saying
the read hangs and for how long, while /livez stays 200 (the loop turns). The read stays out on its
daemon thread (a call into a driver cannot be cancelled), no second one starts beside it, and each
poll waits for it again; its answer, whenever it comes, is the next reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from gpu_agent.foundations.clock import Clock, sleep_or
from gpu_agent.foundations.gpus import GPU, Inventory, describe_unhealthy
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.threads import in_daemon_thread
from gpu_agent.mechanisms.inventory.source import GPUSource, Reading

log = get_logger(__name__)


@dataclass(frozen=True)
class InventoryEvent:
    generation: int
    inventory: Inventory
    error: str | None
    note: str | None
    complete: bool = True  # the reading was an answer (Reading.answered): its count of zero means "no GPUs"


@dataclass
class PendingDrop:
    reading: Reading  # the latest lossy reading: what is acted on when the window ends
    since_monotonic: float
    since_wall: float


def _healthy_uuids(inventory: Inventory) -> frozenset[str]:
    return frozenset(g.uuid for g in inventory.healthy)


def _health_map(inventory: Inventory) -> dict[str, tuple[str, str]]:
    """What a change is made of, per GPU: its state and its reason (not `health_since`, a timestamp)."""
    return {g.uuid: (g.health, g.health_reason) for g in inventory.gpus}


def _same(before: InventoryEvent, reading: Reading) -> bool:
    return (_health_map(before.inventory) == _health_map(reading.inventory) and before.error == reading.error
            and before.complete == reading.answered
            and (before.inventory.clique, before.inventory.fabric) == (reading.inventory.clique, reading.inventory.fabric))


def _loses_gpus(before: InventoryEvent, reading: Reading) -> bool:
    return (bool(before.inventory.uuids - reading.inventory.uuids)
            or bool(_healthy_uuids(before.inventory) - _healthy_uuids(reading.inventory))
            or (reading.error is not None and before.error is None))


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, tz=UTC).isoformat(timespec="milliseconds")


class InventoryMonitor:
    def __init__(self, source: GPUSource, *, clock: Clock, health: HealthRegistry, poll_interval: float,
                 on_change: Callable[[InventoryEvent], Awaitable[None]], component: str = "gpus",
                 zero_is_ready: bool = False, loss_debounce: float = 0.0,
                 on_drop: Callable[[str], None] | None = None, read_timeout: float = 10.0) -> None:
        self.source = source
        self.read_timeout = read_timeout
        self._read: asyncio.Future[Reading] | None = None  # the source's read still out (a hung one), if any
        self._read_since = 0.0
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
        if self._read is None:
            self._read = asyncio.ensure_future(in_daemon_thread(self.source.read))
            self._read_since = self.clock.monotonic()
        read = self._read
        if not read.done():
            await sleep_or(self.clock, self.read_timeout, asyncio.shield(read))
        if not read.done():
            waited = self.clock.monotonic() - self._read_since
            return await self.observe(Reading(Inventory(), error=(
                f"GPU source {self.source.name} has not answered a read for {waited:.0f}s (a hung driver); "
                "waiting for it")))
        self._read = None
        try:
            reading = read.result()
        except Exception as e:  # noqa: BLE001 - a source that breaks is a source that cannot be read
            reading = Reading(Inventory(), error=f"GPU source {self.source.name} failed: {type(e).__name__}: {e}"[:500])
        return await self.observe(reading)


    async def observe(self, reading: Reading) -> InventoryEvent | None:
        prev = self.current
        if prev is not None and _same(prev, reading):
            if self.pending is not None:
                held = self.clock.monotonic() - self.pending.since_monotonic
                self.pending = None
                self.on_drop("absorbed")
                log.info("GPU drop absorbed: the %s came back after %.2fs (within the %gs window); nothing changes",
                         self._describe(Reading(prev.inventory)), held, self.loss_debounce)
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
        event = InventoryEvent(self.generation, reading.inventory, reading.error, reading.note, reading.answered)
        self.current = event
        self._report(event)
        await self.on_change(event)
        return event

    @staticmethod
    def _describe(reading: Reading) -> str:
        if reading.error:
            return f"source unreadable: {reading.error}"
        inventory = reading.inventory
        if not inventory.unhealthy:
            return f"{inventory.count} GPUs"
        return f"{len(inventory.healthy)} healthy of {inventory.count} GPUs ({describe_unhealthy(inventory.unhealthy)})"

    @staticmethod
    def _gpu_health(g: GPU) -> dict[str, object]:
        return {"uuid": g.uuid, "health": g.health, "reason": g.health_reason,
                "since": _iso(g.health_since) if g.health_since else None}

    def _report(self, e: InventoryEvent, announce: bool = True) -> None:
        """Health from `e` (plus any pending drop); `announce` logs the inventory as a change."""
        healthy = len(e.inventory.healthy)
        details = {"count": e.inventory.count, "healthy": healthy, "generation": e.generation, "source": self.source.name,
                   "uuids": sorted(e.inventory.uuids), "gpus": [self._gpu_health(g) for g in e.inventory.gpus]}
        if e.inventory.fabric:  # the NVML source knows the node's NVLink fabric
            details.update(clique=e.inventory.clique, fabric=e.inventory.fabric)
        pending = ""
        if self.pending is not None:
            act_at = self.pending.since_wall + self.loss_debounce
            details["pendingDrop"] = {"seen": self._describe(self.pending.reading),
                                      "seenCount": self.pending.reading.inventory.count,
                                  "seenHealthy": len(self.pending.reading.inventory.healthy),
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
        elif healthy == 0:
            # Listed but none can take work: as good as none, and the reason names each and why.
            reason = f"no healthy GPU: {describe_unhealthy(e.inventory.unhealthy)}"
            self.health.set(self.component, self.zero_is_ready, reason + pending, **details)
            if announce:
                log.info("GPU inventory: %s, generation %d", reason, e.generation)
        else:
            available = (f"{healthy} GPUs available" if healthy == e.inventory.count else
                         f"{healthy} of {e.inventory.count} GPUs healthy; not healthy: {describe_unhealthy(e.inventory.unhealthy)}")
            self.health.set(self.component, True, available + pending, **details)
            if announce:
                log.info("GPU inventory: %s, generation %d", available, e.generation)
                log.v(2, "GPU UUIDs: %s", ", ".join(sorted(e.inventory.uuids)))

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception as e:  # the monitor must outlive any one bad read
                log.error("GPU inventory poll failed unexpectedly: %s", e, exc_info=True)
            await self.clock.sleep(self.poll_interval)
