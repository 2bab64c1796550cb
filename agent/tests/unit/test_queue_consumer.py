"""The queue consumer against a scripted control plane: an item whose executor fails goes back
with its reason (the control plane counts the attempt and holds it back), and the consumer goes
straight on to the next item."""

from typing import ClassVar

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import Fence, Fenced, Unavailable, WorkItem
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.mechanisms.queues.consumer import QueueConsumer


class ScriptedControlPlane:
    """Hands out `items` in order; records what comes back (the test asserts on these records)."""

    def __init__(self, items):
        self.items = list(items)
        self.released, self.acked = [], []

    def start_term(self, credential, holder):
        return Fence(holder, 1)

    def lease(self, credential, lease_seconds, wait_seconds, fence):
        return self.items.pop(0) if self.items else None

    def release(self, credential, item, error=None):
        self.released.append((item.idempotency_key, error))

    def ack(self, credential, item):
        self.acked.append(item.idempotency_key)

    def renew_lease(self, credential, item, lease_seconds):
        pass


class Executor:
    def __init__(self):
        self.ran = []

    async def execute(self, item, leader=None):
        self.ran.append(item.idempotency_key)
        if item.payload.get("poison"):
            raise RuntimeError("creating pod ns/gpu-work-poison failed: 422 Unprocessable Entity")
        return "executed"

    async def after_ack(self, item):
        pass


def item(n, key, **payload):
    return WorkItem(n, key, payload, f"lease-{n}", 1)


async def test_a_failing_item_goes_back_with_its_reason_and_the_next_item_runs_at_once():
    control_plane = ScriptedControlPlane([item(1, "poison", poison=True), item(2, "good")])
    executor = Executor()
    metrics = AgentMetrics()

    async def refused():
        raise AssertionError("never refused here")

    clock = ManualClock()
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), executor, clock=clock,
                             health=HealthRegistry(clock, ["queues"]), metrics=metrics,
                             lease_seconds=30.0, poll_interval=1.0, on_refused=refused)
    await consumer.set_open(True, "")
    assert await consumer.step() and await consumer.step()
    assert control_plane.released == [("poison", "creating pod ns/gpu-work-poison failed: 422 Unprocessable Entity")]
    assert control_plane.acked == ["good"] and executor.ran == ["poison", "good"]
    assert metrics.items.labels("failed")._value.get() == 1


async def test_a_late_fenced_answer_about_an_older_term_does_not_fence_the_term_held_now():
    """This agent leased an item under term 1, lost the lead and got it back (term 3) while the item
    ran; the item's ack, made under term 1, is refused as fenced. The agent keeps leasing under term 3
    (it stopped for good when any fenced answer fenced it)."""
    import asyncio
    from dataclasses import replace

    running, finish = asyncio.Event(), asyncio.Event()
    terms = iter([1, 3])

    class Regained(ScriptedControlPlane):
        def start_term(self, credential, holder):
            return Fence(holder, next(terms))

        def lease(self, credential, lease_seconds, wait_seconds, fence):
            item = super().lease(credential, lease_seconds, wait_seconds, fence)
            return replace(item, fence=fence) if item else None

        def ack(self, credential, item):
            if item.fence.term != 3:
                raise Fenced("409 fenced: term 3 (holder a) is the current term", 409)
            super().ack(credential, item)

    class Blocking(Executor):
        async def execute(self, item, leader=None):
            if item.idempotency_key == "long":
                running.set()
                await asyncio.wait_for(finish.wait(), 10)
            return await super().execute(item)

    control_plane = Regained([item(1, "long"), item(2, "next")])

    async def refused():
        raise AssertionError("never refused here")

    clock = ManualClock()
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), Blocking(), clock=clock,
                             health=HealthRegistry(clock, ["queues"]), metrics=AgentMetrics(),
                             lease_seconds=30.0, poll_interval=1.0, on_refused=refused)
    await consumer.set_open(True, "")
    first = asyncio.ensure_future(consumer.step())
    for _ in range(500):  # poll to a deadline: the long item is running
        if running.is_set():
            break
        await asyncio.sleep(0.01)
    assert running.is_set()
    consumer.new_term()  # lost the lead and regained it meanwhile
    assert await consumer._term(Secret("credential-0123456789")) == Fence("gpu-agent", 3)
    finish.set()
    assert await first
    assert consumer.fenced_by == "" and consumer.active
    assert await consumer.step()  # leases on under term 3
    assert control_plane.acked == ["next"]


async def test_an_ack_whose_answer_was_lost_is_sent_again_and_the_items_pod_is_deleted():
    import asyncio

    class LostAnswer(ScriptedControlPlane):
        """The first ack lands but its answer is lost (a timeout); the second is answered."""
        acks = 0

        def ack(self, credential, item):
            LostAnswer.acks += 1
            super().ack(credential, item)
            if LostAnswer.acks == 1:
                raise Unavailable("POST /v1/queue/items/1/ack: timed out after 10s")

    class Deleting(Executor):
        deleted: ClassVar[list] = []

        async def after_ack(self, item):
            self.deleted.append(item.idempotency_key)

    control_plane, executor = LostAnswer([item(1, "a")]), Deleting()

    async def refused():
        raise AssertionError("never refused here")

    clock = ManualClock()
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), executor, clock=clock,
                             health=HealthRegistry(clock, ["queues"]), metrics=AgentMetrics(),
                             lease_seconds=30.0, poll_interval=1.0, on_refused=refused)
    await consumer.set_open(True, "")
    stepping = asyncio.ensure_future(consumer.step())
    for _ in range(100):  # the retry waits on the injected clock
        if stepping.done():
            break
        await clock.advance(0.5)
    assert await stepping
    assert LostAnswer.acks == 2 and executor.deleted == ["a"]


async def test_a_consumer_fenced_while_it_holds_the_lease_starts_a_term_of_its_own_again():
    """A deposed leader's late start_term (term 2) lands after this leader's (term 1): while the Lease
    says this agent leads, it starts a newer term after a poll and leases on (it stopped for good)."""
    from dataclasses import replace

    from gpu_agent.foundations.fencing import LeaderToken

    terms = iter([1, 3])

    class LateTerm(ScriptedControlPlane):
        def start_term(self, credential, holder):
            return Fence(holder, next(terms))

        def lease(self, credential, lease_seconds, wait_seconds, fence):
            if fence.term == 1:
                raise Fenced("409 fenced: term 2 (holder b) is the current term", 409)
            item = super().lease(credential, lease_seconds, wait_seconds, fence)
            return replace(item, fence=fence) if item else None

    async def refused():
        raise AssertionError("never refused here")

    control_plane, clock = LateTerm([item(1, "a")]), ManualClock()
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), Executor(), clock=clock,
                             health=HealthRegistry(clock, ["queues"]), metrics=AgentMetrics(),
                             lease_seconds=30.0, poll_interval=1.0, on_refused=refused)
    consumer.new_term(LeaderToken("gpu-agent", "uid", 4))
    await consumer.set_open(True, "")
    assert not await consumer.step()  # fenced under term 1
    assert consumer.active and consumer.terms_restarted == 1
    assert await consumer.step()  # term 3 started; leased and acked
    assert control_plane.acked == ["a"] and consumer.fence.term == 3

    # Without a Lease (no leader election) nothing says this agent should lead: fenced for good.
    terms = iter([1])
    alone = QueueConsumer(LateTerm([item(2, "b")]), lambda: Secret("credential-0123456789"), Executor(), clock=clock,
                          health=HealthRegistry(clock, ["queues"]), metrics=AgentMetrics(),
                          lease_seconds=30.0, poll_interval=1.0, on_refused=refused)
    alone.new_term()
    await alone.set_open(True, "")
    assert not await alone.step() and not alone.active and not await alone.step()


async def test_an_attempt_the_infrastructure_prevented_goes_back_without_counting_and_after_a_poll():
    import asyncio

    from gpu_agent.mechanisms.queues.executor import AttemptNotMade

    class Outage(Executor):
        async def execute(self, item, leader=None):
            self.ran.append(item.idempotency_key)
            raise AttemptNotMade("creating pod ns/p got no answer 3 times")

    async def refused():
        raise AssertionError("never refused here")

    control_plane, clock = ScriptedControlPlane([item(1, "a")]), ManualClock()
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), Outage(), clock=clock,
                             health=HealthRegistry(clock, ["queues"]), metrics=AgentMetrics(),
                             lease_seconds=30.0, poll_interval=1.0, on_refused=refused)
    await consumer.set_open(True, "")
    stepping = asyncio.ensure_future(consumer.step())
    await clock.settle()
    assert control_plane.released == [("a", None)]  # no error: the control plane counts no attempt
    assert consumer.health.get("queues").details["notTried"] == "creating pod ns/p got no answer 3 times"
    assert not stepping.done() and clock.sleepers[0] == 1.0  # waits a poll before leasing again
    await clock.advance(1.0)
    assert await stepping


async def test_an_item_whose_last_attempt_failed_is_counted_in_healthz_and_the_metric():
    class LastAttempt(ScriptedControlPlane):
        def release(self, credential, item, error=None):
            super().release(credential, item, error)
            return "failed"  # the control plane's answer: no attempt left

    async def refused():
        raise AssertionError("never refused here")

    clock, metrics = ManualClock(), AgentMetrics()
    health = HealthRegistry(clock, ["queues"])
    consumer = QueueConsumer(LastAttempt([item(1, "poison", poison=True)]), lambda: Secret("credential-0123456789"),
                             Executor(), clock=clock, health=health, metrics=metrics,
                             lease_seconds=30.0, poll_interval=1.0, on_refused=refused)
    await consumer.set_open(True, "")
    assert await consumer.step()
    details = health.get("queues").details
    assert details["failedAttempts"] == 1 and details["failedItems"] == 1
    assert metrics.items.labels("gave-up")._value.get() == 1 and metrics.items.labels("failed")._value.get() == 1


async def test_healthz_active_is_decided_when_asked_so_a_resumed_process_never_serves_a_stale_lead():
    """A process resumed after a SIGSTOP answers /healthz before its event loop has noticed that its
    lease ran out; `active` is asked of the elector's clock at that moment, and no lease is taken."""
    async def refused():
        raise AssertionError("never refused here")

    clock, health = ManualClock(), HealthRegistry(ManualClock(), ["queues"])
    control_plane = ScriptedControlPlane([item(1, "a")])
    lease_held = [True]
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), Executor(), clock=clock, health=health,
                             metrics=AgentMetrics(), lease_seconds=30.0, poll_interval=1.0, on_refused=refused,
                             still_leading=lambda: lease_held[0])
    await consumer.set_open(True, "")
    def gauge():
        return consumer.metrics.active.collect()[0].samples[0].value

    assert health.snapshot()["active"] is True and gauge() == 1
    lease_held[0] = False  # the renew deadline passed while the process was stopped
    assert health.snapshot()["active"] is False and gauge() == 0
    assert not await consumer.step() and control_plane.items  # nothing leased on a stale belief


async def test_a_refused_work_path_leases_nothing_until_a_dry_run_proves_it_and_after_the_bound_is_not_ready():
    """An item's Pod refused for a reason not the item's (here the fencing policy finding no fence): the item
    goes back uncounted, nothing is leased while the probe says no, the queues turn NotReady with the probe's
    reason once PATH_BOUND has passed (an Event through on_path, the metric set), and the first proof turns
    them back and the waiting item runs."""
    from gpu_agent.foundations.fencing import LeaderToken
    from gpu_agent.mechanisms.queues.executor import WorkPathRefused

    control_plane = ScriptedControlPlane([item(1, "refused"), item(2, "after")])
    problems = ["", "no fence yet", "no fence yet", "no fence yet", ""]  # the probe's answers, in order
    probes, told = [], []

    class Refusing(Executor):
        async def execute(self, item, leader=None):
            self.ran.append(item.idempotency_key)
            if item.idempotency_key == "refused" and len(self.ran) == 1:
                raise WorkPathRefused("creating pod ns/x was refused: 422: no params found")
            return "executed"

    async def check_path(leader):
        probes.append(leader)
        return problems.pop(0)

    async def refused():
        raise AssertionError("never refused here")

    clock, metrics = ManualClock(), AgentMetrics()
    health = HealthRegistry(clock, ["queues"])
    executor = Refusing()
    consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), executor, clock=clock,
                             health=health, metrics=metrics, lease_seconds=30.0, poll_interval=1.0, on_refused=refused,
                             check_path=check_path, on_path=lambda ok, why: told.append((ok, why)))
    me = LeaderToken("a", "uid", 1)
    consumer.new_term(me)
    await consumer.set_open(True, "")

    def queues():
        return health.snapshot()["components"]["queues"]

    async def stepped():  # a refused item waits a poll interval on the clock before its place is free
        import asyncio
        task = asyncio.ensure_future(consumer.step())
        for _ in range(10):
            await asyncio.sleep(0)
        if not task.done():
            await clock.advance(1.0)
        return await task

    assert await stepped()  # proven (the first ""), leased, its Pod refused: released uncounted
    assert control_plane.released == [("refused", None)] and probes == [me]
    assert queues()["ready"] and "proving the work path" in queues()["reason"]
    assert not await consumer.step() and len(probes) == 2  # "no fence yet": nothing leased
    assert control_plane.items == [item(2, "after")] and queues()["ready"]
    await clock.advance(consumer.PATH_BOUND)
    assert not await consumer.step()
    assert not queues()["ready"] and queues()["reason"] == "work pods refused: no fence yet", queues()
    assert told == [(False, "no fence yet")] and metrics.work_path_down._value.get() == 1
    assert metrics.work_path_refusals._value.get() == 3  # the real refusal and two dry runs
    assert not await consumer.step()  # still refused: still NotReady, told once
    assert told == [(False, "no fence yet")] and control_plane.items == [item(2, "after")]
    assert metrics.work_path_refusals._value.get() == 4
    assert await consumer.step()  # proven: leasing again, Ready, told
    assert control_plane.acked == ["after"] and queues()["ready"] and queues()["reason"] == "leasing work"
    assert told[-1] == (True, "work pods admitted again") and metrics.work_path_down._value.get() == 0


async def test_a_new_term_proves_its_own_path_afresh_and_a_check_that_raises_or_outlives_its_term_proves_nothing():
    """A leadership that was NotReady for a refused path, then a new term: Ready while it proves its own (no Event of
    the old one's); a check that raises is a problem, not the agent's end; an answer that comes after the term
    changed is dropped (it was about the old token)."""
    import asyncio

    from gpu_agent.foundations.fencing import LeaderToken

    answers: list = []
    told = []
    gate = asyncio.Event()

    async def check_path(leader):
        answer = answers.pop(0)
        if answer == "slow":
            await gate.wait()
            return ""
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def refused():
        raise AssertionError("never refused here")

    clock, health = ManualClock(), HealthRegistry(ManualClock(), ["queues"])
    consumer = QueueConsumer(ScriptedControlPlane([item(1, "one")]), lambda: Secret("credential-0123456789"),
                             Executor(), clock=clock, health=health, metrics=AgentMetrics(), lease_seconds=30.0,
                             poll_interval=1.0, on_refused=refused, check_path=check_path,
                             on_path=lambda ok, why: told.append((ok, why)))

    def queues():
        return health.snapshot()["components"]["queues"]

    consumer.new_term(LeaderToken("a", "uid", 1))
    await consumer.set_open(True, "")
    answers[:] = ["refused", "refused"]
    assert not await consumer.step()
    await clock.advance(consumer.PATH_BOUND)
    assert not await consumer.step() and not queues()["ready"] and told == [(False, "refused")]

    consumer.new_term(LeaderToken("a", "uid", 2))  # led again: its own path, proven afresh
    assert queues()["ready"] and told == [(False, "refused")], queues()
    answers[:] = [RuntimeError("API server gone")]
    assert not await consumer.step() and "checking the work path failed: API server gone" in queues()["reason"]

    answers[:] = ["slow"]
    stepping = asyncio.ensure_future(consumer.step())
    for _ in range(5):
        await asyncio.sleep(0)
    consumer.new_term(LeaderToken("a", "uid", 3))  # the term changes while its check is out
    gate.set()
    assert not await stepping and not consumer.path_proven  # the answer about term 2 proves nothing for term 3


async def test_a_release_that_got_no_answer_is_sent_again_so_the_item_does_not_wait_out_its_lease():
    """The control plane closes a keep-alive connection idle for its timeout; a release sent on a pooled one as it
    closes gets no answer. Sent again after RELEASE_RETRIES[0]: the item is back at once, not after leaseSeconds.
    A try that landed although its answer was lost makes the next one answered 409: nothing more is sent."""
    import asyncio

    from gpu_agent.foundations.control_plane_client import Rejected
    from gpu_agent.mechanisms.queues.executor import AttemptNotMade

    class LostAnswers(ScriptedControlPlane):
        def __init__(self, items, script):
            super().__init__(items)
            self.script, self.tries = list(script), []

        def release(self, credential, item, error=None):
            self.tries.append(item.idempotency_key)
            what = self.script.pop(0) if self.script else "answered"
            if what in ("landed", "answered"):
                super().release(credential, item, error)
            if what in ("lost", "landed"):
                raise Unavailable("POST /v1/queue/items/1/release: connection failed (ConnectionError)")
            if what == "stale":
                raise Rejected("POST /v1/queue/items/1/release: 409 that lease is no longer the current lease", 409)

    class Outage(Executor):
        async def execute(self, item, leader=None):
            raise AttemptNotMade("creating pod ns/p got no answer 3 times")

    async def refused():
        raise AssertionError("never refused here")

    for script, released, tries in ((["lost", "answered"], [("a", None)], 2),  # the first never reached it
                                    (["landed", "stale"], [("a", None)], 2)):  # the first landed: given back once
        control_plane, clock = LostAnswers([item(1, "a")], script), ManualClock()
        consumer = QueueConsumer(control_plane, lambda: Secret("credential-0123456789"), Outage(), clock=clock,
                                 health=HealthRegistry(clock, ["queues"]), metrics=AgentMetrics(),
                                 lease_seconds=30.0, poll_interval=1.0, on_refused=refused)
        await consumer.set_open(True, "")
        stepping = asyncio.ensure_future(consumer.step())
        await clock.settle()
        assert control_plane.tries == ["a"] and clock.sleepers[0] == consumer.RELEASE_RETRIES[0], script
        await clock.advance(consumer.RELEASE_RETRIES[0])
        assert (control_plane.released, len(control_plane.tries)) == (released, tries), script
        await clock.advance(1.0)  # the poll after an attempt not made
        assert await stepping
        assert len(control_plane.tries) == tries, script  # nothing sent after the 409
