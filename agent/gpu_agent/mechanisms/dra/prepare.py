"""Prepare and unprepare: what the kubelet asks of a DRA driver before a pod's containers start and
after its last one ends.

    prepare(claim refs, deadline) ──> one at a time (a lock, waited on no longer than the call may last)
        checkpoint says Completed ─> what it returned then (the kubelet retries; it calls again after a restart)
        checkpoint says Aborted   ─> permanent error (a late retry must not prepare a claim already unprepared)
        GET the claim (its UID must match; it must be allocated) ─> PrepareStarted ─> configs decoded strictly
        ─> our results only, each GPU on this node and healthy ─> CDI spec ─> PrepareCompleted ─> CDI IDs

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
from gpu_agent.mechanisms.dra.checkpoint import (
    PREPARE_ABORTED,
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    Entry,
)
from gpu_agent.mechanisms.dra.config import PermanentError, configs_for
from gpu_agent.mechanisms.dra.devices import NodeDevices

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
                 mounts: list[dict[str, Any]] | None = None) -> None:
        self.get_claim = get_claim
        self.driver, self.node = driver, node
        self.checkpoint = checkpoint
        self.cdi_dir = cdi_dir
        self.devices = devices
        self.clock = clock or SystemClock()
        self.mounts = mounts or []
        self._serial = threading.Lock()  # one prepare or unprepare at a time, as the kubelet plugin helper does

    # -- the two calls ----------------------------------------------------------------------------------------------

    def prepare(self, claims: list[ClaimRef], deadline: float) -> dict[str, Outcome]:
        """`deadline`: on this preparer's clock's monotonic time; answers come back before it."""
        out: dict[str, Outcome] = {}
        for ref in claims:
            try:
                with self._locked(deadline):
                    out[ref.uid] = Outcome(self._prepare(ref, deadline))
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
        self.checkpoint.put(Entry(ref.uid, ref.namespace, ref.name, PREPARE_STARTED, since=self.clock.wall()))
        configs = configs_for(allocation, self.driver)
        results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == self.driver]
        offered = self.devices()
        by_request: dict[str, list[tuple[str, Any]]] = {}
        for r in results:
            if r.get("pool") != self.node:
                raise LookupError(f"device {r.get('pool')}/{r.get('device')} is not in this node's pool {self.node}")
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
            visible = ",".join(g.uuid for _, g in pairs)
            for name, gpu in pairs:
                specs.append({"device": name, "env": [f"NVIDIA_VISIBLE_DEVICES={visible}", f"GPU_AGENT_GPU_{gpu.index}={gpu.uuid}",
                                                      f"GPU_AGENT_CLAIM={ref.uid}", *config.env()]})
                devices.append({"request_names": [request], "pool_name": self.node, "device_name": name,
                                "cdi_device_ids": [cdi.device_id(self.driver, ref.uid, name)]})
        path = cdi.write_spec(self.cdi_dir, self.driver, ref.uid, specs, self.mounts)
        if self.clock.monotonic() > deadline:
            # the kubelet has given up on this call: leave PrepareStarted (undone at unprepare), commit nothing
            raise DeadlineExceeded("the call's deadline passed while preparing")
        self.checkpoint.put(Entry(ref.uid, ref.namespace, ref.name, PREPARE_COMPLETED, devices=devices, cdi_spec=str(path),
                                  since=self.clock.wall()))
        log.info("prepared claim %s: %s", ref, ", ".join(f"{d['device_name']} ({d['request_names'][0]})" for d in devices) or "no device of ours")
        return devices

    # -- unprepare --------------------------------------------------------------------------------------------------

    def _undo(self, entry: Entry) -> None:
        cdi.remove_spec(Path(entry.cdi_spec) if entry.cdi_spec else cdi.spec_path(self.cdi_dir, self.driver, entry.uid))

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
