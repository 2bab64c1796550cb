"""GPU losses are debounced, arrivals are not (mechanisms/inventory/monitor.py), on the manual clock;
a GPU turning unhealthy is a loss, one recovering an arrival.

The source is a script of readings, one per poll; the evidence is the events the monitor hands
to its subscriber (what registration sees) and the drop outcomes it reports, not its own state.
"""

from __future__ import annotations

import asyncio
import dataclasses

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.gpus import GPU, HEALTHY, LOST, UNHEALTHY, Inventory
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.mechanisms.inventory.monitor import InventoryMonitor
from gpu_agent.mechanisms.inventory.source import Reading

POLL = 0.5
WINDOW = 5.0


def gpus(n: int) -> Inventory:
    return Inventory(tuple(GPU(f"GPU-{i:04d}", "H100", 80 << 30, index=i) for i in range(n)))


class ScriptedSource:
    name = "scripted"

    def __init__(self) -> None:
        self.reading = Reading(gpus(0))
        self.reads = 0

    def read(self) -> Reading:
        self.reads += 1
        return self.reading

    def close(self) -> None:
        pass


class Rig:
    def __init__(self, window: float = WINDOW) -> None:
        self.clock = ManualClock()
        self.source = ScriptedSource()
        self.health = HealthRegistry(self.clock, ["gpus"])
        self.events: list[tuple[float, int, int]] = []  # (time, generation, count) as the subscriber saw them
        self.drops: list[tuple[float, str]] = []
        self.monitor = InventoryMonitor(self.source, clock=self.clock, health=self.health, poll_interval=POLL,
                                        on_change=self._changed, loss_debounce=window, on_drop=lambda o: self.drops.append((self.clock.monotonic(), o)))

    async def _changed(self, e) -> None:
        self.events.append((self.clock.monotonic(), e.generation, e.inventory.count))

    def set(self, n: int | None, error: str | None = None) -> None:
        self.source.reading = Reading(Inventory(), error=error) if error else Reading(gpus(n or 0))

    async def __aenter__(self) -> Rig:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()


async def poll() -> None:
    # The source is read in a worker thread; give it a real moment to come back.
    for _ in range(20):
        await asyncio.sleep(0.005)


async def run_for(rig: Rig, seconds: float) -> None:
    steps = round(seconds / POLL)
    for _ in range(steps):
        await rig.clock.advance(POLL)
        await poll()


async def start_with(rig: Rig, n: int) -> None:
    """The agent starts on `n` GPUs: the first reading is published at once, whatever it holds."""
    rig.set(n)
    rig.task = asyncio.create_task(rig.monitor.run())
    await poll()
    await run_for(rig, POLL)


async def test_a_drop_shorter_than_the_window_is_absorbed_without_a_new_generation():
    async with Rig() as rig:
        await start_with(rig, 4)
        assert [c for _, _, c in rig.events] == [4]
        rig.set(0)
        await run_for(rig, 2.0)  # kubelet restart: allocatable reads 0 for 2 s
        health = rig.health.get("gpus")
        assert health.ready and "drop pending" in health.reason and "0 GPUs" in health.reason
        assert health.details["pendingDrop"]["seenCount"] == 0
        rig.set(4)
        await run_for(rig, 10.0)
        assert [(g, c) for _, g, c in rig.events] == [(1, 4)]  # no generation change, nothing re-registered
        assert [o for _, o in rig.drops] == ["absorbed"]
        assert "pendingDrop" not in rig.health.get("gpus").details
        assert rig.source.reads >= 20  # the monitor kept polling through it


async def test_a_drop_longer_than_the_window_acts_at_window_plus_one_poll():
    async with Rig() as rig:
        await start_with(rig, 4)
        rig.set(0)
        t_drop = rig.clock.monotonic()
        await run_for(rig, 10.0)
        assert [(g, c) for _, g, c in rig.events] == [(1, 4), (2, 0)]
        acted_at = rig.events[-1][0] - t_drop
        assert WINDOW <= acted_at <= WINDOW + 2 * POLL, acted_at
        assert [o for _, o in rig.drops] == ["acted"]
        assert not rig.health.get("gpus").ready


async def test_an_arrival_acts_at_once_even_during_a_pending_drop():
    async with Rig() as rig:
        await start_with(rig, 2)
        rig.set(4)
        t = rig.clock.monotonic()
        await run_for(rig, POLL)
        assert rig.events[-1][2] == 4 and rig.events[-1][0] - t <= POLL
        rig.set(1)
        await run_for(rig, 1.0)
        rig.set(8)  # more than before the drop: only additions, act at once
        t = rig.clock.monotonic()
        await run_for(rig, POLL)
        assert [c for _, _, c in rig.events] == [2, 4, 8] and rig.events[-1][0] - t <= POLL


async def test_a_drop_followed_by_a_different_inventory_acts_on_the_new_one_at_the_first_windows_end():
    async with Rig() as rig:
        await start_with(rig, 4)
        rig.set(0)
        t_drop = rig.clock.monotonic()
        await run_for(rig, 2.0)
        rig.set(2)  # the plugin came back with two GPUs fewer
        await run_for(rig, 8.0)
        assert [c for _, _, c in rig.events] == [4, 2]
        assert WINDOW <= rig.events[-1][0] - t_drop <= WINDOW + 2 * POLL


async def test_an_unreadable_source_is_a_loss_and_is_debounced_too():
    async with Rig() as rig:
        await start_with(rig, 4)
        rig.set(None, error="API server unreachable")
        await run_for(rig, 2.0)
        assert len(rig.events) == 1
        rig.set(4)
        await run_for(rig, 2.0)
        assert len(rig.events) == 1 and [o for _, o in rig.drops] == ["absorbed"]


async def test_window_zero_acts_on_every_change_at_the_next_poll():
    async with Rig(window=0.0) as rig:
        await start_with(rig, 4)
        rig.set(0)
        t = rig.clock.monotonic()
        await run_for(rig, POLL)
        assert [c for _, _, c in rig.events] == [4, 0] and rig.events[-1][0] - t <= POLL
        assert [o for _, o in rig.drops] == ["acted"]


# ---- health: a GPU that stops being healthy is a loss; one that recovers acts at once ----------------------

XID79 = "Xid 79 (GPU has fallen off the bus)"
XID48 = "Xid 48 (double-bit ECC error)"


def faulted(n: int, broken: dict[int, tuple[str, str]]) -> Inventory:
    """`n` GPUs, those in `broken` (index -> (health, reason)) not healthy."""
    return Inventory(tuple(GPU(f"GPU-{i:04d}", "H100", 80 << 30, index=i,
                               health=broken.get(i, (HEALTHY, ""))[0], health_reason=broken.get(i, (HEALTHY, ""))[1],
                               health_since=1_700_000_000.0 if i in broken else 0.0) for i in range(n)))


def healthy_counts(rig: Rig) -> list[int]:
    return [h for _, _, _, h in rig.seen]


class HealthRig(Rig):
    """The subscriber also records how many GPUs of each event are healthy (what registration registers)."""

    def __init__(self, window: float = WINDOW, zero_is_ready: bool = False) -> None:
        super().__init__(window)
        self.monitor.zero_is_ready = zero_is_ready
        self.seen: list[tuple[float, int, int, int]] = []  # (time, generation, count, healthy)

    async def _changed(self, e) -> None:
        await super()._changed(e)
        self.seen.append((self.clock.monotonic(), e.generation, e.inventory.count, len(e.inventory.healthy)))

    def put(self, inventory: Inventory) -> None:
        self.source.reading = Reading(inventory)


async def start_faulted(rig: HealthRig, inventory: Inventory) -> None:
    rig.put(inventory)
    rig.task = asyncio.create_task(rig.monitor.run())
    await poll()
    await run_for(rig, POLL)


async def test_a_gpu_turning_unhealthy_is_a_loss_held_for_the_window_then_acted_on():
    async with HealthRig() as rig:
        await start_faulted(rig, faulted(4, {}))
        rig.put(faulted(4, {1: (LOST, XID79)}))
        t_fault = rig.clock.monotonic()
        await run_for(rig, 2.0)
        assert healthy_counts(rig) == [4], "a health loss inside the window must not be published"
        gpus_entry = rig.health.get("gpus")
        assert gpus_entry.ready and "drop pending: 3 healthy of 4 GPUs" in gpus_entry.reason
        assert "GPU-0001 Lost (Xid 79" in gpus_entry.reason
        assert gpus_entry.details["pendingDrop"]["seenHealthy"] == 3
        await run_for(rig, 6.0)
        assert [(g, c, h) for _, g, c, h in rig.seen] == [(1, 4, 4), (2, 4, 3)]
        assert WINDOW <= rig.seen[-1][0] - t_fault <= WINDOW + 2 * POLL
        assert [o for _, o in rig.drops] == ["acted"]
        gpus_entry = rig.health.get("gpus")
        assert gpus_entry.ready and gpus_entry.reason == f"3 of 4 GPUs healthy; not healthy: GPU-0001 Lost ({XID79})"
        assert gpus_entry.details["healthy"] == 3 and gpus_entry.details["count"] == 4


async def test_a_health_blip_shorter_than_the_window_is_absorbed():
    async with HealthRig() as rig:
        await start_faulted(rig, faulted(4, {}))
        rig.put(faulted(4, {0: (UNHEALTHY, XID48), 2: (UNHEALTHY, XID48)}))
        await run_for(rig, 2.0)
        rig.put(faulted(4, {}))
        await run_for(rig, 8.0)
        assert [(g, h) for _, g, _, h in rig.seen] == [(1, 4)]
        assert [o for _, o in rig.drops] == ["absorbed"]


async def test_a_recovery_acts_at_the_next_poll_even_with_a_window():
    async with HealthRig() as rig:
        await start_faulted(rig, faulted(4, {3: (UNHEALTHY, XID48)}))
        assert healthy_counts(rig) == [3]  # the first reading is published at once, whatever it holds
        rig.put(faulted(4, {}))
        t = rig.clock.monotonic()
        await run_for(rig, POLL)
        assert [(g, h) for _, g, _, h in rig.seen] == [(1, 3), (2, 4)] and rig.seen[-1][0] - t <= POLL
        assert rig.drops == []  # a recovery is no drop
        assert rig.health.get("gpus").reason == "4 GPUs available"


async def test_a_new_reason_or_state_of_a_gpu_already_unhealthy_is_a_change_but_no_loss():
    async with HealthRig() as rig:
        await start_faulted(rig, faulted(4, {3: (UNHEALTHY, XID48)}))
        rig.put(faulted(4, {3: (LOST, XID79)}))
        t = rig.clock.monotonic()
        await run_for(rig, POLL)
        assert [(g, h) for _, g, _, h in rig.seen] == [(1, 3), (2, 3)] and rig.seen[-1][0] - t <= POLL
        assert rig.drops == []


async def test_only_the_healthy_since_timestamp_changing_is_no_change():
    async with HealthRig() as rig:
        await start_faulted(rig, faulted(4, {3: (UNHEALTHY, XID48)}))
        later = faulted(4, {3: (UNHEALTHY, XID48)})
        later = Inventory(tuple(dataclasses.replace(g, health_since=g.health_since + 5 if g.health_since else 0.0)
                                for g in later.gpus))
        rig.put(later)
        await run_for(rig, 2.0)
        assert len(rig.seen) == 1


async def test_none_healthy_is_not_ready_and_the_reason_names_each_gpu_and_its_error():
    async with HealthRig(window=0.0) as rig:
        await start_faulted(rig, faulted(2, {}))
        rig.put(faulted(2, {0: (LOST, XID79), 1: (UNHEALTHY, XID48)}))
        await run_for(rig, POLL)
        assert [(c, h) for _, _, c, h in rig.seen] == [(2, 2), (2, 0)]
        gpus_entry = rig.health.get("gpus")
        assert not gpus_entry.ready
        assert gpus_entry.reason == f"no healthy GPU: GPU-0000 Lost ({XID79}), GPU-0001 Unhealthy ({XID48})"
        assert gpus_entry.details["gpus"] == [
            {"uuid": "GPU-0000", "health": LOST, "reason": XID79, "since": "2023-11-14T22:13:20.000+00:00"},
            {"uuid": "GPU-0001", "health": UNHEALTHY, "reason": XID48, "since": "2023-11-14T22:13:20.000+00:00"}]
        rig.put(faulted(2, {}))
        await run_for(rig, POLL)
        gpus_entry = rig.health.get("gpus")
        assert gpus_entry.ready and gpus_entry.details["gpus"][0] == {"uuid": "GPU-0000", "health": HEALTHY, "reason": "",
                                                                      "since": None}


async def test_a_node_agent_with_none_healthy_stays_ready_and_says_why():
    async with HealthRig(window=0.0, zero_is_ready=True) as rig:
        await start_faulted(rig, faulted(1, {0: (LOST, XID79)}))
        gpus_entry = rig.health.get("gpus")
        assert gpus_entry.ready and gpus_entry.reason == f"no healthy GPU: GPU-0000 Lost ({XID79})"
