"""GPU health changes as Events on the node agent's Node (roles/node_agent.py, mechanisms/inventory/gpu_health.py,
foundations/events.py): what a platform team reads with `kubectl events -n default --for node/NAME`. A real node
agent is built on the fake source and the manual clock; its EventRecorder's API is a recording fake (no API server),
and the tests call `drain` where the recorder's thread would."""

from __future__ import annotations

import argparse
import io
import threading
import time

import pytest
from kubernetes import client

from gpu_agent.foundations import fake_state, klog
from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.config import load
from gpu_agent.foundations.events import SERIES_FLUSH, EventRecorder
from gpu_agent.foundations.gpus import GPU, HEALTHY, LOST, UNHEALTHY, Inventory
from gpu_agent.foundations.threads import start_thread
from gpu_agent.mechanisms.inventory.gpu_health import ECC_DOUBLE, XID
from gpu_agent.roles import node_agent
from tests.loopback_kubeconfig import loopback_kubeconfig

NODE = "gpu-node-7"
UUIDS = [f"GPU-{i:08x}-1111-2222-3333-444444444444" for i in range(4)]
NODE_REF = {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}


class FakeEvents:
    """events.k8s.io/v1 as the recorder calls it: records each create and series patch. `fail`: every call raises
    (503); `hold`: a create blocks until `release` is set (a hung API server), saying when it started and returned."""

    def __init__(self, fail: bool = False, hold: bool = False) -> None:
        self.created: list[dict] = []
        self.patched: list[tuple[str, int]] = []
        self.fail, self.hold = fail, hold
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def create_namespaced_event(self, namespace, body, _request_timeout=None):
        assert _request_timeout is not None and namespace == body["metadata"]["namespace"]
        if self.hold:
            self.entered.set()
            self.release.wait(10)
            self.returned.set()
        if self.fail:
            raise client.ApiException(status=503, reason="Service Unavailable")
        self.created.append(body)

    def patch_namespaced_event(self, name, namespace, body, _content_type=None, _request_timeout=None):
        assert _request_timeout is not None and _content_type == "application/merge-patch+json"
        if self.fail:
            raise client.ApiException(status=503, reason="Service Unavailable")
        self.patched.append((name, body["series"]["count"]))


def gpus(faults: dict[int, tuple[str, str]] | None = None) -> Inventory:
    faults = faults or {}
    return Inventory(tuple(GPU(u, "NVIDIA H200", 141 << 30, index=i, health=faults.get(i, (HEALTHY, ""))[0],
                               health_reason=faults.get(i, (HEALTHY, ""))[1]) for i, u in enumerate(UUIDS)))


class Node:
    """A node agent on the fake source (4 GPUs), with recovery `recovery` s and its events API a FakeEvents."""

    def __init__(self, tmp_path, fake: FakeEvents | None = None, recovery: float = 60.0, **environ: str) -> None:
        self.state = tmp_path / "gpus.json"
        self.write()
        env = {"GPU_AGENT_KUBECONFIG": loopback_kubeconfig(1, tmp_path), "GPU_AGENT_GPU_SOURCE": "fake",
               "GPU_AGENT_FAKE_GPU_STATE_FILE": str(self.state), "GPU_AGENT_LISTEN_ADDRESS": "127.0.0.1:0",
               "GPU_AGENT_NODE_NAME": NODE, "GPU_AGENT_GPU_HEALTH_RECOVERY": str(recovery), **environ}
        cfg = load(node_agent.SETTINGS, argparse.Namespace(), environ=env, as_=node_agent.NodeAgentConfig)
        self.clock = ManualClock()
        self.agent = node_agent.NodeAgent(cfg, clock=self.clock)
        self.fake = fake or FakeEvents()
        if self.agent.events is not None:
            self.agent.events.events = self.fake  # the recorder's API: what it would call on the API server
        self.source = self.agent.monitor.source
        self.tracker = self.source.tracker

    def write(self, faults: dict[int, tuple[str, str]] | None = None) -> None:
        fake_state.write_atomic(self.state, fake_state.render(gpus(faults), node=NODE))

    def read(self) -> dict[int, str]:
        """One read of the source (what the monitor's poll does): each GPU's health by index."""
        return {g.index: g.health for g in self.source.read().inventory.gpus}

    def drain(self) -> list[tuple[str, str, str]]:
        self.agent.events.drain()
        return [(e["type"], e["reason"], e["note"]) for e in self.fake.created]


@pytest.fixture
def log():
    stream = io.StringIO()
    klog.setup(0, stream)
    return stream


def test_an_xid_79_records_one_warning_gpu_unhealthy_event_on_the_node_naming_the_gpu_and_the_xid(tmp_path):
    n = Node(tmp_path)
    assert n.read() == dict.fromkeys(range(4), HEALTHY)
    assert n.drain() == []  # GPUs that start healthy are no change
    n.tracker.event(UUIDS[1], XID, 79)  # NVML's event thread
    assert n.fake.created == [], "recording only queues: the health path never waits on the API server"
    assert n.read()[1] == UNHEALTHY
    ((type_, reason, note),) = n.drain()
    assert (type_, reason) == ("Warning", "GPUUnhealthy")
    assert note.startswith(f"GPU 1 ({UUIDS[1]}) Unhealthy: Xid 79 (GPU has fallen off the bus) [critical Xid]"), note
    (event,) = n.fake.created
    assert event["regarding"] == NODE_REF and event["metadata"]["namespace"] == "default"
    assert event["metadata"]["name"].startswith(f"{NODE}.")
    assert (event["reportingController"], event["reportingInstance"]) == ("gpu-agent.io/node-agent", NODE)
    assert event["action"] == "CheckGPUHealth" and "60s" in note
    n.read()
    assert len(n.drain()) == 1, "a GPU that stays Unhealthy is no new Event"


def test_a_double_bit_ecc_error_and_a_lost_gpu_are_warnings_naming_their_class(tmp_path):
    n = Node(tmp_path, recovery=0)
    n.read()
    n.tracker.event(UUIDS[0], ECC_DOUBLE)
    n.write({2: (LOST, "Xid 79 (GPU has fallen off the bus)")})  # the fake's Xid 79: off the bus, NVML answers LOST
    assert n.read() == {0: UNHEALTHY, 1: HEALTHY, 2: LOST, 3: HEALTHY}
    assert n.drain() == [
        ("Warning", "GPUUnhealthy", f"GPU 0 ({UUIDS[0]}) Unhealthy: double-bit ECC error (uncorrectable) "
                                    "[uncorrectable ECC error]; out of service until it counts again once it answers normally"),
        ("Warning", "GPULost", f"GPU 2 ({UUIDS[2]}) Lost: Xid 79 (GPU has fallen off the bus) [critical Xid]; "
                               "out of service until it answers again")]


def test_a_recovery_records_a_normal_gpu_healthy_event(tmp_path):
    n = Node(tmp_path)
    n.read()
    n.tracker.event(UUIDS[3], XID, 79)
    n.read()
    n.clock.advance_blocking(59)
    assert n.read()[3] == UNHEALTHY
    assert [r for _, r, _ in n.drain()] == ["GPUUnhealthy"]
    n.clock.advance_blocking(1)
    assert n.read()[3] == HEALTHY
    assert n.drain()[1] == ("Normal", "GPUHealthy", f"GPU 3 ({UUIDS[3]}) Healthy again (was Unhealthy: Xid 79 (GPU has "
                                                   "fallen off the bus)): answering normally with no critical event for 60s")
    assert n.fake.created[1]["regarding"] == NODE_REF


def test_repeated_xids_on_one_gpu_are_one_events_series_not_new_events(tmp_path):
    n = Node(tmp_path)
    n.read()
    for _ in range(50):  # an Xid storm
        n.tracker.event(UUIDS[1], XID, 79)
        n.clock.advance_blocking(0.1)
    assert n.read()[1] == UNHEALTHY
    events = n.drain()
    assert [r for _, r, _ in events] == ["GPUUnhealthy"], events
    name = n.fake.created[0]["metadata"]["name"]
    assert n.fake.patched == [(name, 2)]  # the second occurrence makes it a series at once
    n.clock.advance_blocking(SERIES_FLUSH)
    n.drain()
    assert n.fake.patched[-1] == (name, 50) and len(n.fake.created) == 1
    # Another Xid on the same GPU is another error: an Event of its own.
    n.tracker.event(UUIDS[1], XID, 48)
    assert [note.split(": ", 1)[1][:6] for _, _, note in n.drain()] == ["Xid 79", "Xid 48"]


def test_a_flapping_gpu_is_one_unhealthy_and_one_healthy_event_each_with_its_count(tmp_path):
    n = Node(tmp_path, recovery=0)
    n.read()
    for _ in range(5):
        n.write({1: (UNHEALTHY, "Xid 48 (double-bit ECC error)")})
        assert n.read()[1] == UNHEALTHY
        n.read()  # the fault holds: read again, no new occurrence
        n.write()
        assert n.read()[1] == HEALTHY
        n.clock.advance_blocking(10)
        n.drain()
    assert [r for _, r, _ in n.drain()] == ["GPUUnhealthy", "GPUHealthy"]
    n.clock.advance_blocking(SERIES_FLUSH)
    n.drain()
    counts = dict(n.fake.patched)
    assert [counts[e["metadata"]["name"]] for e in n.fake.created] == [5, 5]


def test_with_the_setting_off_nothing_is_recorded(tmp_path, monkeypatch):
    recorded = []
    monkeypatch.setattr(EventRecorder, "record", lambda self, *a: recorded.append(a))
    n = Node(tmp_path, GPU_AGENT_GPU_HEALTH_EVENTS="false")
    assert n.agent.events is None and n.tracker.on_change is None
    n.read()
    n.tracker.event(UUIDS[1], XID, 79)
    n.write({2: (LOST, "Xid 79 (GPU has fallen off the bus)")})
    assert n.read() == {0: HEALTHY, 1: UNHEALTHY, 2: LOST, 3: HEALTHY}
    assert recorded == []
    (tmp_path / "on").mkdir()
    on = Node(tmp_path / "on")  # the default: on
    on.read()
    on.tracker.event(UUIDS[1], XID, 79)
    assert len(recorded) == 1


def test_an_events_api_that_fails_breaks_nothing_and_is_logged(tmp_path, log):
    n = Node(tmp_path, fake=FakeEvents(fail=True))
    n.read()
    n.tracker.event(UUIDS[1], XID, 79)
    n.tracker.event(UUIDS[1], XID, 79)
    assert n.read()[1] == UNHEALTHY
    assert n.drain() == [] and n.agent.events.created == 0
    n.clock.advance_blocking(60)
    assert n.read()[1] == HEALTHY, "the state machine went on"
    n.drain()
    assert "recording event GPUUnhealthy about Node gpu-node-7 failed: Service Unavailable" in log.getvalue()


def test_a_hook_that_raises_never_stops_the_state_machine(tmp_path, log):
    n = Node(tmp_path, recovery=0)

    def broken(change):
        raise RuntimeError("recorder broken")

    n.tracker.on_change = broken
    n.read()
    for _ in range(3):
        n.tracker.event(UUIDS[0], XID, 79)
    n.write({2: (LOST, "Xid 79 (GPU has fallen off the bus)")})
    assert n.read() == {0: UNHEALTHY, 1: HEALTHY, 2: LOST, 3: HEALTHY}
    n.write()
    n.read()
    assert n.read() == dict.fromkeys(range(4), HEALTHY)
    warned = [line for line in log.getvalue().splitlines() if "recorder broken" in line]
    assert len(warned) == 1, "logged once at -v 0"


def test_a_hung_events_api_never_holds_the_health_path(tmp_path):
    fake = FakeEvents(hold=True)
    n = Node(tmp_path, fake=fake, recovery=0)
    n.read()
    start_thread("gpu-health-events", n.agent.events.run)  # as the node agent's run does
    try:
        n.tracker.event(UUIDS[1], XID, 79)
        assert fake.entered.wait(10), "the recorder's thread called the API server"
        # The API server hangs that call: the state machine goes on meanwhile, its changes queued.
        n.tracker.event(UUIDS[2], XID, 48)
        n.write({3: (LOST, "Xid 79 (GPU has fallen off the bus)")})
        assert n.read() == {0: HEALTHY, 1: UNHEALTHY, 2: UNHEALTHY, 3: LOST}
        n.write()
        n.read()
        assert n.read() == dict.fromkeys(range(4), HEALTHY)
        assert not fake.returned.is_set(), "the health path returned while the API call still hung"
    finally:
        fake.release.set()
        n.agent.events.stop()
    deadline = time.monotonic() + 10
    while len(fake.created) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)  # poll to a deadline: the recorder's thread sends what was queued once the call returns
    assert [(e["reason"], e["note"][:5]) for e in fake.created] == [
        ("GPUUnhealthy", "GPU 1"), ("GPUUnhealthy", "GPU 2"), ("GPULost", "GPU 3"),
        ("GPUHealthy", "GPU 1"), ("GPUHealthy", "GPU 2"), ("GPUHealthy", "GPU 3")]
