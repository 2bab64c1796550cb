"""The DRA bats suite's "basics" group: one release installed with pyhelm3 at -v 6 (the "GPU basic"
verbosity) in a namespace of its own, checked from every side a platform team would look at."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import tarfile
import uuid

import pyhelm3
import pytest
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from e2e import cluster
from e2e.cluster import host_paths, tool
from e2e.helpers import exec_in, exec_python, pod_http_get, pod_log, wait_until
from e2e.release import CHART, Release

pytestmark = pytest.mark.serial(reason="the bats helper's install looks cluster-wide for the chart's pods and takes values of its own, not the worker's node")

APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
IMAGE = "localhost/gpu-agent:dev"


@pytest.fixture(scope="module")
def installed(api, core, apps, kubeconfig, fake_gpus):
    """Install as the bats helper does: helm without --wait, then explicit waits per component."""
    ns = f"e2e-basics-{uuid.uuid4().hex[:5]}"
    name = f"b{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, labels={"e2e": "true"})))
    # The bats suite looks cluster-wide: any pod of the chart, whatever its release, before ours exists.
    before = [f"{p.metadata.namespace}/{p.metadata.name}" for p in
              core.list_pod_for_all_namespaces(label_selector="app.kubernetes.io/name=gpu-agent").items]
    fake_gpus.set(2)
    helm = pyhelm3.Client(executable=tool("helm"), kubeconfig=kubeconfig)
    values = {"image": {"tag": "dev", "pullPolicy": "Never"}, "logVerbosity": 6, "gracefulNoGPU": True,
              "controlPlane": {"enabled": True},
              "nodeAgent": {"gpuSource": "fake", "fakeGpuStateDir": host_paths()["stateDir"]}}

    async def install():
        chart = await helm.get_chart(str(CHART))
        return await helm.install_or_upgrade_release(name, chart, values, namespace=ns, wait=False, timeout="120s")

    revision = asyncio.run(install())
    release = Release(api, core, apps, kubeconfig, ns, name=name)
    wait_until(release.all_running, 90, "every release pod Running")
    for component in ("cluster-agent", "node-agent", "control-plane"):
        wait_until(lambda c=component: all(cs.ready for p in release.pods(f"app.kubernetes.io/component={c}")
                                           for cs in p.status.container_statuses or []) and release.pods(
            f"app.kubernetes.io/component={c}"), 90, f"{component} pods Ready")
    yield release, before, revision
    asyncio.run(helm.uninstall_release(name, namespace=ns, wait=True))
    core.delete_namespace(ns)
    fake_gpus.set(0)


@pytest.mark.fast
def test_no_agent_pods_before_install_and_every_component_ready_after(installed):
    release, before, revision = installed
    assert before == [], f"pods of the gpu-agent chart existed before the install: {before}"
    assert release.pods(f"app.kubernetes.io/instance={release.name}"), "and the release's pods exist after it"
    assert revision.status.value == "deployed"
    for component in ("cluster-agent", "node-agent", "control-plane"):
        pods = release.pods(f"app.kubernetes.io/component={component}")
        assert pods and all(c.ready and c.restart_count == 0 for p in pods for c in p.status.container_statuses), component


@pytest.mark.fast
def test_helm_list_shows_exactly_one_release_with_the_app_version(installed):
    release, _, _ = installed
    out = subprocess.run([tool("helm"), "--kubeconfig", release.kubeconfig, "-n", release.namespace, "list", "-o", "json"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    releases = json.loads(out)
    assert [(r["name"], r["app_version"], r["status"]) for r in releases] == [(release.name, APP_VERSION, "deployed")]


@pytest.mark.fast
def test_both_crds_exist_and_are_established(installed, api):
    ext = client.ApiextensionsV1Api(api)
    for name in ("gpudomains.gpu-agent.io", "gpudomainmembers.gpu-agent.io"):
        crd = ext.read_custom_resource_definition(name)
        assert any(c.type == "Established" and c.status == "True" for c in crd.status.conditions), name


def test_container_images_are_what_the_values_say(installed):
    release, _, _ = installed
    for p in release.pods(f"app.kubernetes.io/instance={release.name}"):
        for c in p.spec.containers:
            assert (c.image, c.image_pull_policy) == (IMAGE, "Never"), (p.metadata.name, c.image)


def test_version_agrees_across_cli_endpoint_image_labels_and_chart(installed):
    release, _, _ = installed
    cli = subprocess.run([sys.executable, "-m", "gpu_agent", "--version"], capture_output=True, text=True, check=True).stdout
    m = re.fullmatch(r"gpu-agent (\S+) \(commit ([0-9a-f]{12})(-dirty)?, built (\S+)\)\n", cli)
    assert m, cli
    version, commit = m.group(1), m.group(2)
    code, served = pod_http_get(release.core, release.namespace, release.agent_pod(), 8080, "version")
    assert code == 200
    assert served["version"] == version == APP_VERSION
    assert re.fullmatch(r"[0-9a-f]{12}", served["commit"]), served
    if cluster.provider() == "ci":  # the suite built this image from this checkout
        assert served["commit"] == commit, "the image was built from another commit: run `make images`"
    assert re.match(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$", served["buildDate"]), served
    if cluster.provider() == "ci":  # the image archive this suite's `make images` wrote
        archive = cluster.CI_CACHE / "images" / "gpu-agent.oci.tar"
        with tarfile.open(archive) as tar:
            index = json.load(tar.extractfile("index.json"))
            manifest = json.load(tar.extractfile("blobs/sha256/" + index["manifests"][0]["digest"].split(":")[1]))
            config = json.load(tar.extractfile("blobs/sha256/" + manifest["config"]["digest"].split(":")[1]))
        labels = config["config"]["Labels"]
        assert labels["org.opencontainers.image.version"] == version
        assert labels["org.opencontainers.image.revision"] == commit
        assert labels["org.opencontainers.image.created"] == served["buildDate"]


def test_version_executed_in_every_running_container_agrees_with_the_chart_and_the_image(installed, fake_gpus):
    """NVCA's validation: `--version` executed in each running container (cluster agent, node agents on
    every node, control plane, and the fake-gpu device plugins), each the same line: the chart's appVersion
    and the commit and build date the image was stamped with (its /version)."""
    release, _, _ = installed
    code, served = pod_http_get(release.core, release.namespace, release.agent_pod(), 8080, "version")
    assert code == 200, served
    expected = f"{APP_VERSION} (commit {served['commit']}, built {served['buildDate']})"
    pods = [(p, "gpu-agent") for p in release.pods(f"app.kubernetes.io/instance={release.name}")]
    pods += [(p, "fake-gpu") for p in release.core.list_namespaced_pod(
        fake_gpus.namespace, label_selector="app.kubernetes.io/name=fake-gpu").items]
    seen = []
    for pod, command in pods:
        if pod.status.phase != "Running" or pod.metadata.deletion_timestamp is not None:
            continue
        for c in pod.spec.containers:
            out = exec_in(release.api, pod.metadata.namespace, pod.metadata.name, c.name, [command, "--version"]).strip()
            assert out == f"{command} {expected}", (pod.metadata.name, c.name, out)
            seen.append(f"{pod.metadata.name}/{c.name} ({pod.spec.node_name})")
    nodes = len(release.core.list_node().items)
    components = {p.metadata.labels.get("app.kubernetes.io/component") for p, command in pods if command == "gpu-agent"}
    assert components >= {"cluster-agent", "node-agent", "control-plane"}, components
    assert len([s for s in seen if "fake-gpu" in s]) == nodes, seen
    print(f"`--version` in {len(seen)} containers on {nodes} node(s): all '{expected}'")


def test_sigusr2_dumps_every_threads_stack_and_the_agent_keeps_running(installed):
    release, _, _ = installed
    pod = release.agent_pod()
    exec_python(release.api, release.namespace, pod, f"import os; os.kill(1, {int(signal.SIGUSR2)})")
    log = wait_until(lambda: (lambda t: "Current thread 0x" in t and t)(
        pod_log(release.core, release.namespace, pod)), 10, "a stack dump in the agent's log")
    assert len(re.findall(r"^(?:Thread|Current thread) 0x", log, re.M)) >= 3
    status = release.core.read_namespaced_pod(pod, release.namespace).status.container_statuses[0]
    assert status.restart_count == 0 and status.ready
    assert pod_http_get(release.core, release.namespace, pod, 8080, "livez")[0] == 200


def scrape(release: Release, service: str, port: int) -> str:
    """/metrics fetched in-cluster through the Service's DNS name, from the control plane's pod."""
    pod = release.pods("app.kubernetes.io/component=control-plane")[0].metadata.name
    code = ("import urllib.request; print(urllib.request.urlopen("
            f"'http://{release.fullname}-{service}.{release.namespace}.svc:{port}/metrics', timeout=10).read().decode())")
    return exec_python(release.api, release.namespace, pod, code)


def test_metrics_of_both_agents_are_served_in_cluster_through_their_services(installed, fake_gpus):
    release, _, _ = installed
    for service, port in (("cluster-agent", 8080), ("node-agent", 8081)):
        text = scrape(release, service, port)
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert "gpu_agent_gpus" in families, (service, sorted(families))
        assert "gpu_agent_gpu_drops" in families
        if service == "cluster-agent":  # the cluster's GPUs: the fixture gave the first node 2, the others have 0
            assert [s.value for s in families["gpu_agent_gpus"].samples] == [2.0], (service, families["gpu_agent_gpus"])
    # The Service answers from any node's agent: each node agent's own count is read from it, by pod.
    counts = {}
    for pod in release.pods("app.kubernetes.io/component=node-agent"):
        code, text = pod_http_get(release.core, release.namespace, pod.metadata.name, 8081, "metrics")
        assert code == 200, (pod.metadata.name, code)
        families = {f.name: f for f in text_string_to_metric_families(text)}
        counts[pod.spec.node_name] = [s.value for s in families["gpu_agent_gpus"].samples]
    expected = {node: [float(fake_gpus.allocatable(node))] for node in counts}
    assert counts == expected and counts[fake_gpus.node] == [2.0], (counts, expected)


def test_the_image_bytecode_is_current_so_no_module_is_compiled_at_start(installed):
    """Image layers are archived with every mtime set to 0, which made each timestamp-checked .pyc
    stale: every start compiled the kubernetes client again, in memory (+80 MiB RSS, seconds of
    CPU), unable to write the result back. The image's bytecode is checked by hash instead: for
    every module the agent loads, its .pyc exists and is valid without its source's mtime."""
    release, _, _ = installed
    out = exec_python(release.api, release.namespace, release.agent_pod(), (
        "import os, struct, sys\n"
        "import gpu_agent.cli, gpu_agent.roles.cluster_agent, kubernetes.client, kubernetes.watch\n"
        "kubernetes.client.CoreV1Api, kubernetes.client.CustomObjectsApi\n"
        "bad, n = [], 0\n"
        "for m in list(sys.modules.values()):\n"
        "    src, pyc = getattr(m, '__file__', None), getattr(m, '__cached__', None)\n"
        "    if not src or not pyc or not src.endswith('.py'): continue\n"
        "    n += 1\n"
        "    if not os.path.exists(pyc): bad.append('no .pyc: ' + src); continue\n"
        "    flags, mtime = struct.unpack('<II', open(pyc, 'rb').read(12)[4:12])\n"
        "    if flags == 0 and mtime != int(os.stat(src).st_mtime) & 0xFFFFFFFF: bad.append('stale: ' + src)\n"
        "status = open('/proc/1/status').read()\n"
        "rss = [l.split()[1] for l in status.splitlines() if l.startswith('VmRSS')][0]\n"
        "print(n, len(bad), rss); print(*bad[:10], sep='\\n')\n"))
    modules, bad, rss_kib = (int(x) for x in out.split("\n", 1)[0].split())
    print(f"{modules} modules checked; the cluster agent's RSS: {rss_kib / 1024:.1f} MiB")
    assert modules > 500 and bad == 0, out
