"""Large inventories against the real control plane process, with no temporary folder (issue 45).

The chart's control plane pod has a read-only root filesystem and no /tmp volume. waitress used to
spill a request body over 512 KiB to a temporary file, which failed there: registrations of 4,000
GPUs and more got a reset connection, and the agent retried them forever as "connection failed".
Here the process cannot make a temporary file either (harness.NO_TEMP_DIR), and real HTTP carries
a registration of api.MAX_GPUS GPUs (accepted), one more (refused, naming the field and the limit)
and a body over api.MAX_BODY (413, naming the limit in bytes).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from gpu_agent.foundations.control_plane_client import ControlPlaneClient, TooLarge
from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.mechanisms.inventory.cluster import NodeGPUs, inventory_of
from gpu_agent.roles.control_plane import api
from tests.integration.harness import Rig


@pytest.fixture
def chart_like(tmp_path):
    rig = Rig(tmp_path)
    client = rig.start_control_plane(no_temp_dir=True)
    yield rig, client
    rig.stop()


def cluster_inventory(gpus: int) -> Inventory:
    """What the cluster agent registers for device-plugin nodes of 1,024 GPUs with GKE-length names
    (197 bytes a GPU on the wire: the longest realistic registration measured, see api.MAX_BODY)."""
    nodes = {f"gke-prod-gpu-cluster-a3-highgpu-pool-1a2b3c4d-x{k:03d}": NodeGPUs(min(1024, gpus - k * 1024), min(1024, gpus - k * 1024))
             for k in range(-(-gpus // 1024))}
    return inventory_of(nodes)


def longest_fields_inventory(gpus: int) -> Inventory:
    """Every field as long as the API allows: the registration MAX_BODY is sized for."""
    return Inventory(tuple(GPU(f"GPU-{i:0124x}", "N" * 256, 2**63 - 1, index=(1 << 20) - 1 - i) for i in range(gpus)))


def body_bytes(inventory: Inventory) -> int:
    return len(json.dumps({"clusterId": "big", "generation": 7, "gpus": inventory.to_json()}).encode())


def registrations(rig: Rig, client: ControlPlaneClient) -> dict[str, dict[str, int]]:
    return {r["clusterId"]: r for r in client.status(rig.admin_token)["registrations"]}


@pytest.mark.parametrize("build", [cluster_inventory, longest_fields_inventory], ids=["realistic", "longest-fields"])
def test_a_registration_of_max_gpus_is_accepted_without_a_temporary_folder(chart_like, build):
    rig, client = chart_like
    inventory = build(api.MAX_GPUS)
    assert inventory.count == 16384 and body_bytes(inventory) > 3_000_000  # 6 times waitress's 512 KiB spill point
    assert body_bytes(inventory) <= api.MAX_BODY
    client.register(rig.registration_token, "big", 7, inventory)
    reg = registrations(rig, client)["big"]
    assert (reg["gpuCount"], reg["gpusListed"], reg["generation"]) == (16384, 16384, 7)
    assert not rig.cp.grep("Traceback|ERROR|^E"), rig.cp.lines()[-20:]


def test_a_registration_of_one_gpu_more_is_refused_naming_the_field_and_the_limit(chart_like):
    rig, client = chart_like
    with pytest.raises(TooLarge) as refused:
        client.register(rig.registration_token, "big", 7, cluster_inventory(api.MAX_GPUS + 1))
    assert refused.value.status == 422, refused.value
    message = str(refused.value)
    assert "field 'gpus': 16385 items, more than the 16384" in message and "gpuCount" in message, message
    assert "big" not in registrations(rig, client)
    # The agent's way: the first 16,384 listed and the whole count given; the control plane shows both.
    inventory = cluster_inventory(api.MAX_GPUS + 1)
    client.register(rig.registration_token, "big", 8, Inventory(inventory.gpus[:api.MAX_GPUS]), inventory.count)
    reg = registrations(rig, client)["big"]
    assert (reg["gpuCount"], reg["gpusListed"]) == (16385, 16384)


def test_a_body_over_the_limit_is_refused_with_413_naming_the_limit_and_one_at_it_is_read(chart_like):
    rig, _ = chart_like
    headers = {"Authorization": f"Bearer {rig.registration_token.reveal()}", "Content-Type": "application/json"}

    def post(size: int) -> requests.Response:
        prefix = b'{"clusterId": "big", "generation": 1, "padding": "'
        body = prefix + b"x" * (size - len(prefix) - 2) + b'"}'
        assert len(body) == size
        return requests.post(rig.cp_url + "/v1/register", data=body, headers=headers, timeout=30)

    over = post(api.MAX_BODY + 1)
    assert over.status_code == 413, over.text[:300]
    error = over.json()["error"]
    assert f"the request body of {api.MAX_BODY + 1} bytes is over this server's limit of {api.MAX_BODY} bytes" in error
    assert f"lists at most {api.MAX_GPUS} GPUs" in error and "gpuCount" in error, error
    at = post(api.MAX_BODY)  # read whole, then refused for what it holds (no gpus), not for its size
    assert at.status_code == 422 and "field 'gpus'" in at.json()["error"], at.text[:300]
    assert requests.get(rig.cp_url + "/healthz", timeout=5).status_code == 200
    assert not rig.cp.grep("Traceback"), rig.cp.lines()[-20:]


def peak_rss_mib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) // 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's peak RSS from /proc")
def test_repeated_registrations_of_max_gpus_stay_well_inside_the_charts_memory_limit(chart_like):
    """Each registration lands on whichever of the 16 workers is free; with glibc's default malloc arenas each
    worker kept its own peak and the control plane climbed to 179-220 MiB over 20 of these (the chart's limit is
    192 MiB, and agents re-register every minute). With one arena it stays near 90 MiB."""
    rig, client = chart_like
    inventory = cluster_inventory(api.MAX_GPUS)
    for generation in range(20):
        client.register(rig.registration_token, "big", generation, inventory)
    peak = peak_rss_mib(rig.cp.pid)
    print(f"\ncontrol plane peak RSS over 20 registrations of {api.MAX_GPUS} GPUs: {peak} MiB")
    assert peak < 140, f"peak RSS {peak} MiB"
