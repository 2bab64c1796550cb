"""The queue consumer: paused until the agent is ready, then lease, execute, ack.

While an item runs its lease is renewed every third of its length, so that an item that runs
longer than a lease is never delivered to another consumer meanwhile. A renewal the control plane
refuses (the lease expired or was replaced) is logged and not retried: the item may already run
elsewhere, and its executor's idempotency decides. A renewal that fails for want of an answer is
tried again at the next third.

Fencing: the consumer leases under a term it starts at the control plane the first time it
leases after it began to lead (`new_term()` drops the old one). Every lease, ack, renewal and
release names that term. Once another agent has started a newer term the control plane refuses
them ("fenced"). Starting a term hands back the leases older terms held, so the items a dead or
partitioned agent held are delivered again at once, to the new leader, whose executor adopts
what already ran (the Pod executor finds the item's Pod by name).

What a fencing means depends on what ties the term to leadership. With leader election the Lease
does: while this agent holds it (`new_term(leader)` was given its token), a newer term can only be
a deposed leader's late `start_term`, so the consumer starts a term of its own again after a poll
interval (and the deposed one, no longer leading, never answers back). Without leader election
nothing says who should lead, so a fenced consumer stops leasing until `new_term()`. Only a
refusal of the term held now counts: one answered late about an older term is ignored. The Pods
themselves are fenced by the Lease (the executor gets the token; foundations/fencing.py).

Readiness: the `queues` entry of /healthz is ready while the queues are open, and also while they
are paused only because this agent is a hot standby (it does its job: waiting to lead). Whether
this agent leases work is the separate fact `active` (top level of /healthz, the metric
`gpu_agent_active`).

Pausing stops new leases; an item already leased runs to its end and is acked. An item
leased in the instant the queue was paused (a long-polled lease call can be waiting at the
server when it happens) is released back at once rather than run on GPUs the agent may no
longer have.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gpu_agent.foundations.clock import Clock, sleep_or
from gpu_agent.foundations.control_plane_client import (
    ControlPlaneClient,
    ControlPlaneError,
    Fence,
    Fenced,
    Released,
    Unauthorized,
    WorkItem,
)
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.foundations.threads import RunBlocking, in_daemon_thread
from gpu_agent.foundations.toggles import Toggle
from gpu_agent.mechanisms.queues.executor import AttemptNotMade, Executor, Outcome

log = get_logger(__name__)


class QueueConsumer:
    def __init__(self, client: ControlPlaneClient, credential: Callable[[], Secret | None], executor: Executor,
                 *, clock: Clock, health: HealthRegistry, metrics: AgentMetrics, lease_seconds: float,
                 poll_interval: float, on_refused: Callable[[], Awaitable[None]], long_poll: float = 0.0,
                 identity: str = "gpu-agent", run_blocking: RunBlocking = in_daemon_thread,
                 still_leading: Callable[[], bool] | None = None) -> None:
        self.client = client
        self.run_blocking = run_blocking  # every call to the control plane goes through it
        self.identity = identity
        self.fence: Fence | None = None
        self.leader: LeaderToken | None = None  # the Lease's token while leading through one
        self.fenced_by = ""  # set when a newer term refused ours: no leasing until new_term() (or, leading, a poll)
        self.terms_restarted = 0
        # With leader election: whether the Lease is still this agent's by the clock now (the elector's
        # holds_lease), asked before each lease and by /healthz; None without it.
        self.still_leading = still_leading
        self._next_sweep = float("-inf")
        self.credential = credential
        self.executor = executor
        self.clock = clock
        self.health = health
        self.metrics = metrics
        self.lease_seconds = lease_seconds
        self.poll_interval = poll_interval
        self.long_poll = long_poll  # the server holds an empty lease call this long (idle CPU)
        self.on_refused = on_refused
        self.open = Toggle(False)
        self.standby = False  # paused only because another agent leads
        self.processed = 0
        self.failed_attempts = 0  # executions that failed (released with the reason)
        self.failed_items = 0  # items whose last attempt failed here: failed for good at the control plane
        self.not_tried = ""  # why the last item could not be tried (the infrastructure's fault), until one runs
        self.pause_reason = "waiting for GPUs, registration and credentials"
        # Asked at each read, never stored: see HealthRegistry.state.
        self.health.state("active", lambda: self.active)
        self.metrics.active.set_function(lambda: 1 if self.active else 0)
        self._report()

    @property
    def active(self) -> bool:
        """Open, not fenced and (with leader election) still within its lease: this agent leases work."""
        return self.open.is_on and not self.fenced_by and self._within_lease()

    def _within_lease(self) -> bool:
        return self.still_leading is None or self.still_leading()

    def _report(self) -> None:
        on = self.active
        standby = self.standby and not on
        reason = "leasing work" if on else f"paused: {self.pause_reason if standby else self.fenced_by or self.pause_reason}"
        self.health.set("queues", on or standby, reason, processed=self.processed, failedAttempts=self.failed_attempts,
                        failedItems=self.failed_items, term=self.fence.term if self.fence else 0,
                        **({"notTried": self.not_tried} if self.not_tried else {}))

    def new_term(self, leader: LeaderToken | None = None) -> None:
        """This agent began to lead (again): its next lease starts a new term. `leader`: the Lease's
        fencing token of this leadership (None without leader election)."""
        self.fence = None
        self.leader = leader
        self.fenced_by = ""
        self._next_sweep = float("-inf")  # a new leader cleans up after its predecessors first
        self._report()

    def _fenced(self, e: Fenced, under: Fence | None) -> None:
        """A call made under `under` was refused as fenced. Only a refusal of the current term stops
        leasing: one about an older term of this agent (an item leased before it lost and regained
        the lead, answered late) says nothing about the term it holds now."""
        if under is not self.fence:
            log.v(1, "a call of an older term (%s) was refused as fenced; the current term is unaffected",
                  under.term if under else "none")
            return
        self.fence = None
        if self.leader is not None:
            # The Lease says this agent leads: the newer term is a deposed leader's late start_term.
            log.warning("this agent's term was fenced (%s) while it holds the Lease; starting a new term after "
                        "%.1fs", e, self.poll_interval)
            self.terms_restarted += 1
            self._report()
            return
        if not self.fenced_by:
            log.warning("this agent's term is over (%s); it stops leasing work", e)
        self.fenced_by = "fenced: another agent holds a newer term at the control plane"
        self._report()

    async def _term(self, credential: Secret) -> Fence | None:
        if self.fence is None:
            try:
                self.fence = await self.run_blocking(self.client.start_term, credential, self.identity)
            except Unauthorized:
                await self.on_refused()
                return None
            except ControlPlaneError as e:
                log.warning("starting a term failed: %s; retrying in %.1fs", e, self.poll_interval)
                return None
            log.info("leasing work under term %d as %s (leases of older terms handed back)", self.fence.term, self.identity)
            self._report()
        return self.fence

    async def set_open(self, on: bool, reason: str, standby: bool = False) -> None:
        """Open or pause the queues; `standby`: paused only because another agent leads."""
        if on != self.open.is_on:
            log.info("work queues %s%s", "resumed" if on else "paused", "" if on else f": {reason}")
        self.standby = standby and not on
        if not on:
            self.pause_reason = reason
        await self.open.set(on)
        self.metrics.queue_paused.set(0 if on else 1)
        self._report()

    async def _idle(self) -> None:
        """Wait for the next poll, or less if the queue is paused meanwhile."""
        await sleep_or(self.clock, self.poll_interval, self.open.wait_for(False))

    async def step(self) -> bool:
        """Lease and run at most one item; False when there was nothing to do."""
        credential = self.credential()
        if credential is None or self.fenced_by or not self._within_lease():
            return False
        fence = await self._term(credential)
        if fence is None:
            return False
        if self.clock.monotonic() >= self._next_sweep:
            await self._sweep(credential)
        try:
            item = await self.run_blocking(self.client.lease, credential, self.lease_seconds, self.long_poll, fence)
        except Fenced as e:
            self._fenced(e, fence)
            return False
        except Unauthorized:
            await self.on_refused()
            return False
        except ControlPlaneError as e:
            log.warning("leasing work failed: %s; retrying in %.1fs", e, self.poll_interval)
            return False
        if item is None:
            return False
        if not self.open.is_on:
            log.v(2, "queue paused while leasing item %d; releasing it", item.item_id)
            await self._quietly(self.client.release, credential, item)
            return True
        await self._run(credential, item)
        return True

    async def _run(self, credential: Secret, item: WorkItem) -> None:
        log.v(4, "executing item %d (key %s, delivery %d)", item.item_id, item.idempotency_key, item.deliveries)
        started = self.clock.monotonic()
        renewer = asyncio.ensure_future(self._keep_leased(credential, item))
        try:
            outcome = await self.executor.execute(item, self.leader)
        except AttemptNotMade as e:
            # Not the item's fault: back without an attempt counted, after a poll (no spinning on an outage).
            log.warning("item %d (key %s) could not be tried: %s; releasing it (no attempt counted)",
                        item.item_id, item.idempotency_key, e)
            self.not_tried = str(e)[:300]  # in /healthz until an item runs again
            self._report()
            await self._quietly(self.client.release, credential, item)
            await self.clock.sleep(self.poll_interval)
            return
        except Exception as e:  # noqa: BLE001 - a failing item must not stop the queue
            # Released with the reason: the control plane counts the attempt and holds the item back
            # for a backoff (the items behind it go first), then fails it after its last attempt.
            log.error("item %d (key %s) failed: %s; releasing it with the reason (retried after a backoff)",
                      item.item_id, item.idempotency_key, e)
            self.metrics.items.labels("failed").inc()
            self.failed_attempts += 1
            answer = await self._quietly(self.client.release, credential, item, str(e) or type(e).__name__)
            if answer == Released.FAILED:
                log.error("item %d (key %s) failed for good: no attempt left (`gpu-agent queue list` shows why)",
                          item.item_id, item.idempotency_key)
                self.failed_items += 1
                self.metrics.items.labels("gave-up").inc()
            self._report()
            return
        finally:
            renewer.cancel()
        if outcome is Outcome.DUPLICATE:
            log.v(1, "item %d (key %s) was already executed; acknowledging only", item.item_id, item.idempotency_key)
        acked = await self._ack(credential, item)
        if acked:
            await self.executor.after_ack(item)
        # The one line per item a person watching the queue looks for (a state change of the queue).
        log.info("work item %s done (%.1f s)%s%s", item.idempotency_key, self.clock.monotonic() - started,
                 " (already executed before; acknowledged only)" if outcome is Outcome.DUPLICATE else "",
                 "" if acked else " (ack failed: it will be redelivered and acknowledged then)")
        self.processed += 1
        self.not_tried = ""
        self.metrics.items.labels(outcome).inc()
        self._report()

    # An ack that landed but whose answer was lost would otherwise leave the item done at the control
    # plane, never redelivered, and its Pod never deleted; acking again with the same lease is
    # answered "already-acked".
    ACK_RETRIES = (1.0, 2.0, 4.0)

    async def _ack(self, credential: Secret, item: WorkItem) -> bool:
        return bool(await self._quietly(self.client.ack, credential, item, retries=self.ACK_RETRIES))

    async def _keep_leased(self, credential: Secret, item: WorkItem) -> None:
        while True:
            await self.clock.sleep(self.lease_seconds / 3)
            try:  # the current credential: a long item can outlive the one it was leased with
                await self.run_blocking(self.client.renew_lease, self.credential() or credential, item, self.lease_seconds)
                log.v(4, "renewed the lease of item %d for %.1fs", item.item_id, self.lease_seconds)
            except Fenced as e:
                log.warning("the lease of item %d was not renewed: %s; the item may be delivered again", item.item_id, e)
                self._fenced(e, item.fence)
                return
            except ControlPlaneError as e:
                if e.recoverable:
                    log.warning("renewing the lease of item %d failed: %s; trying again", item.item_id, e)
                    continue
                log.warning("the lease of item %d was not renewed: %s; the item may be delivered again", item.item_id, e)
                return

    async def _quietly(self, call: Callable[..., object], credential: Secret, item: WorkItem, *more: object,
                       retries: tuple[float, ...] = ()) -> object:
        """One call about a leased item; a call that got no answer is tried again after each of `retries`
        (seconds on the injected clock). Its answer (True when it has none), or False, logged, when it did
        not succeed."""
        for wait in (*retries, None):
            try:
                answer = await self.run_blocking(call, credential, item, *more)
                return True if answer is None else answer
            except Fenced as e:
                log.warning("%s refused: %s (the current leader has taken the item over)", call.__name__, e)
                self._fenced(e, item.fence)
                return False
            except ControlPlaneError as e:
                if not e.recoverable or wait is None:
                    log.warning("%s failed: %s (the lease will expire and the item be redelivered)", call.__name__, e)
                    return False
                log.warning("%s of item %d got no answer (%s); trying again in %.0fs", call.__name__, item.item_id, e, wait)
                await self.clock.sleep(wait)
        return False

    # The sweep deletes what finished items left behind (their Pods, when after_ack never happened).
    SWEEP_SECONDS = 60.0

    async def _sweep(self, credential: Secret) -> None:
        self._next_sweep = self.clock.monotonic() + self.SWEEP_SECONDS
        sweep = getattr(self.executor, "sweep", None)
        if sweep is None:
            return

        async def item_state(item_id: int) -> str | None:
            try:
                return str(await self.run_blocking(self.client.item_state, credential, item_id))
            except ControlPlaneError as e:
                log.v(2, "asking the state of item %d failed: %s", item_id, e)
                return None
        swept = await sweep(item_state)
        if swept:
            log.info("swept the pods of %d finished item(s)", swept)

    async def run(self) -> None:
        while True:
            await self.open.wait_for(True)
            if not await self.step():
                await self._idle()
