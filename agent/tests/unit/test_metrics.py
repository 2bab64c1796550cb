"""Each role exports its own metrics: the node agent never the cluster agent's readiness or queue."""

from prometheus_client.parser import text_string_to_metric_families

from gpu_agent.foundations.metrics import AgentMetrics, NodeMetrics
from gpu_agent.foundations.version import version_info


def families(metrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_node_agent_exports_node_metrics_only_and_the_cluster_agent_all():
    node, cluster = families(NodeMetrics()), families(AgentMetrics())
    shared = {"gpu_agent_gpus", "gpu_agent_gpu_generation", "gpu_agent_gpu_drops", "gpu_agent_build_info",
              "process_resident_memory_bytes", "process_cpu_seconds", "python_info",
              "gpu_agent_kube_api_throttled", "gpu_agent_kube_api_throttle_wait_seconds"}
    assert shared <= set(node) and shared <= set(cluster)
    cluster_only = {"gpu_agent_ready", "gpu_agent_queue_paused", "gpu_agent_registration_attempts",
                    "gpu_agent_items_processed", "gpu_agent_gate_wait_seconds"}
    assert cluster_only <= set(cluster)
    assert not cluster_only & set(node), "the node agent exports the cluster agent's metrics"


def test_build_info_names_the_build_and_the_role():
    info = version_info()
    for metrics, role in ((NodeMetrics(), "node-agent"), (AgentMetrics(), "cluster-agent")):
        (sample,) = families(metrics)["gpu_agent_build_info"].samples
        assert sample.value == 1
        assert sample.labels == {"version": info["version"], "commit": info["commit"], "build_date": info["buildDate"],
                                 "role": role}


def samples(metrics, name: str, sample: str = "") -> dict:
    """label values (sorted by label name) -> value of a family's samples named `sample` (its name unless given)."""
    return {tuple(sorted(s.labels.items())): s.value for s in families(metrics)[name].samples
            if s.name == (sample or name)}


def test_component_ready_says_which_healthz_component_holds_readiness_down_read_at_each_scrape():
    """What GPUAgentClusterAgentNotReady (charts/gpu-agent/templates/prometheusrule.yaml) names in its description."""
    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.foundations.health import HealthRegistry

    metrics, health = AgentMetrics(), HealthRegistry(ManualClock(), ["gpus", "queues"])
    assert samples(metrics, "gpu_agent_component_ready") == {}  # nothing handed in: no series
    metrics.read_components(health.components_ready)
    health.set("gpus", True, "4 GPUs")
    health.set("queues", False, "paused: not registered")
    assert samples(metrics, "gpu_agent_component_ready") == {(("component", "gpus"),): 1, (("component", "queues"),): 0}
    health.set("queues", True, "leasing work")
    health.set("threads", False, "a thread died")  # a component set later is read too
    assert samples(metrics, "gpu_agent_component_ready") == {
        (("component", "gpus"),): 1, (("component", "queues"),): 1, (("component", "threads"),): 0}


def test_domain_ready_is_each_folded_domains_ready_condition_with_its_reason_and_nothing_unfolded():
    from gpu_agent.mechanisms.domain.aggregate import Aggregator, EveryDomainAggregator

    def folded(name: str, status: str, reason: str) -> Aggregator:
        agg = Aggregator(None, "ns", name)
        agg.writer.cached = {"metadata": {"name": name}, "status": {"conditions": [
            {"type": "Other", "status": "True", "reason": "X"},
            {"type": "Ready", "status": status, "reason": reason, "message": "..."}]}}
        return agg

    never = Aggregator(None, "ns", "new")  # nothing read or written yet
    assert never.readiness() == {}
    every = EveryDomainAggregator(None, "ns")
    every.aggregators = {"d1": folded("d1", "True", "MembersReady"), "d2": folded("d2", "False", "MembersMissing"),
                         "new": never}
    metrics = AgentMetrics()
    metrics.read_domains(every.readiness)
    assert samples(metrics, "gpu_agent_domain_ready") == {
        (("domain", "d1"), ("reason", "MembersReady")): 1, (("domain", "d2"), ("reason", "MembersMissing")): 0}
    every.aggregators = {}  # no longer leading: no domain, no series (a standby exports none)
    assert samples(metrics, "gpu_agent_domain_ready") == {}


def test_control_plane_requests_count_each_call_by_outcome_answered_or_why_not():
    """What GPUAgentControlPlaneUnreachable stands on: calls that got no usable answer (unavailable, tls) and none
    answered. Every outcome starts at 0, so an increase from the first failure on shows."""
    import pytest
    import requests

    from gpu_agent.foundations.control_plane_client import ControlPlaneClient, Unauthorized, Unavailable
    from gpu_agent.foundations.metrics import CONTROL_PLANE_OUTCOMES

    answers = [200, ConnectionError, 503, 401]

    class Scripted(requests.Session):
        def request(self, method, url, **kwargs):
            answer = answers.pop(0)
            if answer is ConnectionError:
                raise requests.ConnectionError("refused")
            response = requests.Response()
            response.status_code, response._content = answer, b'{"id": 1, "state": "done"}'
            return response

    metrics = AgentMetrics()
    family, total = "gpu_agent_control_plane_requests", "gpu_agent_control_plane_requests_total"
    assert samples(metrics, family, total) == {(("outcome", o),): 0 for o in CONTROL_PLANE_OUTCOMES}
    client = ControlPlaneClient("http://cp.invalid", session=Scripted(), on_call=metrics.control_plane_call)
    from gpu_agent.foundations.secrets import Secret

    cred = Secret("t")
    client.item_state(cred, 1)
    for error in (Unavailable, Unavailable, Unauthorized):
        with pytest.raises(error):
            client.item_state(cred, 1)
    counted = {labels[0][1]: v for labels, v in samples(metrics, family, total).items() if v}
    assert counted == {"ok": 1, "unavailable": 2, "unauthorized": 1}
    # Without on_call (the CLI, the hooks) nothing is told and nothing breaks.
    answers.append(200)
    ControlPlaneClient("http://cp.invalid", session=Scripted()).item_state(cred, 1)
