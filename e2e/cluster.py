"""Which cluster the suite runs against: `E2E_CLUSTER` = ci | existing | kind | k3d.

  ci        the CI cluster from ci/ (`make -C ci cluster-up`); kubeconfig at its known path
  existing  whatever $KUBECONFIG (or ~/.kube/config) points at
  kind      a kind cluster (Docker, or podman with KIND_EXPERIMENTAL_PROVIDER=podman)
  k3d       a k3d cluster (Docker)

kind and k3d clusters are made, loaded and deleted by e2e/local_cluster.py, which `make e2e CLUSTER=kind|k3d`
(ci/scripts/e2e.sh) runs around the suite; the suite reads the kubeconfig it wrote. Images: on `ci` they are
imported into containerd by `make -C ci images`; on kind and k3d the same archive goes through
`kind load image-archive` / `k3d image import` into every node.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

SYSTEM_CI_CACHE = Path("/var/cache/gpu-agent-ci")
SYSTEM_CLUSTER_DIR = Path("/var/lib/gpu-agent-ci")


def ci_dirs(env: Mapping[str, str] | None = None, euid: int | None = None) -> tuple[Path, Path]:
    """(CI_CACHE, CLUSTER_DIR): where the CI's caches and a cluster's state live, chosen as ci/scripts/paths.sh
    chooses them for the shell (ci/tests/test_ci_paths.py holds both to the same answers). Root: the system
    folders /var/cache/gpu-agent-ci and /var/lib/gpu-agent-ci. Anyone else: ${XDG_CACHE_HOME:-~/.cache}/gpu-agent-ci
    and ${XDG_STATE_HOME:-~/.local/state}/gpu-agent-ci (an XDG variable that is not absolute is ignored). CI_CACHE
    and CLUSTER_DIR, when set, win. The only place Python code makes that choice."""
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    cache, state = str(SYSTEM_CI_CACHE), str(SYSTEM_CLUSTER_DIR)
    if euid != 0:
        home = env.get("HOME") or _passwd_home(euid)
        xdg_cache, xdg_state = env.get("XDG_CACHE_HOME", ""), env.get("XDG_STATE_HOME", "")
        cache = (xdg_cache if xdg_cache.startswith("/") else f"{home}/.cache") + "/gpu-agent-ci"
        state = (xdg_state if xdg_state.startswith("/") else f"{home}/.local/state") + "/gpu-agent-ci"
    return Path(env.get("CI_CACHE") or cache), Path(env.get("CLUSTER_DIR") or state)


def _passwd_home(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_dir
    except KeyError:  # no entry (a container's arbitrary uid): as the shell's getent, nothing
        return ""


def artifacts_dir(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """Where a failed test's pods, logs and events go: E2E_ARTIFACTS (`make e2e` sets one folder per run), else
    root's /tmp/gpu-agent-e2e-artifacts and another user's CLUSTER_DIR/e2e-artifacts, as paths.sh's
    E2E_ARTIFACTS_ROOT (root's folder in /tmp is not writable by anyone else once root has made it)."""
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    if value := env.get("E2E_ARTIFACTS"):
        return Path(value)
    return Path("/tmp/gpu-agent-e2e-artifacts") if euid == 0 else ci_dirs(env, euid)[1] / "e2e-artifacts"


CI_CACHE, CI_CLUSTER_DIR = ci_dirs()
CI_KUBECONFIG = Path(os.environ.get("KUBECONFIG_PATH") or CI_CLUSTER_DIR / "admin.kubeconfig")
CI_TOOLS = CI_CACHE / "tools"


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


def local_kubeconfig(which: str) -> Path:
    """The kubeconfig of the kind or k3d cluster that e2e/local_cluster.py made (`make e2e CLUSTER=kind|k3d`)."""
    from e2e.local_cluster import Settings

    path = Settings.from_env(which).kubeconfig
    if not path.exists():
        raise SystemExit(f"no {which} cluster kubeconfig at {path}: run `make e2e CLUSTER={which}` (it creates the cluster "
                         f"and writes the file), or `python3 e2e/local_cluster.py {which} up`, or set E2E_KUBECONFIG")
    return path


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
