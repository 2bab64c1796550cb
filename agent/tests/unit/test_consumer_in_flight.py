"""Items in flight side by side (issue 25): the consumer's leasing loop against a scripted control plane and an
executor whose items end when the test says. Time is the injected clock; the control plane is called directly
(no threads), so what the loop does between two `settle()`s is decided, and a loop that spun would never settle."""

import asyncio
from dataclasses import replace

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import Fence, WorkItem
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.mechanisms.queues.consumer import QueueConsumer


class ControlPlane:
    """Hands out `items` in order, several per call when asked; records every call (the tests assert on these)."""

    def __init__(self, items):
        self.items = list(items)
        self.calls: list[int] = []  # the most items each lease call asked for
        self.released, self.acked, self.renewed = [], [], []
        self.term = 1

    def start_term(self, credential, holder):
        return Fence(holder, self.term)

    def lease(self, credential, lease_seconds, wait_seconds, fence):
        items = self.lease_many(credential, lease_seconds, wait_seconds, fence, 1)
        return items[0] if items else None

    def lease_many(self, credential, lease_seconds, wait_seconds, fence, max_items):
        self.calls.append(max_items)
        taken, self.items = self.items[:max_items], self.items[max_items:]
        return [replace(i, fence=fence) for i in taken]

    def release(self, credential, item, error=None):
        self.released.append((item.idempotency_key, error))
        return "released"

    def ack(self, credential, item):
        self.acked.append(item.idempotency_key)

    def renew_lease(self, credential, item, lease_seconds):
        self.renewed.append(item.idempotency_key)


class Executor:
    """Each item runs until the test finishes it (`finish`); records what ran and the most that ran at once."""

    def __init__(self):
        self.running: dict[str, asyncio.Event] = {}
        self.ran: list[str] = []
        self.most = 0

    async def execute(self, item, leader=None):
        self.ran.append(item.idempotency_key)
        done = self.running[item.idempotency_key] = asyncio.Event()
        self.most = max(self.most, len(self.running))
        try:
            await done.wait()
        finally:
            del self.running[item.idempotency_key]
        return "executed"

    def finish(self, *keys):
        for key in keys or list(self.running):
            self.running[key].set()

    async def after_ack(self, item):
        pass


def item(n, key, **payload):
    return WorkItem(n, key, payload, f"lease-{n}", 1)


async def direct(fn, *args, **kwargs):
    return fn(*args, **kwargs)


async def refused():
    raise AssertionError("never refused here")


async def start(control_plane, executor, *, gpus=None, max_in_flight=0, lease_seconds=30.0, run_blocking=direct):
    clock = ManualClock()
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), executor, clock=clock,
                             health=HealthRegistry(clock, ["queues"]), metrics=AgentMetrics(),
                             lease_seconds=lease_seconds, poll_interval=1.0, on_refused=refused,
                             run_blocking=run_blocking, max_in_flight=max_in_flight)

    if gpus is not None:
        await consumer.set_gpus(gpus)
    await consumer.set_open(True, "")
    task = asyncio.ensure_future(consumer.run())
    await clock.settle()
    return consumer, clock, task


async def test_sixteen_gpus_run_sixteen_one_gpu_items_at_once_leased_in_one_call():
    control_plane, executor = ControlPlane([item(n, f"k{n}") for n in range(20)]), Executor()
    consumer, clock, task = await start(control_plane, executor, gpus=16)
    assert len(executor.running) == 16 and control_plane.calls == [16]  # one call filled every slot
    assert consumer.health.get("queues").details["inFlight"] == 16
    executor.finish("k0", "k1")
    await clock.settle()
    assert control_plane.calls == [16, 2] and len(executor.running) == 16  # the two places refilled at once
    for _ in range(10):
        executor.finish()
        await clock.advance(1.0)
    assert sorted(control_plane.acked) == sorted(f"k{n}" for n in range(20)) and executor.most == 16
    assert len(executor.ran) == 20 and not control_plane.released
    task.cancel()


async def test_each_item_in_flight_renews_its_own_lease():
    control_plane, executor = ControlPlane([item(1, "a"), item(2, "b"), item(3, "c")]), Executor()
    _, clock, task = await start(control_plane, executor, gpus=4, lease_seconds=30.0)
    await clock.advance(10.0)  # a third of the lease
    assert sorted(control_plane.renewed) == ["a", "b", "c"]
    executor.finish("b")
    await clock.advance(10.0)
    assert sorted(control_plane.renewed) == ["a", "a", "b", "c", "c"]  # b's renewals stopped with it
    task.cancel()


async def test_pausing_stops_new_leases_while_running_items_finish_and_are_acked():
    control_plane = ControlPlane([item(1, "a"), item(2, "b", gpus=2), item(3, "c"), item(4, "d")])
    executor = Executor()
    consumer, clock, task = await start(control_plane, executor, gpus=2, max_in_flight=2)
    assert sorted(executor.running) == ["a"] and control_plane.calls == [2]  # b waits for its second GPU
    await consumer.set_open(False, "shutting down")
    await clock.settle()
    assert control_plane.released == [("b", None)]  # not started: back without an attempt counted
    executor.finish("a")
    await clock.advance(5.0)
    assert control_plane.acked == ["a"] and control_plane.calls == [2]  # no lease since the pause
    assert control_plane.items == [item(3, "c"), item(4, "d")]
    task.cancel()


async def test_an_item_needing_more_gpus_than_are_free_waits_without_blocking_smaller_ones_behind_it():
    control_plane = ControlPlane([item(1, "a"), item(2, "big", gpus=4), item(3, "c"), item(4, "d"), item(5, "e")])
    executor = Executor()
    consumer, clock, task = await start(control_plane, executor, gpus=4, max_in_flight=8)
    # a takes one GPU; big waits for four; c, d and e run on the three left.
    assert sorted(executor.running) == ["a", "c", "d", "e"] and "big" not in executor.ran
    assert consumer.waiting_since and clock.sleepers == [10.0] * 5  # the five renewals; nothing polls
    executor.finish("a", "c", "d")
    await clock.settle()
    assert sorted(executor.running) == ["e"]  # big still needs four; e holds one
    executor.finish("e")
    await clock.settle()
    assert sorted(executor.running) == ["big"] and not consumer.waiting_since
    executor.finish()
    await clock.advance(1.0)
    assert sorted(control_plane.acked) == ["a", "big", "c", "d", "e"] and not control_plane.released
    task.cancel()


async def test_an_item_waiting_past_the_starve_bound_stops_new_leases_until_it_has_its_gpus():
    small = [item(n, f"s{n}") for n in range(3, 40)]
    control_plane = ControlPlane([item(1, "a", gpus=1), item(2, "big", gpus=2), *small])
    executor = Executor()
    _, clock, task = await start(control_plane, executor, gpus=2, max_in_flight=4)
    assert sorted(executor.running) == ["a", "s3"]  # big waits; s3 went ahead on the GPU left
    await clock.advance(QueueConsumer.STARVE_SECONDS + 1)
    calls = len(control_plane.calls)
    executor.finish("s3")
    await clock.settle()
    assert len(control_plane.calls) == calls and "big" not in executor.running  # the freed GPU is kept for big
    executor.finish("a")
    await clock.settle()
    assert sorted(executor.running) == ["big"]  # it has both GPUs; small items lease on after it
    task.cancel()


async def test_max_in_flight_zero_follows_the_gpus_registered():
    control_plane, executor = ControlPlane([]), Executor()
    consumer, _, task = await start(control_plane, executor, gpus=16)
    assert consumer.in_flight.total == 16
    await consumer.set_gpus(8)
    assert consumer.in_flight.total == 8 and consumer.gpus.total == 8
    fixed, _, fixed_task = await start(ControlPlane([]), Executor(), gpus=16, max_in_flight=3)
    assert fixed.in_flight.total == 3
    task.cancel()
    fixed_task.cancel()


async def test_an_item_whose_term_ended_while_it_waited_for_gpus_is_released_not_run():
    control_plane = ControlPlane([item(1, "a"), item(2, "big", gpus=2)])
    executor = Executor()
    consumer, clock, task = await start(control_plane, executor, gpus=2, max_in_flight=2)
    assert sorted(executor.running) == ["a"]
    consumer.new_term()  # lost the lead and regained it: big's lease belongs to the old term
    executor.finish("a")
    await clock.settle()
    assert ("big", None) in control_plane.released and "big" not in executor.ran
    task.cancel()


async def test_a_redelivery_of_an_item_whose_earlier_delivery_still_runs_here_waits_for_it():
    """Found by the simulation (seed 100150): term 1's delivery of an item hangs in its Pod create; the agent
    leads again under term 2, which hands the item back, and leases it again. The new delivery must not run
    beside the old one (both carry this agent's Lease token: the old create could land after the new one ran
    and deleted its Pod), so it waits, its lease renewed, and runs once the old one ended."""
    control_plane, executor = ControlPlane([item(4, "item-3")]), Executor()
    consumer, clock, task = await start(control_plane, executor, gpus=8, max_in_flight=4)
    assert list(executor.running) == ["item-3"] and executor.ran == ["item-3"]
    consumer.new_term()
    control_plane.term = 2
    control_plane.items.append(replace(item(4, "item-3"), lease_id="lease-4-again"))
    await clock.advance(1.0)  # the leasing loop's idle poll: it leases the redelivery
    assert control_plane.items == [] and executor.ran == ["item-3"]  # leased, and waiting
    await clock.advance(10.0)
    assert control_plane.renewed.count("item-3") == 2  # both deliveries' leases kept meanwhile
    executor.finish("item-3")
    await clock.settle()
    assert executor.ran == ["item-3", "item-3"]  # the redelivery runs only now (and would adopt the old Pod)
    executor.finish("item-3")
    await clock.settle()
    assert control_plane.acked == ["item-3", "item-3"]
    task.cancel()


async def test_items_leased_while_the_places_shrank_are_released_and_no_more_run_than_there_are_places():
    """A long-polled lease call asks for the four places free; while it waits at the server two GPUs go (maxInFlight
    0: the places follow them). The two items past the places are released back, the two others run, and the
    count of places held stays true through their ends (issue 49)."""
    control_plane, executor = ControlPlane([item(n, f"k{n}") for n in range(4)]), Executor()
    answer = asyncio.Event()  # the server's answer to the long-polled lease call

    async def long_polled(fn, *args, **kwargs):
        if fn.__name__ == "lease_many":
            await answer.wait()
        return fn(*args, **kwargs)

    consumer, clock, task = await start(control_plane, executor, gpus=4, run_blocking=long_polled)
    await consumer.set_gpus(2)
    answer.set()
    await clock.settle()
    assert control_plane.calls == [4], "the call asked for the places free when it was made"
    assert sorted(executor.running) == ["k0", "k1"] and sorted(executor.ran) == ["k0", "k1"]
    assert sorted(key for key, _ in control_plane.released) == ["k2", "k3"]
    assert consumer.in_flight.held == 2 and consumer.health.get("queues").details["inFlight"] == 2
    executor.finish("k0")
    await clock.settle()
    assert consumer.in_flight.held == 1 and consumer.health.get("queues").details["inFlight"] == 1
    executor.finish()
    await clock.advance(1.0)
    assert sorted(control_plane.acked) == ["k0", "k1"] and consumer.in_flight.held == 0
    task.cancel()
