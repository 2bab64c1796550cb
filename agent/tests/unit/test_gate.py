import asyncio

import pytest

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.gate import Gate


async def test_holders_run_one_at_a_time_in_arrival_order():
    clock = ManualClock()
    events = []
    gate = Gate(clock, lambda e: events.append((e.purpose, e.event)))
    inside = 0
    max_inside = 0

    async def use(name):
        nonlocal inside, max_inside
        async with gate.hold(name):
            inside += 1
            max_inside = max(max_inside, inside)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            inside -= 1

    await asyncio.gather(use("recovery"), use("renew"), use("periodic"))
    assert max_inside == 1
    assert events == [("recovery", "acquired"), ("recovery", "released"), ("renew", "acquired"),
                      ("renew", "released"), ("periodic", "acquired"), ("periodic", "released")]


async def test_cancelled_waiter_leaves_without_side_effects():
    clock = ManualClock()
    events = []
    gate = Gate(clock, lambda e: events.append((e.purpose, e.event)))
    release = asyncio.Event()
    side_effects = []

    async def holder():
        async with gate.hold("renew"):
            await release.wait()

    async def waiter():
        async with gate.hold("recovery"):
            side_effects.append("registered")

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    w = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    release.set()
    await h
    assert side_effects == []
    assert ("recovery", "abandoned") in events
    # The gate is free again: a later holder gets it at once.
    async with gate.hold("periodic"):
        assert gate.holder == "periodic"


async def test_waiter_timeout_leaves_and_gate_stays_usable():
    gate = Gate(ManualClock())
    release = asyncio.Event()

    async def holder():
        async with gate.hold("renew"):
            await release.wait()

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with gate.hold("recovery", timeout=0.01):
            raise AssertionError("must not run")
    release.set()
    await h
    async with gate.hold("recovery", timeout=0.01):
        pass


async def test_wait_time_is_reported_on_the_injected_clock():
    clock = ManualClock()
    waits = {}
    gate = Gate(clock, lambda e: waits.setdefault((e.purpose, e.event), e.waited))
    release = asyncio.Event()

    async def holder():
        async with gate.hold("renew"):
            await release.wait()

    async def waiter():
        async with gate.hold("recovery"):
            pass

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    w = asyncio.create_task(waiter())
    await clock.advance(2.5)
    release.set()
    await asyncio.gather(h, w)
    assert waits[("recovery", "acquired")] == pytest.approx(2.5)
    assert waits[("renew", "released")] == pytest.approx(2.5)
