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
