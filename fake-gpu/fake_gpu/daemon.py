"""`fake-gpu daemon`: the fake-gpu DaemonSet's process on each node.

    layout ConfigMap (watched) -> this node's layout -> state file (atomic) -> device plugin
                                                     +-> node labels (fake_gpu.node_labels)

The state file is the one the node agent's fake source reads, on a host path both pods
mount, so the device plugin's view and the agent's view are one and the same: a fault in the
layout (`fake-gpu fault --node`) reaches the agent as the GPU's health in the state file and
kubelet as an Unhealthy device in ListAndWatch.

Without the device plugin (`--no-device-plugin`: a node whose GPUs the node agent offers through DRA)
the rest runs as before, but nothing registers with kubelet, so the node advertises no `nvidia.com/gpu`:
a node offers its GPUs one way, never both (each would hand out the same GPU).

Before either, the daemon asks whether the node is a real GPU node (fake_gpu.real_gpu_guard): if so it neither
registers nor labels, says why (log, a Warning Event on the Node, the readiness probe), and waits idle for its stop.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client, config

from fake_gpu.layout import LayoutError, build
from fake_gpu.layout_source import layout_for
from fake_gpu.node_labels import NodeLabeler, desired
from fake_gpu.plugin import Devices, PluginRunner
from fake_gpu.real_gpu_guard import (
    DEFAULT_RESOURCE,
    REAL_GPU_PATHS,
    REFUSED_REASON,
    RealGpuGuard,
    Refusal,
    owner_annotation,
)
from gpu_agent.foundations import fake_state
from gpu_agent.foundations.events import EventRecorder
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT, core_v1_list, items_of, list_then_watch
from gpu_agent.foundations.threads import Threads

log = get_logger("fake_gpu.daemon")


class LayoutApplier:
    def __init__(self, node: str, state_file: Path, devices: Devices, *, default_count: int,
                 labeler: NodeLabeler | None = None, release: str = "", resource: str = DEFAULT_RESOURCE) -> None:
        self.node = node
        self.labeler = labeler
        self.release = release
        self.resource = resource
        self.state_file = state_file
        self.devices = devices
        self.default_count = default_count
        self.rng = random.Random()
        try:
            self.current = fake_state.read(state_file)  # keep UUIDs across daemon restarts
        except fake_state.FakeStateError:
            self.current = Inventory()
        self.devices.set(self.current)
        self.last_error: str | None = None

    def apply(self, data: dict[str, str] | None) -> None:
        try:
            layout = layout_for(data, self.node, self.default_count)
        except LayoutError as e:
            self.last_error = str(e)
            log.error("refusing layout for node %s: %s; keeping %d GPUs", self.node, e, self.current.count)
            return
        self.last_error = None
        if self.labeler is not None:
            self.labeler.set(desired(layout.count, layout.product, layout.memory_mib, self.release, self.resource))
        inventory = build(self.current, layout.count, layout.product, layout.memory_mib, self.rng, max(layout.count, 1),
                          layout.clique, layout.fault_map)
        if inventory == self.current and self.state_file.exists():
            return
        fake_state.write_atomic(self.state_file, fake_state.render(inventory, node=self.node))
        before, before_clique = {g.uuid: g.health for g in self.current.gpus}, self.current.clique
        self.current = inventory
        self.devices.set(inventory)
        if [g.uuid for g in inventory.gpus] != list(before) or inventory.clique != before_clique:
            log.info("node %s now has %d fake GPUs (%s)%s", self.node, inventory.count, layout.product,
                     f", clique {layout.clique}" if layout.clique else "")
        for g in inventory.gpus:
            if before.get(g.uuid, "Healthy") != g.health:
                log.info("node %s: fake GPU %d (%s) is now %s%s", self.node, g.index, g.uuid, g.health,
                         f": {g.health_reason}" if g.health_reason else "")


def watch_layout(api: client.ApiClient, namespace: str, configmap: str, applier: LayoutApplier,
                 stopping: threading.Event) -> None:
    def listed(cms: Any) -> None:
        items = items_of(cms)
        applier.apply(items[0].get("data") if items else None)

    # core_v1_list rather than CoreV1Api: the daemon's footprint (see gpu_agent.foundations.kube)
    list_then_watch(core_v1_list(api, "configmaps"), namespace, field_selector=f"metadata.name={configmap}",
                    on_list=listed, on_event=lambda kind, cm: applier.apply(None if kind == "DELETED" else cm.get("data")),
                    on_error=lambda e: log.warning("watching ConfigMap %s/%s failed: %s; retrying", namespace, configmap, e),
                    stop=stopping, resync_seconds=60)


class Daemon:
    """The daemon's parts on one node: the layout watch (`watch`, given the applier and the stop event; on a cluster
    `watch_layout`), the state file, the node labels (`labeler`) and, with `device_plugin`, the device plugin
    serving kubelet in `plugin_dir`, all of them only once `guard` (None: no check) admits the node. `run` blocks
    until `stop`."""

    def __init__(self, node: str, state_file: Path, host_state_file: str, plugin_dir: Path, default_count: int, *,
                 watch: Callable[[LayoutApplier, threading.Event], None], labeler: NodeLabeler | None = None,
                 release: str = "", device_plugin: bool = True, resource: str = DEFAULT_RESOURCE,
                 guard: RealGpuGuard | None = None) -> None:
        self.node, self.state_file, self.plugin_dir = node, state_file, plugin_dir
        self.stopping = threading.Event()
        self.threads = Threads()  # the daemon's long-lived threads: a death is logged with its traceback, not lost
        self.watch = watch
        self.labeler = labeler
        self.resource = resource
        self.guard = guard
        self.devices = Devices()
        self.applier = LayoutApplier(node, state_file, self.devices, default_count=default_count, labeler=labeler,
                                     release=release, resource=resource)
        self.runner = PluginRunner(plugin_dir, self.devices, host_state_file, resource=resource) if device_plugin else None

    def run(self) -> None:
        if self.guard is not None and not self.guard.admit(self.stopping):
            # Idle rather than exit: a crash loop would restart into the same refusal; the log, the Event and the
            # readiness probe say why, and a change of values rolls the pod.
            self.stopping.wait()
            return
        labeler = self.labeler
        if labeler is not None:
            self.threads.start("node-labels", lambda: labeler.run(self.stopping), self.stopping)
        self.threads.start("layout-watch", lambda: self.watch(self.applier, self.stopping), self.stopping)
        if self.runner is None:
            log.info("fake-gpu daemon for node %s: state file %s; device plugin off (no %s advertised)",
                     self.node, self.state_file, self.resource)
            self.stopping.wait()
        else:
            log.info("fake-gpu daemon for node %s: state file %s, plugin dir %s", self.node, self.state_file, self.plugin_dir)
            self.runner.run()

    def stop(self) -> None:
        self.stopping.set()
        if self.labeler is not None:
            self.labeler.changed.set()
        if self.runner is not None:
            self.runner.stop()


def node_guard(api: client.ApiClient, node: str, resource: str, *, allow_real_gpu_nodes: bool,
               refusal_file: Path | None, real_gpu_paths: tuple[Path, ...] = REAL_GPU_PATHS) -> RealGpuGuard:
    """The real-GPU check with the API server's calls: read the Node, annotate it, post an Event about it."""
    core = client.CoreV1Api(api)

    def read_node(name: str) -> dict[str, Any]:
        # The raw JSON, not the model: the guard reads three fields of it.
        response: Any = core.read_node(name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
        node_json: dict[str, Any] = json.loads(response.data)
        return node_json

    def claim(name: str, owned_resource: str) -> None:
        core.patch_node(name, {"metadata": {"annotations": {owner_annotation(owned_resource): owned_resource}}},
                        _request_timeout=REQUEST_TIMEOUT)

    def warn(node_json: dict[str, Any], refusal: Refusal) -> None:
        post_refusal_event(EventRecorder(api, controller="gpu-agent.io/fake-gpu", instance=f"fake-gpu-{node}"),
                           node_json, refusal)

    return RealGpuGuard(node, resource, read_node=read_node, claim=claim, warn=warn, real_gpu_paths=real_gpu_paths,
                        allow_real_gpu_nodes=allow_real_gpu_nodes, refusal_file=refusal_file)


def post_refusal_event(recorder: EventRecorder, node_json: dict[str, Any], refusal: Refusal) -> None:
    """One Warning Event on the Node (`kubectl describe node` shows it). A Node is cluster-scoped, so the Event
    goes to namespace default, as kubelet's own do (EventRecorder's rule for an object without a namespace)."""
    meta = node_json.get("metadata") or {}
    regarding = {"apiVersion": "v1", "kind": "Node", "name": refusal.node, "namespace": ""}
    if meta.get("uid"):
        regarding["uid"] = str(meta["uid"])
    recorder.record(regarding, "Warning", REFUSED_REASON, "Refuse", refusal.message)
    recorder.drain()  # one call, now, with the request timeout: no thread is left for a single Event


def run(node: str, namespace: str, configmap: str, state_file: Path, host_state_file: str, plugin_dir: Path,
        default_count: int, release: str = "", device_plugin: bool = True, resource: str = DEFAULT_RESOURCE,
        allow_real_gpu_nodes: bool = False, refusal_file: Path | None = None) -> int:
    """`release` (the chart's release name): label the node as GPU feature discovery would; empty: leave it.
    `device_plugin` false: advertise nothing to kubelet (the node's GPUs are offered through DRA). `resource`: the
    name advertised and labelled. On a real GPU node it refuses unless `allow_real_gpu_nodes` (real_gpu_guard)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.ApiClient()
    labeler = None
    if release:
        core = client.CoreV1Api(api)
        labeler = NodeLabeler(node, lambda name, body: core.patch_node(name, body, _request_timeout=REQUEST_TIMEOUT))
    log.info("fake-gpu daemon for node %s: layout ConfigMap %s/%s", node, namespace, configmap)
    daemon = Daemon(node, state_file, host_state_file, plugin_dir, default_count,
                    watch=lambda applier, stopping: watch_layout(api, namespace, configmap, applier, stopping),
                    labeler=labeler, release=release, device_plugin=device_plugin, resource=resource,
                    guard=node_guard(api, node, resource, allow_real_gpu_nodes=allow_real_gpu_nodes,
                                     refusal_file=refusal_file))

    def stop(*_: object) -> None:
        daemon.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    daemon.run()
    time.sleep(0.1)
    return 0
