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
