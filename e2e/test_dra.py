"""GPUs through Dynamic Resource Allocation: the chart with `dra.enabled`, its node agents the DRA driver
(`gpu.gpu-agent.io`), on the real kubelets, scheduler and resourceclaim controller of the cluster.

Mirrors the DRA suites' claim rows: the slice's device count against the node's GPUs, a claim allocated on
create and released on delete, one claim shared by two pods or two containers, the 15 x 5 stress, the unknown
opaque-config field (a FailedPrepareDynamicResources event naming it, the plugin's permanent error), the stale
claim the plugin cleans up itself, and the slices following GPUs that come and go at run time. Evidence is the
cluster's, not the driver's: the GPU count is the device plugin's allocatable for the same fake GPUs, allocations
are the scheduler's, events the kubelet's, and what a container was given is what it prints itself (`fake-gpu smi
-L` inside it, reading the environment containerd 2.x built from the claim's CDI devices), checked against the
UUID the slice lists for the allocated device.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest
from kubernetes import client

from e2e.cluster import restart_kubelet, tool
from e2e.fake_gpu_release import CHART as FAKE_GPU_CHART
from e2e.fake_gpu_release import RELEASE as FAKE_GPU_RELEASE
from e2e.helpers import IMAGE, pod_log, wait_until
from e2e.release import Release, helm

pytestmark = pytest.mark.lane("dra", nodes=2, reason="one DRA driver per node: its registration socket in each kubelet's "
                                                     "plugin registry belongs to this module's release alone")

DRIVER = "gpu.gpu-agent.io"
CLASS = "gpu.gpu-agent.io"
DRA_VALUES = ("--set", "dra.enabled=true", "--set", "gracefulNoGPU=true")


@pytest.fixture(scope="module")
def dra(api, core, apps, kubeconfig, fake_gpus):
    """One release with DRA on for the module (installing one per test would triple the module's time); each
    test owns its namespace for its claims and pods, deleted (pods first) before the release goes."""
    ns = f"e2e-dra-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, labels={"e2e": "true"})))
    release = Release(api, core, apps, kubeconfig, ns, name="dra")
    fake_gpus.set(2)
    started = time.monotonic()
    # gracefulNoGPU: the cluster agent counts the devices this release's own node agents publish, which its first look
    # may come before (an agent failing fast would exit and restart once); and the module's tests take every device
    # away and expect it NotReady, not restarting.
    release.install(*DRA_VALUES, "--wait")
    print(f"\nDRA release installed with --wait in {time.monotonic() - started:.1f}s")
    resource = client.ResourceV1Api(api)
    yield release, resource
    release.uninstall_if_installed()
    # the kubelet would wipe them 30 s after the plugin went; a later module should not see them meanwhile
    resource.delete_collection_resource_slice(field_selector=f"spec.driver={DRIVER}")
    core.delete_namespace(ns)


def kubectl(kubeconfig, *args):
    """What a user would look at, printed beside the test's figures (the assertions read the API)."""
    r = subprocess.run([tool("kubectl"), "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True, timeout=30)
    return r.stdout + r.stderr


def slices(resource, node):
    listed = resource.list_resource_slice(field_selector=f"spec.nodeName={node},spec.driver={DRIVER}", _preload_content=False)
    return json.loads(listed.data)["items"]


def gpu_devices(found):
    """A slice's GPUs: every device but the GPUDomain channel (`type: channel`) the chart's default dra.domainChannels
    adds; an empty pool has no "devices"."""
    return [d for d in found["spec"].get("devices") or [] if (d.get("attributes") or {}).get("type") != {"string": "channel"}]


def device_count(resource, node):
    found = slices(resource, node)
    return len(gpu_devices(found[0])) if len(found) == 1 else None


def claim_of(resource, ns, name):
    return json.loads(resource.read_namespaced_resource_claim(name, ns, _preload_content=False).data)


def pod(name, node, claims, sleep=300):
    """A pod using `claims`: [(pod claim name, {"resourceClaimName": ...} or {"resourceClaimTemplateName": ...})]."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "resourceClaims": [{"name": n, **source} for n, source in claims],
                     "containers": [{"name": "cuda", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", f"fake-gpu smi -L; env | grep ^GPU_AGENT_ || true; sleep {sleep}"],
                                     "resources": {"claims": [{"name": n} for n, _ in claims]}}]}}


def seen_uuids(core, ns, name, container="cuda", timeout=10):
    """The GPUs a container was given, as it saw them: the `UUID:` lines of its `fake-gpu smi -L`, which reads the
    environment the container runtime put together from the claim's CDI devices (none without a runtime with CDI)."""
    def lines():
        text = pod_log(core, ns, name, container)
        return [ln.split("UUID: ")[1].rstrip(")") for ln in text.splitlines() if "UUID: GPU-" in ln] or None
    return wait_until(lines, timeout, f"the UUID lines of {name}/{container}", interval=0.2)


def uuid_in_slice(resource, pool, device):
    """The UUID the slice lists for (pool, device): where the scheduler's allocation points, read from the slice."""
    for d in (d for sl in slices(resource, pool) for d in sl["spec"].get("devices") or []):
        if d["name"] == device:
            return d["attributes"]["uuid"]["string"]
    raise AssertionError(f"no device {pool}/{device} in the slices")


def claim_spec(config=None):
    request = {"name": "gpu", "exactly": {"deviceClassName": CLASS}}
    spec = {"devices": {"requests": [request]}}
    if config is not None:
        spec["devices"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": config}}]
    return spec


def phase(core, ns, name):
    return core.read_namespaced_pod(name, ns).status.phase


def test_the_slice_of_every_node_holds_as_many_devices_as_the_node_has_gpus(dra, core, fake_gpus, kubeconfig):
    _, resource = dra
    nodes = fake_gpus.nodes
    others = [n for n in nodes if n != fake_gpus.node]
    for count, node in enumerate(others, start=1):  # each node a count of its own: 2, 1, 3 on three nodes
        fake_gpus.set(2 * count - 1 if count > 1 else 1, node=node)
    counts = {}
    for node in nodes:
        want = fake_gpus.allocatable(node)  # the device plugin's count of the same fake GPUs
        wait_until(lambda node=node, want=want: device_count(resource, node) == want, 10,
                   f"{node}: {want} devices in its ResourceSlice")
        counts[node] = want
    print(f"\nnode -> devices in its slice (= allocatable nvidia.com/gpu): {counts}")
    print(kubectl(kubeconfig, "get", "resourceslices", "-o", "wide"))
    (only,) = slices(resource, fake_gpus.node)
    device = only["spec"]["devices"][0]
    assert set(device["attributes"]) >= {"type", "uuid", "index", "productName"}
    # beside its GPUs, each node offers its GPUDomain channel (the chart's default dra.domainChannels)
    channel = only["spec"]["devices"][-1]
    assert (channel["name"], channel["attributes"]) == ("channel-0", {"type": {"string": "channel"}, "id": {"int": 0}})
    assert only["spec"]["pool"]["name"] == fake_gpus.node
    assert only["metadata"]["ownerReferences"][0]["kind"] == "Node"
    for node in others:
        fake_gpus.set(0, node=node)


def test_gpus_0_4_0_three_times_the_slice_follows_within_2s_and_nothing_restarts(dra, core, fake_gpus):
    release, resource = dra
    took = []
    for _ in range(3):
        for count in (4, 0):
            r = fake_gpus.command("set", "--node", fake_gpus.node, "--count", str(count))
            assert r.returncode == 0, r.stderr
            started = time.monotonic()
            wait_until(lambda count=count: device_count(resource, fake_gpus.node) == count, 2,
                       f"{count} devices in the slice within 2 s", interval=0.05)
            took.append(round(time.monotonic() - started, 2))
    print(f"\nfake-gpu set -> slice holds the count: {took} s")
    restarts = [(p.metadata.name, c.restart_count) for p in release.pods("app.kubernetes.io/component=node-agent")
                for c in p.status.container_statuses or [] if c.restart_count]
    assert restarts == []
    fake_gpus.set(2)


@pytest.mark.every_cluster  # kind's nodes run containerd 2.x too: the CDI path on a node kind made
def test_a_claim_from_a_template_is_allocated_on_create_prepared_and_released_on_delete(dra, api, core, namespace, fake_gpus):
    _, resource = dra
    fake_gpus.set(2)
    wait_until(lambda: device_count(resource, fake_gpus.node) == 2, 10, "2 devices in the slice")
    resource.create_namespaced_resource_claim_template(namespace, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one-gpu"},
        "spec": {"spec": claim_spec()}})
    started = time.monotonic()
    core.create_namespaced_pod(namespace, pod("one", fake_gpus.node, [("gpu", {"resourceClaimTemplateName": "one-gpu"})]))
    wait_until(lambda: phase(core, namespace, "one") == "Running", 60, "the pod Running (its claim prepared)", interval=0.2)
    took = time.monotonic() - started
    statuses = core.read_namespaced_pod("one", namespace).status.resource_claim_statuses
    (generated,) = [s.resource_claim_name for s in statuses]
    results = claim_of(resource, namespace, generated)["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["pool"]) for r in results] == [(DRIVER, fake_gpus.node)]
    # bats "1 pod(s), 1 full GPU": Ready within 8 s and exactly one UUID line, the allocated device's
    seen = seen_uuids(core, namespace, "one")
    print(f"\ncreate -> Running through a DRA claim: {took:.1f}s; the container sees {seen}")
    assert took <= 8.0
    assert seen == [uuid_in_slice(resource, results[0]["pool"], results[0]["device"])]
    core.delete_namespaced_pod("one", namespace)
    wait_until(lambda: not resource.list_namespaced_resource_claim(namespace).items, 60, "the pod's claim gone with it")


def test_two_pods_sharing_one_resource_claim_share_its_one_device(dra, api, core, namespace, fake_gpus, kubeconfig):
    _, resource = dra
    fake_gpus.set(2)
    wait_until(lambda: device_count(resource, fake_gpus.node) == 2, 10, "2 devices in the slice")
    resource.create_namespaced_resource_claim(namespace, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "shared"}, "spec": claim_spec()})
    for name in ("a", "b"):
        core.create_namespaced_pod(namespace, pod(name, fake_gpus.node, [("gpu", {"resourceClaimName": "shared"})]))
    wait_until(lambda: all(phase(core, namespace, n) == "Running" for n in ("a", "b")), 60, "both pods Running")
    shared = claim_of(resource, namespace, "shared")
    results = shared["status"]["allocation"]["devices"]["results"]
    assert len(results) == 1 and results[0]["driver"] == DRIVER
    assert sorted(r["name"] for r in shared["status"]["reservedFor"]) == ["a", "b"]
    allocated = uuid_in_slice(resource, results[0]["pool"], results[0]["device"])
    assert [seen_uuids(core, namespace, n) for n in ("a", "b")] == [[allocated], [allocated]]
    print(f"\nshared claim: device {results[0]['pool']}/{results[0]['device']} reserved for "
          f"{[r['name'] for r in shared['status']['reservedFor']]}")
    print(kubectl(kubeconfig, "describe", "resourceclaim", "shared", "-n", namespace))
    for name in ("a", "b"):
        core.delete_namespaced_pod(name, namespace)
    wait_until(lambda: not claim_of(resource, namespace, "shared")["status"].get("reservedFor"), 60, "the claim released")


def test_an_unknown_field_in_the_opaque_config_fails_prepare_at_once_naming_the_field(dra, api, core, namespace, fake_gpus):
    release, resource = dra
    fake_gpus.set(2)
    wait_until(lambda: device_count(resource, fake_gpus.node) == 2, 10, "2 devices in the slice")
    resource.create_namespaced_resource_claim(namespace, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "bad"},
        "spec": claim_spec({"apiVersion": "gpu.gpu-agent.io/v1alpha1", "kind": "GpuConfig", "unexpectedField": "foo"})})
    core.create_namespaced_pod(namespace, pod("bad", fake_gpus.node, [("gpu", {"resourceClaimName": "bad"})]))

    def failed_prepare():  # the plugin's refusal (the kubelet's own, "driver not registered", would not name the field)
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=bad").items
        return [e.message for e in events if e.reason == "FailedPrepareDynamicResources"
                and "error preparing devices" in e.message
                and 'strict decoding error: unknown field "unexpectedField"' in e.message]

    started = time.monotonic()
    messages = wait_until(failed_prepare, 15, "a FailedPrepareDynamicResources event naming the field", interval=0.2)
    print(f"\nevent ({time.monotonic() - started:.1f}s after the pod's create): {messages[0]}")
    waiting = core.read_namespaced_pod("bad", namespace).status.container_statuses
    assert not waiting or waiting[0].state.waiting is not None  # never started
    agent = [p.metadata.name for p in release.pods("app.kubernetes.io/component=node-agent") if p.spec.node_name == fake_gpus.node]
    log = core.read_namespaced_pod_log(agent[0], release.namespace)
    assert "Permanent error preparing devices for claim" in log and 'unknown field "unexpectedField"' in log


def gpus_component(release):
    """(HTTP status, the gpus component) of the cluster agent's own /healthz; (0, {}) until it answers."""
    code, body = release.healthz()
    return code, (body or {}).get("components", {}).get("gpus", {})


def gpus_when(release, status):
    """The gpus component of the cluster agent's /healthz once it answers `status`; None before."""
    code, gpus = gpus_component(release)
    return gpus if code == status else None


def slice_uuids(resource, node):
    return sorted(d["attributes"]["uuid"]["string"] for s in slices(resource, node) for d in gpu_devices(s))


def test_the_cluster_agent_counts_the_slices_devices_ready_within_2s_of_the_first_and_not_ready_when_the_last_goes(
        dra, core, fake_gpus):
    """Graceful no-GPU on a DRA cluster: the cluster agent's GPUs are the driver's devices in the ResourceSlices (the
    UUIDs in its /healthz are the slice's, which the node agent wrote: the device plugin's count carries none), a
    device tainted for an Xid counts for nothing, and readiness follows the slices both ways."""
    release, resource = dra
    nodes = fake_gpus.nodes
    for node in nodes:
        fake_gpus.set(0, node=node)
    gpus = wait_until(lambda: gpus_when(release, 503), 20, "the cluster agent NotReady with no device in any slice",
                      interval=0.2)
    # "no Ready node [among the nodes labelled ...] has a device ...": a release scoped to some nodes names them
    assert "no Ready node " in gpus["reason"], gpus
    assert f"has a device of DRA driver {DRIVER} in its ResourceSlices" in gpus["reason"], gpus

    r = fake_gpus.command("set", "--node", fake_gpus.node, "--count", "1")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: device_count(resource, fake_gpus.node) == 1, 5, "1 device in the slice", interval=0.05)
    in_slice = time.monotonic()
    gpus = wait_until(lambda: gpus_when(release, 200), 10, "the cluster agent Ready", interval=0.05)
    ready_after = time.monotonic() - in_slice
    assert gpus["details"]["uuids"] == slice_uuids(resource, fake_gpus.node), gpus
    assert gpus["details"]["gpus"][0]["health"] == "Healthy"

    fault = fake_gpus.command("fault", "--node", fake_gpus.node, "--gpu", "0", "--xid", "48")
    assert fault.returncode == 0, fault.stderr
    started = time.monotonic()
    gpus = wait_until(lambda: gpus_when(release, 503), 15, "NotReady: the one device tainted", interval=0.1)
    tainted_after = time.monotonic() - started
    assert f"tainted {DRIVER}/unhealthy=Unhealthy:NoSchedule" in gpus["reason"], gpus
    assert fake_gpus.command("fault", "--node", fake_gpus.node, "--clear").returncode == 0
    wait_until(lambda: gpus_component(release)[0] == 200, 10, "Ready again once the taint goes", interval=0.1)

    r = fake_gpus.command("set", "--node", fake_gpus.node, "--count", "0")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: device_count(resource, fake_gpus.node) == 0, 5, "the slice empty", interval=0.05)
    emptied = time.monotonic()
    wait_until(lambda: gpus_component(release)[0] == 503, 15, "NotReady once the last device left", interval=0.1)
    not_ready_after = time.monotonic() - emptied
    print(f"\nslice gained its first device -> cluster agent Ready: {ready_after:.2f}s; Xid 48 -> NotReady (the device "
          f"tainted, loss debounce 5 s): {tainted_after:.1f}s; slice emptied -> NotReady: {not_ready_after:.1f}s")
    assert ready_after <= 2.0
    fake_gpus.set(2)


def test_a_work_item_gets_its_gpu_through_a_claim_of_the_charts_device_class(dra, core, fake_gpus):
    """The cluster agent's work Pods on a DRA cluster: the Pod claims its GPU from the template the agent made, the
    scheduler allocates one of our driver's devices to the claim, and the item ends done."""
    from e2e.release import enqueue, items

    release, resource = dra
    fake_gpus.set(2)
    wait_until(lambda: gpus_component(release)[0] == 200, 20, "the cluster agent Ready")
    enqueue(release, ["dra-item"], seconds=20)

    def running_work_pod():
        pods = [p for p in release.pods("gpu-agent.io/work-item=true") if p.status.phase == "Running"]
        return pods[0] if pods else None

    work = wait_until(running_work_pod, 60, "the work Pod Running", interval=0.2)
    assert [c.resource_claim_template_name for c in work.spec.resource_claims] == ["dra-work-gpus-1"]
    assert not (work.spec.containers[0].resources.limits or {}).get("nvidia.com/gpu")
    (status,) = work.status.resource_claim_statuses
    results = claim_of(resource, release.namespace, status.resource_claim_name)["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["request"]) for r in results] == [(DRIVER, "gpus")]
    print(f"\nwork Pod {work.metadata.name} on {work.spec.node_name}: claim {status.resource_claim_name} -> "
          f"{results[0]['pool']}/{results[0]['device']}")
    wait_until(lambda: items(release).get("dra-item") == "done", 90, "the item done")
    template = resource.read_namespaced_resource_claim_template("dra-work-gpus-1", release.namespace)
    assert template.spec.spec.devices.requests[0].exactly.device_class_name == CLASS


# -- the DRA bats rows and the upstream DRA suite's rows ----------------------------------------------------------------

def template(resource, ns, name, count=1):
    spec = claim_spec()
    if count != 1:
        spec["devices"]["requests"][0]["exactly"].update(allocationMode="ExactCount", count=count)
    resource.create_namespaced_resource_claim_template(ns, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
        "spec": {"spec": spec}})


def devices_of_pod(core, resource, ns, name):
    """The devices allocated to each of a Pod's claims, by the Pod's claim name: {claim: [(pool, device), ...]}."""
    statuses = core.read_namespaced_pod(name, ns).status.resource_claim_statuses or []
    out = {}
    for s in statuses:
        results = claim_of(resource, ns, s.resource_claim_name)["status"]["allocation"]["devices"]["results"]
        assert all(r["driver"] == DRIVER for r in results), results
        out[s.name] = [(r["pool"], r["device"]) for r in results]
    return out


def running(core, ns, names, timeout=60):
    wait_until(lambda: all(phase(core, ns, n) == "Running" for n in names), timeout, f"{len(names)} pod(s) Running",
               interval=0.2)


def delete_pods(core, ns, names, timeout=60):
    """Delete the pods gracefully and wait until they are gone: a pod with prepared claims finishes terminating only
    once the kubelet's unprepare succeeded (a 0 s grace period would remove the object at once, before it), so
    gone means unprepared, before anything else may take the devices or the release goes."""
    for name in names:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=1)
    wait_until(lambda: not [p for p in core.list_namespaced_pod(ns).items if p.metadata.name in names], timeout,
               f"{len(names)} pod(s) gone (their claims unprepared)", interval=0.2)


def ready_with(resource, fake_gpus, count):
    fake_gpus.set(count)
    wait_until(lambda: device_count(resource, fake_gpus.node) == count, 10, f"{count} devices in the slice")


def test_two_pods_each_with_a_claim_from_one_template_get_two_different_gpus(dra, core, namespace, fake_gpus):
    """bats: 2 pod(s), 1 full GPU each (RCT)."""
    _, resource = dra
    ready_with(resource, fake_gpus, 2)
    template(resource, namespace, "one-gpu")
    for name in ("p1", "p2"):
        core.create_namespaced_pod(namespace, pod(name, fake_gpus.node, [("gpu", {"resourceClaimTemplateName": "one-gpu"})]))
    running(core, namespace, ["p1", "p2"])
    (first,), (second,) = (devices_of_pod(core, resource, namespace, n)["gpu"] for n in ("p1", "p2"))
    seen = [seen_uuids(core, namespace, n) for n in ("p1", "p2")]
    print(f"\np1 -> {first}, p2 -> {second}; the containers see {seen}")
    assert first != second
    assert seen == [[uuid_in_slice(resource, *first)], [uuid_in_slice(resource, *second)]]
    delete_pods(core, namespace, ["p1", "p2"])


def test_one_pod_two_containers_one_claim_from_a_template_share_its_one_gpu(dra, core, namespace, fake_gpus):
    """bats: 1 pod(s), 2 cntrs, 1 full GPU (shared, 1 RCT): both containers use the pod's one claim."""
    _, resource = dra
    ready_with(resource, fake_gpus, 2)
    template(resource, namespace, "one-gpu")
    body = pod("two", fake_gpus.node, [("gpu", {"resourceClaimTemplateName": "one-gpu"})])
    second = dict(body["spec"]["containers"][0], name="cuda2")
    body["spec"]["containers"].append(second)
    core.create_namespaced_pod(namespace, body)
    running(core, namespace, ["two"])
    containers = core.read_namespaced_pod("two", namespace).spec.containers
    assert [[c.name for c in k.resources.claims] for k in containers] == [["gpu"], ["gpu"]]
    assert {k.name: k.ready for k in core.read_namespaced_pod("two", namespace).status.container_statuses} == \
        {"cuda": True, "cuda2": True}
    (devices,) = devices_of_pod(core, resource, namespace, "two").values()
    assert len(devices) == 1, devices
    seen = {c: seen_uuids(core, namespace, "two", c) for c in ("cuda", "cuda2")}
    print(f"\nboth containers of one pod: {devices[0]}; they see {seen}")
    assert seen == {"cuda": [uuid_in_slice(resource, *devices[0])], "cuda2": [uuid_in_slice(resource, *devices[0])]}
    delete_pods(core, namespace, ["two"])


def test_a_pod_with_two_claim_templates_gets_two_distinct_gpus(dra, core, namespace, fake_gpus):
    """The upstream DRA suite: a pod with two templates gets two distinct GPUs."""
    _, resource = dra
    ready_with(resource, fake_gpus, 2)
    template(resource, namespace, "one-gpu")
    core.create_namespaced_pod(namespace, pod("twice", fake_gpus.node, [("a", {"resourceClaimTemplateName": "one-gpu"}),
                                                                        ("b", {"resourceClaimTemplateName": "one-gpu"})]))
    running(core, namespace, ["twice"])
    devices = devices_of_pod(core, resource, namespace, "twice")
    seen = seen_uuids(core, namespace, "twice")
    print(f"\ntwo templates: {devices}; the container sees {seen}")
    assert sorted(devices) == ["a", "b"] and len({d for ds in devices.values() for d in ds}) == 2
    assert sorted(seen) == sorted(uuid_in_slice(resource, *d) for ds in devices.values() for d in ds)
    delete_pods(core, namespace, ["twice"])


def test_a_job_with_a_claim_template_gets_a_gpu_for_each_of_its_2_completions(dra, api, core, namespace, fake_gpus):
    """The upstream DRA suite: a Job with a ResourceClaimTemplate and 2 completions; every completion's pod ran
    with a claim of our driver, and no claim is left once the pods are gone."""
    _, resource = dra
    ready_with(resource, fake_gpus, 2)
    template(resource, namespace, "one-gpu")
    spec = pod("unused", fake_gpus.node, [("gpu", {"resourceClaimTemplateName": "one-gpu"})], sleep=1)["spec"]
    spec["restartPolicy"] = "Never"
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(namespace, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "job"},
                                            "spec": {"completions": 2, "parallelism": 1, "backoffLimit": 0,
                                                     "template": {"spec": spec}}})
    seen: dict[str, list] = {}

    def done():
        for p in core.list_namespaced_pod(namespace, label_selector="job-name=job").items:
            if p.metadata.name not in seen and p.status.resource_claim_statuses:
                try:
                    seen[p.metadata.name] = devices_of_pod(core, resource, namespace, p.metadata.name)["gpu"]
                except (client.ApiException, KeyError, TypeError):
                    pass  # the claim not allocated yet, or already gone with a finished pod: read again
        return (batch.read_namespaced_job_status("job", namespace).status.succeeded or 0) == 2

    started = time.monotonic()
    wait_until(done, 120, "the Job's 2 completions", interval=0.2)
    print(f"\nJob of 2 completions through a claim template: {time.monotonic() - started:.1f}s; pods -> devices {seen}")
    assert len(seen) >= 1 and all(len(d) == 1 for d in seen.values())
    batch.delete_namespaced_job("job", namespace, propagation_policy="Foreground")
    wait_until(lambda: not resource.list_namespaced_resource_claim(namespace).items, 60, "no claim left")


def test_stress_one_shared_resource_claim_across_15_pods_x_5_loops_leaves_nothing_allocated(dra, core, namespace, fake_gpus):
    """bats: Stress: shared ResourceClaim across 15 pods x 5 loops. Each loop starts 15 pods on one claim, waits
    until all run on its one device, deletes them; at the end the claim is reserved for nobody and every pod is gone."""
    _, resource = dra
    ready_with(resource, fake_gpus, 2)
    resource.create_namespaced_resource_claim(namespace, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "shared"}, "spec": claim_spec()})
    took, devices = [], set()
    for loop in range(5):
        started = time.monotonic()
        names = [f"s{loop}-{i}" for i in range(15)]
        for name in names:
            core.create_namespaced_pod(namespace, pod(name, fake_gpus.node, [("gpu", {"resourceClaimName": "shared"})]))
        running(core, namespace, names, timeout=120)
        claim = claim_of(resource, namespace, "shared")
        assert len(claim["status"]["reservedFor"]) == 15
        devices |= {(r["pool"], r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]}
        (device,) = devices
        assert {n: seen_uuids(core, namespace, n) for n in names} == {n: [uuid_in_slice(resource, *device)] for n in names}
        delete_pods(core, namespace, names, timeout=120)
        took.append(round(time.monotonic() - started, 1))
    print(f"\n15 pods on one claim, 5 loops: {took} s per loop; devices used: {sorted(devices)}")
    assert len(devices) == 1
    claim = claim_of(resource, namespace, "shared")
    assert not claim["status"].get("reservedFor"), claim["status"]
    assert not core.list_namespaced_pod(namespace).items


def running_with_one_gpu(core, resource, namespace, fake_gpus, name):
    """A pod `name` Running on the node with one GPU claimed from a template of the chart's class."""
    ready_with(resource, fake_gpus, 2)
    template(resource, namespace, "one-gpu")
    core.create_namespaced_pod(namespace, pod(name, fake_gpus.node, [("gpu", {"resourceClaimTemplateName": "one-gpu"})]))
    running(core, namespace, [name])


def kill_node_agent(release, node):
    """The node's agent deleted at once (no goodbye), and its successor once Ready: (before, after)."""
    before = node_agent_on(release, node)
    release.core.delete_namespaced_pod(before.metadata.name, release.namespace, grace_period_seconds=0)
    after = wait_until(lambda: (lambda p: p if p is not None and p.metadata.uid != before.metadata.uid else None)(
        node_agent_on(release, node)), 90, "a new node agent Ready on the node", interval=0.5)
    return before, after


def node_agent_on(release, node):
    pods = [p for p in release.pods("app.kubernetes.io/component=node-agent")
            if p.spec.node_name == node and p.metadata.deletion_timestamp is None]
    return pods[0] if len(pods) == 1 and all(c.ready for c in pods[0].status.container_statuses or []) else None


def test_the_plugin_killed_with_a_prepared_claim_keeps_its_pod_running_and_unprepares_it_once_back(dra, core, namespace,
                                                                                                   fake_gpus):
    release, resource = dra
    running_with_one_gpu(core, resource, namespace, fake_gpus, "kept")
    before, after = kill_node_agent(release, fake_gpus.node)
    kept = core.read_namespaced_pod("kept", namespace)
    assert kept.status.phase == "Running" and kept.status.container_statuses[0].restart_count == 0
    (generated,) = [s.resource_claim_name for s in kept.status.resource_claim_statuses]
    started = time.monotonic()
    delete_pods(core, namespace, ["kept"])  # the kubelet unprepares through the new plugin, from its checkpoint
    wait_until(lambda: not resource.list_namespaced_resource_claim(namespace).items, 60, "the claim gone with its pod")
    print(f"\nnode agent {before.metadata.name} -> {after.metadata.name}; pod kept running; claim {generated} "
          f"unprepared and gone {time.monotonic() - started:.1f}s after the pod's delete")
    # the pod is gone only once the kubelet's unprepare succeeded; the new plugin says it undid the claim it never saw
    log = pod_log(core, release.namespace, after.metadata.name)
    assert f"unprepared claim {namespace}/{generated}:" in log, log[-2000:]


@pytest.mark.disruptive
@pytest.mark.ci_host
def test_a_kubelet_restart_wipes_and_republishes_the_slice_and_a_running_pods_claim_stays_prepared(dra, core, namespace,
                                                                                                     fake_gpus):
    _, resource = dra
    running_with_one_gpu(core, resource, namespace, fake_gpus, "through")
    (old,) = [s["metadata"]["uid"] for s in slices(resource, fake_gpus.node)]
    restarted = time.monotonic()
    restart_kubelet()
    # the kubelet deletes the node's slices at its start; the plugin makes the pool again
    wait_until(lambda: [s["metadata"]["uid"] for s in slices(resource, fake_gpus.node)] not in ([], [old]), 60,
               "a new slice for the node after the kubelet's restart", interval=0.2)
    republished = time.monotonic() - restarted
    wait_until(lambda: device_count(resource, fake_gpus.node) == 2, 10, "2 devices in the new slice")
    through = core.read_namespaced_pod("through", namespace)
    assert through.status.phase == "Running" and through.status.container_statuses[0].restart_count == 0
    # a new claim prepares through the restarted kubelet, and the old one unprepares
    core.create_namespaced_pod(namespace, pod("after", fake_gpus.node, [("gpu", {"resourceClaimTemplateName": "one-gpu"})]))
    running(core, namespace, ["after"], timeout=90)
    print(f"\nkubelet restarted -> slice republished {republished:.1f}s later; the running pod untouched")
    delete_pods(core, namespace, ["through", "after"])


def test_a_claim_left_in_prepare_started_whose_object_is_gone_is_unprepared_by_the_plugin_itself(dra, core, namespace,
                                                                                                  fake_gpus):
    """bats: self-initiated unprepare of stale RCs in PrepareStarted. A claim that cannot prepare (its opaque config
    has an unknown field: the plugin checkpointed PrepareStarted before decoding it); then, as the bats test does, the
    release uninstalled, so no plugin is there when the pod and claim are force-deleted and the kubelet cannot
    unprepare it; then installed again: the new plugin, before it registers, finds the claim gone and unprepares it,
    saying so, and the kubelet's unprepare, retried since, finds it PrepareAborted."""
    release, resource = dra
    ready_with(resource, fake_gpus, 2)
    resource.create_namespaced_resource_claim(namespace, body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "stale"},
        "spec": claim_spec({"apiVersion": "gpu.gpu-agent.io/v1alpha1", "kind": "GpuConfig", "unexpectedField": "x"})})
    core.create_namespaced_pod(namespace, pod("stale", fake_gpus.node, [("gpu", {"resourceClaimName": "stale"})]))
    # the plugin's own refusal, not the kubelet's (right after a kubelet restart it may refuse first, "driver not
    # registered", before the plugin ever saw the claim)
    wait_until(lambda: [e for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=stale").items
                        if e.reason == "FailedPrepareDynamicResources" and 'unknown field "unexpectedField"' in e.message],
               30, "the plugin's prepare failed on the unknown field", interval=0.2)
    # With the plugin running, the kubelet's unprepare of the deleted pod reaches it first and the claim is undone
    # by that path (a CI run did so): nothing would be left for the plugin's own cleanup.
    release.uninstall()
    core.delete_namespaced_pod("stale", namespace, grace_period_seconds=0)
    resource.delete_namespaced_resource_claim("stale", namespace, grace_period_seconds=0)
    wait_until(lambda: not resource.list_namespaced_resource_claim(namespace).items, 60, "the claim gone")
    release.install(*DRA_VALUES, "--wait")
    after = wait_until(lambda: node_agent_on(release, fake_gpus.node), 60, "the new node agent Ready", interval=0.5)

    def stale_lines():
        return [ln for ln in pod_log(core, release.namespace, after.metadata.name).splitlines() if f"{namespace}/stale" in ln]

    cleanup = f"Checkpointed RC cleanup: unprepared stale claim: {namespace}/stale"
    try:
        wait_until(lambda: any(cleanup in ln for ln in stale_lines()), 30, "the plugin's own cleanup")
        # the kubelet retries its unprepare with a backoff: it comes, to a claim already undone
        wait_until(lambda: any("Unprepare noop: claim in PrepareAborted state" in ln for ln in stale_lines()), 90,
                   "the kubelet's unprepare, a noop")
    except AssertionError as e:
        raise AssertionError(f"{e}; the new plugin's log ends:\n{pod_log(core, release.namespace, after.metadata.name)[-3000:]}") from None
    lines = stale_lines()
    print("\n" + "\n".join(lines))
    marked = [i for i, ln in enumerate(lines) if "Marked claim PrepareAborted in checkpoint" in ln]
    noop = [i for i, ln in enumerate(lines) if "Unprepare noop: claim in PrepareAborted state" in ln]
    assert marked and noop and marked[0] < noop[0], lines  # the cleanup first, the kubelet after


def taints(resource, node, device):
    for s in slices(resource, node):
        for d in s["spec"].get("devices") or []:
            if d["name"] == device:
                return d.get("taints") or []
    return None


def test_an_xid_79_taints_its_device_within_2s_a_new_claim_never_gets_it_and_a_clear_brings_it_back(dra, core, namespace,
                                                                                                   fake_gpus):
    _, resource = dra
    try:
        ready_with(resource, fake_gpus, 2)
        template(resource, namespace, "one-gpu")
        r = fake_gpus.command("fault", "--node", fake_gpus.node, "--gpu", "0", "--xid", "79")
        assert r.returncode == 0, r.stderr
        started = time.monotonic()
        (taint,) = wait_until(lambda: taints(resource, fake_gpus.node, "gpu-0"), 2, "gpu-0 tainted within 2 s", interval=0.05)
        tainted_after = time.monotonic() - started
        assert {k: taint[k] for k in ("key", "value", "effect")} == {"key": f"{DRIVER}/unhealthy", "value": "Lost",
                                                                   "effect": "NoSchedule"}  # timeAdded: the API server's
        assert taints(resource, fake_gpus.node, "gpu-1") == []
        # one after the other: created together, their claims (the resourceclaim controller's) may be made and
        # scheduled in either order, and under load "second" took gpu-1 first
        core.create_namespaced_pod(namespace, pod("first", fake_gpus.node, [("gpu", {"resourceClaimTemplateName": "one-gpu"})]))
        running(core, namespace, ["first"])
        assert devices_of_pod(core, resource, namespace, "first") == {"gpu": [(fake_gpus.node, "gpu-1")]}
        core.create_namespaced_pod(namespace, pod("second", fake_gpus.node, [("gpu", {"resourceClaimTemplateName": "one-gpu"})]))

        def refused():  # the scheduler looked at "second" and found no untainted device for its claim
            conditions = core.read_namespaced_pod("second", namespace).status.conditions or []
            return [c for c in conditions if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"]

        (verdict,) = wait_until(refused, 30, "the scheduler's Unschedulable verdict on the second pod", interval=0.2)
        print(f"\nsecond pod while gpu-0 is tainted: {verdict.message}")
        assert phase(core, namespace, "second") == "Pending"
        r = fake_gpus.command("fault", "--node", fake_gpus.node, "--clear")
        assert r.returncode == 0, r.stderr
        started = time.monotonic()
        wait_until(lambda: taints(resource, fake_gpus.node, "gpu-0") == [], 2, "the taint gone within 2 s", interval=0.05)
        cleared_after = time.monotonic() - started
        running(core, namespace, ["second"])
        assert devices_of_pod(core, resource, namespace, "second") == {"gpu": [(fake_gpus.node, "gpu-0")]}
        print(f"\nXid 79 -> gpu-0 tainted Lost in the slice: {tainted_after:.2f}s; clear -> taint gone: {cleared_after:.2f}s; "
              "the pod asking meanwhile waited for it and got gpu-0")
        delete_pods(core, namespace, ["first", "second"])
    finally:  # a failure halfway must not leave the next test a faulted GPU
        fake_gpus.command("fault", "--node", fake_gpus.node, "--clear")


def fake_gpu_device_plugin(fake_gpus, enabled: bool):
    """The shared fake-gpu release's device plugin on or off on every node (its GPUs, labels and state stay)."""
    helm("upgrade", FAKE_GPU_RELEASE, str(FAKE_GPU_CHART), "--kubeconfig", fake_gpus.kubeconfig, "-n", fake_gpus.namespace,
         "--reuse-values", "--set", f"devicePlugin.enabled={str(enabled).lower()}", "--wait", "--timeout", "120s")


@pytest.mark.serial(reason="turns the shared fake-gpu release's device plugin off on every node")
def test_a_legacy_nvidia_gpu_pod_is_served_by_dra_where_no_device_plugin_advertises_it(dra, api, core, namespace,
                                                                                        fake_gpus):
    """The upstream DRA suite: a pod asking `nvidia.com/gpu: 1` in its limits, as of a device plugin, is served by DRA
    (DRAExtendedResource, beta and on in 1.36) through the DeviceClass's extendedResourceName: with the device plugin
    off the node's allocatable is 0, the scheduler makes the pod a claim of our driver, and the container sees the
    allocated GPU. Where the device plugin advertises the name it wins, so the shared fake-gpu release's plugin is
    turned off for the test and on again after."""
    release, resource = dra
    ready_with(resource, fake_gpus, 2)
    release.upgrade("--reuse-values", "--set", "dra.extendedResourceName=nvidia.com/gpu", "--wait")
    assert client.ResourceV1Api(api).read_device_class(CLASS).spec.extended_resource_name == "nvidia.com/gpu"
    fake_gpu_device_plugin(fake_gpus, False)
    try:
        wait_until(lambda: fake_gpus.allocatable() == 0, 60, "allocatable nvidia.com/gpu 0 with the device plugin off")
        wait_until(lambda: device_count(resource, fake_gpus.node) == 2, 30, "2 devices still in the slice")
        body = pod("legacy", fake_gpus.node, [])
        del body["spec"]["resourceClaims"], body["spec"]["containers"][0]["resources"]["claims"]
        body["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "1"}
        started = time.monotonic()
        core.create_namespaced_pod(namespace, body)
        running(core, namespace, ["legacy"])
        took = time.monotonic() - started
        raw = json.loads(core.read_namespaced_pod("legacy", namespace, _preload_content=False).data)
        claim_name = raw["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
        results = claim_of(resource, namespace, claim_name)["status"]["allocation"]["devices"]["results"]
        assert [(r["driver"], r["pool"]) for r in results] == [(DRIVER, fake_gpus.node)], results
        seen = seen_uuids(core, namespace, "legacy")
        print(f"\nnvidia.com/gpu: 1 pod -> Running in {took:.1f}s through DRA claim {claim_name} "
              f"({results[0]['pool']}/{results[0]['device']}); the container sees {seen}")
        assert seen == [uuid_in_slice(resource, results[0]["pool"], results[0]["device"])]
        delete_pods(core, namespace, ["legacy"])
        wait_until(lambda: not resource.list_namespaced_resource_claim(namespace).items, 60, "the pod's claim gone")
    finally:
        fake_gpu_device_plugin(fake_gpus, True)
        release.upgrade("--reuse-values", "--set", "dra.extendedResourceName=", "--wait")
    wait_until(lambda: fake_gpus.allocatable() == 2, 60, "allocatable nvidia.com/gpu back to 2 with the plugin on")
