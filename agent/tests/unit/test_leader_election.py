"""Leader election's timing rules on a manual clock and an in-memory Lease."""

import asyncio
import logging
import random
from dataclasses import replace

import pytest

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.mechanisms.leadership.elector import ElectionSettings, LeaderElector, LeaseConflict, LeaseRecord

SETTINGS = ElectionSettings(15.0, 10.0, 2.0)


class MemoryLease:
    """One Lease record with resourceVersion semantics; a caller listed in `cut_off` gets errors, one listed in
    `read_only` errors on its writes only. `watchable`: views offer wait_released (a future resolved when the
    record is deleted or released); `watches` records each call's (version, timeout)."""

    def __init__(self, watchable=False):
        self.record = None
        self.version = 0
        self.cut_off = set()
        self.read_only = set()
        self.watches = []
        self.caller = None
        self.watchable = watchable
        self.watchers = []
        self.wakes = 0  # watchers resolved: recorded, asserted by the test

    def _check(self, who, write=False):
        if who in self.cut_off:
            raise RuntimeError(f"{who}: connection refused")
        if write and who in self.read_only:
            raise RuntimeError(f"{who}: 403 forbidden")

    def for_(self, who):
        """What `who` sees of the Lease: a backend with wait_released only when `watchable`."""
        return (WatchableView if self.watchable else View)(self, who)

    def _released(self):
        for fut in self.watchers:
            if not fut.done():
                self.wakes += 1
                fut.set_result(True)
        self.watchers = []

    def _store(self, record):
        self.version += 1
        self.record = replace(record, version=str(self.version))
        if not record.holder:
            self._released()
        return self.record


class View:
    """One caller's backend over a MemoryLease."""

    def __init__(self, lease, who):
        self.lease, self.who = lease, who

    def get(self):
        self.lease._check(self.who)
        return self.lease.record

    def create(self, record):
        self.lease._check(self.who, write=True)
        if self.lease.record is not None:
            raise LeaseConflict()
        return self.lease._store(record)

    def update(self, record):
        self.lease._check(self.who, write=True)
        if self.lease.record is None or record.version != self.lease.record.version:
            raise LeaseConflict()
        return self.lease._store(record)

    def delete(self, record):
        self.lease._check(self.who)
        if self.lease.record is None or record.version != self.lease.record.version:
            raise LeaseConflict()
        self.lease.record = None
        self.lease._released()


class WatchableView(View):
    def wait_released(self, version, timeout):
        """A future resolved when the record is deleted or released."""
        self.lease._check(self.who)
        self.lease.watches.append((version, timeout))
        fut = asyncio.get_running_loop().create_future()
        if self.lease.record is None or not self.lease.record.holder:
            fut.set_result(True)
        else:
            self.lease.watchers.append(fut)
        return fut

def callbacks(name, changed, stopped=None):
    """The elector's three callbacks, each reported to `changed(leading, reason)` as the cluster agent
    words it; `stopped(why)` hears only on_stopped_leading."""
    async def started_leading():
        await changed(True, f"leader: {name}")

    async def stopped_leading(why):
        if stopped is not None:
            stopped(why)
        await changed(False, f"standby: lost the lease ({why})")

    async def new_leader(identity):
        await changed(False, f"standby: the leader is {identity or '(nobody yet)'}")
    return {"on_started_leading": started_leading, "on_stopped_leading": stopped_leading, "on_new_leader": new_leader}


async def inline(fn, *args):
    result = fn(*args)
    return await result if asyncio.isfuture(result) else result


class Agent:
    def __init__(self, name, lease, clock, tasks, settings=SETTINGS):
        self.name = name
        self.changes = []  # (time, leading, reason): recorded, asserted by the test
        self.stops = []  # when on_stopped_leading was called
        self.clock = clock

        async def changed(leading, reason):
            self.changes.append((clock.monotonic(), leading, reason))
        self.elector = LeaderElector(lease.for_(name), identity=name, settings=settings, clock=clock, rng=random.Random(7),
                                     **callbacks(name, changed, lambda why: self.stops.append(clock.monotonic())),
                                     run_blocking=inline)
        self.task = tasks.start(self.elector.run())

    def leading_since(self):
        return [t for t, leading, _ in self.changes if leading]

    def stopped_at(self):
        return self.stops


async def run_for(clock, seconds, step=0.5):
    for _ in range(int(seconds / step)):
        await clock.advance(step)


def test_settings_that_break_the_timing_rules_are_named(tasks):
    assert ElectionSettings(15, 10, 2).problems() == []
    assert "leaderElectionRenewDeadline (15s) must be shorter than leaderElectionLeaseDuration (15s)" in \
        ElectionSettings(15, 15, 2).problems()[0]
    assert "leaderElectionRetryPeriod" in ElectionSettings(15, 10, 10).problems()[0]


async def leader_and_standby(tasks, settle: float, watchable=False):
    """agent-a leads (it started first), agent-b stands by; `settle` seconds later."""
    clock, lease = ManualClock(), MemoryLease(watchable)
    a = Agent("agent-a", lease, clock, tasks)
    await run_for(clock, 1)
    b = Agent("agent-b", lease, clock, tasks)
    await run_for(clock, settle)
    return clock, lease, a, b


async def test_one_leader_and_a_standby_that_names_it(tasks):
    _clock, lease, a, b = await leader_and_standby(tasks, 30)
    assert a.elector.leading and not b.elector.leading
    assert b.changes == [(b.changes[0][0], False, "standby: the leader is agent-a")]
    assert lease.record.holder == "agent-a" and lease.record.transitions == 0
    # renewals keep the time it was acquired (for people reading the record) and move the renew time
    assert lease.record.acquire_time == 1000.0 and lease.record.renew_time > 1030.0 - SETTINGS.retry_period * 1.2


async def test_the_loser_of_a_race_to_create_the_lease_names_the_winner_at_once(tasks):
    """Both agents find no Lease and both create it; the one refused must name the winner in its first
    report, not "(nobody yet)" until its next attempt (seen on the CI cluster with two replicas)."""
    clock, lease = ManualClock(), MemoryLease()
    b_view = lease.for_("agent-b")
    original_get = b_view.get
    gets = []

    def get_after_a_creates():
        gets.append(1)
        if len(gets) == 1:  # agent-b's first read races agent-a's create: it saw no Lease yet
            lease._store(lease_record_of("agent-a"))
            return None
        return original_get()
    b_view.get = get_after_a_creates
    changes = []

    async def changed(leading, reason):
        changes.append((leading, reason))
    elector = LeaderElector(b_view, identity="agent-b", settings=SETTINGS, clock=clock, rng=random.Random(7),
                            **callbacks("agent-b", changed), run_blocking=inline)
    tasks.start(elector.run())
    await clock.advance(0.1)
    assert changes == [(False, "standby: the leader is agent-a")]


def lease_record_of(holder):
    return LeaseRecord(holder, SETTINGS.lease_duration, 0.0, 0.0, 0)


async def test_a_leader_cut_off_stops_before_anyone_else_can_start(tasks):
    clock, lease, a, b = await leader_and_standby(tasks, 5)
    cut = clock.monotonic()
    lease.cut_off.add("agent-a")
    await run_for(clock, 40)
    (stopped,) = a.stopped_at()
    (started,) = b.leading_since()
    # The leader's last renewal was at most one retry period before the cut.
    assert cut < stopped <= cut + SETTINGS.renew_deadline
    # The standby waits a whole lease duration after it last saw the record change.
    assert started - stopped >= SETTINGS.lease_duration - SETTINGS.renew_deadline
    # ...and no longer than that after the last renewal it saw, plus one attempt's wait on either side.
    assert started <= cut + SETTINGS.lease_duration + 2 * SETTINGS.retry_period * 1.2 + 0.5
    assert lease.record.holder == "agent-b" and lease.record.transitions == 1
    assert lease.record.acquire_time == started  # a new holder's acquire time is its own, not the old holder's
    # Healed, the old leader stays a standby and names the new one.
    lease.cut_off.clear()
    await run_for(clock, 10)
    assert not a.elector.leading and a.changes[-1][2] == "standby: the leader is agent-b"


async def test_a_hung_call_cannot_keep_a_leader_past_its_deadline(tasks):
    clock, lease = ManualClock(), MemoryLease()
    hang = asyncio.Event()

    async def hanging(fn, *args):
        if hang.is_set():
            await asyncio.sleep(3600)  # real time: only wait_for's bound ends it
        return fn(*args)
    changes = []

    async def changed(leading, reason):
        changes.append((clock.monotonic(), leading))
    settings = ElectionSettings(1.5, 1.0, 0.2)
    elector = LeaderElector(lease.for_("a"), identity="a", settings=settings, clock=clock, rng=random.Random(1),
                            **callbacks("a", changed), run_blocking=hanging)
    tasks.start(elector.run())
    await clock.advance(0.1)
    assert changes == [(changes[0][0], True)]
    hang.set()
    # Each attempt is bounded by the time left before the deadline (real seconds here, at most 1 s).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while elector.leading and loop.time() < deadline:
        await clock.advance(0.2)
        await asyncio.sleep(0.05)
    assert not elector.leading


async def test_a_leader_that_shuts_down_hands_over_at_the_standbys_next_attempt(tasks):
    clock, lease, a, b = await leader_and_standby(tasks, 5)
    a.task.cancel()
    await clock.settle()
    assert lease.record is None  # released: deleted, so nothing is left behind on uninstall
    released = clock.monotonic()
    await run_for(clock, 5, step=0.1)
    (started,) = b.leading_since()
    assert started - released <= SETTINGS.retry_period * 1.2 + 0.1


async def leader_a(tasks, clock, lease, run_blocking):
    """Agent "a" on `lease`, its blocking calls through `run_blocking`, leading after 3 s: (elector, its task)."""
    async def changed(leading, reason):
        pass
    elector = LeaderElector(lease.for_("a"), identity="a", settings=SETTINGS, clock=clock, rng=random.Random(1),
                            **callbacks("a", changed), run_blocking=run_blocking)
    task = tasks.start(elector.run())
    await run_for(clock, 3)
    assert elector.leading
    return elector, task


async def test_a_leader_shut_down_while_a_renewal_lands_unheard_still_releases_the_lease(tasks):
    """The renewal in flight at shutdown reaches the server (its thread runs on after the task is cancelled) but
    its answer never reaches the elector, so the version it last saw is behind: the release must still delete
    the record, not leave it to expire (found by `make handover`: 1 in 50 graceful hand-overs waited a lease)."""
    clock, lease = ManualClock(), MemoryLease()
    unheard = asyncio.Event()
    landed = []  # versions written by renewals whose answer was lost: recorded, asserted below

    async def renewal_lands_unheard(fn, *args):
        result = fn(*args)
        if unheard.is_set() and getattr(fn, "__name__", "") == "update":
            landed.append(result.version)
            await asyncio.sleep(3600)  # the answer never comes: only the shutdown's cancel ends the wait
        return result
    elector, task = await leader_a(tasks, clock, lease, renewal_lands_unheard)
    unheard.set()
    await run_for(clock, SETTINGS.retry_period + 0.5)
    assert landed and lease.record.version == landed[-1] != elector.observed.version
    task.cancel()
    await clock.settle()
    assert lease.record is None, "the Lease was left to expire"


async def test_a_shutdown_cancel_that_meets_a_renewals_answer_in_one_turn_still_stops_and_releases(tasks):
    """The renewal's answer arrives (its thread hands it to the loop) in the same turn of the event loop as the
    shutdown's cancel. Python 3.11's asyncio.wait_for then returns the answer and drops the cancel: the elector
    renewed on, the agent's shutdown waited for it, and the kubelet killed it at the end of its grace period, the
    Lease left to expire (run 13 of 2026-12-07: the upgrade matrix's rollback left the cluster leaderless 45.3 s,
    the 30 s grace period and the 15 s lease). The cancel must stop the elector and the Lease be released."""
    clock, lease = ManualClock(), MemoryLease()
    answers = []  # the renewals' answers, held back until the test hands each over: recorded, asserted below

    async def answer_held(fn, *args):
        result = fn(*args)
        if getattr(fn, "__name__", "") != "get" or not answers_held.is_set():
            return result
        answer = asyncio.get_running_loop().create_future()
        answers.append((answer, result))
        return await answer
    answers_held = asyncio.Event()
    _, task = await leader_a(tasks, clock, lease, answer_held)
    answers_held.set()
    await run_for(clock, SETTINGS.retry_period + 0.5)
    assert answers, "no renewal read was held back"
    answer, result = answers[-1]
    answer.set_result(result)  # the answer is handed to the loop ...
    task.cancel()  # ... and the shutdown's cancel comes in the same turn
    await clock.settle()
    assert task.done(), "the elector renewed on after its cancel (the cancel was swallowed)"
    assert lease.record is None, "the Lease was left to expire"


async def test_a_leader_whose_lease_is_taken_from_under_it_stops_at_its_next_attempt_not_at_the_deadline(tasks):
    clock, lease, a, b = await leader_and_standby(tasks, 5)
    lease.record = None  # someone deletes the Lease (a person, a cleanup); the standby creates it first
    lease.cut_off.add("agent-a")
    await run_for(clock, SETTINGS.retry_period * 1.2 + 0.5, step=0.1)
    assert b.elector.leading
    taken = clock.monotonic()
    lease.cut_off.clear()
    await run_for(clock, SETTINGS.retry_period + 0.5, step=0.1)
    stopped, _lost, reason = next(c for c in a.changes if not c[1])
    assert reason == "standby: lost the lease (the lease is held by agent-b)" and a.changes[-1][2] == "standby: the leader is agent-b"
    assert stopped - taken <= SETTINGS.retry_period + 0.2 < SETTINGS.renew_deadline


async def test_a_standby_watching_the_lease_takes_over_the_moment_the_leader_releases_it(tasks):
    """A rolling update's hand-over: the old leader shuts down and releases; the standby must not
    wait out its retry period (that was up to 2.4 s with the defaults)."""
    clock, lease, a, b = await leader_and_standby(tasks, 5, watchable=True)
    assert lease.wakes == 0  # the leader's renewals (two a retry period) woke nobody
    a.task.cancel()
    await clock.settle()
    released = clock.monotonic()
    await clock.advance(0.01)
    (started,) = b.leading_since()
    assert started - released <= 0.01 and lease.wakes == 1
    assert lease.record.holder == "agent-b"


async def test_a_standby_still_takes_over_a_silent_leader_only_after_the_lease_duration_when_watching(tasks):
    clock, lease, a, b = await leader_and_standby(tasks, 5, watchable=True)
    cut = clock.monotonic()
    lease.cut_off.add("agent-a")
    await run_for(clock, 40)
    (stopped,) = a.stopped_at()
    (started,) = b.leading_since()
    assert started - stopped >= SETTINGS.lease_duration - SETTINGS.renew_deadline
    assert started > cut + SETTINGS.lease_duration - SETTINGS.retry_period


async def test_one_attempt_takes_at_most_its_limit_when_the_read_is_slow_and_the_write_hangs():
    """The read and the write of one attempt share its limit: a slow read (0.6 s) leaves the write
    only the rest, so the attempt ends by its 1 s limit (it took up to 1.6 s when each had 1 s)."""
    clock, lease = ManualClock(), MemoryLease()
    lease.for_("a").create(LeaseRecord("a", 15.0, 0.0, 0.0, 0))
    slow = {"get": 0.6, "update": 3600.0}  # real seconds: wait_for's bound is what ends them

    async def slowly(fn, *args):
        await asyncio.sleep(slow.get(fn.__name__, 0))
        return fn(*args)

    async def changed(leading, reason):
        pass
    elector = LeaderElector(lease.for_("a"), identity="a", settings=SETTINGS, clock=clock, rng=random.Random(1),
                            **callbacks("a", changed), run_blocking=slowly)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert not await elector.try_acquire_or_renew(1.0)
    took = loop.time() - started
    assert 0.95 <= took <= 1.2, took


async def test_a_standby_dates_another_holders_lease_from_the_answer_not_from_the_start_of_its_read():
    """b's read takes 5 s (a slow API server); the Lease it returns runs 15 s from when b saw it, so b
    may not take it over 16 s after its read began (it could when it dated the record from the start)."""
    clock, lease = ManualClock(), MemoryLease()
    lease.for_("a").create(LeaseRecord("a", 15.0, 0.0, 0.0, 0))
    delay = {"get": 5.0}

    async def slow_read(fn, *args):
        if fn.__name__ == "get" and delay["get"]:
            clock._now += delay["get"]  # the answer arrives 5 s (of the injected clock) after the call
        return fn(*args)

    async def changed(leading, reason):
        pass
    b = LeaderElector(lease.for_("b"), identity="b", settings=SETTINGS, clock=clock, rng=random.Random(1),
                      **callbacks("b", changed), run_blocking=slow_read)
    began = clock.monotonic()
    assert not await b.try_acquire_or_renew(2.0)
    delay["get"] = 0.0
    clock._now = began + 16.0  # a has not renewed since: 16 s after b's read began, 11 s after its answer
    assert not await b.try_acquire_or_renew(2.0)
    clock._now = began + 20.5  # the lease's 15 s have passed since b saw it
    assert await b.try_acquire_or_renew(2.0)


def test_holds_lease_is_false_past_the_renew_deadline_even_before_the_elector_has_run():
    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.mechanisms.leadership.elector import ElectionSettings, LeaderElector

    clock = ManualClock()
    elector = LeaderElector(None, identity="a", settings=ElectionSettings(15, 10, 2), clock=clock,
                            rng=__import__("random").Random(0), on_started_leading=None, on_stopped_leading=None,
                            on_new_leader=None)
    elector.leading, elector.last_renewal = True, clock.monotonic()
    assert elector.holds_lease()
    clock.advance_blocking(10.0)  # a stopped process: no coroutine ran meanwhile, `leading` is still True
    assert elector.leading and not elector.holds_lease()


async def nothing(leading, reason):
    pass


async def test_a_standby_that_cannot_read_the_lease_names_nobody_yet_at_once(tasks):
    clock, lease = ManualClock(), MemoryLease()
    lease.cut_off.add("agent-b")
    b = Agent("agent-b", lease, clock, tasks)
    await clock.advance(0.1)
    assert b.changes == [(1000.0, False, "standby: the leader is (nobody yet)")]


async def test_a_standby_waits_a_retry_period_stretched_by_its_jitter_watching_from_the_version_it_saw(tasks, fixed_random):
    """Between attempts a standby waits retryPeriod x (1 + 0.2 r), r the random source's draw in [0, 1): 2.2 s, 2 s
    and 2.4 s here, then 2.2 s; meanwhile it watches the Lease from the version it last saw, for no longer than that wait."""
    clock, lease = ManualClock(), MemoryLease(watchable=True)
    lease.for_("agent-a").create(lease_record_of("agent-a"))
    view, reads = lease.for_("agent-b"), []
    get = view.get

    def read():
        reads.append(round(clock.monotonic() - 1000.0, 6))
        return get()
    view.get = read
    elector = LeaderElector(view, identity="agent-b", settings=SETTINGS, clock=clock,
                            rng=fixed_random([0.5, 0.0, 0.999, 0.5]), **callbacks("agent-b", nothing), run_blocking=inline)
    tasks.start(elector.run())
    await run_for(clock, 6.7, step=0.1)
    assert reads == [0.0, 2.2, 4.2, 6.5996]
    assert [(version, round(timeout, 6)) for version, timeout in lease.watches] == [("1", 2.2), ("1", 2.0), ("1", 2.3996),
                                                                                        ("1", 2.2)]


@pytest.mark.parametrize(("retry", "healed_at", "stops"), [(3.0, 7.0, []), (2.5, 8.0, [1010.0])])
async def test_a_leaders_last_attempt_gets_the_time_left_before_its_deadline_and_none_is_made_with_none_left(
        tasks, retry, healed_at, stops):
    """Renewals fail from just after the lease was created at 0 until `healed_at`. With a retry period of 3 s the
    attempts come at 3, 6 and 9 s, the last with 1 s left before the 10 s deadline: it renews, the leader leads on.
    With 2.5 s they come at 2.5, 5 and 7.5 s; at 10 s nothing is left, no attempt is made and the leader stops
    there though the API server answers again (then, the Lease still its own, it takes it again at once)."""
    clock, lease = ManualClock(), MemoryLease()
    a = Agent("agent-a", lease, clock, tasks, settings=ElectionSettings(15.0, 10.0, retry))
    await clock.advance(0.1)
    assert a.elector.leading
    lease.cut_off.add("agent-a")
    await clock.advance(healed_at - 0.1)
    lease.cut_off.clear()
    await clock.advance(12.0 - healed_at)
    assert a.stopped_at() == stops and a.elector.leading


async def test_a_leader_shutting_down_gives_up_a_release_that_hangs_after_two_seconds(tasks):
    """The release on shutdown is bounded (2 s of the event loop's clock): an API server that does not answer
    cannot hold a terminating agent; the Lease is then left to expire."""
    clock, lease = ManualClock(), MemoryLease()
    hang = asyncio.Event()

    async def hanging(fn, *args):
        if hang.is_set():
            await asyncio.sleep(3600)  # real time: only the release's own bound ends it
        return fn(*args)
    elector = LeaderElector(lease.for_("a"), identity="a", settings=SETTINGS, clock=clock, rng=random.Random(1),
                            **callbacks("a", nothing), run_blocking=hanging)
    task = tasks.start(elector.run())
    await clock.advance(0.1)
    assert elector.leading
    hang.set()
    loop = asyncio.get_running_loop()
    started = loop.time()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    took = loop.time() - started
    assert 2.0 <= took < 2.9, took
    assert not elector.leading and elector.token is None and lease.record.holder == "a"


async def test_a_lease_released_by_clearing_its_holder_is_taken_at_the_standbys_next_attempt(tasks):
    """client-go's ReleaseOnCancel releases by writing an empty holder (ours deletes the record): a standby takes
    such a Lease at its next attempt, not a lease duration after it saw it change."""
    clock, lease = ManualClock(), MemoryLease()
    lease.for_("agent-x").create(lease_record_of("agent-x"))
    b = Agent("agent-b", lease, clock, tasks)
    await run_for(clock, 5)
    lease._store(replace(lease.record, holder=""))
    released = clock.monotonic()
    await run_for(clock, 3, step=0.1)
    (started,) = b.leading_since()
    assert started - released <= SETTINGS.retry_period * 1.2 + 0.1
    assert lease.record.holder == "agent-b" and lease.record.transitions == 1


async def test_a_standby_that_cannot_take_a_released_lease_still_waits_its_retry_period_between_attempts(tasks):
    """A released Lease is nothing to watch for: the standby's writes refused (403), it tries once a retry period
    (with jitter), never in a loop that would flood the API server."""
    clock, lease = ManualClock(), MemoryLease(watchable=True)
    lease.for_("agent-x").create(lease_record_of(""))
    lease.read_only.add("agent-b")
    b = Agent("agent-b", lease, clock, tasks)
    view, writes = b.elector.backend, []
    update = view.update

    def counted(record):
        writes.append(clock.monotonic())
        return update(record)
    view.update = counted
    await run_for(clock, 5)
    assert 2 <= len(writes) <= 3, len(writes)
    assert b.changes == [(1000.0, False, "standby: the leader is (nobody yet)")]


async def test_a_leader_that_reads_its_lease_released_but_cannot_write_keeps_leading_until_it_can(tasks):
    """Someone cleared the holder of the leader's Lease; its next renewal reads that and is refused (403). A released
    Lease names no other holder: the leader does not stop at once (only its renew deadline would stop it) and
    takes the Lease back at its next attempt."""
    clock, lease = ManualClock(), MemoryLease()
    a = Agent("agent-a", lease, clock, tasks)
    await run_for(clock, 1)
    lease.read_only.add("agent-a")
    lease._store(replace(lease.record, holder=""))
    await run_for(clock, SETTINGS.retry_period * 1.5, step=0.1)  # one renewal, refused
    lease.read_only.clear()
    await run_for(clock, SETTINGS.retry_period * 1.5, step=0.1)
    assert a.stopped_at() == [] and a.elector.leading and lease.record.holder == "agent-a"


async def test_a_standby_may_take_the_lease_exactly_a_lease_duration_after_it_saw_it_change():
    """client-go's rule: the lease is held while observedTime + leaseDuration is after now; at that instant it is free."""
    clock, lease = ManualClock(), MemoryLease()
    lease.for_("a").create(LeaseRecord("a", 15.0, 0.0, 0.0, 0))
    b = LeaderElector(lease.for_("b"), identity="b", settings=SETTINGS, clock=clock, rng=random.Random(1),
                      **callbacks("b", nothing), run_blocking=inline)
    assert not await b.try_acquire_or_renew(2.0)  # seen at 1000
    clock._now = 1014.9
    assert not await b.try_acquire_or_renew(2.0)
    clock._now = 1015.0
    assert await b.try_acquire_or_renew(2.0)


async def test_a_conflict_with_a_write_that_changed_nothing_the_election_reads_does_not_restart_the_standbys_wait():
    """Someone labels the Lease (its version moves, its holder and times do not) just as the standby takes over a
    silent holder's lease: the write conflicts; read again, the record is the one the standby saw, so the lease
    has still run out and the standby takes it at its next attempt, not a lease duration later."""
    clock, lease = ManualClock(), MemoryLease()
    lease.for_("a").create(LeaseRecord("a", 15.0, 0.0, 0.0, 0))
    view = lease.for_("b")
    get, labelled = view.get, []

    def get_then_labelled():
        record = get()
        if clock.monotonic() >= 1015.0 and not labelled:  # the label lands between the standby's read and write
            labelled.append(True)
            lease._store(lease.record)
        return record
    view.get = get_then_labelled
    b = LeaderElector(view, identity="b", settings=SETTINGS, clock=clock, rng=random.Random(1),
                      **callbacks("b", nothing), run_blocking=inline)
    assert not await b.try_acquire_or_renew(2.0)  # seen at 1000
    clock._now = 1015.0
    assert not await b.try_acquire_or_renew(2.0) and labelled  # the takeover conflicts with the label's write
    clock._now = 1017.2
    assert await b.try_acquire_or_renew(2.0)



def said(caplog) -> list[str]:
    """What the elector logged, in order."""
    return [r.getMessage() for r in caplog.records if r.name.endswith("mechanisms.leadership.elector")]


@pytest.mark.parametrize("meanwhile, says, left", [
    ("nothing", "released the lease", None),
    # a renewal of ours landed unheard and moved the version on, then the record went (another release, a GC)
    ("record gone", "released the lease", None),
    # the standby took the lease over between our last renewal and the shutdown: its record stays
    ("another holder", "not releasing the lease: another agent holds it now", "b"),
])
async def test_the_release_on_shutdown_says_whether_it_gave_the_lease_up_or_found_another_holder(
        tasks, caplog, meanwhile, says, left):
    """An operator reading the old leader's last lines learns whether the Lease was handed back or someone else
    held it already; the record is deleted only while it is ours."""
    caplog.set_level(logging.INFO)
    clock, lease = ManualClock(), MemoryLease()
    _, task = await leader_a(tasks, clock, lease, inline)
    if meanwhile == "record gone":
        lease.record = None
    elif meanwhile == "another holder":
        lease._store(replace(lease.record, holder="b"))
    task.cancel()
    await clock.settle()
    assert said(caplog)[-1] == says, said(caplog)
    assert (lease.record.holder if lease.record else None) == left


async def test_a_release_whose_delete_conflicts_three_times_gives_up_and_says_the_lease_expires(tasks, caplog):
    """Each delete meets a version moved on by a write of ours landing late; one such write is expected (the renewal
    cancelled by the shutdown), three in a row are not: the release stops after its third delete and says the Lease
    is left to expire, instead of retrying for as long as its 2 s allow."""
    caplog.set_level(logging.INFO)
    clock, lease = ManualClock(), MemoryLease()
    deletes = []  # each delete attempted: recorded, asserted below

    class RenewedUnderEachDelete(View):
        def delete(self, record):
            deletes.append(record.version)
            self.lease._store(replace(self.lease.record))  # ours still, one version on
            return super().delete(record)
    elector = LeaderElector(RenewedUnderEachDelete(lease, "a"), identity="a", settings=SETTINGS, clock=clock,
                            rng=random.Random(1), **callbacks("a", nothing), run_blocking=inline)
    task = tasks.start(elector.run())
    await run_for(clock, 3)
    assert elector.leading
    task.cancel()
    await clock.settle()
    assert len(deletes) == 3, deletes
    assert lease.record is not None and lease.record.holder == "a"
    assert said(caplog)[-1] == f"releasing the lease failed: LeaseConflict; it expires in {SETTINGS.lease_duration:.0f}s"
