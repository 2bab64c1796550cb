"""Prometheus metrics, each agent on its own registry (no global state between tests).

Per role: every agent exports its GPU view, its build and its process; only the cluster agent
exports registration, credentials and the work queue. A node agent that exported
`gpu_agent_ready 0` and `gpu_agent_queue_paused 1` forever would page someone for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpu_agent.foundations.gpus import HEALTH_STATES
from gpu_agent.foundations.version import version_info

# The outcomes of a control plane call: answered (2xx) or the kind of its ControlPlaneError
# (foundations/control_plane_client.py); unavailable and tls are the calls that got no usable answer.
CONTROL_PLANE_OUTCOMES = ("ok", "unavailable", "tls", "protocol", "unauthorized", "fenced", "rejected", "too-large")


class _ReadAtScrape(Collector):
    """A gauge family read at each scrape from what `read` returns (label values -> value): the state a registry
    or a folder holds now, never a copy of it that could go stale (as Gauge.set_function, with labels)."""

    def __init__(self, name: str, documentation: str, labels: list[str],
                 read: Callable[[], Mapping[tuple[str, ...], float]]) -> None:
        self.name, self.documentation, self.labels, self.read = name, documentation, labels, read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, value in sorted(self.read().items()):
            family.add_metric(list(values), value)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labels)


class NodeMetrics:
    """What every agent exports: GPUs, build, process."""

    def __init__(self, role: str = "node-agent") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        info = version_info()
        Gauge("gpu_agent_build_info", "Always 1; the labels say which build runs", ["version", "commit", "build_date", "role"],
              registry=r).labels(info["version"], info["commit"], info["buildDate"], role).set(1)
        self.gpus = Gauge("gpu_agent_gpus", "Healthy GPUs the agent sees (those that count for work)", registry=r)
        self.gpu_generation = Gauge("gpu_agent_gpu_generation", "Generation of the GPU inventory (bumped on every change)", registry=r)
        self.gpu_drops = Counter("gpu_agent_gpu_drops", "GPU losses seen: absorbed (came back within gpuLossDebounce) "
                                 "or acted on (a real removal)", ["outcome"], registry=r)
        # GPU health (mechanisms/inventory/gpu_health.py): labels are states and kinds, never UUIDs, so they stay few.
        self.gpus_by_health = Gauge("gpu_agent_gpus_by_health", "GPUs the source lists, by health (Healthy, "
                                    "Unhealthy, Lost) as last read", ["health"], registry=r)
        self.gpu_health_transitions = Counter("gpu_agent_gpu_health_transitions", "GPU health transitions, by the "
                                              "state entered", ["to"], registry=r)
        self.gpu_health_events = Counter("gpu_agent_gpu_health_events", "NVML health events seen, by kind: "
                                         "xid_critical, xid_ignored (gpuHealthIgnoredXids), ecc_single, ecc_double",
                                         ["kind"], registry=r)
        for state in HEALTH_STATES:
            self.gpus_by_health.labels(state).set(0)
            self.gpu_health_transitions.labels(state)
        for kind in ("xid_critical", "xid_ignored", "ecc_single", "ecc_double"):
            self.gpu_health_events.labels(kind)
        # The client-side rate limit of API server calls (foundations/ratelimit.py), by the agent's API client
        # (work, leader, domains, gpus, dra): how often it held a request back, and for how long.
        self.kube_api_throttled = Counter("gpu_agent_kube_api_throttled", "Kubernetes API requests the client-side "
                                          "rate limit (kubeApiQps, kubeApiBurst) held back: waited (then sent) or "
                                          "refused (the wait would have outlasted the request's timeout; not sent)",
                                          ["client", "outcome"], registry=r)
        self.kube_api_throttle_wait = Histogram("gpu_agent_kube_api_throttle_wait_seconds", "Time Kubernetes API "
                                                "requests that waited spent waiting for the client-side rate limit",
                                                ["client"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
                                                registry=r)

    # The health tracker's metrics sink (gpu_health.HealthMetrics).
    def gpu_health_transition(self, to: str) -> None:
        self.gpu_health_transitions.labels(to).inc()

    def gpu_health_counts(self, counts: Mapping[str, int]) -> None:
        for state, n in counts.items():
            self.gpus_by_health.labels(state).set(n)

    def gpu_health_event(self, kind: str) -> None:
        self.gpu_health_events.labels(kind).inc()

    # The rate limiters' sink (ratelimit.LimiterObserver).
    def kube_api_waited(self, client: str, seconds: float) -> None:
        self.kube_api_throttled.labels(client, "waited").inc()
        self.kube_api_throttle_wait.labels(client).observe(seconds)

    def kube_api_refused(self, client: str) -> None:
        self.kube_api_throttled.labels(client, "refused").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AgentMetrics(NodeMetrics):
    """The cluster agent's: the above, plus registration, credentials and the work queue."""

    def __init__(self) -> None:
        super().__init__(role="cluster-agent")
        r = self.registry
        self.registration_attempts = Counter("gpu_agent_registration_attempts", "Registration attempts", ["kind"], registry=r)
        self.registration_failures = Counter("gpu_agent_registration_failures", "Failed registration attempts", ["kind", "reason"], registry=r)
        self.registration_discarded = Counter("gpu_agent_registration_discarded", "Registration responses discarded because the GPU generation changed", registry=r)
        self.renewals = Counter("gpu_agent_credential_renewals", "Credential renewal attempts", registry=r)
        self.renewal_failures = Counter("gpu_agent_credential_renewal_failures", "Failed credential renewals", ["reason"], registry=r)
        self.backoff = Gauge("gpu_agent_registration_backoff_seconds", "Current registration retry delay (0 when not retrying)", registry=r)
        self.queue_paused = Gauge("gpu_agent_queue_paused", "1 while the work queue is paused", registry=r)
        self.ready = Gauge("gpu_agent_ready", "1 while every component is ready (a registered hot standby is ready)",
                           registry=r)
        self.active = Gauge("gpu_agent_active", "1 while this agent leads and its queues are open (it leases work)",
                            registry=r)
        self.items = Counter("gpu_agent_items_processed", "Work items processed", ["outcome"], registry=r)
        for outcome in ("executed", "duplicate", "failed", "gave-up"):  # from 0: an alert's rate sees the first one
            self.items.labels(outcome)
        self.work_path_refusals = Counter(
            "gpu_agent_work_path_refusals", "Work Pods, real or dry-run checks, the API server refused for a reason "
            "that is not the item's (fencing policy, quota, ServiceAccount, webhook)", registry=r)
        self.work_path_down = Gauge("gpu_agent_work_path_down", "1 while the leader's work Pods have been refused for "
                                    "longer than the bound (its queues NotReady)", registry=r)
        self.gate_wait = Histogram("gpu_agent_gate_wait_seconds", "Time spent waiting for the registration gate", ["purpose"],
                                   buckets=(0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.control_plane_requests = Counter(
            "gpu_agent_control_plane_requests", "Calls to the control plane, by outcome: ok (answered) or why not: "
            "unavailable (no answer, a timeout, 5xx or 429), tls (the handshake failed), protocol, unauthorized, "
            "fenced, rejected, too-large", ["outcome"], registry=r)
        for outcome in CONTROL_PLANE_OUTCOMES:
            self.control_plane_requests.labels(outcome)
        # Read at each scrape from what the role hands in (read_components, read_domains); nothing until then.
        self._components: Callable[[], Mapping[str, bool]] = dict
        self._domains: Callable[[], Mapping[str, tuple[bool, str]]] = dict
        r.register(_ReadAtScrape(
            "gpu_agent_component_ready", "1 while the /healthz component is ready, by component: which of them "
            "holds gpu_agent_ready at 0 (/healthz says why)", ["component"],
            lambda: {(name,): 1 if ok else 0 for name, ok in self._components().items()}))
        r.register(_ReadAtScrape(
            "gpu_agent_domain_ready", "1 while the GPUDomain's Ready condition is True, by domain and the "
            "condition's reason; only the agent that folds the domains (the leader) exports it", ["domain", "reason"],
            lambda: {(name, reason): 1 if ok else 0 for name, (ok, reason) in self._domains().items()}))
        self.queue_paused.set(1)

    def read_components(self, ready: Callable[[], Mapping[str, bool]]) -> None:
        """component -> ready, asked at each scrape (HealthRegistry.components_ready)."""
        self._components = ready

    def read_domains(self, ready: Callable[[], Mapping[str, tuple[bool, str]]]) -> None:
        """domain -> (Ready, the Ready condition's reason), asked at each scrape (the aggregator's readiness)."""
        self._domains = ready

    def control_plane_call(self, outcome: str) -> None:
        """ControlPlaneClient's on_call."""
        self.control_plane_requests.labels(outcome).inc()
