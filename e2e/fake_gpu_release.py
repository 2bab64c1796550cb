"""charts/fake-gpu installed once for a cluster: one device plugin per node, shared by every e2e process.

The suite's `fake_gpus` fixture installs it for its session unless E2E_FAKE_GPU_NAMESPACE names a namespace where
it is installed already: ci/scripts/e2e.sh installs it once (`python -m e2e.fake_gpu_release up`) for the serial
and the parallel phase of the suite alike, since two releases of fake-gpu would both register nvidia.com/gpu on
every node, and removes it at the end (`down NAMESPACE`), which checks that its post-delete hook took its node
labels away."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import pyhelm3
from kubernetes import client, config

from e2e.cluster import host_paths, tool
from e2e.helpers import wait_until

CHART = Path(__file__).resolve().parent.parent / "charts" / "fake-gpu"
RELEASE = "fg"


def install(kubeconfig: Path, core: client.CoreV1Api, apps: client.AppsV1Api) -> str:
    """Install the release in a namespace of its own; the namespace, once every node the plugin runs on is labelled."""
    ns = f"e2e-fake-gpu-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    helm = pyhelm3.Client(executable=tool("helm"), kubeconfig=kubeconfig)
    values = {**host_paths(), "image": {"repository": "localhost/gpu-agent", "tag": "dev", "pullPolicy": "Never"},
              "maxCount": 16, "logVerbosity": 2,
              # a value set on every node (the legacy DRA test's devicePlugin.enabled) rolls out at once, not node by
              # node: five nodes one after another took most of that serial test's two minutes
              "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}}

    async def run() -> None:
        chart = await helm.get_chart(str(CHART))
        await helm.install_or_upgrade_release(RELEASE, chart, values, namespace=ns, wait=True, timeout="90s")

    asyncio.run(run())
    labelled(core, apps, ns)
    return ns


def labelled(core: client.CoreV1Api, apps: client.AppsV1Api, ns: str) -> list[str]:
    """The nodes the plugin runs on, sorted, once its DaemonSet is ready and each of them is labelled as GPU feature
    discovery would (the gpu-agent chart's node agents find them by it). Every node on the CI cluster; on kind the
    control-plane node is tainted, so the workers."""
    ds = wait_until(lambda: (lambda d: d if d.status.number_ready == d.status.desired_number_scheduled >= 1 else None)(
        apps.read_namespaced_daemon_set(f"{RELEASE}-fake-gpu", ns)), 60, "fake-gpu DaemonSet ready")
    every = ds.status.desired_number_scheduled
    nodes = wait_until(lambda: (lambda n: n if len(n) == every else None)(fake_gpu_nodes(core, RELEASE)), 30,
                       f"all {every} node(s) running the fake-gpu plugin labelled by it")
    return sorted(n.metadata.name for n in nodes)


def uninstall(kubeconfig: Path, core: client.CoreV1Api, ns: str) -> None:
    helm = pyhelm3.Client(executable=tool("helm"), kubeconfig=kubeconfig)
    asyncio.run(helm.uninstall_release(RELEASE, namespace=ns, wait=True))
    core.delete_namespace(ns)
    left = {n.metadata.name: {k: v for k, v in (n.metadata.labels or {}).items() if k.startswith("nvidia.com/gpu.")}
            for n in fake_gpu_nodes(core, RELEASE)}
    assert not left, f"helm uninstall of fake-gpu left its node labels (the post-delete hook did not run?): {left}"


def fake_gpu_nodes(core: client.CoreV1Api, release: str) -> list:
    """Nodes carrying a fake-gpu release's labels, present=true among them."""
    return [n for n in core.list_node(label_selector=f"gpu-agent.io/fake-gpu-release={release}").items
            if (n.metadata.labels or {}).get("nvidia.com/gpu.present") == "true"]


def main(argv: list[str]) -> int:
    """up KUBECONFIG: install, print the namespace. down KUBECONFIG NAMESPACE: uninstall and check the labels went."""
    if len(argv) < 2 or argv[0] not in ("up", "down") or (argv[0] == "down") != (len(argv) == 3):
        print("usage: python -m e2e.fake_gpu_release up KUBECONFIG | down KUBECONFIG NAMESPACE", file=sys.stderr)
        return 2
    kubeconfig = Path(argv[1])
    api = config.new_client_from_config(str(kubeconfig))
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    if argv[0] == "up":
        print(install(kubeconfig, core, apps))
    else:
        uninstall(kubeconfig, core, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
