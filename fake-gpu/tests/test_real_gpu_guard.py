"""fake-gpu cannot take over a real GPU node (issue 48, part 3): before it first advertises, the daemon refuses a node
whose capacity already holds the resource without fake-gpu's claim, or whose host shows NVIDIA devices; it then
neither registers nor labels, logs one line, posts a Warning Event on the Node, writes the refusal for the readiness
probe, and idles. Its own restart (the claim annotation there) and a deliberate override proceed. The API server is
stood in for here; a real cluster's side is e2e/test_fake_gpu_real_node.py."""

from __future__ import annotations

import logging
import threading

import pytest
from fake_kubelet import Kubelet

from fake_gpu import cli, node_labels
from fake_gpu.daemon import Daemon, post_refusal_event
from fake_gpu.node_labels import RELEASE, NodeLabeler
from fake_gpu.real_gpu_guard import (
    ADMITTED_FILE,
    REFUSED_REASON,
    RealGpuGuard,
    Refusal,
    check_resource_name,
    decide,
    owned,
    owner_annotation,
)
from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.events import EventRecorder

RESOURCE = "nvidia.com/gpu"


def a_node(capacity: str | None = None, claimed_for: str | None = None, allocatable: str | None = None) -> dict:
    meta: dict = {"name": "n1", "uid": "uid-n1"}
    if claimed_for is not None:
        meta["annotations"] = {owner_annotation(claimed_for): claimed_for}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta,
            "status": {"capacity": {"cpu": "8", **({RESOURCE: capacity} if capacity is not None else {})},
                       "allocatable": {"cpu": "8", **({RESOURCE: allocatable or capacity} if capacity is not None else {})}}}


def no_host_devices(tmp_path):
    return (tmp_path / "dev" / "nvidia0", tmp_path / "proc" / "driver" / "nvidia" / "gpus")


def host_with(tmp_path, which: str):
    dev, gpus = no_host_devices(tmp_path)
    if which == "dev":
        dev.parent.mkdir(parents=True)
        dev.write_text("")
    else:
        (gpus / "0000:3b:00.0").mkdir(parents=True)
    return dev, gpus


@pytest.mark.parametrize("node,allow,refused_for", [
    (a_node(), False, None),  # a plain node: fake-gpu's to take
    (a_node(capacity="0"), False, None),  # the resource at 0: nothing advertised it
    (a_node(capacity="8"), False, "its capacity already has nvidia.com/gpu: 8"),  # another plugin's
    (a_node(capacity="8", claimed_for=RESOURCE), False, None),  # fake-gpu's own, before its restart
    (a_node(capacity="8", claimed_for="example.com/gpu"), False, "its capacity already has"),  # claimed, another name
    (a_node(capacity="8"), True, None),  # overridden deliberately
    (a_node(capacity="8", allocatable="0"), False, None),  # a stopped plugin's leftovers (kubelet's 5 min grace)
], ids=["plain", "zero", "capacity unclaimed", "capacity claimed", "claimed for another resource", "override",
        "stopped plugin"])
def test_a_node_whose_capacity_has_the_resource_without_fake_gpus_claim_is_refused(tmp_path, node, allow, refused_for):
    refusal = decide("n1", node, RESOURCE, no_host_devices(tmp_path), allow_real_gpu_nodes=allow)
    if refused_for is None:
        assert refusal is None
    else:
        assert refusal is not None and refused_for in refusal.found and refusal.node == "n1"


@pytest.mark.parametrize("which", ["dev", "proc"])
def test_nvidia_devices_on_the_host_refuse_the_node_even_with_fake_gpus_claim_unless_overridden(tmp_path, which):
    paths = host_with(tmp_path, which)
    claimed = a_node(capacity="2", claimed_for=RESOURCE)
    refusal = decide("n1", claimed, RESOURCE, paths, allow_real_gpu_nodes=False)
    assert refusal is not None and "NVIDIA devices on the host" in refusal.found
    assert str(paths[0] if which == "dev" else paths[1]) in refusal.found
    assert decide("n1", claimed, RESOURCE, paths, allow_real_gpu_nodes=True) is None
    paths[1].mkdir(parents=True, exist_ok=True)  # an empty driver folder (the driver, no GPU) is no evidence
    if which == "proc":
        for gpu in paths[1].iterdir():
            gpu.rmdir()
        assert decide("n1", claimed, RESOURCE, paths, allow_real_gpu_nodes=False) is None


class FakeApi:
    """The three calls the guard makes: read the Node, annotate it, post the Event."""

    def __init__(self, node: dict, read_failures: int = 0) -> None:
        self.node, self.read_failures = node, read_failures
        self.claims: list[tuple[str, str]] = []
        self.warnings: list[Refusal] = []
        self.warned = threading.Event()

    def read_node(self, name):
        if self.read_failures:
            self.read_failures -= 1
            raise ConnectionError("API server away")
        return self.node

    def claim(self, name, resource):
        self.claims.append((name, resource))

    def warn(self, node, refusal):
        self.warnings.append(refusal)
        self.warned.set()


def test_a_refused_node_is_not_claimed_and_is_told_by_log_event_and_refusal_file(tmp_path, caplog):
    api = FakeApi(a_node(capacity="4"))
    refusal_file = tmp_path / "refused"
    guard = RealGpuGuard("n1", RESOURCE, read_node=api.read_node, claim=api.claim, warn=api.warn,
                         real_gpu_paths=no_host_devices(tmp_path), refusal_file=refusal_file)
    with caplog.at_level(logging.ERROR):
        assert guard.admit(threading.Event()) is False
    assert api.claims == [] and [w.node for w in api.warnings] == ["n1"]
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    # One line naming the node, what it found and the fix.
    assert "node n1" in line and "nvidia.com/gpu: 4" in line and "allowRealGpuNodes=true" in line
    assert refusal_file.read_text().strip() == line
    assert not (tmp_path / ADMITTED_FILE).exists()  # the readiness probe waits for this one


def test_the_readiness_probe_file_says_admitted_only_once_the_check_passed(tmp_path):
    """A state file a former pod left on the host made a refused pod Ready for one probe, before it had decided: the
    probe now also needs this file, written only when the node is admitted (claimed now, or already)."""
    for node in (a_node(), a_node(capacity="4", claimed_for=RESOURCE)):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        api = FakeApi(node)
        guard = RealGpuGuard("n1", RESOURCE, read_node=api.read_node, claim=api.claim, warn=api.warn,
                             real_gpu_paths=no_host_devices(tmp_path / "none"), refusal_file=folder / "refused")
        assert not (folder / ADMITTED_FILE).exists()
        assert guard.admit(threading.Event())
        assert (folder / ADMITTED_FILE).exists() and not (folder / "refused").exists()


def test_an_admitted_node_is_claimed_once_and_a_claimed_one_is_not_written_again(tmp_path):
    fresh = FakeApi(a_node())
    guard = RealGpuGuard("n1", RESOURCE, read_node=fresh.read_node, claim=fresh.claim, warn=fresh.warn,
                         real_gpu_paths=no_host_devices(tmp_path))
    assert guard.admit(threading.Event()) and fresh.claims == [("n1", RESOURCE)] and fresh.warnings == []
    restarted = FakeApi(a_node(capacity="4", claimed_for=RESOURCE))
    guard = RealGpuGuard("n1", RESOURCE, read_node=restarted.read_node, claim=restarted.claim, warn=restarted.warn,
                         real_gpu_paths=no_host_devices(tmp_path))
    assert guard.admit(threading.Event()) and restarted.claims == [] and restarted.warnings == []


def test_reading_the_node_is_retried_with_growing_waits_while_the_api_server_is_away(tmp_path):
    waits = []

    class NoWaitClock(ManualClock):
        def wait_blocking(self, event, seconds):
            waits.append(seconds)
            return event.is_set()

    api = FakeApi(a_node(), read_failures=3)
    guard = RealGpuGuard("n1", RESOURCE, read_node=api.read_node, claim=api.claim, warn=api.warn,
                         real_gpu_paths=no_host_devices(tmp_path), clock=NoWaitClock())
    assert guard.admit(threading.Event()) and waits == [1.0, 2.0, 5.0] and api.claims == [("n1", RESOURCE)]


class Events:
    def __init__(self):
        self.created = []

    def create_namespaced_event(self, namespace, body, _request_timeout):
        self.created.append((namespace, body))


def test_the_refusal_is_a_warning_event_on_the_node_in_namespace_default():
    events = Events()
    recorder = EventRecorder(None, controller="gpu-agent.io/fake-gpu", instance="fake-gpu-n1", clock=ManualClock(),
                             events_api=events)
    refusal = Refusal("n1", "its capacity already has nvidia.com/gpu: 4")
    post_refusal_event(recorder, a_node(capacity="4"), refusal)
    ((namespace, body),) = events.created  # posted at once: no thread is left for it
    assert namespace == "default"
    assert body["type"] == "Warning" and body["reason"] == REFUSED_REASON and body["note"] == refusal.message
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "n1", "namespace": "", "uid": "uid-n1"}


@pytest.mark.parametrize("allow", [False, True], ids=["refused", "overridden"])
def test_a_refused_daemon_neither_registers_nor_labels_and_idles_until_stopped(tmp_path, allow):
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    kubelet = Kubelet(plugin_dir)
    api = FakeApi(a_node(capacity="8"))
    guard = RealGpuGuard("n1", "example.com/gpu", read_node=api.read_node, claim=api.claim, warn=api.warn,
                         real_gpu_paths=host_with(tmp_path, "dev"), allow_real_gpu_nodes=allow)
    patches = []
    watched = threading.Event()

    def watch(applier, stopping):
        applier.apply({"n1": '{"count": 2}'})
        watched.set()
        stopping.wait()

    daemon = Daemon("n1", tmp_path / "state.json", "/host/state.json", plugin_dir, 0, watch=watch,
                    labeler=NodeLabeler("n1", lambda name, body: patches.append(body)), release="fg",
                    resource="example.com/gpu", guard=guard)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        if allow:  # the same daemon overridden: claims, registers its resource and follows the layout
            assert kubelet.registered.wait(15) and watched.wait(15)
            assert kubelet.requests[0].resource_name == "example.com/gpu"
            assert api.claims == [("n1", "example.com/gpu")]
        else:
            assert api.warned.wait(15)
            assert thread.is_alive()  # idle, not exited: no crash loop
    finally:
        daemon.stop()
        thread.join(5)
        kubelet.server.stop(grace=0)
    assert not thread.is_alive()
    if not allow:  # run returned only at stop, having started nothing: nothing registered, labelled or written
        assert kubelet.requests == [] and patches == [] and api.claims == [] and not watched.is_set()
        assert not (tmp_path / "state.json").exists()


def test_the_labels_follow_the_resource_name_and_unlabel_takes_them_and_the_claim_off():
    assert node_labels.desired(2, "NVIDIA H100", 81559, "fg", "example.com/gpu") == {
        "example.com/gpu.present": "true", "example.com/gpu.count": "2", "example.com/gpu.product": "NVIDIA-H100",
        "example.com/gpu.memory": "81559", RELEASE: "fg"}

    class Core:
        def __init__(self):
            self.patched = []

        def list_node(self, label_selector, _request_timeout):
            from types import SimpleNamespace
            return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name="a"))])

        def patch_node(self, name, body, _request_timeout):
            self.patched.append((name, body))

    core = Core()
    assert node_labels.unlabel_nodes(core, "fg", "example.com/gpu") == ["a"]
    ((_, body),) = core.patched
    assert set(body["metadata"]["labels"]) == {"example.com/gpu.present", "example.com/gpu.count",
                                               "example.com/gpu.product", "example.com/gpu.memory", RELEASE}
    assert body["metadata"]["annotations"] == {owner_annotation("example.com/gpu"): None}


@pytest.mark.parametrize("name,ok", [("nvidia.com/gpu", True), ("example.com/fake-gpu", True), ("gpu", False),
                                     ("kubernetes.io/gpu", False), ("x.kubernetes.io/gpu", False),
                                     ("example.com/" + "g" * 56, False), ("Example.com/gpu", False)])
def test_only_an_extended_resource_name_is_accepted(name, ok):
    assert (check_resource_name(name) is None) is ok


def test_the_daemon_command_passes_the_override_resource_and_refusal_file_and_refuses_a_bad_name(monkeypatch, capsys):
    import fake_gpu.daemon

    seen = {}
    monkeypatch.setattr(fake_gpu.daemon, "run", lambda *args, **kwargs: seen.update(kwargs) or 0)
    assert cli.main(["daemon", "--node-name", "n1"]) == 0
    assert seen["allow_real_gpu_nodes"] is False and seen["resource"] == RESOURCE and seen["refusal_file"] is None
    assert cli.main(["--resource-name", "example.com/gpu", "daemon", "--node-name", "n1", "--allow-real-gpu-nodes",
                     "--refusal-file", "/run/r"]) == 0
    assert seen["allow_real_gpu_nodes"] is True and seen["resource"] == "example.com/gpu"
    assert str(seen["refusal_file"]) == "/run/r"
    seen.clear()
    assert cli.main(["--resource-name", "kubernetes.io/gpu", "daemon", "--node-name", "n1"]) == 2 and seen == {}
    assert "kubernetes.io domain" in capsys.readouterr().err


def test_each_resource_has_its_own_claim_so_two_releases_on_one_node_keep_theirs():
    """The e2e suite's release claims nvidia.com/gpu on every node; a test's release of another resource on one of
    them must neither overwrite that claim (the suite's pod, restarted, would refuse its own node) nor count on it."""
    ours, theirs = owner_annotation("nvidia.com/gpu"), owner_annotation("e2e.example.com/real-gpu")
    assert ours == "fake-gpu.gpu-agent.io/advertises.nvidia.com_gpu" and ours != theirs
    long_name = "a" * 60 + ".example.com/" + "g" * 55
    key = owner_annotation(long_name)
    assert len(key.split("/", 1)[1]) <= 63 and key != owner_annotation(long_name[:-1] + "h")
    node = a_node(capacity="4", claimed_for="nvidia.com/gpu")
    assert owned(node, "nvidia.com/gpu") and not owned(node, "e2e.example.com/real-gpu")
