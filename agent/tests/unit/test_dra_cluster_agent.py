"""The cluster agent on a cluster that offers GPUs through DRA: its cluster source counts the devices of the
driver's ResourceSlices (foundations/slices.py, mechanisms/inventory/cluster.py), and its work Pods get their
GPUs through a ResourceClaimTemplate per count (mechanisms/queues/work_claims.py). The API server is scripted:
slices as the API server hands them back (dicts here, models in production; `field` reads both)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS  # noqa: N814 - short: it stands in for API objects below

import pytest

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.foundations.gpus import HEALTHY, UNHEALTHY
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.slices import inventory_of_slices, pool_slice, untainted_per_node
from gpu_agent.mechanisms.inventory.monitor import InventoryMonitor
from gpu_agent.mechanisms.queues.pod_executor import PodExecutor, pod_name
from gpu_agent.mechanisms.queues.work_claims import DraWorkClaims

DRIVER = "gpu.gpu-agent.io"
TAINT = {"key": f"{DRIVER}/unhealthy", "value": "Unhealthy", "effect": "NoSchedule"}


def gpu_device(i: int, uuid: str | None = None, taint: dict | None = None) -> dict:
    d = {"name": f"gpu-{i}", "attributes": {"index": {"int": i}, "uuid": {"string": uuid or f"GPU-{i:04d}"}}}
    if taint:
        d["taints"] = [taint]
    return d


def slice_of(name: str, node: str | None, devices: list[dict], generation: int = 1, pool: str | None = None) -> dict:
    spec = {"driver": DRIVER, "pool": {"name": pool or node or "net", "generation": generation, "resourceSliceCount": 1},
            "devices": devices}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name}, "spec": spec}


def node_obj(name: str, ready: bool = True, cordoned: bool = False, gpus: str = "8") -> NS:
    return NS(metadata=NS(name=name), spec=NS(unschedulable=cordoned),
              status=NS(conditions=[NS(type="Ready", status="True" if ready else "False")],
                        allocatable={"nvidia.com/gpu": gpus}, capacity={"nvidia.com/gpu": gpus}))


def kept(*objs: dict) -> dict:
    return {o["metadata"]["name"]: s for o in objs if (s := pool_slice(o)) is not None}


# -- reading slices --------------------------------------------------------------------------------------------------

def test_only_the_newest_generation_of_a_pool_counts_and_a_tainted_device_is_unhealthy_with_its_taint():
    slices = kept(slice_of("n1-old", "n1", [gpu_device(i) for i in range(4)], generation=3),
                  slice_of("n1-new", "n1", [gpu_device(0), gpu_device(1, taint=TAINT)], generation=4),
                  slice_of("n2", "n2", [gpu_device(i, uuid=f"GPU-n2-{i}") for i in range(3)], generation=1))
    inv = inventory_of_slices({"n1", "n2"}, slices, DRIVER)
    assert [g.name for g in inv.gpus] == ["gpu-0 on n1", "gpu-1 on n1", "gpu-0 on n2", "gpu-1 on n2", "gpu-2 on n2"]
    assert [g.health for g in inv.gpus] == [HEALTHY, UNHEALTHY, HEALTHY, HEALTHY, HEALTHY]
    assert inv.gpus[1].health_reason == (f"node n1: device gpu-1 of {DRIVER} tainted "
                                         f"{DRIVER}/unhealthy=Unhealthy:NoSchedule")
    assert [g.uuid for g in inv.gpus[2:]] == ["GPU-n2-0", "GPU-n2-1", "GPU-n2-2"]  # the slice's own UUIDs
    assert untainted_per_node({"n1", "n2"}, slices) == {"n1": 1, "n2": 3}


def test_a_node_not_usable_a_slice_bound_to_no_node_and_a_taint_that_keeps_nothing_off_are_read_as_the_scheduler_does():
    soft = {"key": "maintenance", "value": "soon", "effect": "None"}
    slices = kept(slice_of("n1", "n1", [gpu_device(0, taint=soft), gpu_device(10), gpu_device(2)]),
                  slice_of("down", "down", [gpu_device(0)]), slice_of("net", None, [gpu_device(0)]))
    assert set(slices) == {"n1", "down"}  # a network-attached pool is no node's GPU
    inv = inventory_of_slices({"n1"}, slices, DRIVER)  # "down" is not Ready (or cordoned)
    assert [g.name for g in inv.gpus] == ["gpu-0 on n1", "gpu-2 on n1", "gpu-10 on n1"]  # index order
    assert all(g.is_healthy for g in inv.gpus)


def test_a_channel_device_is_no_gpu_and_a_device_without_a_type_still_is():
    """Node agents publish a `channel-0` device (type channel) beside their GPUs (type gpu) for GPUDomain channels;
    slices published before they set `type` have none. Only GPUs count, for the source and for work claims."""
    typed = [{**gpu_device(i), "attributes": {**gpu_device(i)["attributes"], "type": {"string": "gpu"}}} for i in range(2)]
    channel = {"name": "channel-0", "attributes": {"type": {"string": "channel"}, "id": {"int": 0}}}
    slices = kept(slice_of("n1", "n1", [*typed, channel]), slice_of("n2", "n2", [gpu_device(0, uuid="GPU-n2")]))
    inv = inventory_of_slices({"n1", "n2"}, slices, DRIVER)
    assert [g.name for g in inv.gpus] == ["gpu-0 on n1", "gpu-1 on n1", "gpu-0 on n2"]
    assert untainted_per_node({"n1", "n2"}, slices) == {"n1": 2, "n2": 1}


def test_a_uuid_missing_or_repeated_across_nodes_gets_a_stable_one_of_its_own():
    slices = kept(slice_of("a", "a", [gpu_device(0, uuid="GPU-same")]), slice_of("b", "b", [gpu_device(0, uuid="GPU-same")]))
    first, second = inventory_of_slices({"a", "b"}, slices, DRIVER), inventory_of_slices({"a", "b"}, slices, DRIVER)
    assert first.gpus[0].uuid == "GPU-same" and first.gpus[1].uuid.startswith("GPU-") and first.gpus[1].uuid != "GPU-same"
    assert first.uuids == second.uuids


# -- the cluster source -----------------------------------------------------------------------------------------------

class ScriptedResource:
    def __init__(self, slices: list[dict]) -> None:
        self.slices = slices
        self.selectors: list[str | None] = []

    def list_resource_slice(self, _request_timeout=None, field_selector=None):
        self.selectors.append(field_selector)
        return {"metadata": {"resourceVersion": "1"}, "items": list(self.slices)}


def dra_source(monkeypatch, nodes: list[NS], slices: list[dict]):
    from gpu_agent.mechanisms.inventory import cluster

    class Core:
        def __init__(self, api):
            pass

        def list_node(self, _request_timeout=None, label_selector=None):
            return NS(items=nodes, metadata=NS(resource_version="1"))

    monkeypatch.setattr(cluster.client, "CoreV1Api", Core)
    resource = ScriptedResource(slices)
    source = cluster.ClusterSource(api=None, dra_driver=DRIVER, resource=resource, start=False)
    return source, resource


def test_with_a_dra_driver_the_source_counts_its_slices_devices_not_the_device_plugins_allocatable(monkeypatch):
    source, resource = dra_source(monkeypatch, [node_obj("n1", gpus="8"), node_obj("n2", cordoned=True)],
                                  [slice_of("s1", "n1", [gpu_device(0), gpu_device(1)]), slice_of("s2", "n2", [gpu_device(0)])])
    assert source.read().note == f"waiting for the first list of nodes and {DRIVER} ResourceSlices"
    source._listed_nodes(source.core.list_node())
    waiting = source.read()
    assert waiting.note == f"waiting for the first list of {DRIVER} ResourceSlices"
    assert not waiting.complete and not waiting.answered  # its zero is no answer yet (gracefulNoGPU off waits for one)
    source._listed_slices(resource.list_resource_slice(field_selector=f"spec.driver={DRIVER}"))
    reading = source.read()
    assert reading.complete and reading.answered
    # n1's 8 nvidia.com/gpu of a device plugin are not what a claim of this driver can get; cordoned n2 lists nothing
    assert [g.name for g in reading.inventory.gpus] == ["gpu-0 on n1", "gpu-1 on n1"] and reading.note is None


def test_the_source_follows_slice_events_to_zero_and_names_the_driver_and_a_failed_watch(monkeypatch):
    source, resource = dra_source(monkeypatch, [node_obj("n1")], [slice_of("s1", "n1", [gpu_device(0)])])
    source._listed_nodes(source.core.list_node())
    source._listed_slices(resource.list_resource_slice())
    assert source.read().inventory.count == 1
    source._slice_event("MODIFIED", slice_of("s1", "n1", [], generation=2))  # the node's last GPU left
    assert source.read().inventory.count == 0
    assert source.read().note == f"no Ready node has a device of DRA driver {DRIVER} in its ResourceSlices"
    source._slice_event("MODIFIED", slice_of("s1", "n1", [gpu_device(0), gpu_device(1, taint=TAINT)], generation=3))
    assert [g.is_healthy for g in source.read().inventory.gpus] == [True, False]
    source._slice_event("DELETED", slice_of("s1", "n1", [gpu_device(0)], generation=3))  # the kubelet wiped it
    assert source.read().inventory.count == 0  # a deletion carries the slice's last state: its devices go with it
    source._slice_event("DELETED", slice_of("never-seen", "n1", [gpu_device(0)]))
    source._slice_event("MODIFIED", slice_of("net", None, [gpu_device(0)]))  # bound to no node: not kept
    assert source.read().inventory.count == 0
    source._failed("slices", f"{DRIVER} ResourceSlices")(RuntimeError("403 Forbidden"))
    assert source.read().error == f"watching {DRIVER} ResourceSlices failed: RuntimeError: 403 Forbidden"
    source._listed_slices(resource.list_resource_slice())  # the next list clears it
    assert source.read().error is None and source.read().inventory.count == 1


def test_the_slice_watch_asks_the_api_server_for_this_drivers_slices_only(monkeypatch):
    from gpu_agent.mechanisms.inventory import cluster

    calls = []

    def listing_once(list_call, *, on_list, on_event, on_error, stop, **kwargs):
        calls.append(kwargs)
        on_list(list_call(_request_timeout=10, **{k: v for k, v in kwargs.items() if k.endswith("selector")}))

    source, resource = dra_source(monkeypatch, [node_obj("n1")], [slice_of("s1", "n1", [gpu_device(0)])])
    monkeypatch.setattr(cluster, "list_then_watch", listing_once)
    source._run_slices()
    assert resource.selectors == [f"spec.driver={DRIVER}"]
    assert calls == [{"retry_seconds": 2.0, "resync_seconds": 300, "field_selector": f"spec.driver={DRIVER}"}]


def test_a_failed_slice_watch_is_the_sources_error_until_its_next_list_and_slices_listed_before_nodes_wait_for_them(
        monkeypatch):
    from gpu_agent.mechanisms.inventory import cluster

    source, resource = dra_source(monkeypatch, [node_obj("n1")], [slice_of("s1", "n1", [gpu_device(0)])])
    source._listed_slices(resource.list_resource_slice())
    waiting = source.read()
    assert (waiting.complete, waiting.note) == (False, "waiting for the first list of nodes")

    def failing_then_listing(list_call, *, on_list, on_event, on_error, stop, **kwargs):
        on_error(RuntimeError("connection reset"))
        assert source.read().error == f"watching {DRIVER} ResourceSlices failed: RuntimeError: connection reset"
        on_list(list_call(_request_timeout=10, field_selector=kwargs["field_selector"]))

    monkeypatch.setattr(cluster, "list_then_watch", failing_then_listing)
    source._run_slices()
    source._listed_nodes(source.core.list_node())
    assert source.read().error is None and source.read().inventory.count == 1


def test_node_events_decide_whose_slices_count_a_node_turning_ready_cordoned_or_deleted(monkeypatch):
    source, resource = dra_source(monkeypatch, [node_obj("n1", ready=False)], [slice_of("s1", "n1", [gpu_device(0)])])
    source._listed_nodes(source.core.list_node())
    source._listed_slices(resource.list_resource_slice())
    assert source.read().inventory.count == 0  # n1 is not Ready
    source._node_event("MODIFIED", node_obj("n1"))
    assert source.read().inventory.count == 1
    source._node_event("MODIFIED", node_obj("n1", cordoned=True))
    assert source.read().inventory.count == 0
    source._node_event("MODIFIED", node_obj("n1"))
    assert source.read().inventory.count == 1
    source._node_event("DELETED", node_obj("n1"))  # its slices outlive it a moment: they count for nothing
    assert source.read().inventory.count == 0


async def test_readiness_follows_the_slices_not_ready_at_zero_ready_with_the_first_device_not_ready_with_the_last_gone(monkeypatch):
    source, resource = dra_source(monkeypatch, [node_obj("n1")], [slice_of("s1", "n1", [])])
    source._listed_nodes(source.core.list_node())
    source._listed_slices(resource.list_resource_slice())
    clock = ManualClock()
    health = HealthRegistry(clock, ["gpus"])
    seen = []

    async def changed(e):
        seen.append(len(e.inventory.healthy))

    monitor = InventoryMonitor(source, clock=clock, health=health, poll_interval=0.5, on_change=changed)
    await monitor.poll_once()
    assert not health.get("gpus").ready
    source._slice_event("MODIFIED", slice_of("s1", "n1", [gpu_device(0)], generation=2))
    await monitor.poll_once()
    assert health.get("gpus").ready
    source._slice_event("MODIFIED", slice_of("s1", "n1", [gpu_device(0, taint=TAINT)], generation=3))
    await monitor.poll_once()
    assert not health.get("gpus").ready and seen[-1] == 0


# -- work Pods through claims -----------------------------------------------------------------------------------------

class ApiError(Exception):
    def __init__(self, status: int, reason: str = "") -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class ScriptedDraApi:
    """CoreV1Api and ResourceV1Api in one: Pods that read back `phases`, templates kept by name."""

    def __init__(self, phases, slices, nodes=None):
        self.phases, self.slices = list(phases), slices
        self.nodes = nodes or [node_obj("n1")]
        self.templates: dict[str, dict] = {}
        self.template_calls: list[tuple[str, str]] = []
        self.body = None
        self.deleted: list[str] = []

    # pods
    def create_namespaced_pod(self, namespace, body, _request_timeout):
        self.body = body

    def read_namespaced_pod(self, name, namespace, _request_timeout):
        phase = self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]
        conditions = [NS(type="PodScheduled", status="False", reason="Unschedulable")] if phase == "Pending" else []
        return NS(status=NS(phase=phase, conditions=conditions, reason=None, message="", container_statuses=[]),
                  metadata=NS(deletion_timestamp=None, annotations=self.body["metadata"]["annotations"]),
                  spec=NS(containers=[NS(resources=NS(limits=self.body["spec"]["containers"][0]["resources"].get("limits")))]))

    def list_node(self, _request_timeout, label_selector=None):
        return NS(items=self.nodes)

    def patch_namespaced_pod(self, name, namespace, body, _request_timeout, _content_type):
        pass

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds, _request_timeout):
        self.deleted.append(name)

    # resource.k8s.io
    def create_namespaced_resource_claim_template(self, namespace, body, _request_timeout):
        name = body["metadata"]["name"]
        self.template_calls.append(("create", name))
        if name in self.templates:
            raise ApiError(409, "AlreadyExists")
        self.templates[name] = body

    def read_namespaced_resource_claim_template(self, name, namespace, _request_timeout):
        self.template_calls.append(("read", name))
        return self.templates[name]

    def delete_namespaced_resource_claim_template(self, name, namespace, _request_timeout):
        self.template_calls.append(("delete", name))
        del self.templates[name]

    def list_resource_slice(self, _request_timeout, field_selector=None):
        return {"items": self.slices}


async def inline(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def run_item(api: ScriptedDraApi, item: WorkItem, claims: DraWorkClaims | None = None):
    clock = ManualClock()
    claims = claims or DraWorkClaims(api, "work", DRIVER, release="rel", driver=DRIVER)
    ex = PodExecutor(api, "work", "img", release="rel", poll_seconds=0.5, clock=clock, run_blocking=inline, claims=claims)

    async def drive():
        task = asyncio.ensure_future(ex.execute(item))
        for _ in range(200):
            if task.done():
                return await task
            await clock.advance(0.5)
        task.cancel()
        raise AssertionError("the item was still running after 100 s of its clock")
    return asyncio.run(drive())


def test_a_work_pod_claims_its_gpus_through_a_template_of_its_count_made_once_and_asks_no_device_plugin_gpu():
    api = ScriptedDraApi(["Succeeded"], slices=[])
    claims = DraWorkClaims(api, "work", DRIVER, release="rel", driver=DRIVER)
    run_item(api, WorkItem(1, "two", {"gpus": 2}, "l", 1), claims)
    spec = api.body["spec"]
    assert spec["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": "rel-work-gpus-2"}]
    assert spec["containers"][0]["resources"] == {"claims": [{"name": "gpus"}]}  # no nvidia.com/gpu limits
    (request,) = api.templates["rel-work-gpus-2"]["spec"]["spec"]["devices"]["requests"]
    assert request == {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 2}}
    assert api.templates["rel-work-gpus-2"]["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
    run_item(api, WorkItem(2, "two-more", {"gpus": 2}, "l", 1), claims)
    run_item(api, WorkItem(3, "zero", {"gpus": 0}, "l", 1), claims)
    assert api.template_calls == [("create", "rel-work-gpus-2")]  # remembered; a 0-GPU item claims nothing
    assert "resourceClaims" not in api.body["spec"] and api.body["spec"]["containers"][0]["resources"] == {}


def test_a_template_already_there_is_kept_when_it_asks_the_same_and_replaced_when_it_asks_something_else():
    api = ScriptedDraApi(["Succeeded"], slices=[])
    api.templates["rel-work-gpus-1"] = DraWorkClaims(api, "work", DRIVER, release="rel").template(1)
    run_item(api, WorkItem(1, "same", {"gpus": 1}, "l", 1))
    assert api.template_calls == [("create", "rel-work-gpus-1"), ("read", "rel-work-gpus-1")]
    api.template_calls.clear()
    api.templates["rel-work-gpus-1"] = DraWorkClaims(api, "work", "old-class", release="rel").template(1)
    run_item(api, WorkItem(2, "other", {"gpus": 1}, "l", 1))
    assert [c for c, _ in api.template_calls] == ["create", "read", "delete", "create"]
    assert api.templates["rel-work-gpus-1"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == DRIVER


def test_a_work_pod_asking_more_gpus_than_any_nodes_slices_offer_fails_at_once_counting_only_untainted_devices():
    slices = [slice_of("s1", "n1", [gpu_device(0), gpu_device(1), gpu_device(2, taint=TAINT)]),
              slice_of("s2", "n2", [gpu_device(i) for i in range(8)])]
    api = ScriptedDraApi(["Pending"], slices, nodes=[node_obj("n1"), node_obj("n2", ready=False)])
    with pytest.raises(RuntimeError) as e:
        run_item(api, WorkItem(1, "too-big", {"gpus": 3}, "l", 1))
    assert f"asks for 3 GPUs of DeviceClass {DRIVER}" in str(e.value) and "the most on one node: 2" in str(e.value)
    assert api.deleted == [pod_name("too-big")]


def test_a_work_pod_that_fits_a_nodes_slices_keeps_waiting_for_devices_in_use():
    api = ScriptedDraApi(["Pending", "Pending", "Running", "Succeeded"], [slice_of("s1", "n1", [gpu_device(0), gpu_device(1)])])
    assert run_item(api, WorkItem(1, "fits", {"gpus": 2}, "l", 1)) == "executed"
    assert api.deleted == []


def test_a_template_that_cannot_be_made_fails_the_attempt_naming_it():
    api = ScriptedDraApi(["Succeeded"], slices=[])

    def refuse(namespace, body, _request_timeout):
        raise ApiError(403, "Forbidden")

    api.create_namespaced_resource_claim_template = refuse
    with pytest.raises(RuntimeError, match="making ResourceClaimTemplate work/rel-work-gpus-1 failed: 403 Forbidden"):
        run_item(api, WorkItem(1, "refused", {"gpus": 1}, "l", 1))
    assert api.body is None  # no Pod made without its template


def test_a_gpudomain_channel_device_is_not_a_gpu_from_a_dict_or_the_clients_model():
    from kubernetes import client

    channel = {"name": "channel-0", "attributes": {"type": {"string": "channel"}, "id": {"int": 0}}}
    typed = dict(gpu_device(1), attributes={**gpu_device(1)["attributes"], "type": {"string": "gpu"}})
    inv = inventory_of_slices({"n1"}, kept(slice_of("n1", "n1", [gpu_device(0), typed, channel])), DRIVER)
    assert [g.name for g in inv.gpus] == ["gpu-0 on n1", "gpu-1 on n1"]
    model = client.V1ResourceSlice(
        metadata=client.V1ObjectMeta(name="s1"),
        spec=client.V1ResourceSliceSpec(driver=DRIVER, node_name="n1", pool=client.V1ResourcePool(
            name="n1", generation=1, resource_slice_count=1), devices=[
            client.V1Device(name="channel-0", attributes={"type": client.V1DeviceAttribute(string="channel")})]))
    assert pool_slice(model).devices == ()


def test_a_slice_reads_the_same_from_the_clients_model_as_from_a_dict():
    from kubernetes import client

    model = client.V1ResourceSlice(
        metadata=client.V1ObjectMeta(name="s1"),
        spec=client.V1ResourceSliceSpec(driver=DRIVER, node_name="n1", pool=client.V1ResourcePool(
            name="n1", generation=3, resource_slice_count=1), devices=[
            client.V1Device(name="gpu-0", attributes={"uuid": client.V1DeviceAttribute(string="GPU-0000")},
                            taints=[client.V1DeviceTaint(**TAINT)])]))
    assert pool_slice(model) == pool_slice(slice_of("s1", "n1", [gpu_device(0, taint=TAINT)], generation=3))
