"""fake-gpu cannot take over a real GPU node (issue 48, part 3), on a real cluster.

The CI cluster has no real GPUs, so another device plugin's resource is stood in for the way Kubernetes documents
advertising a node-level extended resource: a PATCH of the Node's status, capacity and allocatable of
`e2e.example.com/real-gpu: 2`. A second fake-gpu release for that resource name, on that node alone, with its own
state folder and no device plugin (its socket name is the session release's: a second plugin would replace the
session's socket on the node) must refuse: its pod not Ready but alive (no restarts past the liveness window), the
readiness probe's message naming the node, a FakeGpuRefused Warning Event on the Node in namespace default, and no
labels or claim annotation on the node. Upgraded with allowRealGpuNodes=true it proceeds (Ready, labels, the claim);
upgraded back to false its new pod finds its own claim and proceeds; uninstalled, its hook takes labels and claim off.
Not covered here: /dev/nvidia0 or /proc/driver/nvidia/gpus on a real GPU node (needs GPU hardware)."""

from __future__ import annotations

import datetime
import time
import uuid

from kubernetes import client

from e2e.cluster import host_paths
from e2e.fake_gpu_release import CHART as FAKE_GPU_CHART
from e2e.helpers import wait_until
from e2e.release import helm
from fake_gpu.node_labels import RELEASE as RELEASE_LABEL
from fake_gpu.real_gpu_guard import owner_annotation

RESOURCE = "e2e.example.com/real-gpu"
OWNER_ANNOTATION = owner_annotation(RESOURCE)  # per resource: the suite's own release claims nvidia.com/gpu here
RELEASE = "fg-real"
# The chart's liveness probe: 10 s initial delay, then 6 failures 10 s apart; a refused pod must outlive it.
LIVENESS_WINDOW = 10 + 6 * 10 + 10


def set_other_plugins_resource(core: client.CoreV1Api, node: str, count: int | None) -> None:
    value = None if count is None else str(count)
    core.patch_node_status(node, {"status": {"capacity": {RESOURCE: value}, "allocatable": {RESOURCE: value}}})


def release_pod(core: client.CoreV1Api, ns: str, node: str):
    pods = [p for p in core.list_namespaced_pod(ns, label_selector=f"app.kubernetes.io/instance={RELEASE}").items
            if p.spec.node_name == node and p.metadata.deletion_timestamp is None]
    return pods[0] if len(pods) == 1 else None


def ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def test_fake_gpu_refuses_a_node_another_plugin_advertises_on_until_overridden(fake_gpus, core, kubeconfig):
    node = fake_gpus.node
    ns = f"e2e-fake-gpu-real-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    values = ["--set", f"resourceName={RESOURCE}", "--set", "devicePlugin.enabled=false", "--set", "defaultCount=1",
              "--set", f"stateDir={host_paths()['stateDir']}-{RELEASE}", "--set", "image.repository=localhost/gpu-agent",
              "--set", "image.tag=dev", "--set", "image.pullPolicy=Never",
              "--set-string", f"nodeSelector.kubernetes\\.io/hostname={node}"]

    def install(allow: bool) -> None:
        helm("upgrade", "--install", RELEASE, str(FAKE_GPU_CHART), "--kubeconfig", str(kubeconfig), "-n", ns, *values,
             "--set", f"allowRealGpuNodes={str(allow).lower()}")

    # One release label per node: this release's takes the suite release's place while it runs, and its post-delete
    # hook takes it off; the suite's own is put back after, or the next test's fake_gpus check finds the node unlabelled.
    suite_release = (core.read_node(node).metadata.labels or {}).get(RELEASE_LABEL)
    set_other_plugins_resource(core, node, 2)
    started = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    try:
        install(allow=False)
        pod = wait_until(lambda: release_pod(core, ns, node), 60, "the refusing release's pod")
        def seen(e) -> datetime.datetime:
            return max(t for t in (e.event_time, e.series.last_observed_time if e.series else None,
                                   e.metadata.creation_timestamp) if t is not None)

        # Posted (or its series counted again) by this release's pod: one from an earlier run may still be there.
        event = wait_until(lambda: next((e for e in client.EventsV1Api(core.api_client).list_namespaced_event(
            "default", field_selector=f"regarding.name={node},reason=FakeGpuRefused").items if seen(e) >= started),
            None), 60, "a FakeGpuRefused Event on the node")
        assert event.type == "Warning" and event.regarding.kind == "Node"
        assert f"node {node}" in event.note and RESOURCE in event.note and "allowRealGpuNodes" in event.note
        probe = wait_until(lambda: next((e.message for e in core.list_namespaced_event(
            ns, field_selector=f"involvedObject.name={pod.metadata.name},reason=Unhealthy").items
            if "refuses node" in (e.message or "")), None), 60, "the readiness probe saying why")
        assert "Readiness probe failed" in probe
        # Alive and idle, not crash-looping: through the liveness window, the one container run, never Ready.
        until = time.monotonic() + LIVENESS_WINDOW

        def outlived_liveness() -> bool:
            now = core.read_namespaced_pod(pod.metadata.name, ns)
            assert not ready(now) and now.status.container_statuses[0].restart_count == 0, now.status
            return time.monotonic() > until

        wait_until(outlived_liveness, LIVENESS_WINDOW + 30, "the liveness window to pass", interval=5)
        meta = core.read_node(node).metadata
        assert OWNER_ANNOTATION not in (meta.annotations or {})
        assert not [k for k in meta.labels or {} if k.startswith(RESOURCE + ".")]
        assert core.read_node(node).status.capacity.get(RESOURCE) == "2"  # the other plugin's, untouched

        install(allow=True)  # deliberately: proceeds, claims and labels
        wait_until(lambda: (lambda p: p if p and ready(p) else None)(release_pod(core, ns, node)), 90,
                   "the overridden pod Ready")
        meta = core.read_node(node).metadata
        assert (meta.annotations or {}).get(OWNER_ANNOTATION) == RESOURCE
        assert meta.labels.get(f"{RESOURCE}.present") == "true"

        install(allow=False)  # its own claim: a new pod is not refused by the capacity it finds
        wait_until(lambda: (lambda p: p if p and ready(p) else None)(release_pod(core, ns, node)), 90,
                   "the pod Ready again on the node it claimed")
    finally:
        helm("uninstall", RELEASE, "--kubeconfig", str(kubeconfig), "-n", ns, "--wait", check=False)
        set_other_plugins_resource(core, node, None)
        core.delete_namespace(ns)
        after = (core.read_node(node).metadata.labels or {}).get(RELEASE_LABEL)
        if suite_release:
            core.patch_node(node, {"metadata": {"labels": {RELEASE_LABEL: suite_release}}})
    meta = core.read_node(node).metadata
    assert after is None, f"the post-delete hook left its release label ({after})"
    assert OWNER_ANNOTATION not in (meta.annotations or {}), "the post-delete hook left fake-gpu's claim"
    assert not [k for k in meta.labels or {} if k.startswith(RESOURCE + ".")], "the post-delete hook left labels"
