"""The DRA driver of one node: the publisher, the kubelet plugin and the cleanup, started and stopped together.

    node agent's inventory event ──> set_inventory ──> NodeDevices ──> SlicePublisher (thread dra-slices,
                                                                        its watch dra-slice-watch)
                                                                  └──> KubeletPlugin health stream
    kubelet ──> KubeletPlugin (gRPC) ──> ClaimPreparer ──> Checkpoint, CDI specs
    thread dra-cleanup: stale PrepareStarted claims unprepared at start and every `cleanup_interval`; the plugin
                       registers with the kubelet only after the first pass (or FIRST_CLEANUP_BOUND)
    thread dra-channel-nudge (with domain channels): a channel claim whose prepare gave up before this node was Ready
                       in its domain (or before the claim that held the channel was unprepared) has its pods annotated
                       once it would prepare (an update of the pod makes the kubelet sync it, and prepare again, at
                       once, instead of at its next resync 60-90 s later)

Its `/healthz` component `dra` is Ready once the kubelet has accepted the registration and the
node's slice is published, and says which of the two is missing otherwise (a kubelet that refuses the
plugin names why). All threads start on the agent's `Threads` (foundations/threads.py) and end with
`run`'s stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT
from gpu_agent.foundations.threads import StopEvent, start_thread
from gpu_agent.mechanisms.dra.checkpoint import Checkpoint
from gpu_agent.mechanisms.dra.devices import NodeDevices
from gpu_agent.mechanisms.dra.plugin import KubeletPlugin
from gpu_agent.mechanisms.dra.prepare import Channels, ClaimPreparer, api_claim_getter
from gpu_agent.mechanisms.dra.slices import SlicePublisher

log = get_logger(__name__)

COMPONENT = "dra"
NUDGE_ANNOTATION = "gpu-agent.io/channel-ready"  # its value: the claim whose node turned Ready in its domain
NUDGE_INTERVAL = 0.25  # how often the waiting channel claims' domains are looked at (in memory)
# How long registration waits for the first cleanup pass: each claim it reads may take REQUEST_TIMEOUT while the
# API server is slow, and a node without its plugin runs no new claims. What the pass has not reached by then it
# finishes beside the plugin (the preparer serializes the two).
FIRST_CLEANUP_BOUND = 15.0


class DRADriver:
    def __init__(self, api: client.ApiClient, *, driver: str, node: str, registry_dir: Path, plugin_dir: Path,
                 cdi_dir: Path, health: HealthRegistry, clock: Clock | None = None, cleanup_interval: float = 600.0,
                 mounts: list[dict[str, Any]] | None = None, channels: Channels | None = None) -> None:
        self.driver, self.node = driver, node
        self.clock = clock or SystemClock()
        self.health = health
        self.cleanup_interval = cleanup_interval
        self._devices = NodeDevices((), {})
        self._registered: tuple[bool, str] | None = None
        self._published: tuple[int, int] | None = None
        self._publish_error = ""
        self.checkpoint = Checkpoint(plugin_dir / driver / "checkpoint.json")
        self.channels = channels or Channels()
        self.api = api
        self.preparer = ClaimPreparer(api_claim_getter(api), driver=driver, node=node, checkpoint=self.checkpoint,
                                      cdi_dir=cdi_dir, devices=lambda: self._devices, clock=self.clock, mounts=mounts,
                                      channels=self.channels)
        # a channel claim prepared before a restart holds its domain again (its pod runs on)
        if rejoined := self.preparer.rejoin():
            log.info("rejoined the GPUDomains of %d channel claim(s) from the checkpoint", rejoined)
        self.plugin = KubeletPlugin(self.preparer, driver=driver, registry_dir=registry_dir, clock=self.clock,
                                    on_registered=self._on_registered)
        self.publisher = SlicePublisher(api, node=node, driver=driver, clock=self.clock,
                                        on_published=self._on_published, on_error=self._on_publish_error)
        self._report()

    def set_inventory(self, inventory: Inventory) -> None:
        self._devices = NodeDevices.of(inventory, self.driver, channel=self.channels.gate is not None)
        self.publisher.set_devices(self._devices.devices)
        self.plugin.set_health([
            (self.node, name, "HEALTHY" if gpu.is_healthy else "UNHEALTHY",
             "" if gpu.is_healthy else f"{gpu.health}" + (f": {gpu.health_reason}" if gpu.health_reason else ""))
            for name, gpu in sorted(self._devices.gpus.items())])

    def _on_registered(self, ok: bool, error: str) -> None:
        self._registered = (ok, error)
        self._report()

    def _on_published(self, generation: int, count: int) -> None:
        self._published, self._publish_error = (generation, count), ""
        self._report()

    def _on_publish_error(self, reason: str) -> None:
        self._publish_error = reason
        self._report()

    def _report(self) -> None:
        missing = []
        if self._registered is None:
            missing.append(f"the kubelet has not registered plugin socket {self.plugin.socket} yet")
        elif not self._registered[0]:
            missing.append(f"the kubelet refused the plugin: {self._registered[1]}")
        if self._publish_error:
            missing.append(self._publish_error)
        elif self._published is None:
            missing.append("this node's ResourceSlice is not published yet")
        generation, count = self._published or (0, 0)
        self.health.set(COMPONENT, not missing, "; ".join(missing) or f"registered; {count} device(s) published",
                        driver=self.driver, poolGeneration=generation, devices=count)

    def _cleanup(self, stop: threading.Event, first_pass_done: Callable[[], None]) -> None:
        while not stop.is_set():
            try:
                self.preparer.cleanup_stale()
            except Exception as e:  # noqa: BLE001 - tried again at the next interval
                log.warning("Checkpointed RC cleanup failed: %s", e)
            first_pass_done()
            self.clock.wait_blocking(stop, self.cleanup_interval)

    def nudge_once(self, patch: Callable[[str, str, dict[str, Any]], None]) -> list[tuple[str, str]]:
        """Annotate the pods of each waiting channel claim whose node is now Ready in its domain; returns the pods."""
        gate, nudged = self.channels.gate, list[tuple[str, str]]()
        if gate is None:
            return nudged
        for uid, (domain, pods) in list(self.preparer.waiting.items()):
            if not self.preparer.retry_due(uid, domain):
                continue
            self.preparer.waiting.pop(uid, None)
            for namespace, pod in pods:
                try:
                    patch(namespace, pod, {"metadata": {"annotations": {NUDGE_ANNOTATION: uid}}})
                    nudged.append((namespace, pod))
                    log.info("node %s Ready in GPUDomain %s, its channel free: nudged pod %s/%s to prepare its "
                             "channel claim again",
                             self.node, domain, namespace, pod)
                except Exception as e:  # noqa: BLE001 - the kubelet's own resync retries it later
                    log.warning("nudging pod %s/%s failed (%s): the kubelet prepares its claim at its next resync",
                                namespace, pod, e)
        return nudged

    def _nudge(self, stop: threading.Event) -> None:
        core = client.CoreV1Api(self.api)

        def patch(namespace: str, pod: str, body: dict[str, Any]) -> None:
            core.patch_namespaced_pod(pod, namespace, body, _request_timeout=REQUEST_TIMEOUT)
        while not stop.is_set():
            self.nudge_once(patch)
            self.clock.wait_blocking(stop, NUDGE_INTERVAL)

    async def run(self, stop: asyncio.Event) -> None:
        # a StopEvent: the halt also shuts down the slice watch's connection (foundations/threads.py)
        halt, loop, first_pass = StopEvent(), asyncio.get_running_loop(), asyncio.Event()

        def first_pass_done() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: run has ended, nobody waits
                loop.call_soon_threadsafe(first_pass.set)

        try:
            start_thread("dra-slices", lambda: self.publisher.run(halt), halt)
            start_thread("dra-slice-watch", lambda: self.publisher.watch(halt), halt)
            start_thread("dra-cleanup", lambda: self._cleanup(halt, first_pass_done), halt)
            if self.channels.gate is not None:
                start_thread("dra-channel-nudge", lambda: self._nudge(halt), halt)
            # The checkpoint reconciled before the kubelet can call: a claim whose object went while no plugin ran
            # is undone by this pass, and the kubelet's own unprepare of it, retried since, finds it PrepareAborted
            # (a noop), instead of the two racing for it.
            waits = [asyncio.ensure_future(first_pass.wait()), asyncio.ensure_future(stop.wait())]
            await asyncio.wait(waits, timeout=FIRST_CLEANUP_BOUND, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if stop.is_set():
                return
            if not first_pass.is_set():
                log.warning("DRA plugin registering before its first checkpoint cleanup finished (%.0fs)",
                            FIRST_CLEANUP_BOUND)
            self.plugin.start()
            await stop.wait()
        finally:
            halt.set()
            self.plugin.stop()
