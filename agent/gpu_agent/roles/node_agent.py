"""The node agent (DaemonSet): this node's GPUs, read through NVML or the fake source.

    GPU source -> InventoryMonitor -> /healthz (gpus entry with UUIDs), /metrics

It is ready whenever its GPU source can be read, with any number of GPUs (zero included, or none
healthy): it reports the truth about the node. Its domain member is Ready only while the node has
a healthy GPU; the member carries the healthy count (`healthyGPUs`) and, when NotReady or not
every GPU is healthy, why (`message`, naming each such GPU and its error). A source that cannot
be read makes it NotReady, with the reason. With `domainName` set it also keeps this node's entry
in that shared GPUDomain (mechanisms/domain) and removes it on shutdown, bounded by
`shutdownTimeout`; with `joinMatchingDomains` it also joins every GPUDomain of `domainNamespace`
whose nodeSelector matches this node's labels, and leaves one that stops matching
(mechanisms/domain/membership.py). As a DRA driver with `draDomainChannels` it offers a GPUDomain
channel device too, and preparing a channel claim joins that claim's domain: the membership is the
DRA driver's gate (mechanisms/dra/channels.py), wired here, as the two mechanisms know nothing of
each other.

With `gpuHealthEvents` (the default) each GPU health change the source's tracker reports
(mechanisms/inventory/gpu_health.py) is an Event on this node's Node, through an EventRecorder
(foundations/events.py: series, spam filter, sent on its own thread): Warning GPUUnhealthy or GPULost,
Normal GPUHealthy. The Node is cluster-scoped, so its Events go to namespace `default`, and their
`regarding` carries the node's name as its UID, as the kubelet's do (so `kubectl describe node` finds
them without this agent reading the Node). The tracker's hook only queues: the health path never waits
on the API server.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.config import LOGGING, RoleConfig, Setting
from gpu_agent.foundations.gpus import Inventory, describe_unhealthy
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.metrics import NodeMetrics
from gpu_agent.foundations.ratelimit import ApiLimit, kube_api_settings
from gpu_agent.foundations.threads import CURRENT, Threads, start_thread
from gpu_agent.mechanisms.domain.entries import OCC_STRATEGIES
from gpu_agent.mechanisms.inventory.gpu_health import HealthChange, health_event
from gpu_agent.mechanisms.inventory.monitor import InventoryEvent, InventoryMonitor
from gpu_agent.mechanisms.inventory.select import GPU_SOURCE_SETTINGS, GPUSourceConfig, loss_debounce, make_source
from gpu_agent.roles.endpoints import EndpointServer

if TYPE_CHECKING:
    from gpu_agent.foundations.events import EventRecorder

log = get_logger(__name__)

# Who records the GPU health Events on a Node (reportingController; reportingInstance is the node's name), and
# their action.
EVENTS_CONTROLLER = "gpu-agent.io/node-agent"
HEALTH_ACTION = "CheckGPUHealth"

SETTINGS = [
    *LOGGING,
    Setting("listenAddress", "address", "127.0.0.1:8081", "HOST:PORT for /livez, /healthz, /version, /metrics"),
    Setting("nodeName", "str", os.environ.get("NODE_NAME") or socket.gethostname(), "this node's name"),
    *GPU_SOURCE_SETTINGS,
    Setting("gpuHealthEvents", "bool", True, "record each GPU health change as an Event on this node's Node (namespace "
            "default, as the kubelet's; `kubectl events -n default --for node/NAME`): Warning GPUUnhealthy (the Xid or "
            "ECC error and its class) or GPULost, Normal GPUHealthy when it recovers; repeats count into one Event's series"),
    Setting("domainName", "str", "", "GPUDomain to publish this node's entry into (empty: none)", optional=True),
    Setting("joinMatchingDomains", "bool", False, "also join every GPUDomain of domainNamespace whose spec.nodeSelector "
            "matches this node's labels (users create them at run time), and leave one that stops matching"),
    Setting("domainNamespace", "str", os.environ.get("POD_NAMESPACE", "default"), "namespace of the GPUDomain"),
    Setting("nodeIp", "str", os.environ.get("NODE_IP", ""), "this node's IP, published in its entry", optional=True),
    Setting("domainWriteStrategy", "choice", "aggregate", "how this node's entry reaches the shared GPUDomain: "
            "aggregate (its own GPUDomainMember, folded in by the cluster agent), or optimistic concurrency on the "
            "GPUDomain itself with dra or fulljitter backoff (see make bench-domain)", choices=("aggregate", *OCC_STRATEGIES)),
    Setting("domainWriteRate", "number", 25.0, "successful writes per second the API server takes on one object "
            "(sets the fulljitter cap to nodes / rate)", 0.1, 10000),
    Setting("domainHeartbeatInterval", "seconds", 5.0, "how often this node renews its GPUDomainMember's heartbeat "
            "(aggregate strategy); the cluster agent marks the member NotReady after its domainHeartbeatTtl (3) intervals "
            "without one", 0.2, 3600),
    Setting("podName", "str", os.environ.get("POD_NAME", ""), "this agent's Pod, the owner of its GPUDomainMember "
            "(deleted with the Pod); empty: no owner", optional=True),
    Setting("podUid", "str", os.environ.get("POD_UID", ""), "that Pod's UID", optional=True),
    Setting("peersFile", "path", "", "file the sorted peer list is rendered into (empty: none)", optional=True),
    Setting("shutdownTimeout", "seconds", 10.0, "how long shutdown may spend removing this node's entry", 0.1, 300),
    Setting("kubeconfig", "path", "", "kubeconfig; empty: in-cluster", optional=True),
    Setting("draDriverName", "str", "", "serve this node's GPUs as the DRA driver of this name (e.g. gpu.gpu-agent.io): "
            "ResourceSlices, and claims prepared for the kubelet through CDI (mechanisms/dra); empty: no DRA", optional=True),
    Setting("draRegistryDir", "path", "/var/lib/kubelet/plugins_registry", "the kubelet's plugin registry folder, where the "
            "DRA driver's registration socket goes"),
    Setting("draPluginDir", "path", "/var/lib/kubelet/plugins", "folder the DRA driver keeps <driver>/checkpoint.json in "
            "(prepared claims, kept across restarts)"),
    Setting("draCdiDir", "path", "/var/run/cdi", "folder the DRA driver writes the CDI spec of each prepared claim into "
            "(one the container runtime reads)"),
    Setting("draDomainChannels", "bool", False, "offer a GPUDomain channel device (channel-0) in this node's "
            "ResourceSlice; preparing a claim of it joins its GPUDomain (of domainNamespace) and completes once this "
            "node is Ready there (the DRA driver's; mechanisms/dra/channels.py)"),
    Setting("draChannelCount", "int", 2048, "channels a claim with allocationMode All gets "
            "(/dev/nvidia-caps-imex-channels/channel0 .. channel<count-1>)", 1, 2048),
    Setting("draChannelReadyWait", "seconds", 10.0, "how long one prepare call of a channel claim waits for this node "
            "to be Ready in its domain before it answers the kubelet with the reason (the pod's "
            "FailedPrepareDynamicResources event); the driver annotates the pod once the node is Ready, and the "
            "kubelet prepares again at once", 0, 40),
    Setting("draChannelHostDevice", "str", "", "host device behind each channel, {n} the channel's number; empty: "
            "/dev/null on the fake source (a harmless stand-in), /dev/nvidia-caps-imex-channels/channel{n} on nvml",
            optional=True),
    Setting("draCleanupInterval", "seconds", 600.0, "how often the DRA driver unprepares claims it left half-prepared "
            "whose object is gone or replaced (also at start)", 1, 86400),
    # Each API client's own limit (foundations/ratelimit.py): the domain's and the DRA driver's. Steady, a node
    # agent sends a fraction of a call a second (its member applied every heartbeat, 5 s; watches). Its bursts: at
    # start a handful (lists, watches, its member, its ResourceSlice); the DRA driver reads each claim it prepares,
    # one at a time, so a 16-GPU node (the CI's fake node) starting a Pod per GPU at once reads 16 claims and
    # writes its slice: inside a burst of 20, refilled in 2 s at 10/s. client-go's default (5/10) would hold the
    # last of those 16 Pods' claims about a second. A DaemonSet multiplies whatever one agent sends by the nodes,
    # so its limit stays low: a bug's loop on 1,000 nodes is 10,000/s, not whatever each can send.
    *kube_api_settings(10.0, 20),
]


class NodeAgentConfig(GPUSourceConfig, RoleConfig):
    """The settings above, typed (`Config.problems` holds the two to each other)."""
    listenAddress: str
    nodeName: str
    gpuHealthEvents: bool
    domainName: str
    joinMatchingDomains: bool
    domainNamespace: str
    nodeIp: str
    domainWriteStrategy: str
    domainWriteRate: float
    domainHeartbeatInterval: float
    podName: str
    podUid: str
    peersFile: str
    shutdownTimeout: float
    kubeconfig: str
    draDriverName: str
    draRegistryDir: str
    draPluginDir: str
    draCdiDir: str
    draCleanupInterval: float
    draDomainChannels: bool
    draChannelCount: int
    draChannelReadyWait: float
    draChannelHostDevice: str
    kubeApiQps: float
    kubeApiBurst: int


def node_reference(node: str) -> dict[str, str]:
    """The `regarding` of an Event about Node `node`: cluster-scoped (no namespace), and its name as its UID, as the
    kubelet refers to its Node (`kubectl describe node` looks for Events by the Node's UID and by its name)."""
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}


def member_message(event: InventoryEvent) -> str:
    """Why this node's member is NotReady, or which of its GPUs are not healthy; "" when all is well."""
    inventory = event.inventory
    if event.error:
        return f"GPU source cannot be read: {event.error}"
    if inventory.count == 0:
        return "no GPUs" + (f": {event.note}" if event.note else "")
    if not inventory.unhealthy:
        return ""
    if not inventory.healthy:
        return f"no healthy GPU: {describe_unhealthy(inventory.unhealthy)}"
    return f"{len(inventory.healthy)} of {inventory.count} GPUs healthy; not healthy: {describe_unhealthy(inventory.unhealthy)}"


class NodeAgent:
    def __init__(self, cfg: NodeAgentConfig, clock: Clock | None = None) -> None:
        cfg = cfg.replace(gpuLossDebounce=loss_debounce(cfg))  # the source's default made explicit in the log
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.health = HealthRegistry(self.clock, ["gpus"] + (["domain"] if cfg.domainName else [])
                                     + (["dra"] if cfg.draDriverName else []))
        # Every long-lived thread this agent starts, from here on and from its run (foundations/threads.py).
        self.threads = Threads(self.health)
        CURRENT.set(self.threads)
        self.metrics = NodeMetrics()
        # Each API client this agent builds gets a bucket of its own from this (foundations/ratelimit.py).
        self.api_limit = ApiLimit(cfg.kubeApiQps, cfg.kubeApiBurst, clock=self.clock, observer=self.metrics)
        self.domain: Any = None
        channels = bool(cfg.draDriverName and cfg.draDomainChannels)
        if cfg.domainName or cfg.joinMatchingDomains or channels:
            # Kubernetes' client costs ~15 MiB of RSS: loaded only where it is used (a domain here; DRA, and the GPU
            # health Events, on by default, below).
            from gpu_agent.foundations.kube import api_client
            from gpu_agent.mechanisms.domain.aggregate import MemberWriter
            from gpu_agent.mechanisms.domain.membership import DomainMembership
            from gpu_agent.mechanisms.domain.reconciler import DomainReconciler
            from gpu_agent.mechanisms.domain.writer import DomainWriter

            api = api_client(cfg.kubeconfig, limit=self.api_limit.named("domains"))

            def reconciler_for(domain: str) -> DomainReconciler:
                writer: DomainWriter | MemberWriter
                resync = 60.0
                if cfg.domainWriteStrategy == "aggregate":
                    owner = {"name": cfg.podName, "uid": cfg.podUid} if cfg.podName and cfg.podUid else None
                    writer = MemberWriter(api, cfg.domainNamespace, domain, clock=self.clock, owner=owner,
                                          heartbeat_interval=cfg.domainHeartbeatInterval)
                    resync = cfg.domainHeartbeatInterval  # each resync applies the member again: the heartbeat
                else:
                    writer = DomainWriter(api, cfg.domainNamespace, domain, cfg.domainWriteStrategy, cfg.domainWriteRate,
                                          clock=self.clock)
                named = domain == cfg.domainName
                peers = (cfg.peersFile if named else f"{cfg.peersFile}.{domain}") if cfg.peersFile else ""
                return DomainReconciler(writer, self.health, node=cfg.nodeName, ip=cfg.nodeIp,
                                        peers_file=Path(peers) if peers else None, resync_seconds=resync, health_component="domain" if named else None,
                                        clock=self.clock)

            self.domain = DomainMembership(api, cfg.domainNamespace, cfg.nodeName, named=cfg.domainName,
                                           join_matching=cfg.joinMatchingDomains, make_reconciler=reconciler_for, leave_timeout=cfg.shutdownTimeout,
                                           writes_members=cfg.domainWriteStrategy == "aggregate",
                                           view_root=Path(cfg.draPluginDir) / cfg.draDriverName / "domains" if channels else None)
        self.dra: Any = None
        if cfg.draDriverName:
            from gpu_agent.foundations.kube import api_client
            from gpu_agent.mechanisms.dra.driver import DRADriver
            from gpu_agent.mechanisms.dra.prepare import Channels

            host_device = cfg.draChannelHostDevice or (
                "/dev/null" if cfg.gpuSource == "fake" else "/dev/nvidia-caps-imex-channels/channel{n}")
            self.dra = DRADriver(api_client(cfg.kubeconfig, limit=self.api_limit.named("dra")), driver=cfg.draDriverName,
                                 node=cfg.nodeName, registry_dir=Path(cfg.draRegistryDir), plugin_dir=Path(cfg.draPluginDir),
                                 cdi_dir=Path(cfg.draCdiDir), health=self.health, clock=self.clock,
                                 cleanup_interval=cfg.draCleanupInterval,
                                 channels=Channels(self.domain if channels else None, cfg.draChannelReadyWait,
                                                   cfg.draChannelCount, host_device))
        # The GPU health Events on this node's Node (None: not recorded).
        self.events: EventRecorder | None = self._health_events() if cfg.gpuHealthEvents else None
        self.node_ref = node_reference(cfg.nodeName)
        self.monitor = InventoryMonitor(make_source(cfg, metrics=self.metrics, clock=self.clock, api_limit=self.api_limit,
                                                    on_health=self._health_changed if self.events is not None else None),
                                        clock=self.clock, health=self.health, poll_interval=cfg.gpuPollInterval,
                                        on_change=self._gpus_changed, zero_is_ready=True, loss_debounce=loss_debounce(cfg),
                                        on_drop=lambda outcome: self.metrics.gpu_drops.labels(outcome).inc())
        host, _, port = cfg.listenAddress.rpartition(":")
        self.endpoints = EndpointServer(host, int(port), self.health, self.metrics)

    def _health_events(self) -> EventRecorder | None:
        from kubernetes.config import ConfigException

        from gpu_agent.foundations.events import EventRecorder
        from gpu_agent.foundations.kube import api_client

        try:
            api = api_client(self.cfg.kubeconfig, limit=self.api_limit.named("events"))
        except ConfigException as e:
            if self.cfg.kubeconfig:
                raise
            # Outside a cluster with no kubeconfig (a node agent run by hand on the fake source): nowhere to record.
            log.warning("GPU health Events are not recorded: no Kubernetes API to record them with (not in a "
                        "cluster, no kubeconfig: %s); gpuHealthEvents=false turns them off", e)
            return None
        return EventRecorder(api, controller=EVENTS_CONTROLLER, instance=self.cfg.nodeName, clock=self.clock)

    def _health_changed(self, change: HealthChange) -> None:
        """The tracker's hook (under its lock, on the source's thread): only queues."""
        if self.events is None:
            return
        type_, reason, note = health_event(change)
        self.events.record(self.node_ref, type_, reason, HEALTH_ACTION, note)

    async def _gpus_changed(self, event: InventoryEvent) -> None:
        healthy = len(event.inventory.healthy)
        self.metrics.gpus.set(healthy)
        self.metrics.gpu_generation.set(event.generation)
        if self.dra is not None:
            # an unreadable source offers nothing: the slice empties rather than offer GPUs nobody can see
            self.dra.set_inventory(event.inventory if event.error is None else Inventory())
        if self.domain is not None:
            self.domain.set_gpus(sorted(event.inventory.uuids), ready=event.error is None and healthy > 0,
                                 clique=event.inventory.clique, healthy=healthy, message=member_message(event))

    async def run(self, stop: asyncio.Event) -> None:
        CURRENT.set(self.threads)
        log.info("effective configuration (secrets redacted):")
        for line in self.cfg.describe():
            log.info("  %s", line)
        self.endpoints.start()
        if self.events is not None:
            start_thread("gpu-health-events", self.events.run)
        log.info("node agent for %s serving on http://%s", self.cfg.nodeName, self.endpoints.address)
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.health.keep_beating()), tg.create_task(self.monitor.run())]
                if self.domain is not None:
                    tasks.append(tg.create_task(self.domain.run()))
                if self.dra is not None:
                    tasks.append(tg.create_task(self.dra.run(stop)))
                await stop.wait()
                log.info("shutting down")
                for t in tasks:
                    t.cancel()
            if self.domain is not None:
                await self.domain.remove_entries(self.cfg.shutdownTimeout)

        finally:
            if self.events is not None:
                self.events.stop()  # what it has queued is dropped: events are best effort
            self.endpoints.stop()
            self.monitor.source.close()
