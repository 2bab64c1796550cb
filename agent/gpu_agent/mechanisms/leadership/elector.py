"""Leader election on a Lease, with client-go's rules and timing, written down.

    candidate --acquired--> leader --renewDeadline passed without a renewal--> candidate
        ^                      |
        +------ released ------+ (on shutdown: the record deleted, so a standby takes over at once)

Settings (client-go's names and defaults):
  leaseDuration  15 s  how long a candidate waits, from the moment it last saw the record change,
                       before it may take the lease over from a silent holder
  renewDeadline  10 s  how long a leader may go without a successful renewal before it stops leading
  retryPeriod     2 s  the wait between attempts (a candidate's waits get x U[1, 1.2) jitter)
Rules checked at start: retryPeriod < renewDeadline < leaseDuration.

Hand-over: a leader that shuts down (a rolling update replacing its pod) releases the record. A
candidate waiting between attempts watches the record (when the backend can) and makes its next
attempt as soon as it is released or deleted, instead of at the end of its retry period; so a
rolling update with a Ready hot standby moves leadership in the time of one watch event and one
write. A silent leader (crashed, partitioned) is still taken over only after leaseDuration.

Why this is safe: a leader stops leading (and the agent pauses its queues) renewDeadline after its
last successful renewal. No candidate takes over before leaseDuration has passed since it last
saw the record change, which is no earlier than that renewal; so the old leader has stopped at
least leaseDuration - renewDeadline (5 s) before anyone else starts. Every decision uses the local
monotonic clock and the time the record was *observed* to change (client-go's observedTime),
never the timestamps written in the record, so clock skew between nodes does not matter. Calls
to the API server are bounded by the time left before the deadline: a hung call cannot keep a
leader leading past it.

Each change of holder increments the record's transitions (client-go's leaseTransitions). A
leadership's fencing token (`token`) is (holder, the record's uid, transitions): the work Pods carry
it and the API server refuses one whose token is not the one the leader wrote into the WorkFence
(foundations/fencing.py, kube_fence.py), so a create a deposed leader sent late never lands. Fencing at the control plane uses its own terms (a
term is started each time an agent begins to lead).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol, cast

from gpu_agent.foundations.clock import Clock, sleep_or
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.threads import in_daemon_thread

log = get_logger(__name__)


class LeaseConflict(Exception):
    """Someone else wrote the record first (create: it exists; update: its version moved)."""


@dataclass(frozen=True)
class LeaseRecord:
    holder: str  # "" once released
    lease_duration: float
    acquire_time: float  # wall clock, for people reading the record; never used for a decision
    renew_time: float
    transitions: int
    version: str = ""  # the store's resourceVersion; not part of what "changed" means
    uid: str = ""  # the store's name for this record's lifetime: a deleted and recreated record has a new one

    def same_as(self, other: LeaseRecord | None) -> bool:
        return other is not None and replace(self, version="") == replace(other, version="")


class LeaseBackend(Protocol):
    """Where the record lives (a coordination.k8s.io/v1 Lease in a cluster; a dict in unit tests)."""

    def get(self) -> LeaseRecord | None: ...

    def create(self, record: LeaseRecord) -> LeaseRecord: ...

    def update(self, record: LeaseRecord) -> LeaseRecord: ...

    def delete(self, record: LeaseRecord) -> None:
        """Delete the record if it is still at `record.version` (LeaseConflict otherwise)."""
        ...

    # Optional: `wait_released(version: str, timeout: float) -> bool` blocks until the record, last
    # seen at `version`, is released (no holder) or deleted (True), or `timeout` passes (False).


@dataclass(frozen=True)
class ElectionSettings:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def problems(self) -> list[str]:
        out = []
        if not self.renew_deadline < self.lease_duration:
            out.append(f"leaderElectionRenewDeadline ({self.renew_deadline:g}s) must be shorter than "
                       f"leaderElectionLeaseDuration ({self.lease_duration:g}s)")
        if not self.retry_period < self.renew_deadline:
            out.append(f"leaderElectionRetryPeriod ({self.retry_period:g}s) must be shorter than "
                       f"leaderElectionRenewDeadline ({self.renew_deadline:g}s)")
        return out


JITTER = 0.2


class LeaderElector:
    """Reports as client-go's LeaderCallbacks do: `on_started_leading()` when this agent begins to lead,
    `on_stopped_leading(why)` when it stops (not on shutdown, which releases the lease instead), and,
    while it does not lead, `on_new_leader(identity)` each time the holder it sees changes ("" when
    nobody holds the lease)."""

    def __init__(self, backend: LeaseBackend, *, identity: str, settings: ElectionSettings, clock: Clock,
                 rng: random.Random, on_started_leading: Callable[[], Awaitable[None]],
                 on_stopped_leading: Callable[[str], Awaitable[None]], on_new_leader: Callable[[str], Awaitable[None]],
                 run_blocking: Callable[..., Awaitable[object]] = in_daemon_thread) -> None:
        self.backend = backend
        self.run_blocking = run_blocking  # unit tests call their in-memory backend inline
        self.identity = identity
        self.settings = settings
        self.clock = clock
        self.rng = rng
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self.on_new_leader = on_new_leader
        self.leading = False
        self.observed: LeaseRecord | None = None
        self.observed_at = float("-inf")
        self.last_renewal = float("-inf")
        self.terms = 0  # how many times this agent began to lead

    def holds_lease(self) -> bool:
        """Leading, and its last renewal within the renew deadline by the clock now: true only while the
        rules of the module docstring let it lead, even in the instant after the process resumed from a
        stop, before `_keep` has run and cleared `leading`."""
        return self.leading and self.clock.monotonic() < self.last_renewal + self.settings.renew_deadline

    @property
    def token(self) -> LeaderToken | None:
        """This leadership's fencing token (what its work Pods carry), or None while not leading."""
        if not self.leading or self.observed is None:
            return None
        return LeaderToken(self.identity, self.observed.uid, self.observed.transitions)

    @property
    def leader(self) -> str:
        """Who holds the lease, as last seen ("" when nobody)."""
        return self.identity if self.leading else (self.observed.holder if self.observed else "")

    async def _call(self, fn: Callable[..., LeaseRecord | None], *args: object, until: float) -> LeaseRecord | None:
        """`fn` bounded by what is left of its attempt: `until` is on the event loop's clock, the one
        wait_for measures with (the monotonic clock in production)."""
        left = until - asyncio.get_running_loop().time()
        # asyncio.timeout, not asyncio.wait_for: in Python 3.11 wait_for returns the answer and drops a cancel that
        # comes in the same turn as it, and the elector renewed on through its agent's shutdown (the Lease kept for
        # the kubelet's whole grace period, then left to expire). run_blocking hands back what `fn` returned.
        async with asyncio.timeout(max(left, 0.001)):
            return cast("LeaseRecord | None", await self.run_blocking(fn, *args))

    async def try_acquire_or_renew(self, limit: float) -> bool:
        """One attempt (client-go's tryAcquireOrRenew); `limit` bounds the whole attempt, its read and
        its write together (each given what the other left), so a leader never renews past its deadline."""
        now, wall = self.clock.monotonic(), self.clock.wall()
        until = asyncio.get_running_loop().time() + limit
        s = self.settings
        try:
            current = await self._call(self.backend.get, until=until)
            if current is None:
                mine = LeaseRecord(self.identity, s.lease_duration, wall, wall, 0)
                self._saw(await self._call(self.backend.create, mine, until=until), now)
                self.last_renewal = now  # when the attempt began: the conservative end of it
                return True
            if not current.same_as(self.observed):
                # Dated from the answer, not from the start of the attempt: another holder's lease is
                # then never thought to run out before it does.
                self._saw(current, self.clock.monotonic())
            held_by_other = current.holder not in ("", self.identity)
            if held_by_other and self.observed_at + current.lease_duration > now:
                return False
            ours = current.holder == self.identity
            mine = LeaseRecord(self.identity, s.lease_duration, current.acquire_time if ours else wall, wall,
                               current.transitions if ours else current.transitions + 1, current.version, current.uid)
            self._saw(await self._call(self.backend.update, mine, until=until), now)
            self.last_renewal = now
            return True
        except LeaseConflict:
            log.v(2, "lease: someone else wrote it first")
            await self._read_after_conflict(until)
            return False
        except TimeoutError:
            log.warning("lease: no answer within %.1fs", limit)
            return False
        except Exception as e:  # noqa: BLE001 - API trouble: the next attempt decides
            log.warning("lease: attempt failed: %s", e)
            return False

    async def _read_after_conflict(self, until: float) -> None:
        """Whoever wrote first is the holder: read it now, within what is left of the attempt, so a
        standby names the leader at once instead of "(nobody yet)" until its next attempt."""
        try:
            current = await self._call(self.backend.get, until=until)
        except Exception as e:  # noqa: BLE001 - the next attempt reads it again
            log.v(2, "lease: reading it after a conflict failed: %s", e)
            return
        if current is not None and not current.same_as(self.observed):
            self._saw(current, self.clock.monotonic())  # seen now: its lease runs from here

    def _saw(self, record: LeaseRecord | None, now: float) -> None:
        self.observed, self.observed_at = record, now

    async def _acquire(self) -> None:
        reported = None
        while True:
            if await self.try_acquire_or_renew(self.settings.retry_period):
                return
            if self.leader != reported:
                reported = self.leader
                await self.on_new_leader(reported)
            await self._wait_between_attempts(self.settings.retry_period * (1 + JITTER * self.rng.random()))

    async def _wait_between_attempts(self, delay: float) -> None:
        """Sleep `delay`, cut short when the holder releases the record (a hand-over)."""
        wait_released = getattr(self.backend, "wait_released", None)
        held = self.observed is not None and self.observed.holder not in ("", self.identity) and self.observed.version
        if wait_released is None or not held:
            await self.clock.sleep(delay)
            return
        assert self.observed is not None
        await sleep_or(self.clock, delay, self._released(wait_released, self.observed.version, delay))

    async def _released(self, wait_released: Callable[[str, float], bool], version: str,
                        timeout: float) -> None:  # noqa: ASYNC109 - the blocking watch's own timeout, not this coroutine's
        try:
            if await self.run_blocking(wait_released, version, timeout):
                log.v(2, "lease: released by its holder; trying now")
                return
        except Exception as e:  # noqa: BLE001 - the retry period still bounds the wait
            log.v(2, "lease: watching for its release failed: %s", e)
        await asyncio.Event().wait()  # not released: the sleep decides

    async def _keep(self) -> str:
        """Renew every retryPeriod; return (why) when renewDeadline has passed since the last renewal, or
        at once when the record shows another holder."""
        s = self.settings

        def left() -> float:
            return self.last_renewal + s.renew_deadline - self.clock.monotonic()

        while left() > 0:
            await self.clock.sleep(min(s.retry_period, left()))  # never sleep past the deadline
            if left() > 0:
                await self.try_acquire_or_renew(left())
            if self.observed is not None and self.observed.holder not in ("", self.identity):
                # the Lease was deleted and recreated under us: stop now, not at the deadline
                return f"the lease is held by {self.observed.holder}"
        return f"the lease was not renewed within the renew deadline ({s.renew_deadline:g}s)"

    async def run(self) -> None:
        try:
            while True:
                await self._acquire()
                self.leading = True
                self.terms += 1
                log.info("became the leader (lease held by %s, transition %d)", self.identity,
                         self.observed.transitions if self.observed else 0)
                await self.on_started_leading()
                why = await self._keep()
                self.leading = False
                log.warning("stopped leading: %s", why)
                await self.on_stopped_leading(why)
        finally:
            if self.leading:
                self.leading = False
                await self._release()

    def _delete_ours(self, seen: LeaseRecord) -> bool:
        """Delete the record while this agent holds it (True once it is gone; False: another holds it now).
        The version last seen may be behind: a renewal cancelled by the shutdown still lands at the server (its
        thread runs on) and moves the version on, and a delete at the old one conflicts. Before, that conflict
        left the Lease to expire, and the standby waited a lease duration (one in 50 graceful hand-overs)."""
        record: LeaseRecord | None = seen
        for _ in range(3):  # one renewal can still land after the first read; more is someone else's doing
            if record is None:
                return True
            if record.holder != self.identity:
                return False
            try:
                self.backend.delete(record)
                return True
            except LeaseConflict:
                record = self.backend.get()
        raise LeaseConflict()

    async def _release(self) -> None:
        """On shutdown, give the lease up so a standby takes over at its next attempt (client-go's
        ReleaseOnCancel clears the holder; we delete the record, only if it is still the one we
        wrote, so that an uninstall leaves no Lease behind: a standby creates it afresh)."""
        if self.observed is None or self.observed.holder != self.identity:
            return
        try:
            async with asyncio.timeout(2.0):  # not wait_for (see _call)
                released = await asyncio.shield(self.run_blocking(self._delete_ours, self.observed))
            if released:
                log.info("released the lease")
            else:
                log.info("not releasing the lease: another agent holds it now")
        except BaseException as e:  # noqa: BLE001 - shutdown goes on; the lease expires by itself
            log.warning("releasing the lease failed: %s; it expires in %.0fs", str(e) or type(e).__name__,
                        self.settings.lease_duration)
