"""GPUs through Dynamic Resource Allocation: the chart with `dra.enabled`, its node agents the DRA driver
(`gpu.gpu-agent.io`), on the real kubelets, scheduler and resourceclaim controller of the cluster.

Mirrors the DRA suites' claim rows that need no CDI-capable container runtime: the slice's device count
against the node's GPUs, a claim allocated on create and released on delete, one claim shared by two pods,
the unknown opaque-config field (a FailedPrepareDynamicResources event naming it, the plugin's permanent
error), and the slices following GPUs that come and go at run time. Evidence is the cluster's, not the
driver's: the GPU count is the device plugin's allocatable for the same fake GPUs, allocations are the
scheduler's, events the kubelet's.

Not here yet: the `UUID:` lines inside the containers. The CI cluster's containerd (1.6) has no CDI, so
the CDI devices a prepare returns are not injected (issue 46 part 4: containerd 2.x); the pods run, and
the tests read the claim's allocation instead.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest
from kubernetes import client

from e2e.cluster import tool
from e2e.helpers import IMAGE, wait_until
from e2e.release import Release

pytestmark = pytest.mark.serial(reason="one DRA driver per node: its registration socket in each kubelet's plugin "
                                       "registry belongs to this module's release alone")

DRIVER = "gpu.gpu-agent.io"
CLASS = "gpu.gpu-agent.io"


@pytest.fixture(scope="module")
def dra(api, core, apps, kubeconfig, fake_gpus):
    """One release with DRA on for the module (installing one per test would triple the module's time); each
    test owns its namespace for its claims and pods, deleted (pods first) before the release goes."""
    ns = f"e2e-dra-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, labels={"e2e": "true"})))
    release = Release(api, core, apps, kubeconfig, ns, name="dra")
    fake_gpus.set(2)
    started = time.monotonic()
    release.install("--set", "dra.enabled=true", "--wait")
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


def device_count(resource, node):
    found = slices(resource, node)
    return len(found[0]["spec"].get("devices") or []) if len(found) == 1 else None  # an empty pool has no "devices"


def claim_of(resource, ns, name):
    return json.loads(resource.read_namespaced_resource_claim(name, ns, _preload_content=False).data)


def pod(name, node, claims, sleep=300):
    """A pod using `claims`: [(pod claim name, {"resourceClaimName": ...} or {"resourceClaimTemplateName": ...})]."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "resourceClaims": [{"name": n, **source} for n, source in claims],
                     "containers": [{"name": "cuda", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", f"env | grep ^GPU_AGENT_ || true; sleep {sleep}"],
                                     "resources": {"claims": [{"name": n} for n, _ in claims]}}]}}


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
    nodes = [n.metadata.name for n in core.list_node().items]
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
    assert set(device["attributes"]) >= {"uuid", "index", "productName"}
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
    print(f"\ncreate -> Running through a DRA claim: {time.monotonic() - started:.1f}s")
    statuses = core.read_namespaced_pod("one", namespace).status.resource_claim_statuses
    (generated,) = [s.resource_claim_name for s in statuses]
    results = claim_of(resource, namespace, generated)["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["pool"]) for r in results] == [(DRIVER, fake_gpus.node)]
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

    def failed_prepare():
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=bad").items
        return [e.message for e in events if e.reason == "FailedPrepareDynamicResources"]

    messages = wait_until(failed_prepare, 15, "a FailedPrepareDynamicResources event", interval=0.2)
    print(f"\nevent: {messages[0]}")
    assert any("error preparing devices" in m and 'strict decoding error: unknown field "unexpectedField"' in m
               for m in messages), messages
    waiting = core.read_namespaced_pod("bad", namespace).status.container_statuses
    assert not waiting or waiting[0].state.waiting is not None  # never started
    agent = [p.metadata.name for p in release.pods("app.kubernetes.io/component=node-agent") if p.spec.node_name == fake_gpus.node]
    log = core.read_namespaced_pod_log(agent[0], release.namespace)
    assert "Permanent error preparing devices for claim" in log and 'unknown field "unexpectedField"' in log
