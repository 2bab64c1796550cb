"""The long-lived threads of an agent (foundations/threads.py): one that dies turns the agent NotReady, naming it and
why; each agent's threads, and the threads they start, report to that agent alone (issue 49)."""

import asyncio
import logging
import threading

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
