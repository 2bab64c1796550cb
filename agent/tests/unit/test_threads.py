"""The long-lived threads of an agent (foundations/threads.py): one that dies turns the agent NotReady, naming it and
why; each agent's threads, and the threads they start, report to that agent alone (issue 49)."""

import asyncio
import contextvars
import logging
import threading
import time

from gpu_agent.foundations import threads as threads_module
from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.threads import CURRENT, Threads, start_thread


def agent():
    health = HealthRegistry(ManualClock(), ["gpus"])
    health.set("gpus", True, "4 GPUs")
    return health, Threads(health)


def test_a_thread_that_raises_turns_the_agent_not_ready_naming_it_and_why_and_logs_its_traceback(caplog):
    health, threads = agent()
    assert health.ready() and health.get("threads").reason == "every thread runs"

    def fold():
        raise ValueError("status.nodes is not a list")

    with caplog.at_level(logging.ERROR, logger=threads_module.log._log.name):
        threads.start("domain-aggregator", fold).join(5)
    entry = health.get("threads")
    assert not health.ready() and not entry.ready
    assert entry.reason == "thread domain-aggregator died: ValueError: status.nodes is not a list"
    assert entry.details == {"running": 0, "died": ["domain-aggregator"]}
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "thread domain-aggregator died" in said and "in fold" in said  # the traceback names the frame


def test_a_thread_that_returns_before_its_stop_is_dead_and_one_stopped_is_not():
    health, threads = agent()
    stop = threading.Event()
    release = threading.Event()
    running = threads.start("members-watch", lambda: release.wait(5), stop)
    assert health.get("threads").details == {"running": 1, "died": []}
    stop.set()
    release.set()
    running.join(5)
    assert health.ready() and health.get("threads").details == {"running": 0, "died": []}
    threads.start("node-watch", lambda: None, threading.Event()).join(5)
    assert health.get("threads").reason == "thread node-watch died: it returned while it should still run"
    assert not health.ready()


async def test_each_agent_and_the_threads_its_threads_start_report_to_that_agent_alone():
    (health_a, threads_a), (health_b, threads_b) = agent(), agent()
    started = []

    def parent():  # starts a watch of its own, as the aggregator does
        child = start_thread("members-watch", lambda: 1 / 0)
        started.append(child)
        child.join(5)

    async def role(threads):
        CURRENT.set(threads)  # what each role does at the start of its run
        await asyncio.to_thread(lambda: start_thread("domain-aggregator", parent).join(5))

    await asyncio.gather(role(threads_a), asyncio.sleep(0))
    assert started and health_a.get("threads").reason == "thread members-watch died: ZeroDivisionError: division by zero"
    assert health_b.ready() and threads_b.died == {}
    assert CURRENT.get() is None  # the test's own context was never touched


# -- blocking calls off the loop ---------------------------------------------------------------------------------

def test_blocking_calls_hold_at_most_their_places_and_the_rest_wait_their_turn(monkeypatch):
    """A control plane that hangs every call holds MAX_BLOCKING_CALLS threads, not one more per call."""
    threads = threads_module
    monkeypatch.setattr(threads, "MAX_BLOCKING_CALLS", 3)
    lock, release = threading.Lock(), threading.Event()
    inside, most = [0], [0]

    def hung(n):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        release.wait(10)
        with lock:
            inside[0] -= 1
        return n

    async def main():
        calls = [asyncio.ensure_future(threads.in_daemon_thread(hung, n)) for n in range(5)]
        deadline = time.monotonic() + 5
        while inside[0] < 3 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a count the threads write
            await asyncio.sleep(0.01)
        for _ in range(20):
            await asyncio.sleep(0)  # the two waiting calls get every chance to start, and must not
        started = inside[0]
        release.set()
        return started, await asyncio.gather(*calls)

    started, results = asyncio.run(main())
    assert (started, most[0], results) == (3, 3, [0, 1, 2, 3, 4])


def test_a_blocking_call_sees_the_callers_context_and_a_cancelled_waiter_frees_its_place_when_the_call_returns(
        monkeypatch):
    threads = threads_module
    monkeypatch.setattr(threads, "MAX_BLOCKING_CALLS", 1)
    who = contextvars.ContextVar("who", default="nobody")
    release = threading.Event()

    async def main():
        who.set("caller")
        assert await threads.in_daemon_thread(who.get) == "caller"
        first = asyncio.ensure_future(threads.in_daemon_thread(release.wait, 10))
        await asyncio.sleep(0.05)
        first.cancel()
        second = asyncio.ensure_future(threads.in_daemon_thread(lambda: "second"))
        await asyncio.sleep(0.05)
        waited = not second.done()  # the cancelled call's thread still holds the one place
        release.set()
        return waited, await asyncio.wait_for(second, 5)

    assert asyncio.run(main()) == (True, "second")
