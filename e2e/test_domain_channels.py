"""GPUDomain channels, the ComputeDomain way, on the real kubelets, scheduler, resourceclaim controller and a
containerd with CDI: the chart with `dra.enabled` (its default `dra.domainChannels` on).

Mirrors the DRA driver's IMEX channel rows (`test_cd_imex_chan_inject.bats`: `ls -la /dev/nvidia-caps-imex-channels`
in the workload shows `channel0`, or with allocationMode All `channel2047` and `channel222`) and what a ComputeDomain
user sees meanwhile: a Pod referencing the domain's channel template waits in ContainerCreating with a
FailedPrepareDynamicResources event while its node is not a Ready member, and starts once it is. Evidence is the
cluster's: the template is the API server's object, the events the kubelet's, the domain's readiness the folded
status the cluster agent writes, and what the workload got is what it prints itself.
"""

from __future__ import annotations

import json
import sys
import time
import uuid

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.artifacts import dump, failing_test
from e2e.helpers import IMAGE, pod_log, wait_until
from e2e.release import Release

pytestmark = pytest.mark.serial(reason="one DRA driver per node: its registration socket in each kubelet's plugin "
                                       "registry belongs to this module's release alone (test_dra.py's, at another time)")

DRIVER = "gpu.gpu-agent.io"
CHANNEL_CLASS = "channel.gpu-agent.io"
GROUP, VERSION, PLURAL = "gpu-agent.io", "v1beta1", "gpudomains"


@pytest.fixture(scope="module")
def channels(api, core, apps, kubeconfig, fake_gpus):
    """One DRA release for the module; its namespace is the domains', so the workloads run there (a domain's channel
    serves only claims of its own namespace). Each test makes its own domain and pods, and deletes its pods."""
    ns = f"e2e-channels-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, labels={"e2e": "true"})))
    release = Release(api, core, apps, kubeconfig, ns, name="ch")
    fake_gpus.set(2)
    release.install("--set", "dra.enabled=true", "--set", "gracefulNoGPU=true", "--wait")
    yield release
    release.uninstall_if_installed()
    client.ResourceV1Api(api).delete_collection_resource_slice(field_selector=f"spec.driver={DRIVER}")
    core.delete_namespace(ns)


def make_domain(api, ns, name, template, mode="Single", expected=1):
    return client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomain", "metadata": {"name": name},
        "spec": {"expectedNodes": expected, "channel": {"resourceClaimTemplate": {"name": template}, "allocationMode": mode}}})


def delete_domain(api, ns, name):
    try:
        client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    except ApiException as e:
        if e.status != 404:
            raise


def domain_node_status(api, ns, name, node):
    obj = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    return next((n.get("status") for n in (obj.get("status") or {}).get("nodes") or [] if n.get("name") == node), None)


def template(api, ns, name):
    try:
        return json.loads(client.ResourceV1Api(api).read_namespaced_resource_claim_template(
            name, ns, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


WORKLOAD = ("ls -la /dev/nvidia-caps-imex-channels | grep -c ' channel' | sed 's/^/channels: /'; "
            "ls -la /dev/nvidia-caps-imex-channels | grep -E ' channel(0|222|2047)$'; "
            "env | grep ^GPU_AGENT_DOMAIN | sort; echo '-- peers'; cat /etc/gpu-agent/domain/peers; echo '-- end'; "
            "sleep 600")


def workload_pod(name, node, claims):
    """A Pod on `node` whose claims are [(pod claim name, {"resourceClaimTemplateName"|"resourceClaimName": ...})]."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "resourceClaims": [{"name": n, **source} for n, source in claims],
                     "containers": [{"name": "work", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", WORKLOAD],
                                     "resources": {"claims": [{"name": n} for n, _ in claims]}}]}}


def delete_pod_and_wait(core, ns, name, timeout=60):
    try:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    except ApiException as e:
        if e.status != 404:
            raise

    def gone():
        try:
            core.read_namespaced_pod(name, ns)
        except ApiException as e:
            return e.status == 404
        return False
    wait_until(gone, timeout, f"pod {ns}/{name} gone (its claim unprepared and deallocated)")


def failed_prepare(core, ns, pod):
    return [e.message for e in core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}").items
            if e.reason == "FailedPrepareDynamicResources"]


def output(core, ns, pod):
    text = pod_log(core, ns, pod)
    return text if "-- end" in text else None


def dump_if_failing(core, ns):
    """The module's release namespace is no test's own, which the suite dumps: a failing test dumps it here, before its
    pods go."""
    if sys.exc_info()[0] is not None and failing_test():
        print(f"\nthe release namespace is in {dump(core, ns, failing_test(), into='release')}")


def scale_cluster_agent(release, replicas):
    release.apps.patch_namespaced_deployment_scale(f"{release.fullname}-cluster-agent", release.namespace,
                                                   {"spec": {"replicas": replicas}})


def test_channel_injection_single_waits_for_the_node_to_be_ready_in_the_domain_then_sees_exactly_channel0(
        channels, api, core, fake_gpus):
    release, ns, node = channels, channels.namespace, fake_gpus.node
    make_domain(api, ns, "single", "single-channel")
    made = wait_until(lambda: template(api, ns, "single-channel"), 30, "the cluster agent's channel template")
    (request,) = made["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == CHANNEL_CLASS
    assert made["metadata"]["ownerReferences"][0]["kind"] == "GPUDomain"
    # Nobody folds the domain while no cluster agent runs: the node's member is written, never shown Ready.
    scale_cluster_agent(release, 0)
    wait_until(lambda: not release.pods("app.kubernetes.io/component=cluster-agent"), 60, "no cluster agent pod")
    core.create_namespaced_pod(ns, workload_pod("single", node, [("channel", {"resourceClaimTemplateName": "single-channel"})]))
    try:
        messages = wait_until(lambda: failed_prepare(core, ns, "single"), 90,
                              "a FailedPrepareDynamicResources event while the node is not Ready in the domain")
        print(f"\nthe waiting pod's event: {messages[0]}")
        assert f"node {node} not Ready in GPUDomain {ns}/single" in messages[0]
        assert "permanent" not in messages[0]
        status = core.read_namespaced_pod("single", ns).status
        assert status.phase == "Pending"
        assert status.container_statuses[0].state.waiting.reason == "ContainerCreating"

        scale_cluster_agent(release, 1)
        wait_until(lambda: domain_node_status(api, ns, "single", node) == "Ready", 120, f"{node} Ready in the domain",
                   interval=0.1)
        ready = time.monotonic()
        wait_until(lambda: core.read_namespaced_pod("single", ns).status.phase == "Running", 60, "the pod Running",
                   interval=0.1)
        took = time.monotonic() - ready
        print(f"the pod Running {took:.1f}s after the domain's status showed {node} Ready")
        # The kubelet's own retry of a failed prepare is its next resync of the pod, 60-90 s later (measured: no
        # retry in 62 s); the node agent's nudge (an annotation on the pod) brings it at once.
        assert took <= 2.0
        text = wait_until(lambda: output(core, ns, "single"), 30, "the workload's output")
        print(text)
        assert "channels: 1" in text
        assert text.count(" channel0\n") == 1 and " channel222" not in text
        assert f"GPU_AGENT_DOMAIN={ns}/single" in text and "GPU_AGENT_DOMAIN_NODE_INDEX=0" in text
        peers = text.split("-- peers\n")[1].split("-- end")[0]
        assert f"0 {node} " in peers and "Ready" in peers
    finally:
        dump_if_failing(core, ns)
        scale_cluster_agent(release, 1)
        delete_pod_and_wait(core, ns, "single")
        delete_domain(api, ns, "single")


def test_channel_injection_all_gives_every_channel_of_the_range(channels, api, core, fake_gpus):
    ns, node = channels.namespace, fake_gpus.node
    make_domain(api, ns, "all", "all-channels", mode="All")
    wait_until(lambda: template(api, ns, "all-channels"), 30, "the cluster agent's channel template")
    core.create_namespaced_pod(ns, workload_pod("all", node, [("channel", {"resourceClaimTemplateName": "all-channels"})]))
    try:
        text = wait_until(lambda: output(core, ns, "all"), 120, "the workload's output")
        print("\n" + text)
        assert "channels: 2048" in text
        for n in (0, 222, 2047):
            assert f" channel{n}\n" in text, n
    finally:
        delete_pod_and_wait(core, ns, "all")
        delete_domain(api, ns, "all")


def test_a_channel_claim_from_another_namespace_is_refused_for_good(channels, api, core, namespace, fake_gpus):
    ns, node = channels.namespace, fake_gpus.node
    make_domain(api, ns, "theirs", "theirs-channel")
    made = wait_until(lambda: template(api, ns, "theirs-channel"), 30, "the cluster agent's channel template")
    # the template's claim spec, copied by hand into another namespace
    client.ResourceV1Api(api).create_namespaced_resource_claim(namespace, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "borrowed"},
        "spec": made["spec"]["spec"]})
    core.create_namespaced_pod(namespace, workload_pod("borrower", node, [("channel", {"resourceClaimName": "borrowed"})]))
    try:
        messages = wait_until(lambda: failed_prepare(core, namespace, "borrower"), 30, "a FailedPrepareDynamicResources event")
        print(f"\n{messages[0]}")
        assert "permanent error" in messages[0] and "serves only claims of its own namespace" in messages[0]
        assert core.read_namespaced_pod("borrower", namespace).status.phase == "Pending"
    finally:
        delete_pod_and_wait(core, namespace, "borrower")
        delete_domain(api, ns, "theirs")


def test_a_deleted_domain_takes_its_channel_template_with_it(channels, api, core):
    ns = channels.namespace
    make_domain(api, ns, "brief", "brief-channel")
    wait_until(lambda: template(api, ns, "brief-channel"), 30, "the cluster agent's channel template")
    delete_domain(api, ns, "brief")
    started = time.monotonic()
    wait_until(lambda: template(api, ns, "brief-channel") is None, 60, "the template gone with its domain")
    print(f"\nthe template went {time.monotonic() - started:.1f}s after its domain")
