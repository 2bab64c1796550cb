"""Prepare and unprepare: what the kubelet asks of a DRA driver before a pod's containers start and
after its last one ends.

    prepare(claim refs, deadline) ──> one at a time (a lock, waited on no longer than the call may last)
        checkpoint says Completed ─> what it returned then (the kubelet retries; it calls again after a restart)
        checkpoint says Aborted   ─> permanent error (a late retry must not prepare a claim already unprepared)
        GET the claim (its UID must match; it must be allocated) ─> PrepareStarted ─> configs decoded strictly
        ─> our results only, each GPU on this node and healthy ─> CDI spec ─> PrepareCompleted ─> CDI IDs
        a channel claim (channels.py): after PrepareStarted, join its GPUDomain and let go of the lock while
        waiting (up to `channel_wait`) for this node to be Ready in it; then, the lock taken again, a claim
        unprepared meanwhile (PrepareAborted) fails for good, and the rest goes on as above. A claim still not
        Ready when the wait ends is remembered with its pods (`waiting`): the kubelet retries a failed prepare
        only at its next resync of the pod (60-90 s), so the driver nudges those pods once the node is Ready
        (driver.py), and the kubelet's retry comes at once.

Errors: a `PermanentError` (the claim's own content is wrong: an unknown config field, a replaced
claim) is logged as one and reported to the kubelet at once; anything else is reported as it is and
the kubelet retries with its backoff. Each claim gets its own answer, and every claim asked about gets
one. Every wait (the lock, the GET) is bounded by the call's deadline, so an answer always comes back
before the kubelet gives up on the call (45 s).

A claim left in PrepareStarted (it failed half-way, or the plugin died half-way) whose object is gone
or was replaced (a new UID under the name) is unprepared by the driver itself, at start and every
`cleanup_interval` (`cleanup_stale`), as NVIDIA's driver does.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT
from gpu_agent.mechanisms.dra import cdi
from gpu_agent.mechanisms.dra.channels import (
    DEFAULT_CHANNEL_COUNT,
    DomainGate,
    DomainNotReady,
    MemberView,
    channel_edits,
)
from gpu_agent.mechanisms.dra.checkpoint import (
    PREPARE_ABORTED,
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    Entry,
)
from gpu_agent.mechanisms.dra.config import ChannelConfig, Config, GpuConfig, PermanentError, configs_for
from gpu_agent.mechanisms.dra.devices import CHANNEL_DEVICE, NodeDevices

log = get_logger(__name__)

ClaimGetter = Callable[[str, str, float], "dict[str, Any] | None"]  # (namespace, name, timeout) -> claim, None if gone


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}:{self.uid}"


@dataclass
class Outcome:
    devices: list[dict[str, Any]]  # {"request_names", "pool_name", "device_name", "cdi_device_ids"}
    error: str = ""


class DeadlineExceeded(Exception):
    pass


CHANNEL_POLL = 0.1  # how often a channel prepare looks whether the claim holding the channel was unprepared


@dataclass(frozen=True)
class ChannelRequest:
    request: str
    config: ChannelConfig


@dataclass(frozen=True)
class Channels:
    """How this node serves channel claims: the domains it joins for them, how long one prepare call waits for the
    node to be Ready in a domain, how many channels `All` gives and the host device behind each."""
    gate: DomainGate | None = None
    wait: float = 10.0
    count: int = DEFAULT_CHANNEL_COUNT
    host_device: str = "/dev/null"


def api_claim_getter(api: client.ApiClient) -> ClaimGetter:
    resource = client.ResourceV1Api(api)

    def get(namespace: str, name: str, timeout: float) -> dict[str, Any] | None:
        try:
            response: Any = resource.read_namespaced_resource_claim(name=name, namespace=namespace, _request_timeout=timeout,
                                                               _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        claim: dict[str, Any] = json.loads(response.data)
        return claim
    return get


class ClaimPreparer:
    def __init__(self, get_claim: ClaimGetter, *, driver: str, node: str, checkpoint: Checkpoint, cdi_dir: Path,
                 devices: Callable[[], NodeDevices], clock: Clock | None = None,
                 mounts: list[dict[str, Any]] | None = None, channels: Channels | None = None) -> None:
        self.get_claim = get_claim
        self.driver, self.node = driver, node
        self.checkpoint = checkpoint
        self.cdi_dir = cdi_dir
        self.devices = devices
        self.clock = clock or SystemClock()
        self.mounts = mounts or []
        self.channels = channels or Channels()
        # channel claims whose last prepare ended before the node was Ready: uid -> (domain, [(namespace, pod)])
        self.waiting: dict[str, tuple[str, list[tuple[str, str]]]] = {}
        self._serial = threading.Lock()  # one prepare or unprepare at a time, as the kubelet plugin helper does

    # -- the two calls ----------------------------------------------------------------------------------------------

    def prepare(self, claims: list[ClaimRef], deadline: float) -> dict[str, Outcome]:
        """`deadline`: on this preparer's clock's monotonic time; answers come back before it."""
        out: dict[str, Outcome] = {}
        # when the kubelet called, beside the pod's events: where a slow start's time went (a kubelet retry, our wait)
        log.info("NodePrepareResources: %d claim(s): %s", len(claims), ", ".join(str(ref) for ref in claims))
        for ref in claims:
            try:
                out[ref.uid] = Outcome(self._prepare(ref, deadline))  # it takes the lock itself, twice for a channel
            except PermanentError as e:
                log.error("Permanent error preparing devices for claim %s: %s", ref, e)
                out[ref.uid] = Outcome([], f"permanent error: error preparing devices for claim {ref}: {e}")
            except Exception as e:  # noqa: BLE001 - told to the kubelet, which retries
                log.warning("error preparing devices for claim %s: %s", ref, e)
                out[ref.uid] = Outcome([], f"error preparing devices for claim {ref}: {e}")
        return out

    def unprepare(self, claims: list[ClaimRef], deadline: float) -> dict[str, str]:
        out: dict[str, str] = {}
        for ref in claims:
            try:
                with self._locked(deadline):
                    self._unprepare(ref)
                out[ref.uid] = ""
            except Exception as e:  # noqa: BLE001 - told to the kubelet, which retries
                log.warning("error unpreparing devices for claim %s: %s", ref, e)
                out[ref.uid] = f"error unpreparing devices for claim {ref}: {e}"
        return out

    @contextlib.contextmanager
    def _locked(self, deadline: float) -> Iterator[None]:
        left = deadline - self.clock.monotonic()
        if left <= 0 or not self._serial.acquire(timeout=left):
            raise DeadlineExceeded("another prepare or unprepare held this node's lock until the call's deadline")
        try:
            yield
        finally:
            self._serial.release()

    # -- prepare ----------------------------------------------------------------------------------------------------

    def _prepare(self, ref: ClaimRef, deadline: float) -> list[dict[str, Any]]:
        with self._locked(deadline):
            entry = self.checkpoint.get(ref.uid)
            if entry is not None and entry.state == PREPARE_COMPLETED:
                log.info("claim %s already prepared: returning its devices again", ref)
                return entry.devices
            if entry is not None and entry.state == PREPARE_ABORTED:
                raise PermanentError(f"stale prepare for claim {ref}: claim prepare was already aborted")
            left = deadline - self.clock.monotonic()
            if left <= 0:
                raise DeadlineExceeded("no time left to read the claim")
            claim = self.get_claim(ref.namespace, ref.name, min(left, REQUEST_TIMEOUT))
            if claim is None:
                raise LookupError(f"ResourceClaim {ref.namespace}/{ref.name} not found")
            uid = (claim.get("metadata") or {}).get("uid")
            if uid != ref.uid:
                raise PermanentError(f"ResourceClaim {ref.namespace}/{ref.name} got replaced: its UID is {uid}, the kubelet asked for {ref.uid}")
            allocation = (claim.get("status") or {}).get("allocation")
            if not allocation:
                raise LookupError(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
            # before any work: a claim that fails from here on is known, and can be undone
            self.checkpoint.put(Entry(ref.uid, ref.namespace, ref.name, PREPARE_STARTED, since=self.clock.wall(),
                                      domain=entry.domain if entry is not None else ""))
            configs = configs_for(allocation, self.driver)
            results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == self.driver]
            channel = self._channel_request(ref, results, configs)
            if channel is None:
                return self._complete(ref, results, configs, None, deadline)
            gate = self.channels.gate
            assert gate is not None  # _channel_request refuses a channel without one
            # joined under the lock, with the domain in the checkpoint: an unprepare (or the stale cleanup) that
            # comes while this call waits below finds both, and releases the domain it took
            self.checkpoint.put(Entry(ref.uid, ref.namespace, ref.name, PREPARE_STARTED, since=self.clock.wall(),
                                      domain=channel.config.domain))
            gate.join(channel.config.domain, ref.uid)
        # the wait holds no lock: other claims of this node prepare and unprepare meanwhile
        began = self.clock.monotonic()
        until = min(began + self.channels.wait, deadline)
        log.info("claim %s: a channel of GPUDomain %s/%s: joined; waiting up to %.0f s for this node to be Ready in it",
                 ref, ref.namespace, channel.config.domain, until - began)
        try:
            view = gate.wait_ready(channel.config.domain, max(0.0, until - self.clock.monotonic()))
            self._wait_for_channel(ref, until)
            log.info("claim %s: this node Ready in GPUDomain %s/%s after %.1f s", ref, ref.namespace,
                     channel.config.domain, self.clock.monotonic() - began)
        except (DomainNotReady, RuntimeError):
            pods = [(ref.namespace, str(r.get("name"))) for r in (claim.get("status") or {}).get("reservedFor") or []
                    if r.get("resource") == "pods" and r.get("name")]
            self.waiting[ref.uid] = (channel.config.domain, pods)
            raise
        self.waiting.pop(ref.uid, None)
        if channel.config.domain_uid and view.uid != channel.config.domain_uid:
            raise PermanentError(f"GPUDomain {view.namespace}/{view.domain} was replaced: this claim was made for UID "
                                 f"{channel.config.domain_uid}, the domain's is {view.uid}; delete the claim's pod so that "
                                 f"a new claim is made from the domain's current template")
        with self._locked(deadline):
            entry = self.checkpoint.get(ref.uid)
            if entry is None or entry.state == PREPARE_ABORTED:
                raise PermanentError(f"stale prepare for claim {ref}: claim prepare was already aborted")
            if entry.state == PREPARE_COMPLETED:
                return entry.devices
            if (holder := self.channel_holder(ref.uid)) is not None:  # prepared meanwhile, by another call
                raise RuntimeError(f"requested device {CHANNEL_DEVICE} is already allocated to different claim "
                                   f"{holder.namespace}/{holder.name}")
            return self._complete(ref, results, configs, (channel, view), deadline)

    def _channel_request(self, ref: ClaimRef, results: list[dict[str, Any]], configs: dict[str, Config]) -> ChannelRequest | None:
        """The claim's channel request, checked: at most one, with a ChannelConfig, for a domain of the claim's namespace."""
        requests = [r.get("request", "").split("/")[0] for r in results if r.get("device") == CHANNEL_DEVICE]
        if not requests:
            return None
        if len(requests) > 1:
            raise PermanentError(f"claim {ref} asks for {len(requests)} channels; a node has one channel device, "
                                 f"ask for it once (count: 1), with allocationMode All for every channel")
        config = configs.get(requests[0], configs[""])
        if not isinstance(config, ChannelConfig):
            raise PermanentError(f"request {requests[0]!r} of claim {ref} was allocated the channel device without a "
                                 f"ChannelConfig naming its GPUDomain: use the ResourceClaimTemplate the domain's "
                                 f"spec.channel names (the cluster agent makes it)")
        gate = self.channels.gate
        if gate is None:
            raise PermanentError(f"claim {ref} asks for GPUDomain {config.domain}'s channel, but this node agent "
                                 f"serves no domain channels (the chart's dra.domainChannels is off)")
        if ref.namespace != gate.namespace:
            raise PermanentError(f"claim {ref} is in namespace {ref.namespace}, GPUDomain {config.domain} is in "
                                 f"{gate.namespace}: a domain's channel serves only claims of its own namespace; run "
                                 f"the workload in {gate.namespace}")
        return ChannelRequest(requests[0], config)

    def channel_holder(self, uid: str) -> Entry | None:
        """Another claim this node has prepared the channel for and not yet unprepared. The scheduler hands channel-0
        to a new claim as soon as the old one is deallocated, which a force-deleted pod's is before the kubelet has
        unprepared it (seen: 2 s after the new claim's prepare)."""
        return next((e for e in self.checkpoint.entries() if e.uid != uid and e.state == PREPARE_COMPLETED and
                     any(d.get("device_name") == CHANNEL_DEVICE for d in e.devices)), None)

    def retry_due(self, uid: str, domain: str) -> bool:
        """Whether a waiting channel claim would prepare now: the node Ready in its domain, the channel free."""
        gate = self.channels.gate
        if gate is None or self.channel_holder(uid) is not None:
            return False
        try:
            gate.wait_ready(domain, 0)
        except DomainNotReady:
            return False
        return True

    def _wait_for_channel(self, ref: ClaimRef, until: float) -> None:
        """Until the channel is this node's to give (another claim's unprepare on its way), by `until`."""
        while (holder := self.channel_holder(ref.uid)) is not None:
            left = until - self.clock.monotonic()
            if left <= 0:
                raise RuntimeError(f"requested device {CHANNEL_DEVICE} is already allocated to different claim "
                                   f"{holder.namespace}/{holder.name}: waiting for its unprepare")
            self.clock.sleep_blocking(min(CHANNEL_POLL, left))

    def _complete(self, ref: ClaimRef, results: list[dict[str, Any]], configs: dict[str, Config],
                  channel: tuple[ChannelRequest, MemberView] | None, deadline: float) -> list[dict[str, Any]]:
        """The rest of a prepare, under the lock: each GPU checked, the CDI spec written, PrepareCompleted."""
        offered = self.devices()
        by_request: dict[str, list[tuple[str, Any]]] = {}
        for r in results:
            if r.get("pool") != self.node:
                raise LookupError(f"device {r.get('pool')}/{r.get('device')} is not in this node's pool {self.node}")
            if r.get("device") == CHANNEL_DEVICE:
                if not offered.channel:
                    raise LookupError(f"device {CHANNEL_DEVICE} is not offered on node {self.node} now")
                continue
            gpu = offered.gpus.get(r.get("device", ""))
            if gpu is None:
                raise LookupError(f"device {r.get('device')} is not on node {self.node} now (its GPU left)")
            if not gpu.is_healthy:
                raise RuntimeError(f"device {r.get('device')} (GPU {gpu.uuid}) is {gpu.health}"
                                   + (f": {gpu.health_reason}" if gpu.health_reason else ""))
            request = r.get("request", "").split("/")[0]  # "req/sub" -> "req": what containers name
            by_request.setdefault(request, []).append((r["device"], gpu))
        specs, devices = [], []
        for request, pairs in sorted(by_request.items()):
            config = configs.get(request, configs[""])
            if not isinstance(config, GpuConfig):
                raise PermanentError(f"request {request!r} of claim {ref} was allocated GPUs with a ChannelConfig: "
                                     f"a ChannelConfig is for the channel device only")
            visible = ",".join(g.uuid for _, g in pairs)
            for name, gpu in pairs:
                specs.append({"device": name, "env": [f"NVIDIA_VISIBLE_DEVICES={visible}", f"GPU_AGENT_GPU_{gpu.index}={gpu.uuid}",
                                                      f"GPU_AGENT_CLAIM={ref.uid}", *config.env()]})
                devices.append({"request_names": [request], "pool_name": self.node, "device_name": name,
                                "cdi_device_ids": [cdi.device_id(self.driver, ref.uid, name)]})
        if channel is not None:
            request, view = channel
            specs.append({"device": CHANNEL_DEVICE, **channel_edits(
                view, mode=request.config.allocation_mode, count=self.channels.count,
                host_device=self.channels.host_device, claim=ref.uid)})
            devices.append({"request_names": [request.request], "pool_name": self.node, "device_name": CHANNEL_DEVICE,
                            "cdi_device_ids": [cdi.device_id(self.driver, ref.uid, CHANNEL_DEVICE)]})
        path = cdi.write_spec(self.cdi_dir, self.driver, ref.uid, specs, self.mounts)
        if self.clock.monotonic() > deadline:
            # the kubelet has given up on this call: leave PrepareStarted (undone at unprepare), commit nothing
            raise DeadlineExceeded("the call's deadline passed while preparing")
        domain = channel[0].config.domain if channel is not None else ""
        self.checkpoint.put(Entry(ref.uid, ref.namespace, ref.name, PREPARE_COMPLETED, devices=devices, cdi_spec=str(path),
                                  since=self.clock.wall(), domain=domain))
        log.info("prepared claim %s: %s%s", ref, ", ".join(f"{d['device_name']} ({d['request_names'][0]})" for d in devices) or "no device of ours",
                 f" (GPUDomain {channel[1].namespace}/{domain}, node index {channel[1].index})" if channel is not None else "")
        return devices

    def rejoin(self) -> int:
        """After a restart: the domains the checkpoint's channel claims hold are joined again. Returns how many claims."""
        joined = 0
        for entry in self.checkpoint.entries():
            if entry.domain and entry.state in (PREPARE_STARTED, PREPARE_COMPLETED) and self.channels.gate is not None:
                self.channels.gate.join(entry.domain, entry.uid)
                joined += 1
        return joined

    # -- unprepare --------------------------------------------------------------------------------------------------

    def _undo(self, entry: Entry) -> None:
        self.waiting.pop(entry.uid, None)
        cdi.remove_spec(Path(entry.cdi_spec) if entry.cdi_spec else cdi.spec_path(self.cdi_dir, self.driver, entry.uid))
        if entry.domain and self.channels.gate is not None:
            self.channels.gate.release(entry.domain, entry.uid)

    def _unprepare(self, ref: ClaimRef) -> None:
        entry = self.checkpoint.get(ref.uid)
        if entry is None:
            log.info("Unprepare noop: claim %s is not prepared on this node", ref)
            return
        if entry.state == PREPARE_ABORTED:
            log.info("Unprepare noop: claim in PrepareAborted state: %s", ref)
            return
        self._undo(entry)
        if entry.state == PREPARE_COMPLETED:
            self.checkpoint.drop(ref.uid)
            log.info("unprepared claim %s", ref)
        else:  # PrepareStarted: partially prepared; a late retry of its prepare must not bring it back
            entry.state, entry.since = PREPARE_ABORTED, self.clock.wall()
            self.checkpoint.put(entry)
            log.info("Marked claim PrepareAborted in checkpoint: %s/%s (unprepared while partially prepared)", ref.namespace, ref.name)

    # -- the driver's own cleanup -----------------------------------------------------------------------------------

    def cleanup_stale(self) -> int:
        """Unprepare every claim left in PrepareStarted whose object is gone or has a new UID. Returns how many."""
        cleaned = 0
        for gone in self.checkpoint.drop_expired_aborted(self.clock.wall()):
            log.info("Checkpointed RC cleanup: dropped expired PrepareAborted entry %s/%s", gone.namespace, gone.name)
        for entry in self.checkpoint.entries():
            if entry.state != PREPARE_STARTED:
                continue
            try:
                claim = self.get_claim(entry.namespace, entry.name, REQUEST_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - tried again at the next cleanup
                log.warning("Checkpointed RC cleanup: cannot read claim %s/%s: %s", entry.namespace, entry.name, e)
                continue
            if claim is not None and (claim.get("metadata") or {}).get("uid") == entry.uid:
                log.info("partially prepared claim not stale: %s/%s", entry.namespace, entry.name)
                continue
            with self._serial:
                current = self.checkpoint.get(entry.uid)
                if current is None or current.state != PREPARE_STARTED:
                    continue  # the kubelet got there first
                self._undo(current)
                current.state, current.since = PREPARE_ABORTED, self.clock.wall()
                self.checkpoint.put(current)
            log.info("Marked claim PrepareAborted in checkpoint: %s/%s", entry.namespace, entry.name)
            log.info("Checkpointed RC cleanup: unprepared stale claim: %s/%s", entry.namespace, entry.name)
            cleaned += 1
        return cleaned
