"""The DRA driver against a scripted kubelet (a grpcio client on the plugin's real unix socket) and a
scripted API server (claims by name, a ResourceSlice store that answers as the API server does)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from kubernetes.client.exceptions import ApiException

from gpu_agent.foundations.clock import SystemClock
from gpu_agent.foundations.gpus import GPU, LOST, UNHEALTHY, Inventory
from gpu_agent.mechanisms.dra import cdi
from gpu_agent.mechanisms.dra.checkpoint import PREPARE_ABORTED, PREPARE_COMPLETED, PREPARE_STARTED, Checkpoint
from gpu_agent.mechanisms.dra.config import GpuConfig, PermanentError, configs_for, decode
from gpu_agent.mechanisms.dra.devices import NodeDevices
from gpu_agent.mechanisms.dra.kubeletapi.drav1 import api_pb2 as v1
from gpu_agent.mechanisms.dra.kubeletapi.drav1 import api_pb2_grpc as v1_grpc
from gpu_agent.mechanisms.dra.kubeletapi.drav1beta1 import api_pb2 as v1beta1
from gpu_agent.mechanisms.dra.kubeletapi.drav1beta1 import api_pb2_grpc as v1beta1_grpc
from gpu_agent.mechanisms.dra.kubeletapi.registration import api_pb2 as reg
from gpu_agent.mechanisms.dra.kubeletapi.registration import api_pb2_grpc as reg_grpc
from gpu_agent.mechanisms.dra.plugin import KubeletPlugin
from gpu_agent.mechanisms.dra.prepare import ClaimPreparer, ClaimRef
from gpu_agent.mechanisms.dra.slices import CONTENT_ANNOTATION, SlicePublisher

DRIVER = "gpu.gpu-agent.io"
NODE = "n1"


def gpus(n, unhealthy=()):
    return Inventory(tuple(GPU(f"GPU-{i:08d}-aaaa", "NVIDIA H200", 141 * 2**30, index=i,
                               health=UNHEALTHY if i in unhealthy else "Healthy",
                               health_reason="Xid 48 (DBE)" if i in unhealthy else "") for i in range(n)))


def claim(uid, name="c1", ns="default", results=(("req", "gpu-0"),), config=()):
    return {"metadata": {"uid": uid, "name": name, "namespace": ns},
            "status": {"allocation": {"devices": {
                "results": [{"request": r, "driver": DRIVER, "pool": NODE, "device": d} for r, d in results]
                + [{"request": "other", "driver": "other.example.com", "pool": NODE, "device": "x-0"}],
                "config": list(config)}}}}


class Claims:
    """The API server's ResourceClaims, as the preparer reads them; records each GET."""

    def __init__(self):
        self.objects, self.gets = {}, []

    def __call__(self, namespace, name, timeout):
        self.gets.append((namespace, name, timeout))
        return self.objects.get((namespace, name))

    def add(self, c):
        self.objects[(c["metadata"]["namespace"], c["metadata"]["name"])] = c


@pytest.fixture
def registry():
    """A short folder: a unix socket's path may not pass 107 bytes, and pytest's tmp_path under xdist can."""
    path = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def world(tmp_path, registry):
    claims = Claims()
    devices = {"now": NodeDevices.of(gpus(4), DRIVER)}
    checkpoint = Checkpoint(tmp_path / "plugins" / DRIVER / "checkpoint.json")
    preparer = ClaimPreparer(claims, driver=DRIVER, node=NODE, checkpoint=checkpoint, cdi_dir=tmp_path / "cdi",
                             devices=lambda: devices["now"])
    return SimpleNamespace(claims=claims, devices=devices, checkpoint=checkpoint, preparer=preparer, tmp=tmp_path, registry=registry)


@pytest.fixture
def kubelet(world):
    """The plugin on its socket, and a kubelet's channel to it."""
    registered = []
    plugin = KubeletPlugin(world.preparer, driver=DRIVER, registry_dir=world.registry,
                           on_registered=lambda ok, error: registered.append((ok, error)))
    plugin.start()
    channel = grpc.insecure_channel(f"unix://{plugin.socket}")
    yield SimpleNamespace(plugin=plugin, channel=channel, registered=registered,
                          v1=v1_grpc.DRAPluginStub(channel), v1beta1=v1beta1_grpc.DRAPluginStub(channel),
                          reg=reg_grpc.RegistrationStub(channel))
    channel.close()
    plugin.stop()


def prepare(kubelet, *claims, pb=v1, timeout=10.0):
    stub = kubelet.v1 if pb is v1 else kubelet.v1beta1
    request = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace=c["metadata"]["namespace"], uid=c["metadata"]["uid"],
                                                              name=c["metadata"]["name"]) for c in claims])
    return stub.NodePrepareResources(request, timeout=timeout)


def unprepare(kubelet, *refs):
    request = v1.NodeUnprepareResourcesRequest(claims=[v1.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in refs])
    return kubelet.v1.NodeUnprepareResources(request, timeout=10)


def spec_env(world, uid):
    spec = json.loads(cdi.spec_path(world.tmp / "cdi", DRIVER, uid).read_text())
    return {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}


# -- registration -------------------------------------------------------------------------------------------------

def test_registration_names_the_driver_the_v1_service_first_and_this_socket(kubelet):
    started = time.monotonic()
    info = kubelet.reg.GetInfo(reg.InfoRequest(), timeout=1)  # the kubelet allows 1 s
    assert time.monotonic() - started < 1
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, "")
    assert list(info.supported_versions)[:2] == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    kubelet.reg.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=False, error="no"), timeout=1)
    kubelet.reg.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=1)
    assert kubelet.registered == [(False, "no"), (True, "")]


def test_a_stale_socket_is_replaced_and_stop_removes_the_socket(world):
    stale = world.registry / f"{DRIVER}-reg.sock"
    stale.write_text("a killed pod's socket")
    plugin = KubeletPlugin(world.preparer, driver=DRIVER, registry_dir=world.registry)
    plugin.start()
    with grpc.insecure_channel(f"unix://{stale}") as channel:
        assert reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=2).name == DRIVER
    plugin.stop()
    assert not stale.exists()


# -- prepare and unprepare ----------------------------------------------------------------------------------------

def test_an_empty_prepare_is_a_health_probe(kubelet):
    assert dict(prepare(kubelet).claims) == {}


@pytest.mark.parametrize("pb", [v1, v1beta1], ids=["v1", "v1beta1"])
def test_prepare_returns_cdi_ids_of_our_devices_only_and_the_spec_names_the_gpus(world, kubelet, pb):
    world.claims.add(claim("u1", results=(("a", "gpu-1"), ("b/sub", "gpu-2"))))
    answer = prepare(kubelet, world.claims.objects[("default", "c1")], pb=pb).claims["u1"]
    assert answer.error == ""
    got = sorted((list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in answer.devices)
    assert got == [(["a"], NODE, "gpu-1", [f"k8s.{DRIVER}/gpu=u1-gpu-1"]),
                   (["b"], NODE, "gpu-2", [f"k8s.{DRIVER}/gpu=u1-gpu-2"])]  # "b/sub" -> "b"; other.example.com's left out
    env = spec_env(world, "u1")
    assert "NVIDIA_VISIBLE_DEVICES=GPU-00000001-aaaa" in env["u1-gpu-1"]
    assert "GPU_AGENT_GPU_2=GPU-00000002-aaaa" in env["u1-gpu-2"]
    assert world.checkpoint.get("u1").state == PREPARE_COMPLETED


def test_prepare_is_idempotent_across_kubelet_retries_and_plugin_restarts(world, kubelet):
    world.claims.add(claim("u1"))
    first = prepare(kubelet, world.claims.objects[("default", "c1")]).claims["u1"]
    again = prepare(kubelet, world.claims.objects[("default", "c1")]).claims["u1"]
    assert again == first and len(world.claims.gets) == 1
    # a new plugin process reads the checkpoint: the claim is still prepared, without asking the API server
    restarted = ClaimPreparer(world.claims, driver=DRIVER, node=NODE, checkpoint=Checkpoint(world.checkpoint.path),
                              cdi_dir=world.tmp / "cdi", devices=lambda: world.devices["now"])
    out = restarted.prepare([ClaimRef("default", "u1", "c1")], deadline=SystemClock().monotonic() + 5)
    assert out["u1"].error == "" and [d["device_name"] for d in out["u1"].devices] == ["gpu-0"]
    assert len(world.claims.gets) == 1


def test_every_claim_asked_about_gets_an_answer(world, kubelet):
    world.claims.add(claim("u1"))
    gone = {"metadata": {"uid": "u2", "name": "gone", "namespace": "default"}}
    answers = prepare(kubelet, world.claims.objects[("default", "c1")], gone).claims
    assert set(answers) == {"u1", "u2"}
    assert answers["u1"].error == "" and "ResourceClaim default/gone not found" in answers["u2"].error


def test_an_unknown_config_field_is_a_permanent_error_naming_it(world, kubelet, caplog):
    bad = {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.gpu-agent.io/v1alpha1", "kind": "GpuConfig", "unexpectedField": "foo"}}}
    world.claims.add(claim("u1", config=[bad]))
    error = prepare(kubelet, world.claims.objects[("default", "c1")]).claims["u1"].error
    assert "error preparing devices" in error
    assert 'strict decoding error: unknown field "unexpectedField"' in error
    assert "Permanent error preparing devices for claim default/c1:u1" in caplog.text
    # left PrepareStarted on purpose: it may be partially prepared, and is undone at unprepare or cleanup
    assert world.checkpoint.get("u1").state == PREPARE_STARTED


def test_a_replaced_claim_is_refused_for_good(world, kubelet):
    world.claims.add(claim("new-uid"))
    old = {"metadata": {"uid": "old-uid", "name": "c1", "namespace": "default"}}
    error = prepare(kubelet, old).claims["old-uid"].error
    assert "permanent error" in error and "got replaced" in error


def test_an_unhealthy_gpu_is_not_prepared(world, kubelet):
    world.devices["now"] = NodeDevices.of(gpus(4, unhealthy={0}), DRIVER)
    world.claims.add(claim("u1"))
    error = prepare(kubelet, world.claims.objects[("default", "c1")]).claims["u1"].error
    assert "is Unhealthy: Xid 48" in error and "permanent" not in error  # retried: it may recover


def test_a_call_held_up_by_another_is_answered_before_the_kubelets_deadline(world, kubelet):
    world.claims.add(claim("u1"))
    world.preparer._serial.acquire()  # another prepare holds the node's lock and never lets go
    try:
        started = time.monotonic()
        answer = prepare(kubelet, world.claims.objects[("default", "c1")], timeout=3.5).claims["u1"]
        took = time.monotonic() - started
    finally:
        world.preparer._serial.release()
    assert "held this node's lock until the call's deadline" in answer.error
    assert 1.0 < took < 3.5  # the remaining 3.5 s less the 2 s margin, and an answer, not the kubelet's timeout


def test_unprepare_removes_the_spec_and_the_entry_and_an_unknown_claim_is_fine(world, kubelet):
    world.claims.add(claim("u1"))
    prepare(kubelet, world.claims.objects[("default", "c1")])
    spec = cdi.spec_path(world.tmp / "cdi", DRIVER, "u1")
    assert spec.exists()
    answer = unprepare(kubelet, ("default", "u1", "c1"), ("default", "never", "x"))
    assert {uid: e.error for uid, e in answer.claims.items()} == {"u1": "", "never": ""}
    assert not spec.exists() and world.checkpoint.get("u1") is None


def test_a_stale_half_prepared_claim_is_unprepared_by_the_driver_and_never_prepared_again(world, kubelet, caplog):
    caplog.set_level(logging.INFO)
    bad = {"opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpu.gpu-agent.io/v1alpha1", "kind": "GpuConfig",
                                                       "unexpectedField": "foo"}}}
    world.claims.add(claim("u1", config=[bad]))
    prepare(kubelet, world.claims.objects[("default", "c1")])
    assert world.preparer.cleanup_stale() == 0
    assert "partially prepared claim not stale: default/c1" in caplog.text
    del world.claims.objects[("default", "c1")]  # force-deleted with its pod
    assert world.preparer.cleanup_stale() == 1
    assert "Checkpointed RC cleanup: unprepared stale claim: default/c1" in caplog.text
    assert world.checkpoint.get("u1").state == PREPARE_ABORTED
    # a late prepare of the same claim must not bring it back
    late = prepare(kubelet, {"metadata": {"uid": "u1", "name": "c1", "namespace": "default"}}).claims["u1"].error
    assert "claim prepare was already aborted" in late
    unprepare(kubelet, ("default", "u1", "c1"))
    assert "Unprepare noop: claim in PrepareAborted state" in caplog.text


class HeldClaims(Claims):
    """Claims whose every GET waits for `release`; records whether the plugin's socket existed at each GET."""

    def __init__(self, socket):
        super().__init__()
        self.socket, self.release, self.socket_seen = socket, threading.Event(), []

    def __call__(self, namespace, name, timeout):
        self.socket_seen.append(self.socket.exists())
        self.release.wait(10)
        return super().__call__(namespace, name, timeout)


def driver_with(tmp_path, registry, claims_of):
    """The whole driver with its API calls scripted: claims from `claims_of(socket)`, a publisher that waits."""
    from kubernetes import client

    from gpu_agent.foundations.health import HealthRegistry
    from gpu_agent.mechanisms.dra.driver import DRADriver
    driver = DRADriver(client.ApiClient(), driver=DRIVER, node=NODE, registry_dir=registry, plugin_dir=tmp_path / "plugins",
                       cdi_dir=tmp_path / "cdi", health=HealthRegistry(SystemClock(), ["dra"]))
    driver.preparer.get_claim = claims_of(driver.plugin.socket)
    driver.publisher.run = driver.publisher.watch = lambda halt: halt.wait()
    return driver


def run_driver(driver, stop_when, timeout=20.0):
    """Runs the driver until `stop_when()` holds (polled to a deadline); returns whether it held."""
    import asyncio

    async def main():
        stop = asyncio.Event()
        task = asyncio.ensure_future(driver.run(stop))
        deadline = time.monotonic() + timeout
        while not stop_when() and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a socket file, which no event announces
            await asyncio.sleep(0.02)
        held = stop_when()
        stop.set()
        await task
        return held

    return asyncio.run(main())


def test_the_plugin_registers_only_after_its_first_cleanup_undid_a_claim_gone_while_it_was_down(tmp_path, registry):
    """A claim left PrepareStarted whose object went while no plugin ran: the restarted plugin undoes it before the
    kubelet can reach it, so the kubelet's unprepare, retried since, is a noop and not a race with the cleanup."""
    from gpu_agent.mechanisms.dra.checkpoint import Entry
    Checkpoint(tmp_path / "plugins" / DRIVER / "checkpoint.json").put(Entry("u1", "default", "c1", PREPARE_STARTED))
    holder = {}
    driver = driver_with(tmp_path, registry, lambda socket: holder.setdefault("claims", HeldClaims(socket)))
    claims = holder["claims"]
    threading.Timer(0.5, claims.release.set).start()  # the API server answers late: the socket waits for it
    assert run_driver(driver, lambda: driver.plugin.socket.exists())
    assert claims.socket_seen == [False]
    assert driver.checkpoint.get("u1").state == PREPARE_ABORTED


def test_a_first_cleanup_held_past_its_bound_does_not_keep_the_plugin_unregistered(tmp_path, registry, monkeypatch):
    from gpu_agent.mechanisms.dra import driver as driver_module
    from gpu_agent.mechanisms.dra.checkpoint import Entry
    monkeypatch.setattr(driver_module, "FIRST_CLEANUP_BOUND", 0.3)
    Checkpoint(tmp_path / "plugins" / DRIVER / "checkpoint.json").put(Entry("u1", "default", "c1", PREPARE_STARTED))
    holder = {}
    driver = driver_with(tmp_path, registry, lambda socket: holder.setdefault("claims", HeldClaims(socket)))
    try:
        assert run_driver(driver, lambda: driver.plugin.socket.exists(), timeout=5)
    finally:
        holder["claims"].release.set()


def test_a_socket_path_too_long_for_unix_names_the_setting(world, tmp_path):
    deep = tmp_path / ("d" * 100)
    with pytest.raises(OSError, match=re.escape("more than a unix socket takes (107): point draRegistryDir at a shorter folder")):
        KubeletPlugin(world.preparer, driver=DRIVER, registry_dir=deep).start()


def test_a_broken_checkpoint_is_kept_aside_and_the_plugin_starts_empty(tmp_path):
    path = tmp_path / "checkpoint.json"
    path.write_text("{not json")
    assert Checkpoint(path).entries() == []
    assert path.with_suffix(".broken").read_text() == "{not json"


# -- opaque configs -----------------------------------------------------------------------------------------------

def cfg(source, params, requests=None):
    return {"source": source, "requests": requests or [], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.gpu-agent.io/v1alpha1", "kind": "GpuConfig", **params}}}


def test_class_configs_apply_first_then_the_claims_and_the_last_match_wins():
    allocation = claim("u", results=(("a", "gpu-0"), ("b", "gpu-1")))["status"]["allocation"]
    allocation["devices"]["config"] = [
        cfg("FromClaim", {"sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}, ["a"]),
        cfg("FromClass", {"sharing": {"strategy": "Exclusive"}}),
        {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"anything": 1}}},
    ]
    got = configs_for(allocation, DRIVER)
    assert got["a"] == GpuConfig("TimeSlicing", "Long")
    assert got["b"] == GpuConfig("Exclusive", "Default")


@pytest.mark.parametrize(("params", "text"), [
    ({"sharing": {"strategy": "TimeSlicing", "foo": 1}}, 'strict decoding error: unknown field "sharing.foo"'),
    ({"sharing": {"strategy": "Spread"}}, "sharing.strategy 'Spread': one of TimeSlicing, Exclusive"),
    ({"sharing": "all"}, "sharing: expected an object, got str"),
    ({"sharing": {"timeSlicingConfig": {"interval": "Forever"}}}, "interval 'Forever'"),
])
def test_bad_configs_are_permanent_errors_naming_the_field(params, text):
    with pytest.raises(PermanentError, match=None) as e:
        decode({"apiVersion": "gpu.gpu-agent.io/v1alpha1", "kind": "GpuConfig", **params})
    assert text in str(e.value)


def test_a_config_of_another_kind_is_refused():
    with pytest.raises(PermanentError, match=re.escape("this driver reads apiVersion gpu.gpu-agent.io/v1alpha1, kind GpuConfig")):
        decode({"apiVersion": "v1", "kind": "ConfigMap"})


# -- ResourceSlices -----------------------------------------------------------------------------------------------

class SliceStore:
    """ResourceSlices as the API server keeps them: names from generateName, resourceVersions, quantities
    rewritten on read (as the real one canonicalises them), and a log of each write."""

    def __init__(self):
        self.slices, self.writes, self.version = {}, [], 0
        self.fail_next = 0

    def _answer(self, body):
        return SimpleNamespace(data=json.dumps(body).encode())

    def _check(self):
        if self.fail_next:
            self.fail_next -= 1
            raise ApiException(status=503, reason="Service Unavailable")

    def list_resource_slice(self, field_selector, _request_timeout, _preload_content):
        self._check()
        assert field_selector == f"spec.nodeName={NODE},spec.driver={DRIVER}"
        return self._answer({"items": list(self.slices.values())})

    def _store(self, body):
        self.version += 1
        body = json.loads(json.dumps(body))
        body["metadata"]["resourceVersion"] = str(self.version)
        for d in body["spec"]["devices"]:
            d["capacity"]["memory"]["value"] = "141Gi"  # what the API server hands back for 151397597184
        self.slices[body["metadata"]["name"]] = body

    def create_resource_slice(self, body, _request_timeout):
        self._check()
        body = json.loads(json.dumps(body))
        body["metadata"]["name"] = body["metadata"].pop("generateName") + f"x{self.version}"
        self.writes.append(("create", body["spec"]["pool"]["generation"], len(body["spec"]["devices"])))
        self._store(body)

    def replace_resource_slice(self, name, body, _request_timeout):
        self._check()
        assert body["metadata"]["resourceVersion"] == self.slices[name]["metadata"]["resourceVersion"]
        self.writes.append(("replace", body["spec"]["pool"]["generation"], len(body["spec"]["devices"])))
        self._store(body)

    def delete_resource_slice(self, name, _request_timeout):
        self.writes.append(("delete", name))
        del self.slices[name]

    def read_node(self, name, _request_timeout, _preload_content):
        return self._answer({"metadata": {"name": name, "uid": "node-uid"}})


def publisher(store, **kwargs):
    return SlicePublisher(None, node=NODE, driver=DRIVER, resource=store, core=store, **kwargs)


def test_the_pool_follows_the_gpus_with_a_new_generation_for_each_change_and_none_without_one():
    store = SliceStore()
    p = publisher(store)
    p.set_devices(NodeDevices.of(gpus(4), DRIVER).devices)
    assert p._reconcile_once()
    assert p._reconcile_once()  # the same devices: nothing written, although the API server reads quantities back otherwise
    p.set_devices(NodeDevices.of(gpus(2), DRIVER).devices)
    assert p._reconcile_once()
    p.set_devices(NodeDevices.of(Inventory(), DRIVER).devices)
    assert p._reconcile_once()
    assert store.writes == [("create", 1, 4), ("replace", 2, 2), ("replace", 3, 0)]  # an empty pool, not no pool
    (only,) = store.slices.values()
    assert only["spec"]["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert only["metadata"]["ownerReferences"][0] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid",
                                                      "controller": True}
    assert CONTENT_ANNOTATION in only["metadata"]["annotations"]


def test_a_wiped_slice_is_published_again_with_a_higher_generation_and_extras_go():
    store = SliceStore()
    p = publisher(store)
    p.set_devices(NodeDevices.of(gpus(2), DRIVER).devices)
    p._reconcile_once()
    store.slices.clear()  # the kubelet at its start
    p._reconcile_once()
    assert store.writes[-1] == ("create", 2, 2)
    twin = json.loads(json.dumps(next(iter(store.slices.values()))))
    twin["metadata"]["name"] = "twin"
    twin["spec"]["pool"]["generation"] = 1
    store.slices["twin"] = twin
    p._reconcile_once()
    assert ("delete", "twin") in store.writes and len(store.slices) == 1


def test_a_restarted_plugin_that_finds_its_predecessors_slice_current_is_published_without_a_write():
    store = SliceStore()
    first = publisher(store)
    first.set_devices(NodeDevices.of(gpus(2), DRIVER).devices)
    first._reconcile_once()
    published = []
    second = publisher(store, on_published=lambda generation, count: published.append((generation, count)))
    second.set_devices(NodeDevices.of(gpus(2), DRIVER).devices)
    assert second._reconcile_once()
    assert store.writes == [("create", 1, 2)] and published == [(1, 2)]  # nothing written, and yet published


def test_an_unhealthy_gpu_stays_listed_with_a_noschedule_taint_and_loses_it_on_recovery():
    sick = NodeDevices.of(gpus(2, unhealthy={1}), DRIVER)
    assert "taints" not in sick.devices[0]
    assert sick.devices[1]["taints"] == [{"key": f"{DRIVER}/unhealthy", "value": "Unhealthy", "effect": "NoSchedule"}]
    lost = NodeDevices.of(Inventory((GPU("GPU-x", "H200", 1, index=0, health=LOST),)), DRIVER)
    assert lost.devices[0]["taints"][0]["value"] == "Lost"
    assert all("taints" not in d for d in NodeDevices.of(gpus(2), DRIVER).devices)


def test_attributes_a_user_selects_on():
    (d,) = NodeDevices.of(Inventory(gpus(1).gpus, clique="cluster-uuid.7"), DRIVER).devices
    assert d["name"] == "gpu-0"
    assert d["attributes"] == {"type": {"string": "gpu"}, "uuid": {"string": "GPU-00000000-aaaa"}, "index": {"int": 0},
                               "productName": {"string": "NVIDIA H200"}, "migMode": {"bool": False},
                               "cliqueId": {"string": "cluster-uuid.7"}}
    assert d["capacity"] == {"memory": {"value": str(141 * 2**30)}}


def test_a_failed_write_is_reported_and_retried_and_the_loop_wakes_on_a_change():
    store = SliceStore()
    store.fail_next = 1
    errors = []
    p = publisher(store, on_error=errors.append, retry_seconds=0.05, resync_seconds=60)
    stop = threading.Event()
    p.set_devices(NodeDevices.of(gpus(1), DRIVER).devices)
    loop = threading.Thread(target=p.run, args=(stop,), daemon=True)
    loop.start()
    deadline = time.monotonic() + 5
    while store.writes != [("create", 1, 1)] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.writes == [("create", 1, 1)] and errors == ["publishing ResourceSlices: 503 Service Unavailable"]
    p.set_devices(NodeDevices.of(gpus(3), DRIVER).devices)  # woken, not after the 60 s resync
    while len(store.writes) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    loop.join(5)
    assert store.writes[1] == ("replace", 2, 3) and not loop.is_alive()


def test_the_cdi_spec_is_replaced_atomically_and_names_no_device_twice(tmp_path):
    path = cdi.write_spec(tmp_path, DRIVER, "u9", [{"device": "gpu-0", "env": ["A=1"]}])
    spec = json.loads(Path(path).read_text())
    assert spec["kind"] == f"k8s.{DRIVER}/gpu" and spec["cdiVersion"] == "0.3.0"
    assert [d["name"] for d in spec["devices"]] == ["u9-gpu-0"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left beside it


def test_the_cdi_version_is_the_lowest_the_cdi_librarys_rules_admit():
    """A claim UID that starts with a digit names devices that need cdiVersion 0.5.0: containerd 2.x drops a spec that
    says less ("the spec version must be at least v0.5.0") and the container fails, unresolvable."""
    def version(uid, mounts=None):
        return cdi.minimum_version({"kind": "k/gpu", "devices": [{"name": f"{uid}-gpu-0", "containerEdits": {
            "env": ["A=1"], **({"mounts": mounts} if mounts else {})}}]})
    assert version("ab12") == "0.3.0"
    assert version("3c77a47a-e8db-482f-a616-dc3189130d95") == "0.5.0"
    assert version("ab12", [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]) == "0.4.0"
    assert version("ab12", [{"hostPath": "/a", "containerPath": "/a"}]) == "0.3.0"
    assert cdi.minimum_version({"devices": [{"name": "x", "containerEdits": {"deviceNodes": [{"path": "/dev/x",
                                                                                              "hostPath": "/dev/y"}]}}]}) == "0.5.0"


def test_a_spec_for_a_claim_uid_that_starts_with_a_digit_says_0_5_0(tmp_path):
    path = cdi.write_spec(tmp_path, DRIVER, "9f0e", [{"device": "gpu-0", "env": ["A=1"]}])
    assert json.loads(Path(path).read_text())["cdiVersion"] == "0.5.0"
