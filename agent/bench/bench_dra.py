"""Benchmark (printed, not asserted): one-GPU pods through DRA against the device plugin, on the same cluster in
the same run, and a GPU's arrival to its device in the node's ResourceSlice.

Installs charts/fake-gpu (its device plugin on) and charts/gpu-agent with dra.enabled in a namespace of its own,
then on one node, one pod at a time (so the two ways never hold the same fake GPU at once):
- BENCH_PODS pods (default 20) claiming one GPU from a ResourceClaimTemplate of the chart's DeviceClass, and as
  many asking `nvidia.com/gpu: 1` of the device plugin: create -> Running each (the scheduler, the claim's
  allocation and the plugin's prepare, or the device plugin's Allocate), then delete and wait until it is gone;
- BENCH_ARRIVALS times (default 10): the node's fake GPUs set 0 -> 2 (the layout write) -> 2 devices in its slice.

    make bench-dra   (brings the CI cluster up and builds the images)
    KUBECONFIG=...   (default: the CI cluster's)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from typing import Any

from bench_footprint import KUBECONFIG, REPO, STATE_DIR, run, tear_down, tool
from kubernetes import client, config
from tests.integration.harness import wait_until

PODS = int(os.environ.get("BENCH_PODS", "20"))
ARRIVALS = int(os.environ.get("BENCH_ARRIVALS", "10"))
DRIVER = CLASS = "gpu.gpu-agent.io"
IMAGE = "localhost/gpu-agent:dev"


def pod_body(name: str, node: str, dra: bool) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "cuda", "image": IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "300"]}
    spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                            "nodeSelector": {"kubernetes.io/hostname": node}, "containers": [container]}
    if dra:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    else:
        container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def create_to_running(core: client.CoreV1Api, ns: str, node: str, dra: bool, count: int) -> list[float]:
    took = []
    for i in range(count):
        name = f"{'dra' if dra else 'dp'}-{i}"
        started = time.monotonic()
        core.create_namespaced_pod(ns, pod_body(name, node, dra), _request_timeout=10)
        wait_until(lambda name=name: core.read_namespaced_pod(name, ns, _request_timeout=10).status.phase == "Running", 120,
             f"pod {name} Running")
        took.append(time.monotonic() - started)
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0, _request_timeout=10)
        wait_until(lambda name=name: not core.list_namespaced_pod(ns, field_selector=f"metadata.name={name}",
                                                            _request_timeout=10).items,
             120, f"pod {name} gone")
    return took


def devices_in_slice(resource: client.ResourceV1Api, node: str) -> int:
    slices = resource.list_resource_slice(field_selector=f"spec.nodeName={node},spec.driver={DRIVER}", _request_timeout=10)
    return sum(len(s.spec.devices or []) for s in slices.items)


def arrivals(resource: client.ResourceV1Api, ns: str, node: str, count: int) -> list[float]:
    from fake_gpu.cluster import ClusterLayout
    from fake_gpu.layout import DEFAULT_MEMORY_MIB, DEFAULT_PRODUCT

    layout = ClusterLayout(ns, KUBECONFIG, "fg")
    took = []
    for _ in range(count):
        layout.set(node, 0, DEFAULT_PRODUCT, DEFAULT_MEMORY_MIB)
        wait_until(lambda: devices_in_slice(resource, node) == 0, 30, "an empty slice")
        started = time.monotonic()  # just before the layout write: the figure is an upper bound
        layout.set(node, 2, DEFAULT_PRODUCT, DEFAULT_MEMORY_MIB)
        wait_until(lambda: devices_in_slice(resource, node) == 2, 30, "2 devices in the slice", interval=0.01)
        took.append(time.monotonic() - started)
    return took


def figures(took: list[float]) -> str:
    ordered = sorted(took)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"median {statistics.median(ordered):6.2f} s   p99 {p99:6.2f} s   (n={len(ordered)}, min {ordered[0]:.2f}, max {ordered[-1]:.2f})"


def main() -> int:
    ns = f"bench-dra-{uuid.uuid4().hex[:5]}"
    helm = [tool("helm"), "--kubeconfig", KUBECONFIG, "-n", ns]
    api = config.new_client_from_config(config_file=KUBECONFIG)
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    node = core.list_node(_request_timeout=10).items[0].metadata.name
    core.create_namespace({"metadata": {"name": ns}}, _request_timeout=10)
    try:
        run(*helm, "install", "fg", str(REPO / "charts" / "fake-gpu"), "--set", "image.tag=dev",
            "--set", "image.pullPolicy=Never", "--set", f"stateDir={STATE_DIR}", "--set", "defaultCount=2",
            "--wait", "--timeout", "120s")
        run(*helm, "install", "ga", str(REPO / "charts" / "gpu-agent"), "--set", "image.tag=dev",
            "--set", "image.pullPolicy=Never", "--set", "controlPlane.enabled=true", "--set", "nodeAgent.gpuSource=fake",
            "--set", f"nodeAgent.fakeGpuStateDir={STATE_DIR}", "--set", "dra.enabled=true",
            # the cluster agent counts the devices this release's node agents publish, maybe after its first look
            "--set", "gracefulNoGPU=true", "--wait", "--timeout", "180s")
        resource.create_namespaced_resource_claim_template(ns, {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one-gpu"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}}}},
            _request_timeout=10)
        wait_until(lambda: devices_in_slice(resource, node) == 2, 60, "2 devices in the slice")
        dra = create_to_running(core, ns, node, True, PODS)
        plugin = create_to_running(core, ns, node, False, PODS)
        arrived = arrivals(resource, ns, node, ARRIVALS)
    finally:
        tear_down(helm, ns)
    print(f"one-GPU pod create -> Running on {node}, one at a time, the same cluster and run:")
    print(f"  through DRA (claim template)   {figures(dra)}")
    print(f"  through the device plugin      {figures(plugin)}")
    print(f"fake GPUs 0 -> 2 on {node} -> 2 devices in its ResourceSlice: {figures(arrived)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
