"""Which cluster the suite runs against: `E2E_CLUSTER` = ci | existing | kind | k3d.

  ci        the CI cluster from ci/ (`make -C ci cluster-up`); kubeconfig at its known path
  existing  whatever $KUBECONFIG (or ~/.kube/config) points at
  kind      a kind cluster through pytest-kind-ng (needs Docker; not available on CI machines)
  k3d       a k3d cluster through the k3d CLI (needs Docker; not available on CI machines)

Images: on `ci` they are imported into containerd by `make -C ci images`; on kind and k3d
they must be loaded with `kind load` / `k3d image import` of the same archive.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CI_KUBECONFIG = Path(os.environ.get("KUBECONFIG_PATH", "/var/lib/gpu-agent-ci/admin.kubeconfig"))
CI_TOOLS = Path(os.environ.get("CI_CACHE", "/var/cache/gpu-agent-ci")) / "tools"


def provider() -> str:
    value = os.environ.get("E2E_CLUSTER", "ci")
    if value not in ("ci", "existing", "kind", "k3d"):
        raise SystemExit(f"E2E_CLUSTER must be one of ci, existing, kind, k3d; got {value!r}")
    return value


def tool(name: str) -> str:
    """helm/kubectl: the CI cache's copies first, then PATH."""
    candidate = CI_TOOLS / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: run `make -C ci cluster-up` (it installs helm and kubectl) or put it on PATH")
    return found


def k3d_kubeconfig(name: str = "gpu-agent-e2e") -> Path:
    subprocess.run(["k3d", "cluster", "create", name, "--wait"], check=True)
    out = Path.home() / ".kube" / f"k3d-{name}.yaml"
    out.write_text(subprocess.run(["k3d", "kubeconfig", "get", name], check=True, capture_output=True, text=True).stdout)
    return out


CI_CLUSTER_DIR = Path(os.environ.get("CLUSTER_DIR", "/var/lib/gpu-agent-ci"))


def host_paths() -> dict[str, str]:
    """Host folders the fake GPUs use. kubelet's device-plugin folder is fixed at
    /var/lib/kubelet/device-plugins whatever its root dir; the state folder of the CI cluster
    goes when the cluster does."""
    # On the CI cluster every node, workers included, has its own /var/lib/kubelet (a worker binds
    # its own folder there), so a state folder under it is per node, as on separate machines; the
    # cluster made /var/lib/kubelet, and removes it.
    state = "/var/lib/kubelet/fake-gpu" if provider() == "ci" else "/var/lib/gpu-agent/fake-gpu"
    return {"devicePluginPath": "/var/lib/kubelet/device-plugins", "stateDir": state}


def restart_kubelet() -> None:
    """Only the CI cluster's kubelet can be restarted from here."""
    if provider() != "ci":
        raise RuntimeError("restarting kubelet is supported on the CI cluster only")
    repo = Path(__file__).resolve().parent.parent
    subprocess.run(["bash", str(repo / "ci" / "scripts" / "restart-kubelet.sh")], check=True)


def node_fault(action: str, node: str) -> None:
    """stop | start | partition | heal a worker of the CI cluster (ci/scripts/node.sh)."""
    if provider() != "ci":
        raise RuntimeError("node faults are supported on the CI cluster only")
    repo = Path(__file__).resolve().parent.parent
    subprocess.run(["bash", str(repo / "ci" / "scripts" / "node.sh"), action, node], check=True, timeout=120)
