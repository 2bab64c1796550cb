"""Large inventories on a real cluster (issue 45): the chart's control plane, in its own pod (read-only root
filesystem, no writable /tmp), takes a registration of 16,384 GPUs and refuses one GPU more and a body over its
limit, naming the limit; and the cluster agent of a 20,000-GPU cluster (fake GPUs at up to fake-gpu's per-node
maximum on every node) becomes Ready, the control plane recording the whole count and the first 16,384 listed.

Before, registrations of 4,000 GPUs and more got a reset connection in the chart's pod (waitress spilled the body
to a temporary file there was no folder for), and the agent reported "connection failed" and retried forever.
The evidence is the control plane's own answers and record, read from inside its pod, and the agent's /healthz
through the API server's proxy.
"""

from __future__ import annotations

import json
import math

import pytest

from e2e.fake_gpu_release import RELEASE, fake_gpu_nodes
from e2e.helpers import wait_until
from e2e.release import Release
from fake_gpu.layout_source import MAX_COUNT

REGISTRATIONS = 20  # each on whichever of the control plane's workers is free (its memory must not climb with them)
CLUSTER_GPUS = 20_000

# Run in the control plane's pod after release.CONTROL_PLANE_PRELUDE (a client `c`, the admin token `t`).
LARGE_REGISTRATIONS = """
import json, requests
from gpu_agent.foundations.control_plane_client import TooLarge
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.mechanisms.inventory.cluster import NodeGPUs, inventory_of
from gpu_agent.roles.control_plane import api
reg = Secret(open('/var/run/secrets/gpu-agent/registrationToken').read().strip())
out = {}
def cluster(n):  # as the cluster agent registers them: 197 bytes a GPU with node names this long
    return inventory_of({f"gke-prod-gpu-cluster-a3-highgpu-pool-1a2b3c4d-x{k:03d}": NodeGPUs(min(1024, n - k * 1024),
                         min(1024, n - k * 1024)) for k in range(-(-n // 1024))})
full = cluster(api.MAX_GPUS)
for generation in range(REGISTRATIONS):
    c.register(reg, "e2e-large", generation, full)
out["status"] = [r for r in c.status(t)["registrations"] if r["clusterId"] == "e2e-large"]
try:
    c.register(reg, "e2e-large", 100, cluster(api.MAX_GPUS + 1))
    out["one_more"] = "accepted"
except TooLarge as e:
    out["one_more"] = [e.status, str(e)]
body = b'{"clusterId": "e2e-large", "generation": 1, "padding": "' + b"x" * api.MAX_BODY + b'"}'
r = requests.post(url + "/v1/register", data=body, timeout=60, verify=ca or True,
                  headers={"Authorization": "Bearer " + reg.reveal(), "Content-Type": "application/json"})
out["oversized"] = [r.status_code, r.headers.get("Content-Type"), r.text[:600], len(body)]
out["limits"] = [api.MAX_GPUS, api.MAX_BODY]
out["peak_rss_mib"] = int(open("/proc/1/status").read().split("VmHWM:")[1].split()[0]) // 1024
print("RESULT " + json.dumps(out))
"""


@pytest.fixture
def release(api, core, apps, kubeconfig, namespace, fake_gpus):
    r = Release(api, core, apps, kubeconfig, namespace)
    yield r
    r.uninstall_if_installed()


def test_the_charts_control_plane_takes_16384_gpus_and_refuses_one_more_and_an_oversized_body_naming_the_limits(release):
    release.install("--set", "gracefulNoGPU=true")  # whatever GPUs the last test left (maybe none): the agent waits
    out = release.control_plane(f"REGISTRATIONS = {REGISTRATIONS}\n" + LARGE_REGISTRATIONS)
    result = json.loads(out.split("RESULT ", 1)[1])
    max_gpus, max_body = result["limits"]
    assert max_gpus == 16384
    (reg,) = result["status"]
    assert (reg["gpuCount"], reg["gpusListed"], reg["generation"], reg["registrations"]) == (
        16384, 16384, REGISTRATIONS - 1, REGISTRATIONS), reg
    status, message = result["one_more"]
    assert status == 422 and "field 'gpus': 16385 items, more than the 16384" in message and "gpuCount" in message, message
    code, content_type, text, sent = result["oversized"]
    assert code == 413 and content_type == "application/json", (code, content_type, text)
    assert f"the request body of {sent} bytes is over this server's limit of {max_body} bytes" in json.loads(text)["error"]
    # The chart's limit is 192 MiB: the control plane stays well inside it however many registrations came.
    assert result["peak_rss_mib"] < 160, result["peak_rss_mib"]
    pod = release.core.read_namespaced_pod(release.control_plane_pod(), release.namespace)
    assert all(s.restart_count == 0 for s in pod.status.container_statuses), "the control plane restarted (OOMKilled?)"
    log = release.core.read_namespaced_pod_log(pod.metadata.name, release.namespace)
    assert "Traceback" not in log and "cluster e2e-large registered 16384 GPUs" in log


@pytest.mark.multinode
@pytest.mark.serial(reason="sets GPUs on every node and raises the shared fake-gpu release's maxCount")
def test_a_cluster_of_20000_fake_gpus_registers_the_first_16384_with_the_whole_count_and_is_ready(
        release, core, fake_gpus):
    nodes = sorted(n.metadata.name for n in fake_gpu_nodes(core, RELEASE))
    per_node = math.ceil(CLUSTER_GPUS / len(nodes))
    if per_node > MAX_COUNT:
        pytest.skip(f"{CLUSTER_GPUS} fake GPUs need {math.ceil(CLUSTER_GPUS / MAX_COUNT)} nodes at fake-gpu's maximum of "
                    f"{MAX_COUNT} a node; the cluster has {len(nodes)} (make cluster-up NODES=3)")
    layout = core.read_namespaced_config_map(fake_gpus.layout_configmap, fake_gpus.namespace)
    before = (layout.data or {}).get("maxCount", "16")
    core.patch_namespaced_config_map(fake_gpus.layout_configmap, fake_gpus.namespace, {"data": {"maxCount": str(MAX_COUNT)}})
    counts = {node: min(per_node, CLUSTER_GPUS - i * per_node) for i, node in enumerate(nodes)}
    try:
        for node, count in counts.items():
            fake_gpus.set(count, timeout=120, node=node)  # kubelet takes the device list through ListAndWatch
        assert sum(fake_gpus.allocatable(node) for node in nodes) == CLUSTER_GPUS
        release.install()

        def registered():
            code, body = release.healthz()
            return body if code == 200 else None
        health = wait_until(registered, 180, f"the cluster agent Ready with {CLUSTER_GPUS} GPUs")
        reason = health["components"]["registration"]["reason"]
        assert f"{CLUSTER_GPUS} GPUs, the first 16384 listed" in reason, reason
        assert health["components"]["gpus"]["details"]["count"] == CLUSTER_GPUS
        out = release.control_plane("import json; print('RESULT ' + json.dumps(c.status(t)['registrations']))")
        (reg,) = json.loads(out.split("RESULT ", 1)[1])
        assert (reg["gpuCount"], reg["gpusListed"]) == (CLUSTER_GPUS, 16384), reg
    finally:  # the shared release's maxCount back even if a count fails to go back (later tests set counts over it)
        try:
            for node in counts:
                fake_gpus.set(0, timeout=120, node=node)
        finally:
            core.patch_namespaced_config_map(fake_gpus.layout_configmap, fake_gpus.namespace,
                                             {"data": {"maxCount": before}})
