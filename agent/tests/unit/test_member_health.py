"""A node agent's domain member follows its GPUs' health (roles/node_agent.py, mechanisms/domain):
Ready only while the node has a healthy GPU, the healthy count in `healthyGPUs`, and why in
`message`. The evidence is what the node agent hands its domains, what a reconciler turns into a
write, and the member body the writer applies (a recording API), all on the manual clock."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from kubernetes import client

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.config import load
from gpu_agent.foundations.gpus import GPU, HEALTHY, LOST, UNHEALTHY, Inventory
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.mechanisms.domain.aggregate import MAX_MESSAGE, MemberWriter
from gpu_agent.mechanisms.domain.entries import Entry
from gpu_agent.mechanisms.domain.reconciler import DomainReconciler
from gpu_agent.mechanisms.inventory.source import Reading
from gpu_agent.roles import node_agent

XID79 = "Xid 79 (GPU has fallen off the bus)"
XID48 = "Xid 48 (double-bit ECC error)"
MEMBER_CRD = Path(__file__).resolve().parents[3] / "charts" / "gpu-agent" / "crds" / "gpudomainmember.yaml"


def gpus(n: int, broken: dict[int, tuple[str, str]] | None = None) -> Inventory:
    broken = broken or {}
    return Inventory(tuple(GPU(f"GPU-{i:04d}", "H100", 80 << 30, index=i, health=broken.get(i, (HEALTHY, ""))[0],
                               health_reason=broken.get(i, (HEALTHY, ""))[1]) for i in range(n)))


class ScriptedSource:
    name = "scripted"

    def __init__(self) -> None:
        self.reading = Reading(Inventory())

    def read(self) -> Reading:
        return self.reading

    def close(self) -> None:
        pass


class RecordingDomains:
    """Stands in for DomainMembership: records what the node agent hands every domain it joined."""

    def __init__(self) -> None:
        self.handed: list[dict[str, object]] = []

    def set_gpus(self, uuids, ready, clique="", healthy=None, message=""):
        self.handed.append({"uuids": list(uuids), "ready": ready, "healthy": healthy, "message": message})


def agent(tmp_path) -> tuple[node_agent.NodeAgent, ScriptedSource, RecordingDomains]:
    args = argparse.Namespace(fakeGpuStateFile=str(tmp_path / "none.json"), listenAddress="127.0.0.1:0")
    cfg = load(node_agent.SETTINGS, args, environ={}, as_=node_agent.NodeAgentConfig)
    a = node_agent.NodeAgent(cfg, clock=ManualClock())
    source, domains = ScriptedSource(), RecordingDomains()
    a.monitor.source = source
    a.domain = domains
    return a, source, domains


async def test_the_member_is_ready_only_while_a_gpu_is_healthy_and_says_why_not(tmp_path):
    a, source, domains = agent(tmp_path)
    source.reading = Reading(gpus(4))
    await a.monitor.poll_once()
    assert domains.handed[-1] == {"uuids": ["GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003"], "ready": True,
                                  "healthy": 4, "message": ""}
    source.reading = Reading(gpus(4, {1: (LOST, XID79)}))
    await a.monitor.poll_once()
    assert domains.handed[-1]["ready"] is True and domains.handed[-1]["healthy"] == 3
    assert domains.handed[-1]["message"] == f"3 of 4 GPUs healthy; not healthy: GPU-0001 Lost ({XID79})"
    assert len(domains.handed[-1]["uuids"]) == 4, "the member lists every GPU of the node, healthy or not"
    source.reading = Reading(gpus(2, {0: (LOST, XID79), 1: (UNHEALTHY, XID48)}))
    await a.monitor.poll_once()
    assert domains.handed[-1]["ready"] is False and domains.handed[-1]["healthy"] == 0
    assert domains.handed[-1]["message"] == f"no healthy GPU: GPU-0000 Lost ({XID79}), GPU-0001 Unhealthy ({XID48})"
    assert a.health.get("gpus").ready, "the node agent itself stays Ready: it reports the truth about its node"
    assert "gpu_agent_gpus 0.0" in a.metrics.render().decode()
    source.reading = Reading(gpus(2))  # both recover: Ready again at once
    await a.monitor.poll_once()
    assert domains.handed[-1] == {"uuids": ["GPU-0000", "GPU-0001"], "ready": True, "healthy": 2, "message": ""}


async def test_an_unreadable_source_or_no_gpus_is_notready_with_the_reason(tmp_path):
    a, source, domains = agent(tmp_path)
    source.reading = Reading(Inventory(), note="no NVIDIA driver loaded")
    await a.monitor.poll_once()
    assert domains.handed[-1] == {"uuids": [], "ready": False, "healthy": 0, "message": "no GPUs: no NVIDIA driver loaded"}
    source.reading = Reading(Inventory(), error="NVML: driver/library version mismatch")
    await a.monitor.poll_once()
    assert domains.handed[-1]["ready"] is False
    assert domains.handed[-1]["message"] == "GPU source cannot be read: NVML: driver/library version mismatch"


class NoWriter:
    where = "GPUDomain ns/d1"


def test_a_change_of_health_alone_is_a_new_entry_for_the_reconciler_to_write():
    r = DomainReconciler(NoWriter(), HealthRegistry(ManualClock(), ["domain"]), node="n1", ip="", peers_file=None,
                         clock=ManualClock())
    r.set_gpus(["GPU-0000", "GPU-0001"], True, "", 2, "")
    generation = r.generation
    r.set_gpus(["GPU-0000", "GPU-0001"], True, "", 2, "")
    assert r.generation == generation, "the same entry again is no work"
    r.set_gpus(["GPU-0000", "GPU-0001"], True, "", 1, f"1 of 2 GPUs healthy; not healthy: GPU-0001 Lost ({XID79})")
    assert r.generation == generation + 1
    assert r.entry == Entry("n1", "", ("GPU-0000", "GPU-0001"), True, "", 1,
                            f"1 of 2 GPUs healthy; not healthy: GPU-0001 Lost ({XID79})")
    assert r._entry_shown(Entry("n1", "", (), False, "", 0, "no healthy GPU: x")) == \
        "entry n1 NotReady (no healthy GPU: x) in GPUDomain ns/d1"


class Members:
    def __init__(self) -> None:
        self.applied: list[dict] = []

    def patch_namespaced_custom_object(self, g, v, ns, plural, name, body, **kw):
        self.applied.append(body)
        return body

    def get_namespaced_custom_object(self, *a, **kw):
        raise client.ApiException(status=404, reason="Not Found")


def test_the_member_carries_the_healthy_count_and_the_message_and_drops_a_message_no_longer_true():
    fake = Members()
    w = MemberWriter(client.ApiClient(), "ns", "train", custom_api=fake)
    assert w.ensure(Entry("n1", "10.0.0.1", ("GPU-0000",), False, "", 0, f"no healthy GPU: GPU-0000 Lost ({XID79})"))
    spec = fake.applied[-1]["spec"]
    assert (spec["ready"], spec["healthyGPUs"], spec["message"]) == (False, 0, f"no healthy GPU: GPU-0000 Lost ({XID79})")
    assert w.ensure(Entry("n1", "10.0.0.1", ("GPU-0000",), True, "", 1, ""))
    spec = fake.applied[-1]["spec"]
    assert spec["healthyGPUs"] == 1 and "message" not in spec  # server-side apply removes the old one
    assert w.ensure(Entry("n1", "", ("GPU-0000",), False, "", 0, "x" * 5000))
    assert len(fake.applied[-1]["spec"]["message"]) == MAX_MESSAGE, "cut, never refused by the CRD's maxLength"
    assert w.ensure(Entry("n1", "", (), True))
    assert "healthyGPUs" not in fake.applied[-1]["spec"], "not known: not claimed"


def test_the_crd_declares_the_new_fields_alike_in_every_served_version_with_the_writers_bound():
    crd = yaml.safe_load(MEMBER_CRD.read_text())
    specs = [v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"] for v in crd["spec"]["versions"]]
    assert len(specs) == 2 and specs[0] == specs[1], "conversion None: the versions' schemas must be the same"
    assert specs[0]["healthyGPUs"]["type"] == "integer" and specs[0]["healthyGPUs"]["minimum"] == 0
    assert specs[0]["message"] == {**specs[0]["message"], "type": "string", "maxLength": MAX_MESSAGE}
    for v in crd["spec"]["versions"]:
        assert {"name": "Healthy GPUs", "type": "integer", "jsonPath": ".spec.healthyGPUs"} in v["additionalPrinterColumns"]
