"""The Pod executor: a work item runs as a Pod with a name derived from its idempotency key.

A redelivered item finds its Pod already there (AlreadyExists) and only waits for it, so an
item never makes a second Pod. The Pod is deleted only after the item is acknowledged
(`after_ack`): a crash between the Pod finishing and the ack leaves the Pod to be found by
the redelivery.

Three rules keep "one Pod per item" true under schedules nobody plans for:
- Fencing: every Pod carries the fencing token of the leadership that created it
  (foundations/fencing.py) and the chart's admission policy refuses one whose token is not the
  one the leader wrote into the release's WorkFence, so a create a deposed leader sent late
  (stalled in a partition, its process paused) never lands after its successor ran the item. A
  refused create is tried again after FENCED_RETRIES, then the item goes back without counting an
  attempt (WorkPathRefused).
- A finalizer (`gpu-agent.io/work-item`) keeps the Pod, and so the record that the item ran,
  until the item is acknowledged: a Pod deleted by someone else (a user, PodGC, a hook) after it
  Succeeded is still found by the redelivery, which acknowledges it instead of running it again.
  A deleted Pod that never started is released (the finalizer removed) and the attempt fails, so
  the retry makes a new one; one deleted while it ran is a run (at most once), as a Failed Pod is.
- Every call has a request timeout; a create without an answer is sent again (if the first
  landed, the second's conflict is our own Pod); a read without one is read again at the next poll.

A create the API server refuses (anything answered but a conflict) is told apart by a dry run of a Pod
any item would make (one GPU, the default command) under the same token: refused too, it is not the
item's doing (the fencing policy, a quota, a missing ServiceAccount, an admission webhook or policy
refusing every Pod) but WorkPathRefused: the item goes back uncounted and the consumer proves the path
with `probe` (dry-run creates: the leader's own token admitted, and with fencing a stale one refused)
before it leases more. Admitted, the refusal was about what the item asks: an attempt counted.

A Pod that can never be scheduled (it asks for more GPUs than any node has) fails the attempt at
once instead of holding the queue for the whole timeout: the scheduler's Unschedulable condition
is checked against the nodes' allocatable GPUs (at most every NODE_CHECK_SECONDS), and the Pod,
which never ran, is deleted so that the redelivery (after the control plane's backoff) tries
afresh, and a failed item leaves nothing Pending behind. A Pod the kubelet refused before any of its
containers ran (Failed, e.g. UnexpectedAdmissionError after a kubelet restart) fails the attempt
the same way instead of being acknowledged as a run.

The executor is a coroutine: its polls wait on the injected clock and its API calls go through
the offload it was given (a daemon thread in production, the simulated network in agent/tests/sim).
In production one watch of the work Pods says when to read each Pod again (pod_changes.py), instead
of a read every `poll_seconds` per item in flight; the reads, and so every decision, stay the same.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.config import parse_labels
from gpu_agent.foundations.control_plane_client import ItemState, WorkItem
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT, api_message, device_count
from gpu_agent.foundations.kube import api_status as _status
from gpu_agent.foundations.slices import node_usable
from gpu_agent.foundations.threads import RunBlocking, in_daemon_thread
from gpu_agent.mechanisms.queues.executor import AttemptNotMade, Outcome, WorkPathRefused
from gpu_agent.mechanisms.queues.pod_changes import PodChanges, Polling
from gpu_agent.mechanisms.queues.work_claims import GPU_COUNT_ANNOTATION, DraWorkClaims

log = get_logger(__name__)
LABEL = "gpu-agent.io/work-item"
FINALIZER = "gpu-agent.io/work-item"
# Removes only this finalizer (a strategic-merge patch): what the agent, the cleanup hook and the e2e
# teardown send before deleting a work Pod.
RELEASE_PATCH = {"metadata": {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}}
RELEASE_PATCH_TYPE = "application/strategic-merge-patch+json"
ITEM_ID = "gpu-agent.io/item-id"  # the control plane's id of the item, for the sweep
GPU = "nvidia.com/gpu"
NODE_CHECK_SECONDS = 15.0
CREATE_ATTEMPTS = 3
# A fenced create is tried again after each of these (seconds): the admission policy's copy of the
# WorkFence can lag the token this agent has just written; a real fencing stays refused.
FENCED_RETRIES = (0.5, 1.0, 2.0)


def pod_name(key: str) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-")[:30].strip("-")
    return f"gpu-work-{slug}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


class PodExecutor:
    def __init__(self, core: Any, namespace: str, image: str, *, release: str = "", timeout_seconds: float = 600,
                 poll_seconds: float = 0.5, clock: Clock | None = None, run_blocking: RunBlocking = in_daemon_thread,
                 pod_changes: PodChanges | Polling | None = None, node_selector: str = "",
                 claims: DraWorkClaims | None = None, fencing: bool = False,
                 work_pods: dict[str, Any] | None = None, service_account: str = "") -> None:
        self.core = core
        # the ServiceAccount work Pods run as (the chart's <fullname>-work, bound to no role); "": the namespace's
        # default. Either way no token is mounted (_pod), and the chart's shape policy refuses any other account
        self.service_account = service_account
        # what the user adds to every work Pod (foundations/work_pods.py, parsed by the settings loader); what the
        # agent sets itself is put last in _pod and wins
        self.work_pods = dict(work_pods or {})
        # the chart's fencing policy guards the work Pods (workPodFence set): `probe` checks it refuses a stale token
        self.fencing = fencing  # kubernetes.client.CoreV1Api, or the simulation's API server
        # GPUs through DRA (a ResourceClaimTemplate per count: work_claims.py); None: nvidia.com/gpu limits
        self.claims = claims
        # the nodes whose GPUs the agent counts (gpuNodeSelector): work Pods go there and nowhere else
        self.node_selector = node_selector
        self.node_labels = parse_labels(node_selector)  # parsed once, not for every Pod
        self.namespace = namespace
        self.image = image
        self.release = release
        self.timeout_seconds = timeout_seconds
        self.poll_seconds = poll_seconds
        self.clock = clock or SystemClock()
        self.run_blocking = run_blocking
        # when to read a Pod again; None: every poll_seconds (the simulation)
        self.pod_changes = pod_changes if pod_changes is not None else Polling(self.clock)

    async def _api(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        return await self.run_blocking(call, *args, _request_timeout=REQUEST_TIMEOUT, **kwargs)

    def _pod(self, item: WorkItem, leader: LeaderToken | None) -> dict[str, Any]:
        """The item's Pod: the user's workPods shape under what the agent needs, which wins on every shared key
        (its labels, annotations, finalizer, restartPolicy, the GPU limit or claim, the gpuNodeSelector)."""
        payload = item.payload
        command = payload.get("command") or ["fake-gpu", "smi", "-L"]
        gpus = int(payload.get("gpus", 1))
        shape = self.work_pods
        labels = {**shape.get("labels", {}), LABEL: "true", "app.kubernetes.io/managed-by": "gpu-agent"}
        if self.release:
            labels["app.kubernetes.io/instance"] = self.release
        spec_claims, resources = ({}, {"limits": {GPU: str(gpus)}}) if self.claims is None or not gpus \
            else self.claims.pod_parts(gpus)
        resources = with_users_resources(shape.get("resources", {}), resources if gpus else {})
        node_selector = {**shape.get("nodeSelector", {}), **self.node_labels}
        placement = {key: shape[key] for key in ("tolerations", "affinity", "runtimeClassName", "imagePullSecrets",
                                                 "priorityClassName") if key in shape}
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(item.idempotency_key), "labels": labels, "finalizers": [FINALIZER],
                         "annotations": {**shape.get("annotations", {}),
                                         "gpu-agent.io/idempotency-key": item.idempotency_key[:250], ITEM_ID: str(item.item_id),
                                         GPU_COUNT_ANNOTATION: str(gpus), **(leader.annotations() if leader else {})}},
            "spec": {
                **placement,
                **({"serviceAccountName": self.service_account} if self.service_account else {}),
                # An item's command needs no API access, and a token here would be one more credential for a Pod
                # anyone who can enqueue may shape; the chart's shape policy refuses a work Pod that mounts one.
                "automountServiceAccountToken": False,
                # the release's Services (the control plane's among them) are not the work's business
                "enableServiceLinks": False,
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 5,
                **({"nodeSelector": node_selector} if node_selector else {}),
                **spec_claims,
                "containers": [{
                    "name": "work", "image": self.image, "imagePullPolicy": "IfNotPresent",
                    "command": [str(c) for c in command],
                    "resources": resources,
                    # Admitted by Pod Security "restricted", like every pod of the chart.
                    "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
                }],
            },
        }

    async def _create(self, item: WorkItem, name: str, leader: LeaderToken | None) -> Outcome:
        """EXECUTED, or DUPLICATE when the Pod of an earlier delivery is there. A create that got no
        answer is sent again: if the first landed, the second's conflict is our own Pod."""
        fenced_waits = list(FENCED_RETRIES)
        unanswered = 0
        gpus = int(item.payload.get("gpus", 1))
        if self.claims is not None and gpus:
            await self.claims.ensure(gpus, self._api)
        while unanswered < CREATE_ATTEMPTS:
            try:
                await self._api(self.core.create_namespaced_pod, self.namespace, self._pod(item, leader))
                log.v(1, "created pod %s/%s for item %d", self.namespace, name, item.item_id)
                return Outcome.EXECUTED
            except Exception as e:  # noqa: BLE001 - an answer decides; no answer: try again
                status, refusal = _status(e), fencing_refusal(e) if leader is not None else ""
                if status == 409:
                    # a redelivery: the pod from the first delivery is the execution (or our own unanswered create)
                    return Outcome.EXECUTED if unanswered else Outcome.DUPLICATE
                if refusal and fenced_waits:  # the policy reads the fence from a cache, which can lag a token just written
                    await self.clock.sleep(fenced_waits.pop(0))
                    continue
                if status is not None and (refusal or await self._refused_for_any_item(leader)):
                    raise WorkPathRefused(f"creating pod {self.namespace}/{name} was refused: "
                                          f"{refusal_text(e, leader, refusal)}") from None
                if status is not None:  # a Pod like it, the item's own parts aside, is admitted: the item's doing
                    raise RuntimeError(f"creating pod {self.namespace}/{name} failed: {status} "
                                       f"{getattr(e, 'reason', '')}: {api_message(e)}") from None
                unanswered += 1
                log.warning("creating pod %s/%s got no answer (%s); attempt %d of %d", self.namespace, name,
                            type(e).__name__, unanswered, CREATE_ATTEMPTS)
        raise AttemptNotMade(f"creating pod {self.namespace}/{name} got no answer {CREATE_ATTEMPTS} times")

    async def _read(self, name: str) -> Any:
        """The Pod, or None when the API server did not answer in time (the caller polls again)."""
        try:
            return await self._api(self.core.read_namespaced_pod, name, self.namespace)
        except Exception as e:  # noqa: BLE001 - no answer, or an error: the next poll reads again
            status = _status(e)
            if status == 404:
                raise RuntimeError(f"work pod {self.namespace}/{name} was deleted by someone else (its finalizer "
                                   "removed) before it finished") from None
            if status is not None:
                log.warning("reading pod %s/%s failed: %s %s; reading again", self.namespace, name, status,
                            getattr(e, "reason", ""))
            else:
                log.warning("reading pod %s/%s got no answer (%s); reading again", self.namespace, name, type(e).__name__)
        return None

    async def probe(self, leader: LeaderToken | None) -> str:
        """Prove the work path without running anything: "" when a dry-run create of an item's Pod under
        `leader` is admitted and, with fencing, one under a token that was never the fence's is refused by the
        policy; else what is wrong. Each dry run passes every admission step a real create does (the policy,
        quota, Pod Security, webhooks) and makes nothing."""
        problem = await self._refused_for_any_item(leader)
        if problem or not (self.fencing and leader is not None):
            return problem
        check = WorkItem(item_id=0, idempotency_key="work-path-check", payload={"gpus": 1}, lease_id="", deliveries=0)
        never = LeaderToken(f"{leader.holder}.work-path-check", leader.lease_uid, leader.transitions)
        refused = await self._dry_run(self._probe_pod(check, never))
        if refused is None:
            return ("fencing is not enforced: a dry-run work pod under a token that is not the WorkFence's was admitted "
                    "(the ValidatingAdmissionPolicy or its binding missing, or not active yet); a deposed leader's late "
                    "create could run an item twice. Reinstall the chart's policy, or set clusterAgent.workPodFencing=false")
        status, text = refused
        if status is None:
            return f"a dry-run create of a work pod got no answer ({text})"
        if "work pod fenced" not in text:
            return f"a dry-run work pod under a stale token was refused, but not by the fencing policy: {text}"
        return ""

    async def _refused_for_any_item(self, leader: LeaderToken | None) -> str:
        """Why a dry-run work Pod of one GPU and the default command, under `leader`, is refused ("" when admitted):
        what any item's Pod would meet (the fencing policy, a quota, a ServiceAccount, a webhook). A real Pod refused
        while this one is admitted was refused for what its item asks. A refusal by the fencing policy is tried again
        after each of FENCED_RETRIES: its copy of the WorkFence can lag the token the leader has just written."""
        check = WorkItem(item_id=0, idempotency_key="work-path-check", payload={"gpus": 1}, lease_id="", deliveries=0)
        if self.claims is not None:
            try:
                await self.claims.ensure(1, self._api)
            except Exception as e:  # noqa: BLE001 - the path's problem, told in /healthz; never the agent's end
                return f"the ResourceClaimTemplate of work Pods could not be made: {e}"
        for wait in (*FENCED_RETRIES, None):
            refused = await self._dry_run(self._probe_pod(check, leader))
            if refused is None:
                return ""
            status, text = refused
            if status is None:
                return f"a dry-run create of a work pod got no answer ({text})"
            if wait is None or not ("work pod fenced" in text or "no params found" in text):
                return f"a dry-run create of a work pod under this agent's own token was refused: {text}"
            await self.clock.sleep(wait)
        return ""  # not reached: the last try returns

    def _probe_pod(self, item: WorkItem, leader: LeaderToken | None) -> dict[str, Any]:
        pod = self._pod(item, leader)
        del pod["metadata"]["name"]
        pod["metadata"]["generateName"] = "gpu-work-path-check-"  # a dry run persists nothing, and never conflicts
        return pod

    async def _dry_run(self, pod: dict[str, Any]) -> tuple[int | None, str] | None:
        """None when admitted; else (status or None for no answer, what was said)."""
        try:
            await self._api(self.core.create_namespaced_pod, self.namespace, pod, dry_run="All")
            return None
        except Exception as e:  # noqa: BLE001 - every answer is told back
            status = _status(e)
            if status is None:
                return None, type(e).__name__
            return status, f"{status} {getattr(e, 'reason', '')}: {api_message(e)}"

    def close(self) -> None:
        """Stop watching the work Pods (this agent stopped leading, or shuts down); an item still running then
        reads its Pod every `poll_seconds`, and the next item leased starts the watch again."""
        self.pod_changes.stop()

    async def execute(self, item: WorkItem, leader: LeaderToken | None = None) -> Outcome:

        name = pod_name(item.idempotency_key)
        self.pod_changes.start()
        with self.pod_changes.interest(name) as changed:
            return await self._follow(item, name, leader, changed)

    async def _follow(self, item: WorkItem, name: str, leader: LeaderToken | None, changed: asyncio.Event) -> Outcome:
        """Create the item's Pod (or find it) and read it until it ends; between reads, wait for the watch
        to show it changed (pod_changes.py) or, without one, `poll_seconds`."""
        outcome = await self._create(item, name, leader)
        deadline = self.clock.monotonic() + self.timeout_seconds
        nodes_checked = float("-inf")
        while True:
            changed.clear()  # before the read: a change from here on ends the wait below at once
            pod = await self._read(name)
            phase = pod.status.phase if pod is not None else None
            deleting = pod is not None and pod.metadata.deletion_timestamp is not None
            if phase == "Pending" and unschedulable(pod) and self.clock.monotonic() - nodes_checked >= NODE_CHECK_SECONDS:
                nodes_checked = self.clock.monotonic()
                wanted, most = gpus_asked(pod, dra=self.claims is not None), await self._most_gpus_on_a_node()
                if wanted > most:
                    await self._delete(name)
                    raise RuntimeError(f"the item asks for {wanted} {self._offered} and no node has that many (the most "
                                       f"on one node: {most}); its pod {self.namespace}/{name} can never be scheduled "
                                       "and was deleted")
            if phase in ("Pending", "Failed", "Unknown") and never_started(pod) and (phase == "Failed" or deleting):
                # Refused by the kubelet before any container ran (UnexpectedAdmissionError, OutOf<resource>
                # right after a kubelet restart), or deleted by someone before it started: not a run.
                # Deleted (its finalizer removed) so that the retry makes a new Pod.
                await self._delete(name)
                why = "was deleted before any container started" if phase != "Failed" else \
                    f"failed before any container started ({pod.status.reason or 'no reason given'}: {pod.status.message or ''})"
                raise RuntimeError(f"work pod {self.namespace}/{name} {why}; deleted, to be tried again")
            if phase in ("Succeeded", "Failed"):
                # A failed run is still a run: acknowledged, never started again. A Succeeded Pod someone
                # deleted is kept by the finalizer until this ack.
                if phase == "Failed":
                    log.warning("work pod %s/%s of item %d ended Failed%s", self.namespace, name, item.item_id,
                                " (deleted while it ran)" if deleting else "")
                return outcome
            if self.clock.monotonic() > deadline:
                raise RuntimeError(f"pod {self.namespace}/{name} did not finish within {self.timeout_seconds:.0f}s")
            await self.pod_changes.wait(changed, self.poll_seconds)

    @property
    def _offered(self) -> str:
        return GPU if self.claims is None else f"GPUs of DeviceClass {self.claims.device_class}"

    async def _most_gpus_on_a_node(self) -> int:
        selector = {"label_selector": self.node_selector} if self.node_selector else {}
        nodes = (await self._api(self.core.list_node, **selector)).items
        if self.claims is not None:
            return await self.claims.most_on_a_node({n.metadata.name for n in nodes if node_usable(n)}, self._api)
        return max((device_count(n.status.allocatable, GPU) for n in nodes if n.status), default=0)

    async def _delete(self, name: str) -> None:
        """Remove the finalizer, then delete: the Pod is gone at once. Either call may fail (the next
        delivery or the cleanup hook tries again); a Pod already gone is fine."""
        steps = (("releasing", self.core.patch_namespaced_pod, (name, self.namespace, RELEASE_PATCH),
                  {"_content_type": RELEASE_PATCH_TYPE}),
                 ("deleting", self.core.delete_namespaced_pod, (name, self.namespace), {"grace_period_seconds": 0}))
        for what, call, args, kwargs in steps:
            try:
                await self._api(call, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - logged; see above
                if _status(e) == 404:
                    return
                log.warning("%s pod %s/%s failed: %s", what, self.namespace, name, getattr(e, "reason", None) or type(e).__name__)

    async def after_ack(self, item: WorkItem) -> None:
        await self._delete(pod_name(item.idempotency_key))

    async def sweep(self, item_state: Callable[[int], Awaitable[str | None]]) -> int:
        """Delete the Pods of items the control plane has finished (done or failed): those whose
        `after_ack` never happened (its agent died between the ack and the delete, the delete got no
        answer, or the ack's answer was lost and its retry fenced). Any other Pod is left to its
        item's delivery. `item_state` asks the control plane (None: it could not say). How many were deleted."""
        try:
            pods = (await self._api(self.core.list_namespaced_pod, self.namespace,
                                    label_selector=work_pod_selector(self.release))).items
        except Exception as e:  # noqa: BLE001 - the next sweep tries again
            log.warning("listing work pods to sweep failed: %s", getattr(e, "reason", None) or type(e).__name__)
            return 0
        swept = 0
        for pod in pods:
            item_id = (pod.metadata.annotations or {}).get(ITEM_ID, "")
            if not item_id.isdigit() or await item_state(int(item_id)) not in (ItemState.DONE, ItemState.FAILED):
                continue
            log.info("work pod %s/%s belongs to item %s, which is finished; deleting it", self.namespace,
                     pod.metadata.name, item_id)
            await self._delete(pod.metadata.name)
            swept += 1
        return swept


def with_users_resources(users: dict[str, dict[str, str]], agents: dict[str, Any]) -> dict[str, Any]:
    """The work container's resources: the user's requests and limits with the agent's (the GPU limit, or the DRA
    claim) over them; only the agent's when the user set none."""
    if not users:
        return agents
    out: dict[str, Any] = {part: dict(amounts) for part, amounts in users.items()}
    for part, value in agents.items():
        out[part] = {**out.get(part, {}), **value} if isinstance(value, dict) else value
    return out


def work_pod_selector(release: str) -> str:
    """The work Pods of this release (all releases' when empty): what the sweep lists and pod_changes.py watches."""
    return f"{LABEL}=true" + (f",app.kubernetes.io/instance={release}" if release else "")


def fencing_refusal(e: BaseException) -> str:
    """How the chart's admission policy refused a work Pod: "fenced" (403 "work pod fenced": its token is not
    the WorkFence's), "no fence" (422 "no params found": no leader has written it yet, or the policy has not
    seen it yet), or "" (not the policy). Told by the message, so that a Pod refused for what it asks (422 for
    a bad limit) still counts an attempt."""
    if _status(e) not in (403, 422):
        return ""
    text = f"{getattr(e, 'reason', '')} {getattr(e, 'body', '')}"
    return "fenced" if "work pod fenced" in text else "no fence" if "no params found" in text else ""


def refusal_text(e: BaseException, leader: LeaderToken | None, refusal: str) -> str:
    message = api_message(e)
    if refusal == "no fence":
        return (f"the admission policy fencing work Pods found no WorkFence, though this agent leads under {leader} "
                f"(it writes its token there before its first item): {message}")
    if refusal == "fenced":
        return f"this agent's leadership ({leader}) is not the WorkFence's (fenced by the admission policy): {message}"
    return f"{_status(e)} {getattr(e, 'reason', '')}: {message}"


def never_started(pod: Any) -> bool:
    """No container of the Pod ever ran: none is running or terminated with a start time, now or before."""
    for status in pod.status.container_statuses or []:
        for state in (status.state, status.last_state):
            if state is not None and (state.running is not None
                                      or (state.terminated is not None and state.terminated.started_at is not None)):
                return False
    return True


def unschedulable(pod: Any) -> bool:
    return any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
               for c in (pod.status.conditions or []))


def gpus_asked(pod: Any, *, dra: bool = False) -> int:
    """The GPUs a work Pod asks for: its limits, or through DRA the count it was made with (its annotation)."""
    if dra:
        value = (pod.metadata.annotations or {}).get(GPU_COUNT_ANNOTATION, "0")
        return int(value) if value.isdigit() else 0
    return sum(int(((c.resources.limits if c.resources else None) or {}).get(GPU, "0")) for c in pod.spec.containers)
