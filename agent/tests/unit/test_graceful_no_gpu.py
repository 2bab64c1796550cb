"""gracefulNoGPU (roles/cluster_agent.py): off (the agent's default, NVCA's), the cluster agent's run ends with exit
code 3 when its first complete GPU reading counts no GPU, its reason the last log line, the shutdown the one SIGTERM
takes; GPUs seen at start make later losses NotReady, never an exit; on, no GPUs is NotReady for as long as it
lasts. A reading that is no answer (an error, a hung read, the cluster source before its first list) decides
nothing.

The agent runs whole (ClusterAgent.run, its endpoints on a free port) on the manual clock; its GPU source is a
script whose reads run on the event loop (the monitor's offload replaced), so that each poll is one clock step
and no test waits on real time."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import socket

import pytest

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.config import load
from gpu_agent.foundations.gpus import GPU, UNHEALTHY, Inventory
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.mechanisms.inventory import monitor as monitor_module
from gpu_agent.mechanisms.inventory.monitor import InventoryMonitor
from gpu_agent.mechanisms.inventory.source import Reading
from gpu_agent.roles.cluster_agent import EXIT_NO_GPUS, SETTINGS, ClusterAgent

POLL = 0.5  # gpuPollInterval's default


def gpus(n: int, health: str = "Healthy") -> Inventory:
    return Inventory(tuple(GPU(f"GPU-{i:04d}", "H100", 80 << 30, index=i, health=health,
                               health_reason="" if health == "Healthy" else "Xid 79") for i in range(n)))


NONE = Reading(Inventory(), note="fake GPU state file lists no GPUs")


class ScriptedSource:
    """Each read answers `reading`; `hang()` makes the next read hang until `answer()` (a driver wedged, then back)."""

    name = "scripted"

    def __init__(self, reading: Reading) -> None:
        self.reading = reading
        self.reads = 0
        self._hang = False
        self.hung: asyncio.Future[Reading] | None = None

    def read(self) -> Reading | asyncio.Future[Reading]:
        self.reads += 1
        if self._hang:
            self._hang = False
            self.hung = asyncio.get_running_loop().create_future()
            return self.hung
        return self.reading

    def hang(self) -> None:
        self._hang = True

    def answer(self, reading: Reading) -> None:
        self.reading = reading
        assert self.hung is not None
        self.hung.set_result(reading)

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def reads_on_the_loop(monkeypatch):
    """The monitor reads its source on a daemon thread; here on the loop (a hung read is a future not yet done)."""
    async def inline(fn, *args):
        value = fn(*args)
        return await value if isinstance(value, asyncio.Future) else value

    monkeypatch.setattr(monitor_module, "in_daemon_thread", inline)


@pytest.fixture
def lines():
    """The agent's log lines, in order, as it wrote them (at -v 0)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    root = logging.getLogger("gpu_agent")
    handler, level = Keep(), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield seen
    root.removeHandler(handler)
    root.setLevel(level)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(tmp_path, reading: Reading, graceful: bool | None = None) -> tuple[ClusterAgent, ScriptedSource, ManualClock]:
    environ = {"GPU_AGENT_GPU_SOURCE": "fake", "GPU_AGENT_FAKE_GPU_STATE_FILE": str(tmp_path / "gpus.json"),
               "GPU_AGENT_EXECUTOR_JOURNAL": str(tmp_path / "journal.sqlite"), "GPU_AGENT_LISTEN_ADDRESS": "127.0.0.1:0",
               "GPU_AGENT_CONTROL_PLANE_URL": f"http://127.0.0.1:{free_port()}"}  # refuses at once: nothing registers
    if graceful is not None:  # unset: the agent's own default
        environ["GPU_AGENT_GRACEFUL_NO_GPU"] = str(graceful).lower()
    cfg = load(SETTINGS, argparse.Namespace(), environ=environ)
    clock = ManualClock()
    a = ClusterAgent(cfg, clock, random.Random(3))
    source = ScriptedSource(reading)
    a.monitor.source = source
    return a, source, clock


def closed(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def not_ready(a: ClusterAgent) -> bool:
    snap = a.health.snapshot()
    return (snap["status"], snap["components"]["gpus"]["ready"], snap["components"]["queues"]["ready"]) == (
        "notready", False, False)


async def polls(clock: ManualClock, n: int) -> None:
    for _ in range(n):
        await clock.advance(POLL)


async def ended(run: asyncio.Task[int]) -> int:
    """The run's exit code once it has ended (its shutdown takes a few loop turns, no clock time); a run that does
    not end fails the test here instead of at the suite's 30 s bound."""
    return await asyncio.wait_for(run, 10)


async def test_off_is_the_default_and_no_gpus_at_the_first_complete_reading_ends_the_run_with_code_3_and_why_last(
        tmp_path, lines):
    a, source, _ = agent(tmp_path, NONE)
    assert a.cfg.gracefulNoGPU is False
    code = await a.run(asyncio.Event())  # ends by itself: no stop request, no clock moved
    assert code == EXIT_NO_GPUS == 3
    assert source.reads == 1
    assert lines[-1] == ("no GPUs in the cluster at start (fake GPU state file lists no GPUs) and gracefulNoGPU is off: "
                         "exiting (set gracefulNoGPU=true to wait for GPUs live but NotReady)")
    # The shutdown a stop request takes: the queues paused first, the endpoints closed after.
    assert any(line.startswith("shutting down (exit code 3") for line in lines)
    assert a.health.snapshot()["components"]["queues"]["reason"].startswith("paused")
    assert closed(a.endpoints.address)


async def test_off_with_gpus_at_start_then_none_is_not_ready_with_the_queues_paused_and_never_exits(
        tmp_path, lines, tasks):
    a, source, clock = agent(tmp_path, Reading(gpus(2)), graceful=False)
    stop = asyncio.Event()
    run = tasks.start(a.run(stop))
    await polls(clock, 1)
    assert a.started_with_gpus is True
    assert a.health.snapshot()["components"]["gpus"]["ready"] is True
    source.reading = NONE
    await polls(clock, 20)  # 10 s without GPUs (the fake source's loss debounce is 0)
    assert not run.done()
    assert not_ready(a) and a.health.snapshot()["components"]["gpus"]["details"]["count"] == 0
    assert not any("no GPUs in the cluster at start" in line for line in lines)
    stop.set()
    assert await ended(run) == 0
    assert closed(a.endpoints.address)


async def test_on_no_gpus_is_live_not_ready_with_the_queues_paused_until_gpus_come(tmp_path, lines, tasks):
    a, source, clock = agent(tmp_path, NONE, graceful=True)
    stop = asyncio.Event()
    run = tasks.start(a.run(stop))
    await polls(clock, 20)
    assert not run.done() and source.reads >= 20
    assert not_ready(a)
    assert a.health.snapshot()["components"]["gpus"]["reason"] == "no GPUs available: fake GPU state file lists no GPUs"
    source.reading = Reading(gpus(1))
    await polls(clock, 1)
    assert a.health.snapshot()["components"]["gpus"]["ready"] is True
    stop.set()
    assert await ended(run) == 0
    assert not any("no GPUs in the cluster at start" in line for line in lines)


NO_ANSWER = {
    "the source failed": Reading(Inventory(), error="fake GPU state file /x cannot be read: no such file"),
    "the cluster source before its first list": Reading(Inventory(), complete=False,
                                                        note="waiting for the first list of nodes"),
    "a hung read": None,  # the source's read does not come back
}


@pytest.mark.parametrize("first", NO_ANSWER)
async def test_off_a_first_reading_that_is_no_answer_decides_nothing_and_the_first_answer_does(
        tmp_path, lines, tasks, first):
    reading = NO_ANSWER[first]
    a, source, clock = agent(tmp_path, reading or NONE, graceful=False)
    if reading is None:
        source.hang()
    run = tasks.start(a.run(asyncio.Event()))
    await polls(clock, 60)  # 30 s: three of the monitor's 10 s waits for a hung read
    assert not run.done(), "the agent exited before the source answered"
    assert a.started_with_gpus is None and not_ready(a)
    if reading is None:
        assert "has not answered a read for" in a.health.snapshot()["components"]["gpus"]["reason"]
        source.answer(NONE)
    else:
        source.reading = NONE
    await polls(clock, 1)
    assert await ended(run) == EXIT_NO_GPUS
    assert lines[-1].startswith("no GPUs in the cluster at start") and "gracefulNoGPU" in lines[-1]


async def test_off_gpus_listed_but_none_healthy_are_gpus_the_agent_waits_for(tmp_path, lines, tasks):
    a, _, clock = agent(tmp_path, Reading(gpus(2, health=UNHEALTHY)), graceful=False)
    stop = asyncio.Event()
    run = tasks.start(a.run(stop))
    await polls(clock, 4)
    assert not run.done() and a.started_with_gpus is True and not_ready(a)
    stop.set()
    assert await ended(run) == 0


async def test_a_source_turning_from_not_looked_yet_to_an_answer_of_zero_is_an_event():
    """What lets the cluster agent decide: the first list of an empty cluster is published, although the count
    (zero) is what it read before that list."""
    clock, events = ManualClock(), []

    async def changed(e):
        events.append((e.inventory.count, e.complete, e.note))

    source = ScriptedSource(Reading(Inventory(), complete=False, note="waiting for the first list of nodes"))
    monitor = InventoryMonitor(source, clock=clock, health=HealthRegistry(clock, ["gpus"]), poll_interval=POLL,
                               on_change=changed)
    await monitor.poll_once()
    await monitor.poll_once()  # the same: nothing new
    source.reading = Reading(Inventory(), note="no Ready node has nvidia.com/gpu")
    await monitor.poll_once()
    await monitor.poll_once()
    assert events == [(0, False, "waiting for the first list of nodes"), (0, True, "no Ready node has nvidia.com/gpu")]
