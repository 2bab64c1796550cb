"""What the queue consumer tells and sends (mechanisms/queues/consumer.py, issue 49): its `queues` entry in /healthz
and the paused metric from the start through pause, standby and fencing; the credential, lease length and long
poll of every call to the control plane; the renewals, acks and releases that get no answer or are refused; the
sweep of finished items' Pods; and how leased items take places and GPUs. The control plane is called directly (no
threads) and time is a ManualClock, as in test_consumer_in_flight.py."""

import asyncio
from dataclasses import replace

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import Fence, Fenced, Rejected, Unavailable, WorkItem
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.mechanisms.queues.consumer import QueueConsumer
from gpu_agent.mechanisms.queues.executor import AttemptNotMade, WorkPathRefused

CREDENTIAL = Secret("credential-0123456789")


class ControlPlane:
    """Hands out `items` (each carrying the term it was leased under); records every call with its arguments.
    `faults[call]`: what each next call of that name raises (None: answered)."""

    def __init__(self, items=()):
        self.items = list(items)
        self.calls: list[tuple] = []
        self.acked, self.released, self.renewed = [], [], []
        self.faults: dict[str, list] = {}
        self.states: dict[int, str] = {}

    def _fault(self, name):
        script = self.faults.get(name)
        if script:
            fault = script.pop(0)
            if fault is not None:
                raise fault

    def start_term(self, credential, holder):
        self.calls.append(("start_term", credential, holder))
        return Fence(holder, 1)

    def lease(self, credential, lease_seconds, wait_seconds, fence):
        self.calls.append(("lease", credential, lease_seconds, wait_seconds))
        self._fault("lease")
        return replace(self.items.pop(0), fence=fence) if self.items else None

    def lease_many(self, credential, lease_seconds, wait_seconds, fence, max_items):
        self.calls.append(("lease_many", credential, lease_seconds, wait_seconds, max_items))
        taken, self.items = self.items[:max_items], self.items[max_items:]
        return [replace(i, fence=fence) for i in taken]

    def release(self, credential, item, error=None):
        self.calls.append(("release", credential))
        self._fault("release")
        self.released.append((item.idempotency_key, error))
        return "released"

    def ack(self, credential, item):
        self.calls.append(("ack", credential))
        self._fault("ack")
        self.acked.append(item.idempotency_key)

    def renew_lease(self, credential, item, lease_seconds):
        self.calls.append(("renew", credential, lease_seconds))
        self._fault("renew")
        self.renewed.append(item.idempotency_key)

    def item_state(self, credential, item_id):
        self.calls.append(("item_state", credential, item_id))
        state = self.states[item_id]
        if isinstance(state, Exception):
            raise state
        return state


class Executor:
    """Runs each item at once (or raises what `fail[key]` says); records the leader each ran under."""

    def __init__(self, fail=None):
        self.fail = dict(fail or {})
        self.ran, self.leaders, self.after = [], [], []

    async def execute(self, item, leader=None):
        self.ran.append(item.idempotency_key)
        self.leaders.append(leader)
        if item.idempotency_key in self.fail:
            raise self.fail[item.idempotency_key]
        return "executed"

    async def after_ack(self, item):
        self.after.append(item.idempotency_key)


class Held(Executor):
    """Each item runs until the test finishes it."""

    def __init__(self):
        super().__init__()
        self.running: dict[str, asyncio.Event] = {}

    async def execute(self, item, leader=None):
        await super().execute(item, leader)
        done = self.running[item.idempotency_key] = asyncio.Event()
        try:
            await done.wait()
        finally:
            del self.running[item.idempotency_key]
        return "executed"

    def finish(self, *keys):
        for key in keys or list(self.running):
            self.running[key].set()


def item(n, key, **payload):
    return WorkItem(n, key, payload, f"lease-{n}", 1)


async def direct(fn, *args, **kwargs):
    return fn(*args, **kwargs)


async def refused():
    raise AssertionError("never refused here")


def consumer_of(control_plane, executor, *, clock=None, credential=lambda: CREDENTIAL, **kwargs):
    clock = clock or ManualClock()
    return QueueConsumer(control_plane, credential, executor, clock=clock, health=HealthRegistry(clock, ["queues"]),
                         metrics=AgentMetrics(), lease_seconds=30.0, poll_interval=1.0, on_refused=refused,
                         run_blocking=direct, **kwargs)


def queues(consumer):
    return consumer.health.snapshot()["components"]["queues"]


def details(consumer):
    return consumer.health.get("queues").details


async def settled_step(consumer, clock):
    task = asyncio.ensure_future(consumer.step())
    for _ in range(20):
        if task.done():
            break
        await clock.advance(1.0)
    return await task


# --- /healthz and the paused metric ----------------------------------------------------------------------------

async def test_a_new_consumer_is_paused_waiting_for_its_inputs_with_nothing_counted_and_opening_it_leases_work():
    told = []

    async def check_path(leader):
        return ""

    consumer = consumer_of(ControlPlane(), Executor(), check_path=check_path, on_path=lambda ok, why: told.append(ok))
    assert not consumer.active and queues(consumer)["ready"] is False
    assert queues(consumer)["reason"] == "paused: waiting for GPUs, registration and credentials"
    assert details(consumer) == {"processed": 0, "inFlight": 0, "maxInFlight": 1, "failedAttempts": 0,
                                 "failedItems": 0, "term": 0}  # no notTried: nothing was refused
    await consumer.set_open(True, "")
    assert consumer.active and queues(consumer)["ready"] and queues(consumer)["reason"] == "leasing work"
    assert consumer.metrics.queue_paused._value.get() == 0 and told == []  # nothing to tell: the path was never down


async def test_paused_is_not_ready_with_its_reason_a_standby_is_ready_and_a_fenced_consumer_says_it_is_fenced():
    control_plane = ControlPlane()
    consumer = consumer_of(control_plane, Executor())
    await consumer.set_open(True, "")
    await consumer.set_open(False, "shutting down")
    assert queues(consumer) | {"since": None} == queues(consumer) | {"since": None, "ready": False,
                                                                      "reason": "paused: shutting down"}
    assert consumer.metrics.queue_paused._value.get() == 1
    await consumer.set_open(False, "another agent leads", standby=True)
    assert queues(consumer)["ready"] and queues(consumer)["reason"] == "paused: another agent leads"
    await consumer.set_open(True, "")
    await consumer.set_open(False, "registration lost")  # not standby unless said so
    assert not queues(consumer)["ready"] and queues(consumer)["reason"] == "paused: registration lost"

    await consumer.set_open(True, "")
    consumer.fence = Fence("gpu-agent", 1)
    consumer._fenced(Fenced("409 fenced: term 2", 409), consumer.fence)  # no Lease: fenced until new_term()
    fenced = "paused: fenced: another agent holds a newer term at the control plane"
    assert not queues(consumer)["ready"] and queues(consumer)["reason"] == fenced
    await consumer.set_open(False, "another agent leads", standby=True)  # a standby says why it waits, not the fence
    assert queues(consumer)["ready"] and queues(consumer)["reason"] == "paused: another agent leads"


async def test_healthz_counts_terms_items_done_failed_and_why_one_could_not_be_tried_until_one_runs():
    boom = ValueError()  # no message: the release names its type
    long_reason = "x" * 400
    control_plane = ControlPlane([item(1, "ok"), item(2, "bad"), item(3, "worse"), item(4, "outage"), item(5, "ok2")])
    control_plane.release = lambda credential, it, error=None: (control_plane.released.append((it.idempotency_key, error)),
                                                                  "failed")[1]
    executor = Executor(fail={"bad": boom, "worse": RuntimeError("no"), "outage": AttemptNotMade(long_reason)})
    clock = ManualClock()
    consumer = consumer_of(control_plane, executor, clock=clock)
    await consumer.set_open(True, "")
    assert await settled_step(consumer, clock)
    assert details(consumer)["processed"] == 1 and details(consumer)["term"] == 1
    assert consumer.metrics.items.labels("executed")._value.get() == 1
    assert await settled_step(consumer, clock) and await settled_step(consumer, clock)
    assert control_plane.released == [("bad", "ValueError"), ("worse", "no")]
    assert details(consumer)["failedAttempts"] == 2 and details(consumer)["failedItems"] == 2
    assert await settled_step(consumer, clock)
    assert details(consumer)["notTried"] == "x" * 300
    assert await settled_step(consumer, clock)
    assert "notTried" not in details(consumer) and details(consumer)["processed"] == 2


async def test_a_plain_attempt_not_made_leaves_the_work_path_alone_and_a_refused_one_names_the_refusal():
    probes = []

    async def check_path(leader):
        probes.append(leader)
        return ""

    clock = ManualClock()
    control_plane = ControlPlane([item(1, "outage"), item(2, "refused"), item(3, "fine")])
    executor = Executor(fail={"outage": AttemptNotMade("no answer"), "refused": WorkPathRefused("quota exceeded")})
    consumer = consumer_of(control_plane, executor, clock=clock, check_path=check_path)
    token = LeaderToken("a", "uid", 1)
    consumer.new_term(token)
    await consumer.set_open(True, "")
    assert queues(consumer)["reason"] == "leasing work"  # a new term has no problem before its first probe
    assert await settled_step(consumer, clock)
    assert consumer.metrics.work_path_refusals._value.get() == 0 and consumer.path_proven  # proven once, kept
    assert queues(consumer)["reason"] == "leasing work"
    assert await settled_step(consumer, clock)
    assert queues(consumer)["reason"] == "proving the work path: quota exceeded"
    assert await settled_step(consumer, clock)
    assert probes == [token, token] and executor.leaders == [token] * 3  # one probe per refusal, the token to each


async def test_a_consumer_fenced_twice_while_it_holds_the_lease_counts_both_restarts():
    consumer = consumer_of(ControlPlane(), Executor())
    consumer.new_term(LeaderToken("a", "uid", 1))
    for term in (1, 2):
        consumer.fence = Fence("gpu-agent", term)
        consumer._fenced(Fenced("409 fenced", 409), consumer.fence)
    assert consumer.terms_restarted == 2 and not consumer.fenced_by


# --- what each call sends ------------------------------------------------------------------------------------------

async def test_every_call_carries_the_credential_the_lease_length_and_the_long_poll_and_renewals_the_current_credential():
    current = [CREDENTIAL]
    control_plane = ControlPlane([item(1, "a")])
    executor = Held()
    clock = ManualClock()
    consumer = consumer_of(control_plane, executor, clock=clock, credential=lambda: current[0])
    await consumer.set_open(True, "")
    stepping = asyncio.ensure_future(consumer.step())
    await clock.settle()
    assert control_plane.calls[:2] == [("start_term", CREDENTIAL, "gpu-agent"), ("lease", CREDENTIAL, 30.0, 0.0)]
    newer = Secret("credential-rotated-987654")
    current[0] = newer
    await clock.advance(10.0)
    current[0] = None  # the credential is gone for now: the one the item was leased with renews it
    await clock.advance(10.0)
    assert [c for c in control_plane.calls if c[0] == "renew"] == [("renew", newer, 30.0), ("renew", CREDENTIAL, 30.0)]
    executor.finish()
    assert await stepping
    assert control_plane.calls[-1] == ("ack", CREDENTIAL)

    many = ControlPlane([item(2, "b"), item(3, "c")])
    consumer = consumer_of(many, Executor(), long_poll=20.0, max_in_flight=2)
    await consumer.set_gpus(2)
    await consumer.set_open(True, "")
    task = asyncio.ensure_future(consumer.run())
    await clock.settle()
    assert many.calls[1] == ("lease_many", CREDENTIAL, 30.0, 20.0, 2)
    task.cancel()


async def test_a_renewal_refused_as_fenced_fences_the_term_and_stops_and_one_without_an_answer_is_tried_again():
    clock = ManualClock()
    control_plane = ControlPlane([item(1, "a")])
    control_plane.faults["renew"] = [Unavailable("timed out"), None, Fenced("409 fenced: term 2", 409)]
    executor = Held()
    consumer = consumer_of(control_plane, executor, clock=clock)
    await consumer.set_open(True, "")
    stepping = asyncio.ensure_future(consumer.step())
    await clock.advance(10.0)  # no answer: tried again at the next third
    await clock.advance(10.0)
    assert control_plane.renewed == ["a"] and consumer.active
    await clock.advance(10.0)  # refused as fenced: this agent's term is over (no Lease says it leads)
    assert not consumer.active and consumer.fenced_by
    await clock.advance(30.0)
    assert len([c for c in control_plane.calls if c[0] == "renew"]) == 3  # no renewal after the refusal
    executor.finish()
    await stepping

    other = ControlPlane([item(2, "b")])
    other.faults["renew"] = [Rejected("409 that lease is no longer the current lease", 409)]
    executor = Held()
    consumer = consumer_of(other, executor, clock=clock)
    await consumer.set_open(True, "")
    stepping = asyncio.ensure_future(consumer.step())
    await clock.advance(40.0)
    assert len([c for c in other.calls if c[0] == "renew"]) == 1 and consumer.active  # refused: not tried again
    executor.finish()
    await stepping


async def test_an_ack_refused_or_lost_and_then_refused_deletes_nothing_and_a_fenced_ack_fences_the_term():
    for faults, fenced in (([Rejected("409 that lease is no longer the current lease", 409)], False),
                           ([Unavailable("timed out"), Rejected("409 that lease is no longer the current lease", 409)],
                            False),
                           ([Fenced("409 fenced: term 2 (holder b) is the current term", 409)], True)):
        clock = ManualClock()
        control_plane = ControlPlane([item(1, "a")])
        control_plane.faults["ack"] = list(faults)
        executor = Executor()
        consumer = consumer_of(control_plane, executor, clock=clock)
        await consumer.set_open(True, "")
        assert await settled_step(consumer, clock)
        assert executor.after == [], faults  # not acknowledged: its Pod stays for the redelivery
        assert bool(consumer.fenced_by) is fenced, faults


async def test_a_release_without_an_answer_twice_is_sent_a_third_time():
    clock = ManualClock()
    control_plane = ControlPlane([item(1, "a")])
    control_plane.faults["release"] = [Unavailable("connection failed"), Unavailable("connection failed"), None]
    consumer = consumer_of(control_plane, Executor(fail={"a": AttemptNotMade("no answer")}), clock=clock)
    await consumer.set_open(True, "")
    assert await settled_step(consumer, clock)
    assert control_plane.released == [("a", None)] and len([c for c in control_plane.calls if c[0] == "release"]) == 3


# --- the sweep ------------------------------------------------------------------------------------------------------

class Sweeping(Executor):
    def __init__(self):
        super().__init__()
        self.sweeps = []

    async def sweep(self, item_state):
        self.sweeps.append([await item_state(n) for n in (1, 2)])
        return 1


async def test_the_first_lease_of_a_term_sweeps_finished_items_and_then_once_a_minute_asking_their_states():
    clock = ManualClock()
    control_plane = ControlPlane()
    control_plane.states = {1: "done", 2: Unavailable("timed out")}
    executor = Sweeping()
    consumer = consumer_of(control_plane, executor, clock=clock)
    await consumer.set_open(True, "")
    assert not await consumer.step()
    assert executor.sweeps == [["done", None]]  # a state the control plane could not say: None
    assert ("item_state", CREDENTIAL, 1) in control_plane.calls
    await clock.advance(QueueConsumer.SWEEP_SECONDS - 1)
    assert not await consumer.step() and len(executor.sweeps) == 1
    await clock.advance(1.0)  # a minute after the last
    assert not await consumer.step() and len(executor.sweeps) == 2
    consumer.new_term()  # a new leader sweeps first
    assert not await consumer.step() and len(executor.sweeps) == 3


# --- places and GPUs --------------------------------------------------------------------------------------------------

async def start(control_plane, executor, *, gpus=None, max_in_flight=0, clock=None):
    clock = clock or ManualClock()
    consumer = consumer_of(control_plane, executor, clock=clock, max_in_flight=max_in_flight)
    if gpus is not None:
        await consumer.set_gpus(gpus)
    await consumer.set_open(True, "")
    task = asyncio.ensure_future(consumer.run())
    await clock.settle()
    return consumer, clock, task


async def test_an_empty_queue_is_asked_again_after_a_poll_not_at_once():
    control_plane = ControlPlane()
    _, clock, task = await start(control_plane, Held(), gpus=1, max_in_flight=1)
    assert [c[0] for c in control_plane.calls] == ["start_term", "lease"]
    await clock.advance(1.0)
    assert [c[0] for c in control_plane.calls] == ["start_term", "lease", "lease"]
    task.cancel()


async def test_a_zero_gpu_item_takes_no_gpu_an_odd_count_takes_one_and_one_asking_more_than_there_are_takes_them_all():
    executor = Held()
    _, _, task = await start(ControlPlane([item(1, "cpu", gpus=0), item(2, "two", gpus=2)]), executor, gpus=2,
                             max_in_flight=4)
    assert sorted(executor.running) == ["cpu", "two"]
    task.cancel()

    executor = Held()
    _, _, task = await start(ControlPlane([item(1, "odd", gpus="x"), item(2, "one")]), executor, gpus=2,
                             max_in_flight=4)
    assert sorted(executor.running) == ["odd", "one"]
    task.cancel()

    executor = Held()
    _, _, task = await start(ControlPlane([item(1, "huge", gpus=4)]), executor, gpus=1, max_in_flight=4)
    assert sorted(executor.running) == ["huge"]  # waits for all of them: the one there is
    task.cancel()


async def test_the_last_free_place_is_filled_and_gpus_registered_later_start_the_leasing():
    control_plane, executor = ControlPlane([item(1, "a")]), Held()
    _, clock, task = await start(control_plane, executor, gpus=4, max_in_flight=2)
    control_plane.items.append(item(2, "b"))
    await clock.advance(1.0)  # one place of two free
    assert sorted(executor.running) == ["a", "b"]
    task.cancel()

    control_plane, executor = ControlPlane([item(1, "a"), item(2, "b")]), Held()
    consumer, clock, task = await start(control_plane, executor, gpus=0, max_in_flight=4)
    assert executor.running == {} and control_plane.calls == []
    await consumer.set_gpus(2)  # the leasing loop wakes for the GPUs alone
    await clock.settle()
    assert sorted(executor.running) == ["a", "b"]
    task.cancel()

    consumer, _, task = await start(ControlPlane(), Held(), gpus=4, max_in_flight=0)
    await consumer.set_gpus(1)
    assert details(consumer)["maxInFlight"] == 1
    await consumer.set_gpus(0)
    assert details(consumer)["maxInFlight"] == 1  # at least one place, whatever the GPUs
    task.cancel()


async def test_an_item_waiting_exactly_the_starve_bound_already_stops_new_leases():
    small = [item(n, f"s{n}") for n in range(3, 40)]
    control_plane = ControlPlane([item(1, "a"), item(2, "big", gpus=2), *small])
    executor = Held()
    _, clock, task = await start(control_plane, executor, gpus=2, max_in_flight=4)
    assert sorted(executor.running) == ["a", "s3"]
    await clock.advance(QueueConsumer.STARVE_SECONDS)

    def leases():
        return [c for c in control_plane.calls if c[0].startswith("lease")]
    before = leases()
    executor.finish("s3")
    await clock.settle()
    assert leases() == before and "big" not in executor.running
    task.cancel()


async def test_a_pause_while_the_loop_waits_for_a_place_holds_the_loop_until_the_queue_opens_again():
    control_plane, executor = ControlPlane([item(1, "a")]), Held()
    consumer, clock, task = await start(control_plane, executor, gpus=1, max_in_flight=1)
    await consumer.set_open(False, "shutting down")
    executor.finish("a")
    await clock.settle()
    assert not task.done() and control_plane.acked == ["a"]
    control_plane.items.append(item(2, "b"))
    await consumer.set_open(True, "")
    await clock.settle()
    assert sorted(executor.running) == ["b"]
    task.cancel()


async def test_a_redelivery_leased_while_its_earlier_delivery_waits_for_gpus_runs_once_that_one_was_released():
    """Term 1's delivery of `big` waits for its GPUs; the next term hands it back and the redelivery is leased and
    waits too. The GPUs freed go to the old delivery first, which finds its term over and releases the item; the
    redelivery then takes them and runs (the leasing loop lives on)."""
    control_plane, executor = ControlPlane([item(1, "a"), item(2, "big", gpus=2)]), Held()
    consumer, clock, task = await start(control_plane, executor, gpus=2, max_in_flight=4)
    assert sorted(executor.running) == ["a"]
    consumer.new_term()
    control_plane.items.append(replace(item(2, "big", gpus=2), lease_id="lease-2-again"))
    await clock.advance(1.0)
    assert control_plane.items == [] and sorted(executor.running) == ["a"]
    executor.finish("a")
    await clock.settle()
    assert ("big", None) in control_plane.released and sorted(executor.running) == ["big"] and not task.done()
    assert not consumer.waiting_since
    task.cancel()
