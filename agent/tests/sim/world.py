"""The simulated world: virtual time, a network that misbehaves, processes that pause and die, and
in-memory fakes of the API server and the control plane's transport.

Everything runs on one event loop whose clock is virtual (`VirtualTimeLoop`): when nothing is
ready, time jumps to the next timer, so a minute of faults costs milliseconds. Nothing runs on a
thread, so a seed fixes the whole schedule: every random draw comes from the world's one
`random.Random`, in an order the loop fixes.

The network (`Net.call`) is the `RunBlocking` every agent mechanism is given. A request travels for
a drawn delay (now and then a stall of seconds), may be lost, may arrive twice, and is applied by
its server when it arrives; its answer travels back the same way. The caller waits up to its
timeout on its own clock, which stops while its process is paused (SIGSTOP): a paused caller
cannot give up. A partition drops what crosses it, either way.

Two assumptions about the API server are written down here. A request whose caller gave up is
applied only if it arrives before then (the API server cancels a request's context when its
client's connection goes away, and a killed process's connections go with it). And a request is
never applied twice: HTTP over one TCP connection delivers it once, and the Kubernetes client does
not send a POST again by itself. (A create landing twice, the second after the item's Pod was
deleted, would run the item again under the same leadership; no token can tell it apart.) The
control plane, a plain HTTP server, applies a late request whenever it arrives, and may get one
twice (a proxy's retry): its handlers must be idempotent.

Faults that cost an item an attempt (a kubelet refusal, a Pod deleted before it started) are drawn
at most ITEM_FAULT_BUDGET times per item, fewer than the control plane's five attempts: an item the
world keeps refusing is failed by design, and the invariant is that a runnable one is not.

The API server fake keeps the history the invariants read (every Pod created, with its UID and
creator's token; every start and end; every write of the Lease), and enforces what the real one
does: names are unique (409), finalizers keep a deleted Pod until they are removed, and the chart's
admission policy fences work Pods by the Lease as it saw it a moment ago (its informer lags).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import selectors
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace as NS  # noqa: N814 - short: it stands in for many API objects below
from typing import Any

from gpu_agent.foundations.control_plane_client import Fence, Fenced, Rejected, Unauthorized, Unavailable, WorkItem
from gpu_agent.foundations.fencing import LEADER, LEASE_TRANSITIONS, LEASE_UID
from gpu_agent.mechanisms.leadership.elector import LeaseConflict, LeaseRecord
from gpu_agent.mechanisms.leadership.kube_fence import KubeWorkFence
from gpu_agent.mechanisms.queues.pod_executor import FINALIZER, LABEL, RELEASE_PATCH, RELEASE_PATCH_TYPE
from gpu_agent.roles.control_plane.store import Fenced as StoreFenced
from gpu_agent.roles.control_plane.store import Store

EPOCH = 1_800_000_000.0  # wall time at virtual 0
ITEM_FAULT_BUDGET = 3  # attempt-costing faults drawn per item at most (the store fails an item after 5 attempts)


class SimulationStuck(Exception):
    """Nothing is scheduled and nothing is ready: every coroutine waits for something that cannot come."""


class _VirtualSelector(selectors.SelectSelector):
    loop: VirtualTimeLoop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise SimulationStuck("no timer left and nothing ready")
        if timeout > 0:
            self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` only moves when it would otherwise wait: to the next timer."""

    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


# --- processes ------------------------------------------------------------------------------------

class Proc:
    """One agent process: its tasks, whether it runs (SIGSTOP pauses it) and whether it lives."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.running = asyncio.Event()
        self.running.set()
        self.alive = True
        self.resumed_at = float("-inf")
        self.tasks: set[asyncio.Task[Any]] = set()
        self.clock = ProcClock(self)

    async def gate(self) -> None:
        if not self.alive:
            raise asyncio.CancelledError()
        if not self.running.is_set():
            await self.running.wait()

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"{self.name}:{name}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def pause(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.resumed_at = asyncio.get_running_loop().time()
        self.running.set()

    def kill(self) -> None:
        """SIGKILL: no finally block reaches the outside (its calls fail at once), its connections close."""
        self.alive = False
        self.running.set()
        for task in list(self.tasks):
            task.cancel()


class ProcClock:
    """The Clock the agent's code gets: virtual time; a sleep that ends while the process is paused
    returns only when it resumes (a stopped process does not run)."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def wall(self) -> float:
        return EPOCH + asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))
        await self.proc.gate()


# --- faults and the network -----------------------------------------------------------------------

@dataclass
class Faults:
    """Fault levels; all zero once the world heals."""
    drop_request: float = 0.0
    drop_answer: float = 0.0
    duplicate: float = 0.0
    stall: float = 0.0  # a delay of seconds instead of milliseconds
    cut: set[tuple[str, str]] = field(default_factory=set)  # (process, "api" | "cp") partitions

    def healed(self) -> Faults:
        return Faults()


class Net:
    def __init__(self, world: World) -> None:
        self.world = world

    def delay(self) -> float:
        w = self.world
        if w.rng.random() < w.faults.stall:
            return w.rng.uniform(0.5, 15.0)
        return w.rng.uniform(0.001, 0.03)

    async def call(self, proc: Proc, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn` (a bound method of a server fake) called over the network from `proc`."""
        server = fn.__self__
        side: str = server.side
        timeout = kwargs.get("_request_timeout") or server.timeout
        w, loop = self.world, asyncio.get_running_loop()
        if not proc.alive:
            raise server.no_answer(fn.__name__, 0.0)
        await proc.gate()
        answer: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        gave_up = [False]

        def arrive(first: bool) -> None:
            if side == "api" and gave_up[0]:
                w.note(f"{proc.name}: {fn.__name__} arrived after its caller gave up; not applied")
                return
            if (proc.name, side) in w.faults.cut:
                return
            w.caller = proc.name
            try:
                result = (True, fn(*args, **kwargs))
            except Exception as e:  # noqa: BLE001 - the answer carries it back
                result = (False, e)
            finally:
                w.caller = ""
            if not first or w.rng.random() < w.faults.drop_answer:
                return

            def land() -> None:
                if not answer.done() and (proc.name, side) not in w.faults.cut:
                    answer.set_result(result)
            loop.call_later(self.delay(), land)

        if w.rng.random() >= w.faults.drop_request:
            d = self.delay()
            loop.call_later(d, arrive, True)
            if side == "cp" and w.rng.random() < w.faults.duplicate:
                loop.call_later(d + self.delay(), arrive, False)
        timer = asyncio.ensure_future(proc.clock.sleep(timeout))
        try:
            await asyncio.wait({answer, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            if not answer.done():
                gave_up[0] = True
        await proc.gate()
        if answer.done():
            ok, value = answer.result()
            if ok:
                return value
            raise value
        raise server.no_answer(fn.__name__, timeout)


# --- the API server -------------------------------------------------------------------------------

class ApiError(Exception):
    """What kubernetes.client.ApiException carries that the agent reads: status and reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"({status}) {reason}")
        self.status = status
        self.reason = reason


@dataclass
class PodRecord:
    name: str
    uid: str
    key: str
    gpus: int
    annotations: dict[str, str]
    finalizers: list[str]
    created_at: float
    creator: str
    phase: str = "Pending"
    started: bool = False
    unschedulable: bool = False
    deletion: float | None = None
    reason: str = ""
    ended_at: float | None = None
    gone_at: float | None = None


class ApiServer:
    POLICY_LAG = 0.2  # how far behind the admission policy's copy of the Lease may be

    def __init__(self, world: World, node_gpus: tuple[int, ...] = (4, 4)) -> None:
        self.world = world
        self.node_gpus = node_gpus
        self.pods: dict[str, PodRecord] = {}
        self.created: list[PodRecord] = []  # every Pod ever created, in order (the history)
        self.refused: list[tuple[float, str, str, str]] = []  # (time, pod, creator, why)
        self.fencing = True  # the chart's admission policy; off: what a build without it would do
        self.lease: LeaseRecord | None = None
        self.lease_history: list[tuple[float, LeaseRecord | None, str]] = [(0.0, None, "")]
        self.last_write_by: dict[str, float] = {}  # holder -> when it last wrote the Lease as its holder
        self.ids = itertools.count(1)
        # The release's WorkFence, the fencing policy's param (mechanisms/leadership/kube_fence.py): its spec and
        # resourceVersion as stored, and every version with when it was written (the policy reads it with a lag).
        self.fence: dict[str, Any] | None = None
        self.fence_history: list[tuple[float, dict[str, Any] | None]] = [(0.0, None)]

    @property
    def now(self) -> float:
        return self.world.now

    # the Lease ---------------------------------------------------------------
    def _set_lease(self, record: LeaseRecord | None) -> None:
        self.lease = record
        self.lease_history.append((self.now, record, self.world.caller))
        if record is not None and record.holder == self.world.caller:
            self.last_write_by[record.holder] = self.now

    def fence_as_of(self, at: float) -> dict[str, Any] | None:
        seen = None
        for t, spec in self.fence_history:
            if t > at:
                break
            seen = spec
        return seen

    def write_fence(self, body: dict[str, Any], create: bool) -> dict[str, Any]:
        """The WorkFence's create or conditional replace, with the CRD's rule on leaseTransitions."""
        if create and self.fence is not None:
            raise ApiError(409, "AlreadyExists")
        if not create:
            if self.fence is None:
                raise ApiError(404, "NotFound")
            if body["metadata"].get("resourceVersion") != self.fence["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict")
            old, new = self.fence["spec"], body["spec"]
            if old["leaseUid"] == new["leaseUid"] and new["leaseTransitions"] < old["leaseTransitions"]:
                raise ApiError(422, "Invalid: spec.leaseTransitions may not go back")
        self.fence = {"metadata": {"name": body["metadata"]["name"], "resourceVersion": str(next(self.ids))},
                      "spec": dict(body["spec"])}
        self.fence_history.append((self.now, dict(body["spec"])))
        return dict(self.fence)

    def lease_as_of(self, at: float) -> LeaseRecord | None:
        seen = None
        for t, record, _ in self.lease_history:
            if t > at:
                break
            seen = record
        return seen

    # Pods --------------------------------------------------------------------
    def create_pod(self, body: dict[str, Any], dry_run: bool = False) -> NS | None:
        """A dry run passes the same admission and stores nothing (its name may be a generateName)."""
        meta = body["metadata"]
        name = meta.get("name") or meta["generateName"] + "dry-run"
        annotations = dict(meta.get("annotations") or {})
        if name in self.pods and not dry_run:
            raise ApiError(409, "AlreadyExists")
        limits = body["spec"]["containers"][0].get("resources", {}).get("limits", {})
        gpus = int(limits.get("nvidia.com/gpu", "0"))
        if gpus < 0:
            raise ApiError(422, "Invalid: spec.containers[0].resources.limits[nvidia.com/gpu]: must be >= 0")
        if self.fencing and meta.get("labels", {}).get(LABEL) == "true" and LEADER in annotations:
            # The chart's policy: its param the WorkFence, as its cache has it (up to POLICY_LAG behind).
            fence = self.fence_as_of(self.now - self.world.rng.uniform(0, self.POLICY_LAG))
            if fence is None:
                self.refused.append((self.now, name, self.world.caller, "no WorkFence"))
                raise ApiError(422, "Invalid: failed to configure binding: no params found for policy binding with "
                                    "`Deny` parameterNotFoundAction")
            if not (annotations.get(LEADER) == fence["holder"] and annotations.get(LEASE_UID) == fence["leaseUid"]
                    and annotations.get(LEASE_TRANSITIONS) == str(fence["leaseTransitions"])):
                named = f"{fence['holder']} (transition {fence['leaseTransitions']})"
                self.refused.append((self.now, name, self.world.caller, f"the fence names {named}"))
                raise ApiError(403, f"Forbidden: work pod fenced: created under leadership {annotations.get(LEADER)}; "
                                    f"the fence now names {named}")
        if dry_run:
            return None
        pod = PodRecord(name, f"uid-{next(self.ids)}", annotations.get("gpu-agent.io/idempotency-key", ""), gpus,
                        annotations, list(meta.get("finalizers") or []), self.now, self.world.caller)
        self.pods[name] = pod
        self.created.append(pod)
        self.world.kubelet.admit(pod)
        return self.view(pod)

    def view(self, pod: PodRecord) -> NS:
        ran = NS(state=NS(running=None, terminated=NS(started_at="t")), last_state=None)
        conditions = [NS(type="PodScheduled", status="False", reason="Unschedulable")] if pod.unschedulable else []
        return NS(metadata=NS(name=pod.name, uid=pod.uid, deletion_timestamp=pod.deletion, finalizers=list(pod.finalizers),
                              annotations=dict(pod.annotations)),
                  status=NS(phase=pod.phase, conditions=conditions, reason=pod.reason or None, message="",
                            container_statuses=[ran] if pod.started else []),
                  spec=NS(containers=[NS(resources=NS(limits={"nvidia.com/gpu": str(pod.gpus)}))]))

    def read_pod(self, name: str) -> NS:
        pod = self.pods.get(name)
        if pod is None:
            raise ApiError(404, "NotFound")
        return self.view(pod)

    def _remove_if_released(self, pod: PodRecord) -> None:
        if pod.deletion is not None and not pod.finalizers:
            self.pods.pop(pod.name, None)
            pod.gone_at = self.now

    def release_pod(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is None:
            raise ApiError(404, "NotFound")
        pod.finalizers = [f for f in pod.finalizers if f != FINALIZER]
        self._remove_if_released(pod)

    def delete_pod(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is None:
            raise ApiError(404, "NotFound")
        if pod.deletion is None:
            pod.deletion = self.now
            self.world.kubelet.stop(pod)
        self._remove_if_released(pod)


class FakeCore:
    """CoreV1Api's calls the Pod executor makes, against the ApiServer."""
    side = "api"
    timeout = 10.0

    def __init__(self, api: ApiServer) -> None:
        self.api = api

    @staticmethod
    def no_answer(what: str, timeout: float) -> Exception:
        return TimeoutError(f"{what}: read timed out ({timeout:g}s)")

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any], _request_timeout: float,
                              dry_run: str | None = None) -> NS | None:
        return self.api.create_pod(body, dry_run=dry_run == "All")

    def read_namespaced_pod(self, name: str, namespace: str, _request_timeout: float) -> NS:
        return self.api.read_pod(name)

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any], _request_timeout: float,
                             _content_type: str) -> None:
        assert (body, _content_type) == (RELEASE_PATCH, RELEASE_PATCH_TYPE), body
        self.api.release_pod(name)

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int, _request_timeout: float) -> None:
        self.api.delete_pod(name)

    def list_namespaced_pod(self, namespace: str, label_selector: str, _request_timeout: float) -> NS:
        assert label_selector.startswith(f"{LABEL}=true"), label_selector
        return NS(items=[self.api.view(p) for p in self.api.pods.values()])

    def list_node(self, _request_timeout: float) -> NS:
        return NS(items=[NS(status=NS(allocatable={"nvidia.com/gpu": str(n)})) for n in self.api.node_gpus])


class FakeFenceApi:
    """CustomObjectsApi's calls on the WorkFence, against the ApiServer (made at the instant they arrive)."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                     _request_timeout: float) -> dict[str, Any]:
        if self.api.fence is None:
            raise ApiError(404, "NotFound")
        return {**self.api.fence, "spec": dict(self.api.fence["spec"])}

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                        body: dict[str, Any], _request_timeout: float) -> dict[str, Any]:
        return self.api.write_fence(body, create=True)

    def replace_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                         body: dict[str, Any], _request_timeout: float) -> dict[str, Any]:
        return self.api.write_fence(body, create=False)


class SimWorkFence(KubeWorkFence):
    """The real WorkFence writer; each of its API calls (its read, its write) crosses the simulated network on its
    own, as the agent makes them (net.call reads where a call goes from the object it is a method of)."""
    side = "api"

    def __init__(self, api: ApiServer) -> None:
        super().__init__(None, namespace="work", name="sim", request_timeout=4.0, custom=FakeFenceApi(api),
                         apps=object())

    @staticmethod
    def no_answer(what: str, timeout: float) -> Exception:
        return TimeoutError(f"fence {what}: read timed out ({timeout:g}s)")


class FakeLease:
    """The elector's LeaseBackend as KubeLease behaves: 409 is LeaseConflict, 404 on read is None."""
    side = "api"
    timeout = 4.0  # what the cluster agent gives KubeLease with the default settings

    def __init__(self, api: ApiServer) -> None:
        self.api = api

    @staticmethod
    def no_answer(what: str, timeout: float) -> Exception:
        return TimeoutError(f"lease {what}: read timed out ({timeout:g}s)")

    def _stored(self, record: LeaseRecord, uid: str) -> LeaseRecord:
        return replace(record, version=str(next(self.api.ids)), uid=uid)

    def get(self) -> LeaseRecord | None:
        return self.api.lease

    def create(self, record: LeaseRecord) -> LeaseRecord:
        if self.api.lease is not None:
            raise LeaseConflict()
        stored = self._stored(record, f"lease-{next(self.api.ids)}")
        self.api._set_lease(stored)
        return stored

    def update(self, record: LeaseRecord) -> LeaseRecord:
        current = self.api.lease
        if current is None or record.version != current.version:
            raise LeaseConflict()
        stored = self._stored(record, current.uid)
        self.api._set_lease(stored)
        return stored

    def delete(self, record: LeaseRecord) -> None:
        current = self.api.lease
        if current is None:
            return
        if record.version != current.version:
            raise LeaseConflict()
        self.api._set_lease(None)


class Kubelet:
    """Runs work Pods: starts them after a moment, ends them after their work; faults from the world."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.timers: dict[str, asyncio.TimerHandle] = {}

    def admit(self, pod: PodRecord) -> None:
        w = self.world
        if pod.gpus > max(w.api.node_gpus):
            pod.unschedulable = True
            return
        loop = asyncio.get_running_loop()
        if w.rng.random() < w.fault_rate("admission") and w.spend_item_fault(pod.key):
            self.timers[pod.uid] = loop.call_later(w.rng.uniform(0.2, 2.0), self._end, pod, "Failed", "UnexpectedAdmissionError")
            return
        self.timers[pod.uid] = loop.call_later(w.rng.uniform(0.2, 2.0), self._start, pod)

    def _start(self, pod: PodRecord) -> None:
        w = self.world
        pod.phase, pod.started = "Running", True
        work = w.rng.uniform(0.5, 6.0) if w.rng.random() > 0.1 else w.rng.uniform(20.0, 45.0)
        failed = w.rng.random() < w.fault_rate("crash")
        self.timers[pod.uid] = asyncio.get_running_loop().call_later(
            work, self._end, pod, "Failed" if failed else "Succeeded", "Error" if failed else "")

    def _end(self, pod: PodRecord, phase: str, reason: str) -> None:
        self.timers.pop(pod.uid, None)
        pod.phase, pod.reason, pod.ended_at = phase, reason, self.world.now

    def stop(self, pod: PodRecord) -> None:
        """The Pod is being deleted: a running container is killed (Failed, it ran); one not started never starts."""
        timer = self.timers.pop(pod.uid, None)
        if timer is not None:
            timer.cancel()
        if pod.phase == "Running":
            self._end(pod, "Failed", "Killed")


# --- the control plane's transport ---------------------------------------------------------------

class ControlPlane:
    """What ControlPlaneClient does over HTTP, done on the real Store, with the server's mapping of
    results to errors (roles/control_plane/server.py)."""
    side = "cp"
    timeout = 10.0

    def __init__(self, world: World, rng: random.Random) -> None:
        self.world = world
        self.store = Store(Path(":memory:"), clock=lambda: EPOCH + world.now, rng=rng)
        self.refuse_until = float("-inf")

    @staticmethod
    def no_answer(what: str, timeout: float) -> Exception:
        return Unavailable(f"{what}: timed out after {timeout:g}s")

    def _authorized(self) -> None:
        if self.world.now < self.refuse_until:
            raise Unauthorized("401 credential expired or revoked", 401)

    def _call(self, fn: Any, *args: Any) -> Any:
        self._authorized()
        try:
            result = fn(*args)
        except StoreFenced as e:
            raise Fenced(f"409 {e}", 409) from None
        if result == "stale-lease":
            raise Rejected("409 that lease is no longer the current lease", 409)
        if result == "unknown":
            raise Rejected("404 no such item", 404)
        return result

    def start_term(self, credential: Any, holder: str) -> Fence:
        term, _ = self._call(self.store.start_term, holder)
        return Fence(holder, term)

    def lease(self, credential: Any, lease_seconds: float, wait_seconds: float = 0.0,
              fence: Fence | None = None) -> WorkItem | None:
        items = self.lease_many(credential, lease_seconds, wait_seconds, fence, 1)
        return items[0] if items else None

    def lease_many(self, credential: Any, lease_seconds: float, wait_seconds: float = 0.0,
                   fence: Fence | None = None, max_items: int = 1) -> list[WorkItem]:
        docs = self._call(self.store.lease_many, lease_seconds, max_items, fence.holder if fence else None,
                          fence.term if fence else None)
        return [WorkItem(d["id"], d["idempotencyKey"], d["payload"], d["leaseId"], d["deliveries"], fence) for d in docs]

    def ack(self, credential: Any, item: WorkItem) -> None:
        self._call(self.store.ack, item.item_id, item.lease_id, item.fence.term if item.fence else None)

    def renew_lease(self, credential: Any, item: WorkItem, lease_seconds: float) -> None:
        self._call(self.store.renew, item.item_id, item.lease_id, lease_seconds, item.fence.term if item.fence else None)

    def release(self, credential: Any, item: WorkItem, error: str | None = None) -> str:
        return self._call(self.store.release, item.item_id, item.lease_id, item.fence.term if item.fence else None, error)

    def item_state(self, credential: Any, item_id: int) -> str:
        state = self._call(self.store.item_state, item_id)
        if state is None:
            raise Rejected("404 no such item", 404)
        return str(state)


# --- the world ------------------------------------------------------------------------------------

class World:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.faults = Faults()
        self.rates: dict[str, float] = {}
        self.item_faults: dict[str, int] = {}
        self.trace: list[tuple[float, str]] = []
        self.caller = ""  # the process whose request a server is applying now (for the history)
        self.net = Net(self)
        self.api = ApiServer(self)
        self.kubelet = Kubelet(self)
        self.control_plane = ControlPlane(self, random.Random(seed ^ 0x5EED))

    @property
    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def fault_rate(self, kind: str) -> float:
        return self.rates.get(kind, 0.0)

    def spend_item_fault(self, key: str) -> bool:
        """Whether one more attempt-costing fault may hit item `key` (and count it)."""
        if self.item_faults.get(key, 0) >= ITEM_FAULT_BUDGET:
            return False
        self.item_faults[key] = self.item_faults.get(key, 0) + 1
        return True

    def note(self, text: str) -> None:
        self.trace.append((self.now, text))
