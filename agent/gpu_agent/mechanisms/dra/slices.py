"""The ResourceSlice publisher: this node's pool, kept in the API server as the node's GPUs change.

    set_devices (inventory changed) ─┐
    a watch on our slices (one gone) ├─> wake ──> reconcile: list ours ──> none: create │ ours stale: replace,
    resync (every `resync_seconds`) ─┘                                                   │ generation + 1 │ extras: delete

Timing rules:
- A change of the node's devices is published at the next turn of the loop (no wait): a GPU that
  arrives or leaves reaches the slice within one API round trip of the inventory event.
- The kubelet deletes the node's slices at its own start and 30 s after its last plugin connection
  ends; the watch on our slices (fieldSelector node + driver) wakes the loop on a delete, and the
  resync catches whatever the watch missed.
- The pool's generation grows on every change of content (and when a slice is recreated), so a
  consumer never takes an old slice for the current one. What was published is recognised by a
  hash of the content in an annotation, not by comparing what the API server hands back (it
  rewrites quantities into their canonical form).
- A node with no GPU publishes one empty slice: an empty pool is not a missing pool.
- A failed call is reported (`on_error`) and retried after `retry_seconds`; the loop never dies of it.
- `on_published` is told after every reconcile that finds the pool current, written or not: a restarted plugin
  whose predecessor's slice is still right is published without a write.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT, list_then_watch
from gpu_agent.mechanisms.dra.devices import slice_body

log = get_logger(__name__)

CONTENT_ANNOTATION = "gpu-agent.io/content-hash"


def content_hash(devices: tuple[dict[str, Any], ...]) -> str:
    return hashlib.sha256(json.dumps(devices, sort_keys=True).encode()).hexdigest()[:16]


class SlicePublisher:
    def __init__(self, api: client.ApiClient, *, node: str, driver: str, clock: Clock | None = None,
                 resync_seconds: float = 30.0, retry_seconds: float = 1.0,
                 on_published: Callable[[int, int], None] | None = None,
                 on_error: Callable[[str], None] | None = None, resource: Any = None, core: Any = None) -> None:
        # `resource`, `core`: stand-ins for the two API classes (a unit test's scripted API server)
        self.resource = resource if resource is not None else client.ResourceV1Api(api)
        self.core = core if core is not None else client.CoreV1Api(api)
        self.node, self.driver = node, driver
        self.clock = clock or SystemClock()
        self.resync_seconds, self.retry_seconds = resync_seconds, retry_seconds
        self.on_published = on_published or (lambda generation, count: None)
        self.on_error = on_error or (lambda reason: None)
        self._devices: tuple[dict[str, Any], ...] | None = None  # None: the inventory is not known yet
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._generation = 0  # the highest generation this publisher wrote or saw
        self._owner: dict[str, str] | None = None
        self.selector = f"spec.nodeName={node},spec.driver={driver}"

    def set_devices(self, devices: tuple[dict[str, Any], ...]) -> None:
        with self._lock:
            self._devices = devices
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Reconcile until `stop` is set (each wake, and every `resync_seconds`)."""
        while not stop.is_set():
            self._wake.clear()
            ok = self._reconcile_once()
            if stop.is_set():
                return
            if not ok:
                self.clock.wait_blocking(stop, self.retry_seconds)
                continue
            self._wait_wake(stop, self.resync_seconds)

    def _wait_wake(self, stop: threading.Event, seconds: float) -> None:
        # one event to wait on: a stop wakes the wait too
        deadline = self.clock.monotonic() + seconds
        while not stop.is_set() and not self._wake.is_set():
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return
            self.clock.wait_blocking(self._wake, min(left, 0.5))

    def watch(self, stop: threading.Event) -> None:
        """Wake the loop when one of our slices is deleted or changed by someone else."""
        def on_event(kind: str, obj: Any) -> None:
            if kind == "DELETED":
                log.info("ResourceSlice %s was deleted (the kubelet wipes a node's slices at its start): publishing again",
                         getattr(getattr(obj, "metadata", None), "name", "?"))
                self._wake.set()
            elif kind == "MODIFIED":
                self._wake.set()

        list_then_watch(self.resource.list_resource_slice, field_selector=self.selector, on_list=lambda listed: self._wake.set(),
                        on_event=on_event, on_error=lambda e: log.warning("watching ResourceSlices: %s", e),
                        stop=stop, retry_seconds=self.retry_seconds, resync_seconds=240, clock=self.clock)

    # -- one reconcile ----------------------------------------------------------------------------------------------

    def _reconcile_once(self) -> bool:
        with self._lock:
            devices = self._devices
        if devices is None:
            return True
        try:
            self._reconcile(devices)
            return True
        except ApiException as e:
            reason = f"publishing ResourceSlices: {e.status} {e.reason}"
        except Exception as e:  # noqa: BLE001 - reported and retried: the loop must outlive a bad answer
            reason = f"publishing ResourceSlices: {e}"
        log.warning("%s (retrying in %.1f s)", reason, self.retry_seconds)
        self.on_error(reason)
        return False

    def _owner_ref(self) -> dict[str, str] | None:
        if self._owner is None:
            try:
                node = json.loads(cast(Any, self.core.read_node(self.node, _request_timeout=REQUEST_TIMEOUT,
                                                                 _preload_content=False)).data)
                self._owner = {"name": self.node, "uid": str(node["metadata"]["uid"])}
            except ApiException as e:
                if e.status != 404:
                    raise
                return None  # a node object not there (yet): published without an owner, fixed at the next change
        return self._owner

    def _reconcile(self, devices: tuple[dict[str, Any], ...]) -> None:
        listed = cast(Any, self.resource.list_resource_slice(field_selector=self.selector, _request_timeout=REQUEST_TIMEOUT,
                                                             _preload_content=False))
        slices = json.loads(listed.data)["items"]
        slices.sort(key=lambda s: (-int(s["spec"]["pool"].get("generation", 0)), s["metadata"]["name"]))
        for s in slices:
            self._generation = max(self._generation, int(s["spec"]["pool"].get("generation", 0)))
        want = content_hash(devices)
        keep, extras = (slices[0], slices[1:]) if slices else (None, [])
        for extra in extras:
            self._delete(extra["metadata"]["name"])
        if keep is not None and (keep["metadata"].get("annotations") or {}).get(CONTENT_ANNOTATION) == want and not extras:
            # What we want is there: published by this process, or by the one before it (a restarted plugin finds
            # its predecessor's slice current and writes nothing, but is published all the same).
            self.on_published(int(keep["spec"]["pool"].get("generation", 0)), len(devices))
            return
        self._generation += 1
        body = slice_body(name=keep["metadata"]["name"] if keep else None, node=self.node, driver=self.driver,
                          generation=self._generation, devices=devices, owner=self._owner_ref(),
                          resource_version=keep["metadata"]["resourceVersion"] if keep else None)
        body["metadata"]["annotations"] = {CONTENT_ANNOTATION: want}
        if keep is None:
            self.resource.create_resource_slice(body=cast(Any, body), _request_timeout=REQUEST_TIMEOUT)
            what = "created"
        else:
            self.resource.replace_resource_slice(name=keep["metadata"]["name"], body=cast(Any, body), _request_timeout=REQUEST_TIMEOUT)
            what = "updated"
        log.info("ResourceSlice of node %s %s: %d device(s), pool generation %d", self.node, what, len(devices), self._generation)
        self.on_published(self._generation, len(devices))

    def _delete(self, name: str) -> None:
        try:
            self.resource.delete_resource_slice(name=name, _request_timeout=REQUEST_TIMEOUT)
            log.info("deleted extra ResourceSlice %s of node %s", name, self.node)
        except ApiException as e:
            if e.status != 404:
                raise
