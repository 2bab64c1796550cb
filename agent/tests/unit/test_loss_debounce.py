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


# ---- what the monitor says: its log lines and its health entry, reading by reading (observe, no poll loop) -------

import contextlib  # noqa: E402
import io  # noqa: E402

from gpu_agent.foundations import klog  # noqa: E402

T0 = 1_700_000_000.0  # the manual clock's monotonic and wall time at the start: 2023-11-14T22:13:20Z


def log_at(v: int) -> io.StringIO:
    stream = io.StringIO()
    klog.setup(v, stream)
    return stream


def messages(stream: io.StringIO) -> list[str]:
    return [line.split("] ", 1)[1] for line in stream.getvalue().splitlines()]


class Observed:
    """A monitor fed readings one by one (`observe`), on a manual clock; what it hands on and reports."""

    def __init__(self, window: float = WINDOW, zero_is_ready: bool = False) -> None:
        self.clock = ManualClock(start=T0)
        self.health = HealthRegistry(self.clock, ["gpus"])
        self.events: list = []
        self.drops: list[str] = []
        self.monitor = InventoryMonitor(ScriptedSource(), clock=self.clock, health=self.health, poll_interval=POLL,
                                        on_change=self._changed, loss_debounce=window, on_drop=self.drops.append,
                                        zero_is_ready=zero_is_ready)

    async def _changed(self, e) -> None:
        self.events.append(e)

    async def see(self, reading: Reading, after: float = 0.0):
        self.clock.advance_blocking(after)
        return await self.monitor.observe(reading)

    @property
    def entry(self):
        return self.health.get("gpus")


async def test_the_drop_window_says_what_it_saw_until_when_it_waits_and_what_came_back():
    log = log_at(0)
    o = Observed()
    await o.see(Reading(gpus(4)))
    assert await o.see(Reading(gpus(2)), after=1.0) is None
    pending = {"seen": "2 GPUs", "seenCount": 2, "seenHealthy": 2, "since": "2023-11-14T22:13:21.000+00:00",
               "actAt": "2023-11-14T22:13:26.000+00:00", "windowSeconds": WINDOW}
    assert o.entry.ready and o.entry.details["pendingDrop"] == pending
    assert o.entry.reason == ("4 GPUs available; drop pending: 2 GPUs seen since 2023-11-14T22:13:21.000+00:00, "
                              "acted on at 2023-11-14T22:13:26.000+00:00 unless the GPUs come back")
    await o.see(Reading(gpus(1)), after=1.0)  # another lossy reading: the window keeps its start
    assert o.entry.details["pendingDrop"] == {**pending, "seen": "1 GPUs", "seenCount": 1, "seenHealthy": 1}
    assert await o.see(Reading(gpus(4)), after=1.0) is None
    assert o.entry.reason == "4 GPUs available" and "pendingDrop" not in o.entry.details
    await o.see(Reading(gpus(0)), after=1.0)
    assert await o.see(Reading(gpus(0)), after=4.99) is None  # 4.99 s into the window: still held
    event = await o.see(Reading(gpus(0)), after=0.01)
    assert (event.generation, event.inventory.count) == (2, 0) and o.drops == ["absorbed", "acted"]
    assert messages(log) == [
        "GPU inventory: 4 GPUs available, generation 1",
        "GPU drop seen (2 GPUs); acting on it at 2023-11-14T22:13:26.000+00:00 unless the GPUs come back",
        "GPU drop absorbed: the 4 GPUs came back after 2.00s (within the 5s window); nothing changes",
        "GPU drop seen (0 GPUs); acting on it at 2023-11-14T22:13:29.000+00:00 unless the GPUs come back",
        "GPU drop held for 5.00s (window 5s): acting on it",
        "GPU inventory: 0 GPUs (none found), generation 2"]


async def test_each_kind_of_reading_is_announced_and_reported_as_what_it_is():
    log = log_at(2)
    o = Observed(window=0.0)
    await o.see(Reading(gpus(2)))
    assert (o.entry.ready, o.entry.reason) == (True, "2 GPUs available")
    assert o.entry.details == {"count": 2, "healthy": 2, "generation": 1, "source": "scripted",
                               "uuids": ["GPU-0000", "GPU-0001"],
                               "gpus": [{"uuid": f"GPU-000{i}", "health": HEALTHY, "reason": "", "since": None}
                                        for i in range(2)]}
    await o.see(Reading(faulted(2, {1: (UNHEALTHY, XID48)})))
    assert o.entry.reason == f"1 of 2 GPUs healthy; not healthy: GPU-0001 Unhealthy ({XID48})"
    await o.see(Reading(faulted(2, {0: (LOST, XID79), 1: (UNHEALTHY, XID48)})))
    await o.see(Reading(Inventory(), note="NVIDIA driver not loaded"))
    assert (o.entry.ready, o.entry.reason) == (False, "no GPUs available: NVIDIA driver not loaded")
    await o.see(Reading(Inventory(), error="NVML error 999: boom"))
    assert (o.entry.ready, o.entry.reason) == (False, "NVML error 999: boom")
    assert (o.entry.details["count"], o.entry.details["generation"], o.entry.details["gpus"]) == (0, 5, [])
    await o.see(Reading(Inventory(gpus(1).gpus, clique="rack.7", fabric="fabric completed: clique rack.7")))
    assert (o.entry.details["clique"], o.entry.details["fabric"]) == ("rack.7", "fabric completed: clique rack.7")
    await o.see(Reading(Inventory()))
    assert (o.entry.ready, o.entry.reason) == (False, "no GPUs available")
    assert messages(log) == [
        "GPU inventory: 2 GPUs available, generation 1",
        "GPU UUIDs: GPU-0000, GPU-0001",
        f"GPU inventory: 1 of 2 GPUs healthy; not healthy: GPU-0001 Unhealthy ({XID48}), generation 2",
        "GPU UUIDs: GPU-0000, GPU-0001",
        f"GPU inventory: no healthy GPU: GPU-0000 Lost ({XID79}), GPU-0001 Unhealthy ({XID48}), generation 3",
        "GPU inventory: 0 GPUs (NVIDIA driver not loaded), generation 4",
        "GPU source scripted cannot be read: NVML error 999: boom (treating as 0 GPUs, generation 5)",
        "GPU inventory: 1 GPUs available, generation 6",
        "GPU UUIDs: GPU-0000",
        "GPU inventory: 0 GPUs (none found), generation 7"]


async def test_a_change_of_the_nvlink_fabric_or_of_the_error_alone_is_a_change():
    o = Observed(window=WINDOW)
    await o.see(Reading(Inventory(gpus(2).gpus, clique="", fabric="fabric registration in progress on GPU(s) 0, 1")))
    await o.see(Reading(Inventory(gpus(2).gpus, clique="rack.7", fabric="fabric completed: clique rack.7")))
    await o.see(Reading(Inventory(gpus(2).gpus, clique="rack.7", fabric="fabric completed: clique rack.7")))
    await o.see(Reading(Inventory(), error="first"))  # a loss: held for the window
    await o.see(Reading(Inventory(), error="first"), after=WINDOW)
    await o.see(Reading(Inventory(), error="second"))  # unreadable before and after: no loss, at once
    assert [(e.generation, e.inventory.clique, e.error) for e in o.events] == [
        (1, "", None), (2, "rack.7", None), (3, "", "first"), (4, "", "second")]


async def test_a_source_whose_read_raises_is_a_source_that_cannot_be_read_saying_why():
    class Broken(ScriptedSource):
        def read(self) -> Reading:
            raise RuntimeError("x" * 600)

    o = Observed(window=0.0)
    o.monitor.source = Broken()
    event = await o.monitor.poll_once()
    assert event.error == ("GPU source scripted failed: RuntimeError: " + "x" * 600)[:500] and len(event.error) == 500
    assert not o.entry.ready and event.inventory.count == 0


async def test_an_unhealthy_gpu_that_leaves_the_inventory_is_a_loss_too():
    o = Observed()
    await o.see(Reading(faulted(2, {1: (UNHEALTHY, XID48)})))
    assert await o.see(Reading(gpus(1))) is None  # GPU-0001 gone: held for the window, like any loss
    assert (await o.see(Reading(gpus(1)), after=WINDOW)).inventory.count == 1 and o.drops == ["acted"]


async def test_a_poll_that_fails_unexpectedly_is_logged_with_its_traceback_and_the_polls_go_on():
    log = log_at(0)
    o = Observed()
    polls: list[float] = []

    async def poll_once() -> None:
        polls.append(o.clock.monotonic())
        if len(polls) == 1:
            raise RuntimeError("boom")

    o.monitor.poll_once = poll_once  # type: ignore[method-assign]
    task = asyncio.create_task(o.monitor.run())
    await o.clock.advance(POLL)
    await o.clock.advance(POLL)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert polls == [T0, T0 + POLL, T0 + 2 * POLL]
    first, second = log.getvalue().splitlines()[:2]
    assert first.startswith("E") and first.endswith("] GPU inventory poll failed unexpectedly: boom")
    assert second == "Traceback (most recent call last):"


async def test_a_window_under_a_second_still_holds_a_loss():
    o = Observed(window=0.5)
    await o.see(Reading(gpus(4)))
    assert await o.see(Reading(gpus(2))) is None
    assert await o.see(Reading(gpus(2)), after=0.25) is None
    assert (await o.see(Reading(gpus(2)), after=0.25)).inventory.count == 2 and o.drops == ["acted"]


async def test_a_read_is_reported_hung_once_it_is_out_ten_seconds_by_default_and_its_late_answer_is_read(monkeypatch):
    """No role sets read_timeout: its default is the hung-driver threshold (an NVML call wedged after an Xid 79)."""
    from gpu_agent.mechanisms.inventory import monitor as monitor_module

    answer: asyncio.Future[Reading] = asyncio.get_running_loop().create_future()

    async def on_the_loop(read):  # the read "runs" until the test answers it
        return await answer

    monkeypatch.setattr(monitor_module, "in_daemon_thread", on_the_loop)
    o = Observed()
    poll = asyncio.ensure_future(o.monitor.poll_once())
    await o.clock.advance(9.9)
    assert not poll.done()
    await o.clock.advance(0.1)
    assert poll.done()
    assert poll.result().error == "GPU source scripted has not answered a read for 10s (a hung driver); waiting for it"
    answer.set_result(Reading(gpus(1)))
    assert (await o.monitor.poll_once()).inventory.count == 1
