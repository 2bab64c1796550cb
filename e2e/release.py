"""A gpu-agent release on the cluster, driven through the real helm binary, with probes through
the API server (so they work on any cluster the suite reaches through its kubeconfig)."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import yaml

from e2e.cluster import host_paths, tool
from e2e.helpers import exec_python, pod_http_get, wait_until

CHART = Path(__file__).resolve().parent.parent / "charts" / "gpu-agent"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
BASE = ["--set", "image.tag=dev", "--set", "controlPlane.enabled=true"]
CA = "app.kubernetes.io/component=cluster-agent"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=300)
    if check and r.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed: {r.stderr}")
    return r


class Release:
    """A gpu-agent release on the fake GPUs, with probes through the API server."""

    def __init__(self, api, core, apps, kubeconfig, namespace, name="ga"):
        self.api, self.core, self.apps, self.namespace, self.name = api, core, apps, namespace, name
        self.kubeconfig = str(kubeconfig)
        self.fullname = f"{name}-gpu-agent" if "gpu-agent" not in name else name

    def args(self, *extra):
        return ["--kubeconfig", self.kubeconfig, "-n", self.namespace, self.name, str(CHART), *BASE,
                "--set", "image.pullPolicy=Never", "--set", "nodeAgent.gpuSource=fake", "--set", "nodeAgent.nodeSelector=null",
                "--set", f"nodeAgent.fakeGpuStateDir={host_paths()['stateDir']}", "--set", "logVerbosity=2", *extra]

    def install(self, *extra):
        return helm("install", *self.args(*extra), "--timeout", "120s")

    def upgrade(self, *extra):
        return helm("upgrade", *self.args(*extra), "--timeout", "120s")

    def uninstall(self):
        return helm("uninstall", "--kubeconfig", self.kubeconfig, "-n", self.namespace, self.name, "--wait", "--timeout", "120s")

    def all_running(self, at_least: int = 3) -> bool:
        pods = self.pods(f"app.kubernetes.io/instance={self.name}")
        return len(pods) >= at_least and all(p.status.phase == "Running" and p.metadata.deletion_timestamp is None
                                             for p in pods)

    def pods(self, selector):
        return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items

    def agent_pod(self):
        pods = [p for p in self.pods(CA) if p.metadata.deletion_timestamp is None and p.status.phase == "Running"]
        return pods[0].metadata.name if len(pods) == 1 else None

    def healthz(self):
        """(status, body) of the agent's own /healthz; (0, None) until the agent itself answers
        (the API server's proxy says 503 too while a pod is not serving yet)."""
        pod = self.agent_pod()
        if pod is None:
            return 0, None
        code, body = pod_http_get(self.core, self.namespace, pod, 8080, "healthz")
        return (code, body) if isinstance(body, dict) and "components" in body else (0, None)

    def metrics(self) -> str:
        pod = self.agent_pod()
        code, body = pod_http_get(self.core, self.namespace, pod, 8080, "metrics") if pod else (0, "")
        return body if code == 200 and isinstance(body, str) else ""

    def control_plane(self, code: str) -> str:
        """Run Python in the control plane's pod with a client `c` and the admin token `t`; raises
        if it fails (the output would otherwise be taken for an answer)."""
        def ready_pod():
            pods = [p for p in self.pods("app.kubernetes.io/component=control-plane")
                    if p.metadata.deletion_timestamp is None and all(c.ready for c in p.status.container_statuses or [])
                    and p.status.container_statuses]
            return pods[0].metadata.name if pods else None

        pod = wait_until(ready_pod, 60, "the control plane Ready")
        prelude = ("from gpu_agent.foundations.control_plane_client import ControlPlaneClient\n"
                   "from gpu_agent.foundations.secrets import Secret\n"
                   "c = ControlPlaneClient('http://127.0.0.1:8700')\n"
                   "t = Secret(open('/var/run/secrets/gpu-agent/adminToken').read().strip())\n")
        out = exec_python(self.api, self.namespace, pod, prelude + code)
        if "Traceback (most recent call last)" in out:
            raise AssertionError(f"control plane call failed: {out[-600:]}")
        return out

    def tokens(self):
        secret = self.core.read_namespaced_secret(f"{self.fullname}-control-plane-tokens", self.namespace)
        return [base64.b64decode(v).decode() for v in secret.data.values()]


