"""A GPUDomain's channel claims on the node: prepare joins the domain, waits until the node is Ready in its folded
status, and injects the channel(s), the domain's environment and its peer list; unprepare lets the domain go.

The gate is the node agent's real DomainMembership; what its reconcilers' watches would see is handed to it as
they hand it (`_observed`), and the kubelet is a real gRPC client on the plugin's socket."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from gpu_agent.mechanisms.domain.membership import DomainMembership, wanted_domains, why_not_ready
from gpu_agent.mechanisms.dra import cdi
from gpu_agent.mechanisms.dra.checkpoint import PREPARE_ABORTED, PREPARE_COMPLETED, PREPARE_STARTED, Checkpoint
from gpu_agent.mechanisms.dra.config import ChannelConfig, PermanentError, decode
from gpu_agent.mechanisms.dra.devices import CHANNEL_DEVICE, MAX_DEVICES_WITH_TAINTS, NodeDevices
from gpu_agent.mechanisms.dra.prepare import Channels, ClaimPreparer

from .test_dra_driver import DRIVER, NODE, Claims, claim, gpus, kubelet, prepare, registry, unprepare  # noqa: F401

NS = "gpu-agent"
DOMAIN = "train"


def channel_config(mode="Single", domain=DOMAIN, **extra):
    return {"requests": ["channel"], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.gpu-agent.io/v1alpha1", "kind": "ChannelConfig", "domain": domain, "allocationMode": mode,
        **extra}}}


def channel_claim(uid, name="ch", ns=NS, mode="Single", gpu=False, **extra):
    results = (("channel", CHANNEL_DEVICE),) + ((("gpus", "gpu-0"),) if gpu else ())
    return claim(uid, name=name, ns=ns, results=results, config=[channel_config(mode, **extra)])


def domain_obj(*nodes, uid="uid-train", waiting=()):
    status = {"nodes": [{"name": n, "ip": f"10.0.0.{i + 1}", "index": i, "status": s, "gpuUUIDs": []}
                        for i, (n, s) in enumerate(nodes)]}
    if waiting:
        status["cliques"] = [{"id": "c1", "nodes": 1, "readyNodes": 1, "waiting": list(waiting)}]
    return {"metadata": {"name": DOMAIN, "namespace": NS, "uid": uid}, "status": status}


@pytest.fixture
def world(tmp_path, registry):  # noqa: F811 - the fixture imported above, used by this one
    claims = Claims()
    gate = DomainMembership(None, NS, NODE, named="", join_matching=False, make_reconciler=lambda name: None,
                            view_root=tmp_path / "domains")
    devices = {"now": NodeDevices.of(gpus(2), DRIVER, channel=True)}
    checkpoint = Checkpoint(tmp_path / "plugins" / DRIVER / "checkpoint.json")

    def preparer(wait=0.2, count=8):
        return ClaimPreparer(claims, driver=DRIVER, node=NODE, checkpoint=checkpoint, cdi_dir=tmp_path / "cdi",
                             devices=lambda: devices["now"], channels=Channels(gate, wait, count, "/dev/null"))

    from types import SimpleNamespace
    return SimpleNamespace(claims=claims, gate=gate, devices=devices, checkpoint=checkpoint, preparer=preparer(),
                           make=preparer, tmp=tmp_path, registry=registry)


def spec_of(world, uid):
    return json.loads(cdi.spec_path(world.tmp / "cdi", DRIVER, uid).read_text())


def channel_edits(world, uid):
    (device,) = [d for d in spec_of(world, uid)["devices"] if d["name"].endswith(CHANNEL_DEVICE)]
    return device["containerEdits"]


# -- what the node offers ---------------------------------------------------------------------------------------

def test_the_slice_offers_one_channel_device_beside_the_gpus_each_saying_its_type():
    offered = NodeDevices.of(gpus(2), DRIVER, channel=True)
    assert [d["name"] for d in offered.devices] == ["gpu-0", "gpu-1", CHANNEL_DEVICE]
    assert offered.devices[-1]["attributes"] == {"type": {"string": "channel"}, "id": {"int": 0}}
    assert all(d["attributes"]["type"] == {"string": "gpu"} for d in offered.devices[:2])
    assert CHANNEL_DEVICE not in [d["name"] for d in NodeDevices.of(gpus(2), DRIVER).devices]


def test_a_full_node_keeps_its_channel_within_the_slices_device_limit():
    offered = NodeDevices.of(gpus(MAX_DEVICES_WITH_TAINTS + 3), DRIVER, channel=True)
    assert len(offered.devices) == MAX_DEVICES_WITH_TAINTS and offered.devices[-1]["name"] == CHANNEL_DEVICE
    assert len(offered.gpus) == MAX_DEVICES_WITH_TAINTS - 1


# -- the config ---------------------------------------------------------------------------------------------------

def test_a_channel_config_decodes_strictly():
    assert decode(channel_config("All")["opaque"]["parameters"]) == ChannelConfig(DOMAIN, "", "All")
    with pytest.raises(PermanentError, match='strict decoding error: unknown field "unexpectedField"'):
        decode(channel_config(unexpectedField="foo")["opaque"]["parameters"])
    with pytest.raises(PermanentError, match="allocationMode 'Some': one of Single, All"):
        decode(channel_config("Some")["opaque"]["parameters"])
    with pytest.raises(PermanentError, match=r"ChannelConfig\.domain is empty"):
        decode(channel_config(domain="")["opaque"]["parameters"])


# -- the gate's reasons -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("obj, says", [
    (None, "the domain is not there (yet)"),
    (domain_obj(), "waiting for its member to be folded into the domain's status"),
    (domain_obj(("other", "Ready")), "waiting for its member to be folded"),
    (domain_obj((NODE, "NotReady")), "its member is NotReady"),
    (domain_obj(("other", "Ready"), waiting=[NODE]), "clique 'c1' is full"),
])
def test_what_a_waiting_prepare_says(obj, says):
    why = why_not_ready(NS, DOMAIN, NODE, obj)
    assert why.startswith(f"node {NODE} not Ready in GPUDomain {NS}/{DOMAIN}: ") and says in why
    assert why_not_ready(NS, DOMAIN, NODE, domain_obj((NODE, "Ready"))) is None


def test_a_claimed_domain_is_wanted_until_its_last_claim_lets_go(world):
    world.gate.join(DOMAIN, "u1")
    world.gate.join(DOMAIN, "u2")
    world.gate.release(DOMAIN, "u1")
    assert wanted_domains("", False, {}, None, world.gate.claims) == {DOMAIN}
    world.gate.release(DOMAIN, "u2")
    assert wanted_domains("", False, {}, None, world.gate.claims) == set()


# -- prepare ------------------------------------------------------------------------------------------------------

def test_a_channel_claim_waits_for_the_node_to_be_ready_in_the_domain_naming_why(world, kubelet):  # noqa: F811
    world.claims.add(channel_claim("u1"))
    world.gate._observed(DOMAIN, domain_obj(("other", "Ready")))
    answer = prepare(kubelet, world.claims.objects[(NS, "ch")]).claims["u1"]
    assert "permanent" not in answer.error
    assert f"node {NODE} not Ready in GPUDomain {NS}/{DOMAIN}: waiting for its member to be folded" in answer.error
    assert world.gate.claims == {DOMAIN: {"u1"}}  # the node joined: its member is on its way
    entry = world.checkpoint.get("u1")
    assert entry.state == PREPARE_STARTED and entry.domain == DOMAIN
    assert not cdi.spec_path(world.tmp / "cdi", DRIVER, "u1").exists()


def test_a_ready_node_gets_channel0_the_domains_environment_and_its_peer_list(world, kubelet):  # noqa: F811
    world.claims.add(channel_claim("u1", gpu=True))
    ready = domain_obj(("other", "Ready"), (NODE, "Ready"))
    (world.tmp / "domains" / DOMAIN).mkdir(parents=True)
    (world.tmp / "domains" / DOMAIN / "peers").write_text("0 other 10.0.0.1 Ready\n1 n1 10.0.0.2 Ready\n")
    world.gate._observed(DOMAIN, ready)
    answer = prepare(kubelet, world.claims.objects[(NS, "ch")]).claims["u1"]
    assert answer.error == ""
    assert sorted(d.device_name for d in answer.devices) == [CHANNEL_DEVICE, "gpu-0"]
    edits = channel_edits(world, "u1")
    assert edits["deviceNodes"] == [{"path": "/dev/nvidia-caps-imex-channels/channel0", "hostPath": "/dev/null",
                                     "permissions": "rw"}]
    assert {"GPU_AGENT_DOMAIN=gpu-agent/train", "GPU_AGENT_DOMAIN_UID=uid-train", "GPU_AGENT_DOMAIN_NODE_INDEX=1",
            "GPU_AGENT_DOMAIN_PEERS=/etc/gpu-agent/domain/peers"} <= set(edits["env"])
    assert edits["mounts"] == [{"hostPath": str(world.tmp / "domains" / DOMAIN), "containerPath": "/etc/gpu-agent/domain",
                                "options": ["ro", "nosuid", "nodev", "bind"]}]
    assert spec_of(world, "u1")["cdiVersion"] == "0.5.0"  # hostPath device nodes need it
    entry = world.checkpoint.get("u1")
    assert entry.state == PREPARE_COMPLETED and entry.domain == DOMAIN
    # the GPU of the same claim is prepared as ever
    gpu_env = next(d for d in spec_of(world, "u1")["devices"] if d["name"].endswith("gpu-0"))["containerEdits"]["env"]
    assert "NVIDIA_VISIBLE_DEVICES=GPU-00000000-aaaa" in gpu_env


def test_all_gives_every_channel_of_the_range(world, kubelet):  # noqa: F811
    world.claims.add(channel_claim("u1", mode="All"))
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready")))
    assert prepare(kubelet, world.claims.objects[(NS, "ch")]).claims["u1"].error == ""
    paths = [n["path"] for n in channel_edits(world, "u1")["deviceNodes"]]
    assert paths == [f"/dev/nvidia-caps-imex-channels/channel{n}" for n in range(8)]


def test_a_prepare_waiting_for_readiness_completes_as_soon_as_the_domain_shows_the_node_ready(world, kubelet):  # noqa: F811
    world.preparer.channels = Channels(world.gate, 10.0, 8, "/dev/null")
    world.claims.add(channel_claim("u1"))
    world.gate._observed(DOMAIN, domain_obj())
    answers = []
    caller = threading.Thread(target=lambda: answers.append(prepare(kubelet, world.claims.objects[(NS, "ch")])))
    caller.start()
    deadline = time.monotonic() + 5
    while DOMAIN not in world.gate.claims and time.monotonic() < deadline:
        time.sleep(0.01)
    assert DOMAIN in world.gate.claims
    turned_ready = time.monotonic()
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready")))
    caller.join(10)
    assert answers and answers[0].claims["u1"].error == ""
    assert time.monotonic() - turned_ready < 1.0


def test_a_claim_of_another_namespace_is_refused_for_good(world, kubelet):  # noqa: F811
    world.claims.add(channel_claim("u1", ns="someone-else"))
    error = prepare(kubelet, world.claims.objects[("someone-else", "ch")]).claims["u1"].error
    assert error.startswith("permanent error") and "a domain's channel serves only claims of its own namespace" in error
    assert world.gate.claims == {}


def test_a_replaced_domain_is_refused_for_good(world, kubelet):  # noqa: F811
    world.claims.add(channel_claim("u1", domainUID="uid-old"))
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready"), uid="uid-new"))
    error = prepare(kubelet, world.claims.objects[(NS, "ch")]).claims["u1"].error
    assert error.startswith("permanent error") and "was replaced" in error


def test_a_node_without_domain_channels_refuses_a_channel_claim_for_good(world, kubelet):  # noqa: F811
    world.preparer.channels = Channels(None)
    world.claims.add(channel_claim("u1"))
    error = prepare(kubelet, world.claims.objects[(NS, "ch")]).claims["u1"].error
    assert error.startswith("permanent error") and "dra.domainChannels" in error


def test_unprepare_lets_the_domain_go(world, kubelet):  # noqa: F811
    world.claims.add(channel_claim("u1"))
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready")))
    prepare(kubelet, world.claims.objects[(NS, "ch")])
    assert world.gate.claims == {DOMAIN: {"u1"}}
    unprepare(kubelet, (NS, "u1", "ch"))
    assert world.gate.claims == {} and world.checkpoint.get("u1") is None
    assert not cdi.spec_path(world.tmp / "cdi", DRIVER, "u1").exists()


def test_a_prepare_that_outlives_its_unprepare_does_not_bring_the_claim_back(world, kubelet, caplog):  # noqa: F811
    """The PrepareAborted race (NVIDIA's #1162), provoked: the kubelet unprepares while a prepare waits for readiness;
    the domain then turns Ready, and the late prepare must neither write a spec nor hold the domain."""
    caplog.set_level(logging.INFO)
    world.preparer.channels = Channels(world.gate, 10.0, 8, "/dev/null")
    world.claims.add(channel_claim("u1"))
    world.gate._observed(DOMAIN, domain_obj())
    answers = []
    caller = threading.Thread(target=lambda: answers.append(prepare(kubelet, world.claims.objects[(NS, "ch")], timeout=20)))
    caller.start()
    deadline = time.monotonic() + 5
    while DOMAIN not in world.gate.claims and time.monotonic() < deadline:
        time.sleep(0.01)
    assert unprepare(kubelet, (NS, "u1", "ch")).claims["u1"].error == ""
    assert world.checkpoint.get("u1").state == PREPARE_ABORTED and world.gate.claims == {}
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready")))
    caller.join(15)
    error = answers[0].claims["u1"].error
    assert error.startswith("permanent error") and "claim prepare was already aborted" in error
    assert not cdi.spec_path(world.tmp / "cdi", DRIVER, "u1").exists()
    assert world.gate.claims == {} and world.checkpoint.get("u1").state == PREPARE_ABORTED


def test_a_stale_half_prepared_channel_claim_lets_its_domain_go(world):
    world.claims.add(channel_claim("u1"))
    world.preparer.prepare([_ref("u1")], time.monotonic() + 5)  # not Ready: left PrepareStarted, the domain held
    assert world.gate.claims == {DOMAIN: {"u1"}}
    del world.claims.objects[(NS, "ch")]
    assert world.preparer.cleanup_stale() == 1
    assert world.gate.claims == {}


def test_a_restarted_agent_holds_the_domains_of_the_claims_it_prepared(world):
    world.claims.add(channel_claim("u1"))
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready")))
    assert world.preparer.prepare([_ref("u1")], time.monotonic() + 5)["u1"].error == ""
    restarted = DomainMembership(None, NS, NODE, named="", join_matching=False, make_reconciler=lambda name: None,
                                 view_root=world.tmp / "domains")
    preparer = ClaimPreparer(world.claims, driver=DRIVER, node=NODE, checkpoint=Checkpoint(world.checkpoint.path),
                             cdi_dir=world.tmp / "cdi", devices=lambda: world.devices["now"],
                             channels=Channels(restarted, 0.1, 8, "/dev/null"))
    assert preparer.rejoin() == 1 and restarted.claims == {DOMAIN: {"u1"}}


def test_a_second_channel_claim_on_the_node_is_refused_while_the_first_holds_channel0(world):
    world.claims.add(channel_claim("u1"))
    world.claims.add(channel_claim("u2", name="ch2"))
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready")))
    assert world.preparer.prepare([_ref("u1")], time.monotonic() + 5)["u1"].error == ""
    error = world.preparer.prepare([_ref("u2", "ch2")], time.monotonic() + 5)["u2"].error
    assert "requested device channel-0 is already allocated to different claim gpu-agent/ch" in error


def _ref(uid, name="ch"):
    from gpu_agent.mechanisms.dra.prepare import ClaimRef
    return ClaimRef(NS, uid, name)


class SeeingWriter:
    """What the reconciler's watch hands the writer; nothing is written."""
    where, namespace, name = f"GPUDomain {NS}/{DOMAIN}", NS, DOMAIN

    def __init__(self):
        from types import SimpleNamespace
        self.stats = SimpleNamespace()

    def observe(self, obj):
        pass

    def needs_reapply(self, obj, entry):
        return False


def test_the_reconciler_keeps_the_view_folders_peer_list_current_and_tells_the_gate_after_writing_it(tmp_path):
    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.foundations.health import HealthRegistry
    from gpu_agent.mechanisms.domain.reconciler import DomainReconciler

    r = DomainReconciler(SeeingWriter(), HealthRegistry(ManualClock(), []), node=NODE, ip="", peers_file=None,
                         health_component=None, clock=ManualClock())
    r.view_file = tmp_path / DOMAIN / "peers"
    seen = []
    r.on_observed = lambda obj: seen.append((obj, r.view_file.read_text() if r.view_file.exists() else None))
    r._observed(domain_obj(("other", "Ready"), (NODE, "Ready")))
    assert seen[0][1].splitlines()[1:] == ["0 other 10.0.0.1 Ready", "1 n1 10.0.0.2 Ready"]
    r._observed(domain_obj((NODE, "Ready")))
    assert r.view_file.read_text().splitlines()[1:] == ["0 n1 10.0.0.1 Ready"]
    r._listed_domain({"items": []})
    assert seen[-1] == (None, r.view_file.read_text())


def test_the_pods_of_a_claim_that_gave_up_waiting_are_nudged_once_the_node_is_ready(world, tmp_path):
    """The kubelet retries a failed prepare only at its next resync of the pod (60-90 s): the driver annotates the
    waiting claim's pods when the node turns Ready, once, so the kubelet syncs the pod and prepares at once."""
    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.foundations.health import HealthRegistry
    from gpu_agent.mechanisms.dra.driver import NUDGE_ANNOTATION, DRADriver

    waiting = channel_claim("u1")
    waiting["status"]["reservedFor"] = [{"resource": "pods", "name": "worker-0", "uid": "p1"}]
    world.claims.add(waiting)
    driver = DRADriver(None, driver=DRIVER, node=NODE, registry_dir=tmp_path / "reg", plugin_dir=tmp_path / "plugins",
                       cdi_dir=tmp_path / "cdi", health=HealthRegistry(ManualClock(), ["dra"]), clock=ManualClock(),
                       channels=Channels(world.gate, 0.05, 8, "/dev/null"))
    driver.preparer = world.preparer
    world.gate._observed(DOMAIN, domain_obj())
    assert "not Ready" in world.preparer.prepare([_ref("u1")], time.monotonic() + 5)["u1"].error
    patches = []
    assert driver.nudge_once(lambda ns, pod, body: patches.append((ns, pod, body))) == []  # not Ready: nobody nudged
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready")))
    assert driver.nudge_once(lambda ns, pod, body: patches.append((ns, pod, body))) == [(NS, "worker-0")]
    assert patches == [(NS, "worker-0", {"metadata": {"annotations": {NUDGE_ANNOTATION: "u1"}}})]
    assert driver.nudge_once(lambda ns, pod, body: patches.append((ns, pod, body))) == []  # once
    assert world.preparer.prepare([_ref("u1")], time.monotonic() + 5)["u1"].error == ""


def test_a_channel_claim_whose_channel_is_still_held_by_a_force_deleted_pods_claim_prepares_once_that_one_is_unprepared(
        world, tmp_path):
    """The scheduler gives channel-0 to a new claim as soon as a force-deleted pod's claim is deallocated, before the
    kubelet unprepared it (seen on the CI cluster, 2 s apart): the new prepare waits for that unprepare; one that
    gave up first is nudged once the channel is free."""
    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.foundations.health import HealthRegistry
    from gpu_agent.mechanisms.dra.driver import DRADriver

    world.claims.add(channel_claim("old"))
    new = channel_claim("new", name="ch2")
    new["status"]["reservedFor"] = [{"resource": "pods", "name": "next", "uid": "p2"}]
    world.claims.add(new)
    world.gate._observed(DOMAIN, domain_obj((NODE, "Ready")))
    assert world.preparer.prepare([_ref("old")], time.monotonic() + 5)["old"].error == ""
    # within its wait: the old claim unprepared meanwhile, the new one prepared
    world.preparer.channels = Channels(world.gate, 5.0, 8, "/dev/null")
    releaser = threading.Timer(0.3, lambda: world.preparer.unprepare([_ref("old")], time.monotonic() + 5))
    releaser.start()
    assert world.preparer.prepare([_ref("new", "ch2")], time.monotonic() + 10)["new"].error == ""
    releaser.join()
    # past its wait: it says why, and its pod is nudged once the channel is free
    world.preparer.unprepare([_ref("new", "ch2")], time.monotonic() + 5)
    assert world.preparer.prepare([_ref("old")], time.monotonic() + 5)["old"].error == ""
    world.preparer.channels = Channels(world.gate, 0.1, 8, "/dev/null")
    error = world.preparer.prepare([_ref("new", "ch2")], time.monotonic() + 5)["new"].error
    assert "requested device channel-0 is already allocated to different claim gpu-agent/ch: waiting for its unprepare" in error
    driver = DRADriver(None, driver=DRIVER, node=NODE, registry_dir=tmp_path / "reg", plugin_dir=tmp_path / "plugins",
                       cdi_dir=tmp_path / "cdi", health=HealthRegistry(ManualClock(), ["dra"]), clock=ManualClock(),
                       channels=world.preparer.channels)
    driver.preparer = world.preparer
    patches = []
    assert driver.nudge_once(lambda ns, pod, body: patches.append(pod)) == []  # still held
    world.preparer.unprepare([_ref("old")], time.monotonic() + 5)
    assert driver.nudge_once(lambda ns, pod, body: patches.append(pod)) == [(NS, "next")]
    assert world.preparer.prepare([_ref("new", "ch2")], time.monotonic() + 5)["new"].error == ""
