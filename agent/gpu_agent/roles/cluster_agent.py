"""The cluster agent: from GPU discovery to leasing work, failing fast or graceful without GPUs.

    GPU source -> InventoryMonitor -> RegistrationManager -> (credentials) --+
                                                                             +--> QueueConsumer -> Executor
    LeaderElector (a Lease, when leaderElection is on) -> (leading) ---------+--> Aggregator (domain status)
                                                                             +--> ChannelTemplates (each domain's
                                                                                  channel ResourceClaimTemplate)

It is live from the first moment (`/livez` 200). Ready (`/healthz` 200) means "this replica does
its job": the cluster has healthy GPUs (an unhealthy one, Xid or ECC or lost, counts for nothing;
when none is healthy the reason names each and why), registration for the current GPU generation
has succeeded and a valid credential is installed (NVCA's definition), and it either leads or is a
hot standby. Only the leader is *active*: its queues are open and it leases work (`active` in
/healthz, the metric `gpu_agent_active`), folds the domains and makes their channel templates. A standby
registers too (it takes over with its credential in hand) but leases no work, folds no domain and makes no
template; it reports "standby: the leader is <identity>".

Why a standby is Ready: Kubernetes, Helm (`--wait`), Argo CD and Flux read Pod readiness as "this
replica does its job". A NotReady standby could never let a rolling update replace the leader,
and `replicas: 2` could never be installed with `--wait`. With it Ready, a rolling update is a
hand-over: the new pod registers and becomes a Ready standby, the old leader is told to stop,
pauses its queues and releases the Lease, and the standby, watching the Lease, leads at once.
With no GPUs nothing is Ready, as NVCA validated (the chart then replaces the pod: Recreate).

Without GPUs at start, `gracefulNoGPU` decides, as NVCA's flag of that name does:

- off (the default, NVCA's, and the chart's): the agent fails fast. When the inventory monitor's first
  complete reading (the source answered in full: not an error, not a hung read, not the cluster source
  still waiting for its first list of nodes or slices) counts no GPU at all, the agent stops as it does
  on SIGTERM (queues paused, the Lease released, endpoints closed) and the process exits with code 3
  (EXIT_NO_GPUS), its last log line saying why and what to set. GPUs listed but unhealthy are GPUs: it
  waits for them, NotReady. Once a first complete reading has counted GPUs, the start is done: GPUs lost
  later turn the agent NotReady with its queues paused, as in graceful mode, and it never exits for it.
- on: graceful no-GPU mode. The agent is live with no GPUs (`/livez` 200) but NotReady (`/healthz` 503)
  with its queues paused, however long that lasts, until GPUs, registration and credentials are there.

`gpu-agent local` (make run) is the graceful mode's demo, started with no GPUs: its default is on.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.config import LOGGING, ConfigError, RoleConfig, Setting
from gpu_agent.foundations.control_plane_client import TRANSPORT_SETTINGS, ControlPlaneClient
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.gate import Gate, GateEvent
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.randomness import RandomSources
from gpu_agent.foundations.ratelimit import ApiLimit, kube_api_settings
from gpu_agent.foundations.secrets import Secret
from gpu_agent.foundations.threads import CURRENT, Threads, start_thread
from gpu_agent.foundations.token_file import TokenFile
from gpu_agent.mechanisms.inventory.monitor import InventoryEvent, InventoryMonitor
from gpu_agent.mechanisms.inventory.select import GPU_SOURCE_SETTINGS, GPUSourceConfig, loss_debounce, make_source
from gpu_agent.mechanisms.leadership.elector import ElectionSettings, LeaderElector
from gpu_agent.mechanisms.queues.consumer import QueueConsumer
from gpu_agent.mechanisms.queues.executor import Executor, RecordingExecutor
from gpu_agent.mechanisms.registration.manager import RegistrationManager, RegistrationSettings
from gpu_agent.roles.endpoints import EndpointServer

if TYPE_CHECKING:  # loaded when folding starts: the Kubernetes client costs memory (see make_executor)
    from gpu_agent.foundations.events import EventRecorder
    from gpu_agent.mechanisms.domain.aggregate import Aggregator, EveryDomainAggregator
    from gpu_agent.mechanisms.domain.channels import ChannelTemplates
    from gpu_agent.mechanisms.leadership.kube_fence import KubeWorkFence

log = get_logger(__name__)

COMPONENTS = ["gpus", "registration", "credentials", "leadership", "queues"]


SETTINGS = [
    *LOGGING,
    Setting("listenAddress", "address", "127.0.0.1:8080", "HOST:PORT for /livez, /healthz, /version, /metrics"),
    *GPU_SOURCE_SETTINGS,
    Setting("gracefulNoGPU", "bool", False, "with no GPUs at start, stay live but NotReady (queues paused) until "
            "GPUs come; false: exit with code 3 when the first complete GPU reading counts none (GPUs lost after a "
            "start with GPUs never make the agent exit)"),
    Setting("gpuNodeSelector", "labels", "", "node labels (key=value,...): with gpuSource=cluster only the GPUs of the "
            "nodes that carry them count, and work Pods are placed on those nodes (their nodeSelector); empty: every "
            "node", optional=True),
    Setting("draDriverName", "str", "", "the DRA driver that offers the GPUs: with gpuSource=cluster, count the GPU "
            "devices of its ResourceSlices (healthy: untainted, on Ready nodes) instead of allocatable nvidia.com/gpu; "
            "where GPUDomains are folded, make each domain's channel ResourceClaimTemplate (spec.channel) for its "
            "channel devices; empty: device plugins, and no channel templates", optional=True),
    Setting("draDeviceClassName", "str", "", "work Pods (executor=pod) get their GPUs through a ResourceClaimTemplate "
            "asking this DeviceClass (one template per GPU count, made on first use); empty: nvidia.com/gpu limits",
            optional=True),
    *TRANSPORT_SETTINGS,
    Setting("controlPlaneToken", "secret", "", "registration token (env only; or controlPlaneTokenFile)"),
    Setting("controlPlaneTokenFile", "path", "", "file holding the registration token; read again when it changes "
            "(a rotated token needs no restart)", optional=True),
    Setting("clusterId", "str", "local", "this cluster's name at the control plane"),
    Setting("registrationRetryInitial", "seconds", 0.0, "first registration retry delay; 0: the GPU poll interval "
            "(gpuPollInterval), as NVCA's backoff starts", 0, 3600),
    Setting("registrationRetryMax", "seconds", 300.0, "registration retry delay cap", 0.01, 86400),
    Setting("registrationRetryJitter", "number", 0.2, "fraction by which a retry delay may be shortened at random", 0, 0.99),
    Setting("reregistrationInterval", "seconds", 60.0, "periodic re-registration interval", 0.1, 86400),
    Setting("credentialRenewInterval", "seconds", 2700.0, "credential renewal interval (renewal also happens at 80% of its lifetime)", 0.1, 86400),
    Setting("requestTimeout", "seconds", 10.0, "timeout of one control-plane call", 0.1, 300),
    Setting("leaseSeconds", "seconds", 30.0, "lease length asked for each work item", 0.1, 3600),
    Setting("queuePollInterval", "seconds", 1.0, "wait between lease attempts on an empty queue", 0.01, 60),
    Setting("queueLongPoll", "seconds", 5.0, "how long the control plane may hold an empty lease call (0 = plain polling); "
            "also the longest a shutdown waits for it", 0, 30),
    Setting("queueMaxInFlight", "int", 0, "work items run side by side (each with its own lease); 0: as many as the "
            "GPUs registered, so a node of 16 GPUs runs 16 one-GPU items at once", 0, 4096),
    Setting("executor", "choice", "record", "how a work item runs: record (a local journal) or pod (a Pod per item)",
            choices=("record", "pod")),
    Setting("executorJournal", "path", ".run/executions.sqlite", "journal of executed items (record executor)"),
    Setting("executorWorkSeconds", "seconds", 0.0, "simulated work time per item (record executor)", 0, 3600),
    Setting("workNamespace", "str", os.environ.get("POD_NAMESPACE", "default"), "namespace of work Pods (pod executor)"),
    Setting("workImage", "str", "localhost/gpu-agent:dev", "image of work Pods (pod executor)"),
    Setting("releaseName", "str", "", "Helm release, recorded on work Pods for cleanup", optional=True),
    Setting("workServiceAccount", "str", "", "ServiceAccount of work Pods (pod executor): the chart's <fullname>-work, "
            "bound to no role; empty: the namespace's default. No token is mounted in a work Pod either way",
            optional=True),
    Setting("workPods", "workPods", {}, "what every work Pod gets besides what the agent sets (pod executor): "
            "tolerations, nodeSelector (merged with gpuNodeSelector, which wins on a shared key), affinity, "
            "runtimeClassName, imagePullSecrets, resources (of its container), priorityClassName, labels, annotations; "
            "the agent's own labels, annotations (gpu-agent.io/...) and GPU request are refused (the chart's workPods)",
            optional=True),
    Setting("domainName", "str", "", "GPUDomain whose members this agent folds into its status "
            "(node agents with domainWriteStrategy=aggregate); empty: none", optional=True),
    Setting("domainNamespace", "str", os.environ.get("POD_NAMESPACE", "default"), "namespace of that GPUDomain"),
    Setting("foldAllDomains", "bool", False, "fold the members of every GPUDomain of domainNamespace, those users create "
            "at run time included (node agents with joinMatchingDomains; aggregate strategy only)"),
    Setting("channelDeviceClassName", "str", "channel.gpu-agent.io", "DeviceClass of the DRA driver's channel "
            "devices (the chart's dra.channelDeviceClassName): what a GPUDomain's channel ResourceClaimTemplate asks "
            "for (with draDriverName)"),
    Setting("domainHeartbeatTtl", "number", 3.0, "heartbeat intervals a member may stay silent before it is marked "
            "NotReady in the domain", 1.5, 100),
    Setting("featureGates", "featureGates", "", "feature gates, e.g. LongPollLeases=false", optional=True),
    Setting("kubeconfig", "path", "", "kubeconfig (cluster source, pod executor); empty: in-cluster", optional=True),
    Setting("identity", "str", os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
            "this agent's name in the Lease and at the control plane (its Pod's name in a cluster)"),
    Setting("leaderElection", "bool", False, "elect one active agent through a coordination.k8s.io Lease "
            "(on in the chart: replicas beyond the first are hot standbys)"),
    Setting("leaderElectionLeaseName", "str", "gpu-agent-cluster-agent", "name of that Lease"),
    Setting("leaderElectionNamespace", "str", os.environ.get("POD_NAMESPACE", "default"), "namespace of that Lease"),
    Setting("leaderElectionOwner", "str", "", "Deployment (in that namespace) that owns the Lease, so that it is deleted "
            "with it; empty: no owner", optional=True),
    Setting("workPodFence", "str", "", "WorkFence (in that namespace) the leader writes its fencing token into before "
            "its first item, for the admission policy that refuses a deposed leader's work Pods (the chart's "
            "clusterAgent.workPodFencing); empty: no fencing policy", optional=True),
    Setting("leaderElectionLeaseDuration", "seconds", 15.0, "how long a standby waits after the leader's last "
            "renewal it saw before taking over", 1, 3600),
    Setting("leaderElectionRenewDeadline", "seconds", 10.0, "how long the leader may fail to renew before it stops "
            "leading and pauses its queues (shorter than the lease duration)", 0.5, 3600),
    Setting("leaderElectionRetryPeriod", "seconds", 2.0, "wait between attempts to acquire or renew "
            "(shorter than the renew deadline)", 0.1, 600),
    # Each API client's own limit (foundations/ratelimit.py). The busy client is the Pod executor's: an item costs
    # about 7 calls (its Pod's create; a read at once, then one per change the watch shows: scheduled, started,
    # ended; after the ack the finalizer's release and the delete), and an item still running one read per 5 s
    # (the watch's fallback). The queue bench's 16 one-GPU slots turn over no faster than every ~2 s (create ->
    # Succeeded -> gone), so at most ~8 items/s: at most ~56 calls/s at the floor's pace, ~45 at the bench's goal
    # (0.8 of it). 100/s is about twice that; a burst of 200 lets a wave of 100 items start at once (a create and
    # a read each), and a wave of ~600 queue within the 10 s a call may wait. Beyond ~500 items running at once
    # their fallback reads alone (0.2/s each) reach 100/s: raise it there. The other clients send far less: the
    # Lease's a renewal every 2 s; the domain fold's a list and a watch per domain when it starts (64 domains:
    # 128, inside the burst), then about one status write per domain per change, coalesced; the GPU source's one
    # watch. kube-controller-manager's 20/30 per controller would hold the executor to ~3 items/s: a controller
    # reads from its informers' cache, the executor reads its Pod fresh.
    *kube_api_settings(100.0, 200),
]


class ClusterAgentConfig(GPUSourceConfig, RoleConfig):
    """The settings above, typed (`Config.problems` holds the two to each other)."""
    listenAddress: str
    gracefulNoGPU: bool
    gpuNodeSelector: str
    draDriverName: str
    draDeviceClassName: str
    controlPlaneUrl: str
    controlPlaneCaFile: str
    controlPlaneAllowInsecure: bool
    controlPlaneToken: Secret
    controlPlaneTokenFile: str
    clusterId: str
    registrationRetryInitial: float
    registrationRetryMax: float
    registrationRetryJitter: float
    reregistrationInterval: float
    credentialRenewInterval: float
    requestTimeout: float
    leaseSeconds: float
    queuePollInterval: float
    queueLongPoll: float
    queueMaxInFlight: int
    executor: str
    executorJournal: str
    executorWorkSeconds: float
    workNamespace: str
    workImage: str
    releaseName: str
    workServiceAccount: str
    workPods: dict[str, Any]
    domainName: str
    domainNamespace: str
    foldAllDomains: bool
    channelDeviceClassName: str
    domainHeartbeatTtl: float
    featureGates: dict[str, bool]
    kubeconfig: str
    identity: str
    leaderElection: bool
    leaderElectionLeaseName: str
    leaderElectionNamespace: str
    leaderElectionOwner: str
    workPodFence: str
    leaderElectionLeaseDuration: float
    leaderElectionRenewDeadline: float
    leaderElectionRetryPeriod: float
    kubeApiQps: float
    kubeApiBurst: int


WORK_CONNECTIONS = 64  # the Pod executor's pool of API server connections, at least

EXIT_NO_GPUS = 3  # the process's exit code when it starts with no GPUs and gracefulNoGPU is off


def no_gpus_at_start(note: str | None) -> str:
    """The reason an agent without gracefulNoGPU gives up at start: its last log line."""
    seen = f" ({note})" if note else ""
    return (f"no GPUs in the cluster at start{seen} and gracefulNoGPU is off: exiting (set gracefulNoGPU=true to wait "
            "for GPUs live but NotReady)")


def make_executor(cfg: ClusterAgentConfig, clock: Clock, api_limit: ApiLimit | None = None) -> Executor:
    if cfg.executor == "pod":
        # Kubernetes' client costs ~15 MiB of RSS: loaded only by the roles that use it.
        from kubernetes import client

        from gpu_agent.foundations.kube import api_client, core_v1_list
        from gpu_agent.mechanisms.queues.pod_changes import PodChanges
        from gpu_agent.mechanisms.queues.pod_executor import PodExecutor, work_pod_selector
        from gpu_agent.mechanisms.queues.work_claims import DraWorkClaims

        # Each item in flight reads its Pod: a pool smaller than the calls in flight closes connections it cannot
        # keep, and the next call pays a TLS handshake (foundations/kube.py). 0 in flight: the GPUs, not known yet.
        connections = max(WORK_CONNECTIONS, cfg.queueMaxInFlight + 4)
        api = api_client(cfg.kubeconfig, connections=connections, limit=api_limit.named("work") if api_limit else None)
        # One watch of the release's work Pods says when each item reads its Pod again (not every 0.5 s each).
        changes = PodChanges(core_v1_list(api, "pods"), cfg.workNamespace, work_pod_selector(cfg.releaseName), clock=clock)
        claims = DraWorkClaims(client.ResourceV1Api(api), cfg.workNamespace, cfg.draDeviceClassName, release=cfg.releaseName,
                               driver=cfg.draDriverName) if cfg.draDeviceClassName else None
        return PodExecutor(client.CoreV1Api(api), cfg.workNamespace, cfg.workImage, release=cfg.releaseName, clock=clock,
                           pod_changes=changes, node_selector=cfg.gpuNodeSelector, claims=claims,
                           fencing=bool(cfg.leaderElection and cfg.workPodFence), work_pods=cfg.workPods,
                           service_account=cfg.workServiceAccount)

    return RecordingExecutor(Path(cfg.executorJournal), cfg.executorWorkSeconds, clock)


def first_retry_delay(cfg: ClusterAgentConfig) -> float:
    """The first registration retry delay: the setting, or the GPU poll interval where it is 0 (unset)."""
    return cfg.registrationRetryInitial or cfg.gpuPollInterval


class ClusterAgent:
    def __init__(self, cfg: ClusterAgentConfig, clock: Clock | None = None, rng: random.Random | None = None) -> None:
        cfg = cfg.replace(gpuLossDebounce=loss_debounce(cfg))  # the source's default made explicit in the log
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.random = RandomSources(rng)
        self.election = ElectionSettings(cfg.leaderElectionLeaseDuration, cfg.leaderElectionRenewDeadline,
                                         cfg.leaderElectionRetryPeriod)
        if cfg.leaderElection and self.election.problems():
            raise ConfigError("; ".join(self.election.problems()))
        # What every part reports to and shares.
        self.health = HealthRegistry(self.clock, COMPONENTS)
        # Every long-lived thread this agent starts, from here on and from its run (foundations/threads.py).
        self.threads = Threads(self.health)
        CURRENT.set(self.threads)
        self.metrics = AgentMetrics()
        self.metrics.ready.set_function(lambda: 1 if self.health.ready() else 0)  # /healthz's answer, whatever set it
        self.metrics.read_components(self.health.components_ready)  # which component holds it down
        self.metrics.read_domains(self._domains_ready)
        # Each API client this agent builds gets a bucket of its own from this (foundations/ratelimit.py).
        self.api_limit = ApiLimit(cfg.kubeApiQps, cfg.kubeApiBurst, clock=self.clock, observer=self.metrics)
        self.gate = Gate(self.clock, self._gate_observed)
        self.client = ControlPlaneClient(cfg.controlPlaneUrl, cfg.requestTimeout, ca_file=cfg.controlPlaneCaFile,
                                         on_call=self.metrics.control_plane_call)
        # The parts, as the module docstring draws them (the elector and the aggregator are made when
        # they start: both need the Kubernetes API).
        self.monitor = InventoryMonitor(make_source(cfg, metrics=self.metrics, clock=self.clock, api_limit=self.api_limit),
                                        clock=self.clock, health=self.health,
                                        poll_interval=cfg.gpuPollInterval, on_change=self._gpus_changed,
                                        loss_debounce=loss_debounce(cfg),
                                        on_drop=lambda outcome: self.metrics.gpu_drops.labels(outcome).inc())
        self.registration = self._registration()
        self.executor = make_executor(cfg, self.clock, self.api_limit)
        self.queue = self._queue()
        self.elector: LeaderElector | None = None
        self.work_fence: KubeWorkFence | None = None  # made with the elector (it needs the Kubernetes API)
        self.path_events: EventRecorder | None = None  # the Events of the work path's refusals
        self.aggregator: Aggregator | EveryDomainAggregator | None = None
        self.recorder: EventRecorder | None = None  # the Events of what the aggregator writes
        self.channels: ChannelTemplates | None = None  # the domains' channel templates, made while folding
        host, _, port = cfg.listenAddress.rpartition(":")
        self.endpoints = EndpointServer(host, int(port), self.health, self.metrics)
        # Their state as this agent sees it.
        self.registered = (False, "waiting for GPUs, registration and credentials")
        self.leading = (not cfg.leaderElection, "leader election off: this is the only agent"
                        if not cfg.leaderElection else "standby: electing a leader")
        self.health.set("leadership", True, self.leading[1])  # a standby does its job: see the module docstring
        self.logged: tuple[bool, str] | None = None
        self.started = asyncio.Event()  # set once the endpoints serve
        # Whether the first complete GPU reading counted GPUs (None until one came): without gracefulNoGPU, none
        # at start ends the run; after a start with GPUs nothing does.
        self.started_with_gpus: bool | None = None
        # Why this agent stops on its own, with the process's exit code (None: it runs until told to stop).
        self.exit: tuple[int, str] | None = None
        self._stopping = asyncio.Event()

    def _registration(self) -> RegistrationManager:
        cfg = self.cfg
        settings = RegistrationSettings(cfg.clusterId, first_retry_delay(cfg), cfg.registrationRetryMax,
                                        cfg.registrationRetryJitter, cfg.reregistrationInterval,
                                        cfg.credentialRenewInterval, holder=cfg.identity)
        # From a file (the chart's Secret volume): read again when it changes, so a rotated token needs no restart.
        path = cfg.secret_file("controlPlaneToken")
        token = (TokenFile(path, "controlPlaneTokenFile", "--control-plane-token-file", initial=cfg.controlPlaneToken)
                 if path else cfg.controlPlaneToken)
        return RegistrationManager(self.client, token, settings=settings, clock=self.clock,
                                   rng=self.random.for_("registration"), health=self.health, metrics=self.metrics,
                                   gate=self.gate, on_readiness=self._readiness_changed)

    def _queue(self) -> QueueConsumer:
        cfg = self.cfg
        return QueueConsumer(self.client, self.registration.current_credential, self.executor, clock=self.clock,
                             health=self.health, metrics=self.metrics, lease_seconds=cfg.leaseSeconds,
                             poll_interval=cfg.queuePollInterval, on_refused=self.registration.credential_refused,
                             long_poll=cfg.queueLongPoll if cfg.featureGates["LongPollLeases"] else 0.0,
                             identity=cfg.identity, still_leading=self._holds_lease if cfg.leaderElection else None,
                             max_in_flight=cfg.queueMaxInFlight,
                             check_path=self._check_work_path if hasattr(self.executor, "probe") else None,
                             on_path=self._work_path_changed)

    async def _check_work_path(self, leader: LeaderToken | None) -> str:
        """The consumer's proof of the work path: this leadership's token written into the WorkFence (with
        fencing), then the executor's dry runs. "" when work can run; else why not."""
        if self.work_fence is not None and leader is not None:
            def still_this_leadership() -> bool:  # not a later one of this agent's: its own check writes its token
                return self._holds_lease() and self.elector is not None and self.elector.token == leader

            try:
                await self.work_fence.publish(leader, still_this_leadership)
            except Exception as e:  # noqa: BLE001 - told in /healthz as the reason no work runs
                return f"the fencing token could not be written: {e}"
        probe = getattr(self.executor, "probe", None)
        try:
            return str(await probe(leader)) if probe is not None else ""
        except Exception as e:  # noqa: BLE001 - as above
            return f"the dry runs of a work pod failed: {e}"

    def _work_path_changed(self, ok: bool, why: str) -> None:
        """The queues turned NotReady because work Pods are refused (or back): an Event on the Deployment."""
        if ok:
            log.info("work pods are admitted again; the queues are Ready")
        else:
            log.error("work pods refused for %.0fs: %s; the queues are NotReady", QueueConsumer.PATH_BOUND, why)
        if self.path_events is not None and self.cfg.leaderElectionOwner:
            regarding = {"apiVersion": "apps/v1", "kind": "Deployment", "name": self.cfg.leaderElectionOwner,
                         "namespace": self.cfg.leaderElectionNamespace}
            self.path_events.record(regarding, "Normal" if ok else "Warning",
                                    "WorkPodsAdmitted" if ok else "WorkPodsRefused", "ProveWorkPath", why[:1000])

    def _domains_ready(self) -> dict[str, tuple[bool, str]]:
        """The domains this agent folds (while it leads), each (Ready, reason) as last written: the metric
        gpu_agent_domain_ready; a standby folds none, so only the leader exports it."""
        aggregator = self.aggregator
        return aggregator.readiness() if aggregator is not None else {}

    def _holds_lease(self) -> bool:
        # No elector yet (it is made when the agent runs): nothing has led, so the queues are closed anyway.
        return self.elector is None or self.elector.holds_lease()

    def _gate_observed(self, e: GateEvent) -> None:
        if e.event == "acquired":
            self.metrics.gate_wait.labels(e.purpose).observe(e.waited)
        log.v(2, "gate %s by %s (%s %.3fs)", e.event, e.purpose, "held" if e.event == "released" else "waited", e.waited)

    async def _gpus_changed(self, event: InventoryEvent) -> None:
        self.metrics.gpus.set(len(event.inventory.healthy))  # what it registers: only healthy GPUs count
        self.metrics.gpu_generation.set(event.generation)
        if self._no_gpus_at_start(event):
            return
        await self.queue.set_gpus(len(event.inventory.healthy))  # what items in flight may use
        await self.registration.gpus_changed(event.generation, event.inventory)

    def _no_gpus_at_start(self, event: InventoryEvent) -> bool:
        """NVCA's fail-fast, decided once, by the first complete reading: True when it counts no GPU and
        gracefulNoGPU is off, and the run is then told to stop. A reading that is no answer (an error, a hung
        read, a source still waiting for its first list) decides nothing: the next one may."""
        if self.started_with_gpus is not None or not event.complete:
            return False
        self.started_with_gpus = event.inventory.count > 0
        if self.started_with_gpus or self.cfg.gracefulNoGPU:
            return False
        self.stop_with(EXIT_NO_GPUS, no_gpus_at_start(event.note))
        return True

    def stop_with(self, code: int, reason: str) -> None:
        """End the run as a stop request does (queues paused, the Lease released, endpoints closed), then have
        it log `reason` as its last line and return `code`, the process's exit code. The first reason wins."""
        if self.exit is None:
            self.exit = (code, reason)
        self._stopping.set()

    async def _readiness_changed(self, ready: bool, reason: str) -> None:
        self.registered = (ready, reason)
        await self._open_queues_when_ready()

    # The elector's callbacks (client-go's LeaderCallbacks).
    async def _started_leading(self) -> None:
        self._lead((True, f"leader: {self.cfg.identity}"))
        self.queue.new_term(self.elector.token if self.elector is not None else None)
        self._start_folding()
        await self._open_queues_when_ready()

    async def _stopped_leading(self, why: str) -> None:
        self._lead((False, f"standby: lost the lease ({why})"))
        self._stop_folding()
        await self._open_queues_when_ready()
        self._close_executor()  # its watch of the work Pods: a standby has no item to wake

    async def _new_leader(self, identity: str) -> None:
        self._lead((False, f"standby: the leader is {identity or '(nobody yet)'}"))
        await self._open_queues_when_ready()

    def _lead(self, leading: tuple[bool, str]) -> None:
        self.leading = leading
        self.health.set("leadership", True, leading[1])

    async def _open_queues_when_ready(self) -> None:
        registered, leading = self.registered[0], self.leading[0]
        active = registered and leading
        reason = self.registered[1] if not registered else self.leading[1]
        await self.queue.set_open(active, reason, standby=registered and not leading)
        if (active, reason) == self.logged:
            return
        self.logged = (active, reason)
        if active:
            log.info("cluster agent Ready: GPUs registered, credentials installed, %s, queues open",
                     "leading" if self.cfg.leaderElection else "the only agent")
        elif registered:
            log.info("cluster agent Ready as a hot standby (%s): GPUs registered, credentials installed, queues "
                     "paused until it leads", reason)
        else:
            log.info("cluster agent NotReady: %s", reason)

    def _start_folding(self) -> None:
        if not (self.cfg.domainName or self.cfg.foldAllDomains) or self.aggregator is not None:
            return
        from gpu_agent.foundations.events import EventRecorder
        from gpu_agent.foundations.kube import api_client
        from gpu_agent.mechanisms.domain.aggregate import FOLDER_CONNECTIONS, Aggregator, EveryDomainAggregator
        from gpu_agent.mechanisms.inventory.cluster import ClusterSource

        api = api_client(self.cfg.kubeconfig, connections=FOLDER_CONNECTIONS, limit=self.api_limit.named("domains"))
        self.recorder = EventRecorder(api, controller="gpu-agent.io/cluster-agent", instance=self.cfg.identity,
                                      clock=self.clock)
        start_thread("domain-events", self.recorder.run)
        # Members are checked against their node agents' Pods (one watch of them) and, with the cluster GPU source,
        # their GPUs against the Nodes' capacity that source's Node watch already holds (no second watch).
        source = self.monitor.source
        capacity = source.gpu_capacity if isinstance(source, ClusterSource) else None
        if self.cfg.foldAllDomains:  # the named domain is one of them
            self.aggregator = EveryDomainAggregator(api, self.cfg.domainNamespace,
                                                    heartbeat_ttl_intervals=self.cfg.domainHeartbeatTtl,
                                                    clock=self.clock, rng=self.random.for_("domains"),
                                                    recorder=self.recorder, check_members=True, gpu_capacity=capacity)
            log.info("folding the members of every GPUDomain of %s", self.cfg.domainNamespace)
        else:
            self.aggregator = Aggregator(api, self.cfg.domainNamespace, self.cfg.domainName,
                                         heartbeat_ttl_intervals=self.cfg.domainHeartbeatTtl, clock=self.clock,
                                         rng=self.random.for_("domains"), recorder=self.recorder, check_members=True,
                                         gpu_capacity=capacity)
            log.info("folding GPUDomainMembers into GPUDomain %s/%s", self.cfg.domainNamespace, self.cfg.domainName)
        start_thread("domain-aggregator", self.aggregator.run)
        self._start_channels(api)

    def _start_channels(self, api: Any) -> None:
        """The domains' channel ResourceClaimTemplates, by the agent that folds them (with a DRA driver)."""
        if not self.cfg.draDriverName or self.channels is not None:
            return
        from gpu_agent.mechanisms.domain.channels import ChannelSettings, ChannelTemplates

        self.channels = ChannelTemplates(api, self.cfg.domainNamespace,
                                         ChannelSettings(self.cfg.draDriverName, self.cfg.channelDeviceClassName),
                                         domain="" if self.cfg.foldAllDomains else self.cfg.domainName,
                                         clock=self.clock, rng=self.random.for_("channels"), recorder=self.recorder)
        start_thread("domain-channels", self.channels.run, self.channels.stop_event)
        log.info("making the channel ResourceClaimTemplates of %s of %s (class %s, driver %s)",
                 "every GPUDomain" if self.cfg.foldAllDomains else f"GPUDomain {self.cfg.domainName}",
                 self.cfg.domainNamespace, self.cfg.channelDeviceClassName, self.cfg.draDriverName)

    def _close_executor(self) -> None:
        close = getattr(self.executor, "close", None)  # the Pod executor's; the recording one has none
        if close is not None:
            close()

    def _stop_folding(self) -> None:
        if self.channels is not None:
            self.channels.stop()
            self.channels = None
        if self.recorder is not None:
            self.recorder.stop()  # what it has queued is dropped: the next leader tells what it writes
            self.recorder = None
        if self.aggregator is not None:
            self.aggregator.stop()
            self.aggregator = None
            log.info("stopped folding GPUDomains of %s (not leading)", self.cfg.domainNamespace)

    def _elector(self) -> LeaderElector:
        from gpu_agent.foundations.events import EventRecorder
        from gpu_agent.foundations.kube import api_client
        from gpu_agent.mechanisms.leadership.kube_fence import KubeWorkFence
        from gpu_agent.mechanisms.leadership.kube_lease import KubeLease

        api = api_client(self.cfg.kubeconfig, limit=self.api_limit.named("leader"))
        timeout = min(self.cfg.requestTimeout, self.election.retry_period * 2)
        if self.cfg.workPodFence:
            self.work_fence = KubeWorkFence(api, namespace=self.cfg.leaderElectionNamespace, name=self.cfg.workPodFence,
                                            request_timeout=timeout, owner_deployment=self.cfg.leaderElectionOwner)
        if self.cfg.executor == "pod":
            self.path_events = EventRecorder(api, controller="gpu-agent.io/cluster-agent", instance=self.cfg.identity,
                                             clock=self.clock)
            start_thread("work-path-events", self.path_events.run)
        lease = KubeLease(api, namespace=self.cfg.leaderElectionNamespace,
                          name=self.cfg.leaderElectionLeaseName, request_timeout=timeout,
                          owner_deployment=self.cfg.leaderElectionOwner)
        log.info("electing a leader through Lease %s/%s as %s", self.cfg.leaderElectionNamespace,
                 self.cfg.leaderElectionLeaseName, self.cfg.identity)
        return LeaderElector(lease, identity=self.cfg.identity, settings=self.election, clock=self.clock,
                             rng=self.random.for_("election"),
                             on_started_leading=self._started_leading, on_stopped_leading=self._stopped_leading,
                             on_new_leader=self._new_leader)

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until `stop` is set or the agent stops itself (`stop_with`); the process's exit code: 0, or the
        code `stop_with` gave, after its reason has been logged as the last line."""
        CURRENT.set(self.threads)
        log.info("effective configuration (secrets redacted):")
        for line in self.cfg.describe():
            log.info("  %s", line)
        self.endpoints.start()
        if not self.cfg.leaderElection:
            self._start_folding()
        log.info("serving /livez /healthz /version /metrics on http://%s", self.endpoints.address)
        self.started.set()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.health.keep_beating(), name="heartbeat"),
                         tg.create_task(self.monitor.run(), name="inventory-monitor"),
                         tg.create_task(self.registration.run(), name="registration"),
                         tg.create_task(self.queue.run(), name="queue-consumer")]
                if self.cfg.leaderElection:
                    self.elector = self._elector()
                    tasks.append(tg.create_task(self.elector.run(), name="leader-election"))
                await first_of(stop.wait(), self._stopping.wait())
                # Stop leasing before the Lease is released (the elector's task, cancelled below), so
                # that the successor never finds this agent still leasing: a hand-over, not an overlap.
                log.info("shutting down%s: pausing the queues, then releasing the lease",
                         "" if self.exit is None else f" (exit code {self.exit[0]}, why in the last line)")
                await self.queue.set_open(False, "shutting down")
                for t in tasks:
                    t.cancel()
        finally:
            self._stop_folding()
            if self.path_events is not None:
                self.path_events.stop()
            self.endpoints.stop()
            self.monitor.source.close()
            self.client.close()
            self._close_executor()
        if self.exit is None:
            return 0
        log.error("%s", self.exit[1])  # the last line: why, and what to do
        return self.exit[0]


async def first_of(*waits: Coroutine[Any, Any, object]) -> None:
    """Wait until the first of `waits` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
