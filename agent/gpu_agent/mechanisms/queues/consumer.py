"""The queue consumer: paused until the agent is ready, then lease, execute, ack, several items at once.

Items in flight: up to `max_in_flight` items run side by side (0: as many as the GPUs registered,
at least one), each in its own task with its own lease renewal, ack and release. The leasing loop
takes new items only while a place in flight and a GPU are free, as many per lease call as there
are such places (one control-plane round trip fills a node's worth of slots). An item states its GPUs
in its payload (`gpus`, 1 when absent: what the Pod executor asks of the scheduler); once leased it
waits for that many GPUs to be free, its lease renewed meanwhile, without polling (foundations/slots.py)
and without holding up the smaller items leased after it, which run first if they fit. So that a big
item is not starved by a stream of small ones, the leasing loop takes no new item while one has waited
longer than STARVE_SECONDS: the GPUs the running ones free then go to it. An item asking more GPUs
than are registered waits for all of them (and the executor then says whether it can ever run). A
place in flight is held until the item is acknowledged; its GPUs are given back as soon as its
execution ends (the Pod is done), before the ack.

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
themselves are fenced by the leader's token in the WorkFence (the executor gets the token;
foundations/fencing.py, mechanisms/leadership/kube_fence.py).

Readiness: the `queues` entry of /healthz is ready while the queues are open, and also while they
are paused only because this agent is a hot standby (it does its job: waiting to lead). Whether
this agent leases work is the separate fact `active` (top level of /healthz, the metric
`gpu_agent_active`).

The work path: Ready must never hide a path on which no work can run (a fencing policy that refuses
every Pod, a quota, a missing ServiceAccount, an admission webhook). Before the first lease of each
term, and after the executor said an item's Pod was refused for a reason that is not the item's
(WorkPathRefused: the item went back uncounted), the consumer leases nothing until the executor's
`probe` proves the path (dry runs; `check_path`), trying again every poll interval. A path refused
for PATH_BOUND seconds turns the `queues` entry NotReady with the reason (`on_path(False, why)`: the
agent's Event; the metric gpu_agent_work_path_down), and the first proof turns it back.

Pausing stops new leases; an item already running runs to its end and is acked. An item
leased in the instant the queue was paused (a long-polled lease call can be waiting at the
server when it happens), or still waiting for its GPUs when it pauses, is released back at once
rather than run on GPUs the agent may no longer have; so is one whose term is over by the time
its GPUs are free. Fencing, Pod adoption and the poison-item rules are per item: each item carries
the term it was leased under, and its executor adopts its Pod by name.
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
from gpu_agent.foundations.slots import Slots
from gpu_agent.foundations.threads import RunBlocking, in_daemon_thread
from gpu_agent.foundations.toggles import Toggle
from gpu_agent.mechanisms.queues.executor import AttemptNotMade, Executor, Outcome, WorkPathRefused

log = get_logger(__name__)
MAX_LEASE_BATCH = 64  # the control plane's most items per lease call (api.MAX_LEASE_ITEMS)


def gpus_needed(item: WorkItem) -> int:
    """The GPUs an item states it needs (`gpus` in its payload; 1 when absent), as the Pod executor asks them."""
    try:
        return max(0, int(item.payload.get("gpus", 1)))
    except (TypeError, ValueError):
        return 1  # the control plane validated it; the executor reports anything odd


class QueueConsumer:
    def __init__(self, client: ControlPlaneClient, credential: Callable[[], Secret | None], executor: Executor,
                 *, clock: Clock, health: HealthRegistry, metrics: AgentMetrics, lease_seconds: float,
                 poll_interval: float, on_refused: Callable[[], Awaitable[None]], long_poll: float = 0.0,
                 identity: str = "gpu-agent", run_blocking: RunBlocking = in_daemon_thread,
                 still_leading: Callable[[], bool] | None = None, max_in_flight: int = 1,
                 check_path: Callable[[LeaderToken | None], Awaitable[str]] | None = None,
                 on_path: Callable[[bool, str], None] | None = None) -> None:
        self.client = client
        # The work path (see the module docstring): proven before leasing; None: nothing to prove (a journal).
        self.check_path = check_path
        self.on_path = on_path
        self.path_proven = check_path is None
        self.path_refused_since: float | None = None  # monotonic, since the path was first refused (None: it is not)
        self.path_problem = ""
        self.path_down_told = False
        # Places for items in flight and the GPUs they use: one condition, so the leasing loop waits for
        # "a place and a GPU" in one wait. The GPUs are counted once `set_gpus` told how many there are.
        self.max_in_flight = max_in_flight  # 0: as many as the GPUs registered
        self.in_flight = Slots(max(1, max_in_flight))
        self.gpus: Slots | None = None
        self.waiting_since: dict[int, float] = {}  # item id -> when it began to wait for its GPUs
        self._deliveries: dict[int, asyncio.Event] = {}  # item id -> set when its delivery running here ends
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

    PATH_BOUND = 10.0  # seconds a refused work path may last before the queues say NotReady

    def _path_down(self) -> bool:
        since = self.path_refused_since
        return since is not None and self.clock.monotonic() - since >= self.PATH_BOUND

    def _report(self) -> None:
        on = self.active
        standby = self.standby and not on
        reason = "leasing work" if on else f"paused: {self.pause_reason if standby else self.fenced_by or self.pause_reason}"
        down = on and self._path_down()
        if on and self.path_problem:
            reason = f"work pods refused: {self.path_problem}" if down else f"proving the work path: {self.path_problem}"
        self.metrics.work_path_down.set(1 if down else 0)
        if down != self.path_down_told and self.on_path is not None and on:  # a standby tells nothing
            self.on_path(not down, self.path_problem if down else "work pods admitted again")
        self.path_down_told = down
        self.health.set("queues", (on and not down) or standby, reason, processed=self.processed, inFlight=self.in_flight.held,
                        maxInFlight=self.in_flight.total, failedAttempts=self.failed_attempts,
                        failedItems=self.failed_items, term=self.fence.term if self.fence else 0,
                        **({"notTried": self.not_tried} if self.not_tried else {}))

    def new_term(self, leader: LeaderToken | None = None) -> None:
        """This agent began to lead (again): its next lease starts a new term. `leader`: the Lease's
        fencing token of this leadership (None without leader election)."""
        self.fence = None
        self.leader = leader
        self.fenced_by = ""
        self._next_sweep = float("-inf")  # a new leader cleans up after its predecessors first
        # Each leadership proves its own token's path, afresh: what an earlier one was refused is not this one's.
        self.path_proven = self.check_path is None
        self.path_refused_since, self.path_problem, self.path_down_told = None, "", False
        self._report()

    async def _prove_path(self) -> bool:
        """True once the executor's dry runs admit this term's work Pods; else the problem is recorded."""
        assert self.check_path is not None
        leader = self.leader
        try:
            problem = await self.check_path(leader)
        except Exception as e:  # noqa: BLE001 - a check that fails is a path not proven, never the agent's end
            problem = f"checking the work path failed: {e}"
        if self.leader is not leader:  # the term changed meanwhile: this answer is about the old one
            return False
        if problem:
            self._path_refused(problem)
            return False
        if self.path_problem:
            log.info("the work path is proven again (%s before); leasing work", self.path_problem)
        self.path_proven, self.path_refused_since, self.path_problem = True, None, ""
        self._report()
        return True

    def _path_refused(self, problem: str) -> None:
        """An item's Pod or a dry run was refused for a reason not the item's: no lease until a probe proves it."""
        if self.path_refused_since is None:
            self.path_refused_since = self.clock.monotonic()
            log.warning("the work path is refused (%s); leasing nothing until a dry run proves it", problem)
        self.path_problem = problem[:400]
        self.path_proven = False
        self.metrics.work_path_refusals.inc()
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

    async def set_gpus(self, count: int) -> None:
        """The GPUs registered now (healthy ones): what items in flight may use, and with max_in_flight 0
        how many items may be in flight."""
        if self.gpus is None:
            self.gpus = Slots(count, self.in_flight.changed)
        else:
            await self.gpus.resize(count)
        if self.max_in_flight == 0:
            await self.in_flight.resize(max(1, count))
        self._report()

    STARVE_SECONDS = 60.0

    def _room(self) -> bool:
        """A place in flight and a GPU are free, and no leased item has waited past STARVE_SECONDS for its GPUs."""
        if self.in_flight.free < 1 or (self.gpus is not None and self.gpus.free < 1):
            return False
        now = self.clock.monotonic()
        return all(now - since < self.STARVE_SECONDS for since in self.waiting_since.values())

    def _batch(self) -> int:
        """How many items one lease call asks for: each free place in flight that has a free GPU."""
        free = self.in_flight.free if self.gpus is None else min(self.in_flight.free, self.gpus.free)
        return max(1, min(free, MAX_LEASE_BATCH))

    async def step(self) -> bool:
        """Lease and run at most one item, to its ack; False when there was nothing to do."""
        leased = await self._lease(1)
        if leased is None:
            return False
        credential, items = leased
        for item, placed in await self._admit(credential, items):
            await self._hold(credential, item, placed)
        return True

    async def _lease(self, most: int) -> tuple[Secret, list[WorkItem]] | None:
        """Up to `most` items leased under the current term, with the credential they were leased with;
        None when there was nothing to do (no credential, fenced, no term, an error, an empty queue).
        Items leased in the instant the queue was paused are released back (an empty list)."""
        credential = self.credential()
        if credential is None or self.fenced_by or not self._within_lease():
            return None
        if not self.path_proven and not await self._prove_path():
            return None
        fence = await self._term(credential)
        if fence is None:
            return None
        if self.clock.monotonic() >= self._next_sweep:
            await self._sweep(credential)
        try:
            if most == 1:  # the call every control plane answers (maxItems came later)
                item = await self.run_blocking(self.client.lease, credential, self.lease_seconds, self.long_poll, fence)
                items = [item] if item is not None else []
            else:
                items = await self.run_blocking(self.client.lease_many, credential, self.lease_seconds, self.long_poll,
                                                fence, most)
        except Fenced as e:
            self._fenced(e, fence)
            return None
        except Unauthorized:
            await self.on_refused()
            return None
        except ControlPlaneError as e:
            log.warning("leasing work failed: %s; retrying in %.1fs", e, self.poll_interval)
            return None
        if not items:
            return None
        if not self.open.is_on:
            for item in items:
                log.v(2, "queue paused while leasing item %d; releasing it", item.item_id)
                await self._release(credential, item)
            return credential, []
        return credential, items

    async def _hold(self, credential: Secret, item: WorkItem, placed: int | None) -> None:
        """One item in flight (its place already taken): its GPUs, its run, its ack; the place given back.

        One delivery of an item at a time in this agent: a redelivery (a new term handed back the item while
        the delivery of the old term still runs here, its Pod create unanswered) waits, its lease renewed,
        until the earlier delivery's task has ended. Both carry this agent's Lease token, so the admission
        policy would let the old create land after the new delivery ran, acked and deleted its Pod: a second
        run. Waiting, the redelivery finds the old create's Pod instead and adopts it."""
        renewer = asyncio.ensure_future(self._keep_leased(credential, item))  # also while it waits
        mine = asyncio.Event()
        try:
            while (earlier := self._deliveries.get(item.item_id)) is not None:
                log.v(1, "item %d was delivered again while its earlier delivery still runs here; waiting for it",
                      item.item_id)
                await earlier.wait()
            self._deliveries[item.item_id] = mine
            await self._run(credential, item, placed, renewer)
        finally:
            renewer.cancel()
            if self._deliveries.get(item.item_id) is mine:
                del self._deliveries[item.item_id]
            mine.set()
            await self.in_flight.give(1)
            self._report()

    def _need(self, item: WorkItem) -> int:
        """The GPUs the item waits for: what it asks, at most all of those registered."""
        return 0 if self.gpus is None else min(gpus_needed(item), max(1, self.gpus.total))

    async def _admit(self, credential: Secret, items: list[WorkItem]) -> list[tuple[WorkItem, int | None]]:
        """The leased items that take a place in flight, each with `_place`'s answer (its GPUs, if free). The
        leasing loop alone takes places and asked for no more than were free, but the places can shrink while
        its call waits at the server (with maxInFlight 0 they follow the GPUs registered): an item past them is
        released back at once, not run on GPUs the agent may no longer have nor counted as a place it lacks."""
        admitted: list[tuple[WorkItem, int | None]] = []
        for item in items:
            if self.in_flight.try_take(1):
                admitted.append((item, self._place(item)))
                continue
            log.info("item %d leased while the places in flight shrank to %d (%d held); releasing it", item.item_id,
                     self.in_flight.total, self.in_flight.held)
            await self._release(credential, item)
        return admitted

    def _place(self, item: WorkItem) -> int | None:
        """Take the item's GPUs now, as it is leased (so the next lease call counts them): how many it took,
        or None when they are not free (it is then waiting from now on)."""
        need = self._need(item)
        if self.gpus is None or self.gpus.try_take(need):
            return need
        self.waiting_since[item.item_id] = self.clock.monotonic()
        return None

    async def _take_gpus(self, item: WorkItem) -> int | None:
        """Wait for the item's GPUs; how many it took, or None when the queue paused first (nothing taken)."""
        gpus, need = self.gpus, self._need(item)
        assert gpus is not None  # _place took them at once otherwise
        log.v(2, "item %d waits for %d GPU(s) (%d free)", item.item_id, need, gpus.free)
        taking = asyncio.ensure_future(gpus.take(need))
        paused = asyncio.ensure_future(self.open.wait_for(False))
        try:
            await asyncio.wait({taking, paused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            paused.cancel()
            taking.cancel()
            self.waiting_since.pop(item.item_id, None)
            await gpus.poke()  # the leasing loop may have been held back by this wait
        # A take that completed as it was cancelled holds the GPUs all the same; given back if the queue
        # paused by then (the item has not started: it goes back, as the docstring of the module says).
        if taking.done() and not taking.cancelled() and taking.exception() is None:
            if self.open.is_on:
                return need
            await gpus.give(need)
        return None

    async def _run(self, credential: Secret, item: WorkItem, placed: int | None, renewer: asyncio.Future[None]) -> None:
        """`placed`: the GPUs `_place` took for it, None when it waits for them first. `renewer`: the task
        that keeps its lease, stopped when its execution ends."""
        started = self.clock.monotonic()
        gpus = placed if placed is not None else await self._take_gpus(item)
        term_over = item.fence is not None and item.fence is not self.fence
        if gpus is None or term_over:
            renewer.cancel()
            if gpus:
                await self._give_gpus(gpus)
            log.v(2, "item %d was not started (%s); releasing it", item.item_id,
                  "the queue paused while it waited for GPUs" if gpus is None else "its term is over")
            await self._release(credential, item)
            return
        log.v(4, "executing item %d (key %s, delivery %d)", item.item_id, item.idempotency_key, item.deliveries)
        try:
            outcome = await self.executor.execute(item, self.leader)
        except AttemptNotMade as e:
            # Not the item's fault: back without an attempt counted, after a poll (no spinning on an outage).
            log.warning("item %d (key %s) could not be tried: %s; releasing it (no attempt counted)",
                        item.item_id, item.idempotency_key, e)
            self.not_tried = str(e)[:300]  # in /healthz until an item runs again
            if isinstance(e, WorkPathRefused) and self.check_path is not None:
                self._path_refused(str(e))
            self._report()
            await self._release(credential, item)
            await self.clock.sleep(self.poll_interval)
            return
        except Exception as e:  # noqa: BLE001 - a failing item must not stop the queue
            # Released with the reason: the control plane counts the attempt and holds the item back
            # for a backoff (the items behind it go first), then fails it after its last attempt.
            log.error("item %d (key %s) failed: %s; releasing it with the reason (retried after a backoff)",
                      item.item_id, item.idempotency_key, e)
            self.metrics.items.labels("failed").inc()
            self.failed_attempts += 1
            answer = await self._release(credential, item, str(e) or type(e).__name__)
            if answer == Released.FAILED:
                log.error("item %d (key %s) failed for good: no attempt left (`gpu-agent queue list` shows why)",
                          item.item_id, item.idempotency_key)
                self.failed_items += 1
                self.metrics.items.labels("gave-up").inc()
            self._report()
            return
        finally:
            renewer.cancel()
            await self._give_gpus(gpus)  # the Pod is done: its GPUs are free before the ack
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

    async def _give_gpus(self, n: int) -> None:
        if self.gpus is not None and n:
            await self.gpus.give(n)

    # An ack that landed but whose answer was lost would otherwise leave the item done at the control
    # plane, never redelivered, and its Pod never deleted; acking again with the same lease is
    # answered "already-acked".
    ACK_RETRIES = (1.0, 2.0, 4.0)

    async def _ack(self, credential: Secret, item: WorkItem) -> bool:
        return bool(await self._quietly(self.client.ack, credential, item, retries=self.ACK_RETRIES))

    # A release that got no answer is sent again: else the item stays leased, shown as such and given to no one,
    # until its lease runs out (the leaseSeconds; longer than a refused work path waits to say NotReady). The
    # control plane closes a keep-alive connection idle for its timeout, and a call sent on a pooled one just as
    # it closes gets no answer. A try that had landed makes the next one answered 409 (no longer its lease):
    # the item was given back, and the attempt, if one was counted, counted once.
    RELEASE_RETRIES = (1.0, 2.0, 4.0)

    async def _release(self, credential: Secret, item: WorkItem, *error: str) -> object:
        return await self._quietly(self.client.release, credential, item, *error, retries=self.RELEASE_RETRIES)

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
        unanswered = False
        for wait in (*retries, None):
            try:
                answer = await self.run_blocking(call, credential, item, *more)
                return True if answer is None else answer
            except Fenced as e:
                log.warning("%s refused: %s (the current leader has taken the item over)", call.__name__, e)
                self._fenced(e, item.fence)
                return False
            except ControlPlaneError as e:
                if unanswered and e.status == 409:  # the try that got no answer had landed: its lease is gone
                    log.v(1, "%s of item %d: the try without an answer had landed (%s)", call.__name__, item.item_id, e)
                    return False
                unanswered = e.recoverable
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
        """The leasing loop: items in flight each run in a task of their own. An exception none of them
        expects ends the loop and the agent (as it did when items ran one at a time)."""
        async with asyncio.TaskGroup() as items:
            while True:
                await self.open.wait_for(True)
                await self.in_flight.wait_until(self._room)
                if not self.open.is_on:
                    continue
                leased = await self._lease(self._batch())
                if leased is None:
                    await self._idle()
                    continue
                credential, batch = leased
                for item, placed in await self._admit(credential, batch):
                    items.create_task(self._hold(credential, item, placed), name=f"work-item-{item.item_id}")
                self._report()

