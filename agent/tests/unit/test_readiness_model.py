"""The cluster agent's readiness model: Ready means "this replica does its job" (GPUs, registration,
credentials, and leading or a hot standby); `active` (queues open, leasing) is a separate fact.
Driven through the agent's own callbacks on a manual clock; the evidence is its /healthz snapshot
and its metrics, which the endpoints serve as they are."""

import argparse
import random

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.config import load
from gpu_agent.roles.cluster_agent import SETTINGS, ClusterAgent


def agent(tmp_path, leader_election=True):
    cfg = load(SETTINGS, argparse.Namespace(), environ={
        "GPU_AGENT_LEADER_ELECTION": "true" if leader_election else "false",
        "GPU_AGENT_GPU_SOURCE": "fake", "GPU_AGENT_FAKE_GPU_STATE": str(tmp_path / "gpus.json"),
        "GPU_AGENT_EXECUTOR_JOURNAL": str(tmp_path / "journal.sqlite"), "GPU_AGENT_LISTEN_ADDRESS": "127.0.0.1:0"})
    return ClusterAgent(cfg, ManualClock(), random.Random(3))


def state(a):
    snap = a.health.snapshot()
    metrics = a.metrics.render().decode()
    gauge = lambda name: float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name + " ")))  # noqa: E731 - a one-line reader, local to the helper
    return (snap["status"], snap["active"], snap["components"]["queues"]["ready"],
            gauge("gpu_agent_ready"), gauge("gpu_agent_active"))


async def test_a_registered_standby_is_ready_but_not_active_and_the_leader_is_both(tmp_path):
    a = agent(tmp_path)
    assert state(a) == ("notready", False, False, 0.0, 0.0)  # nothing yet
    await a._new_leader("other-pod")
    assert state(a) == ("notready", False, False, 0.0, 0.0)  # not registered: a standby without GPUs is not Ready
    for component in ("gpus", "registration", "credentials"):
        a.health.set(component, True, "ok")
    await a._readiness_changed(True, "registered")
    assert state(a) == ("ready", False, True, 1.0, 0.0)  # a hot standby: Ready, not leasing
    assert a.health.snapshot()["components"]["leadership"]["reason"] == "standby: the leader is other-pod"
    await a._started_leading()
    assert state(a) == ("ready", True, True, 1.0, 1.0)
    await a._stopped_leading("deadline")
    assert state(a) == ("ready", False, True, 1.0, 0.0)
    a.health.set("gpus", False, "no GPUs available in cluster")
    await a._readiness_changed(False, "no GPUs available in cluster")
    assert state(a) == ("notready", False, False, 0.0, 0.0)  # graceful no-GPU: nothing is Ready without GPUs


async def test_a_fenced_leader_is_not_ready_and_not_active(tmp_path):
    a = agent(tmp_path)
    for component in ("gpus", "registration", "credentials"):
        a.health.set(component, True, "ok")
    await a._readiness_changed(True, "registered")
    await a._started_leading()
    from gpu_agent.foundations.control_plane_client import Fenced
    a.queue._fenced(Fenced("newer term"), a.queue.fence)  # refused under the term it holds
    assert state(a) == ("notready", False, False, 0.0, 0.0)


async def test_without_election_the_only_agent_is_active_once_registered(tmp_path):
    a = agent(tmp_path, leader_election=False)
    for component in ("gpus", "registration", "credentials"):
        a.health.set(component, True, "ok")
    await a._readiness_changed(True, "registered")
    assert state(a) == ("ready", True, True, 1.0, 1.0)


async def test_losing_the_lease_closes_the_executor_so_its_watch_of_the_work_pods_stops(tmp_path):
    a = agent(tmp_path)
    closed = []
    a.executor.close = lambda: closed.append("closed")  # the Pod executor's close stops its watch (test_pod_changes)
    await a._started_leading()
    assert closed == []
    await a._stopped_leading("deadline")
    assert closed == ["closed"]


async def test_the_metrics_name_the_component_that_holds_readiness_down_the_leaders_domains_and_its_calls(tmp_path):
    """The series the chart's alerts stand on (templates/prometheusrule.yaml): gpu_agent_component_ready follows
    /healthz, gpu_agent_domain_ready what the aggregator folds (a standby folds nothing) and the control plane client
    counts its calls into gpu_agent_control_plane_requests."""
    from prometheus_client.parser import text_string_to_metric_families

    def series(name):
        families = {f.name: f for f in text_string_to_metric_families(a.metrics.render().decode())}
        return {tuple(s.labels.values()): s.value for s in families[name].samples if s.name.startswith(name)}

    a = agent(tmp_path)
    assert series("gpu_agent_component_ready") == {(c,): 0 for c in ("credentials", "gpus", "queues", "registration")} | {
        ("leadership",): 1, ("threads",): 1}
    for component in ("gpus", "registration", "credentials"):
        a.health.set(component, True, "ok")
    await a._readiness_changed(True, "registered")
    assert set(series("gpu_agent_component_ready").values()) == {1}

    class Folding:
        def readiness(self):
            return {"d1": (False, "MembersMissing")}

    assert series("gpu_agent_domain_ready") == {}
    a.aggregator = Folding()
    assert series("gpu_agent_domain_ready") == {("d1", "MembersMissing"): 0}
    a.aggregator = None
    assert series("gpu_agent_domain_ready") == {}
    a.client.on_call("unavailable")
    assert series("gpu_agent_control_plane_requests")[("unavailable",)] == 1
