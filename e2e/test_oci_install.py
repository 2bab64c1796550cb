"""`helm install oci://...` from the CI's own registry, the image pulled by the nodes through an imagePullSecret
(issue 50): what docs/install.md's air-gapped install does, on the CI cluster.

ci/scripts/e2e.sh (registry_up) starts the registry (ci/scripts/registry.sh: Debian's docker-registry, TLS from the
CI's CA, an htpasswd login) on the first node's address after cluster-up, where every node's containerd trusts its CA
(config_path and the hosts.toml registry.sh writes), pushes the project image from the archive the run built (skopeo,
digests kept) and both charts signed (scripts/release-oci.sh), and exports the REGISTRY_* paths (no secret) to the
suite. Each test here logs helm into the registry in a config of its own, makes a kubernetes.io/dockerconfigjson
Secret from the registry's credentials file and installs the chart from oci:// with `global.imageRegistry` and
`global.imagePullSecrets` and `image.pullPolicy=Always`, so that each container start is a pull from the registry
through the Secret. The nodes hold the image's layers already (the archive is imported as localhost/gpu-agent): the
pull resolves the tag and fetches the manifest and config through the login, and reuses those layers by digest, as
any node that has them does.

Elsewhere than on the CI cluster (kind, k3d, an existing cluster) these tests skip: that registry and its CA live on
the CI cluster's host."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import ssl
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from e2e import cluster
from e2e.cluster import host_paths, tool
from e2e.release import NODE_SCOPE, Release, helm

REPO = Path(__file__).resolve().parent.parent
_CHART = yaml.safe_load((REPO / "charts" / "gpu-agent" / "Chart.yaml").read_text())
CHART_VERSION, APP_VERSION = _CHART["version"], _CHART["appVersion"]
IMAGE_PATH = "gpu-agent"  # localhost/gpu-agent with global.imageRegistry: REGISTRY/gpu-agent
ENV = ("REGISTRY_HOST", "REGISTRY_CA", "REGISTRY_CREDENTIALS", "REGISTRY_RELEASE_DIR")
SECRET = "ci-registry"
pytestmark = pytest.mark.skipif(cluster.provider() != "ci", reason=(
    f"the CI registry (ci/scripts/registry.sh) and the CA its nodes trust live on the CI cluster's host: E2E_CLUSTER=ci "
    f"only, not {cluster.provider()}"))


@dataclass(frozen=True)
class CIRegistry:
    host: str  # HOST:PORT, the first node's address
    ca: str
    credentials: Path  # username=..., password=... (0600)
    release_dir: Path  # the signed charts pushed this run, and their public keyring

    def secret(self, key: str) -> str:
        return dict(line.split("=", 1) for line in self.credentials.read_text().splitlines())[key]

    def manifest_digest(self, path: str, tag: str) -> str:
        """The registry's digest of PATH:TAG (Docker-Content-Digest), "" when it has none."""
        request = urllib.request.Request(f"https://{self.host}/v2/{path}/manifests/{tag}", method="HEAD", headers={
            "Accept": "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json",
            "Authorization": "Basic " + base64.b64encode(
                f"{self.secret('username')}:{self.secret('password')}".encode()).decode()})
        try:
            with urllib.request.urlopen(request, timeout=10, context=ssl.create_default_context(cafile=self.ca)) as r:
                return r.headers.get("Docker-Content-Digest", "")
        except urllib.error.HTTPError:
            return ""


@pytest.fixture(scope="session")
def registry() -> CIRegistry:
    """The CI registry's paths. Session-scoped and first among each test's fixtures, so that without a registry the
    test skips before anything is made on the cluster."""
    values = {k: os.environ.get(k, "") for k in ENV}
    if not all(values.values()):  # pytest run by hand against a running CI cluster: ask the registry itself
        r = subprocess.run(["bash", str(REPO / "ci" / "scripts" / "registry.sh"), "env"], capture_output=True, text=True,
                           timeout=60)
        if r.returncode:
            pytest.skip(f"no CI registry running ({r.stderr.strip()[-300:]}): `make e2e CLUSTER=ci` starts one after "
                        f"cluster-up and pushes the image and charts (ci/scripts/e2e.sh registry_up)")
        values = {k: shlex.split(v)[0] for k, v in
                  (line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines())}
    return CIRegistry(values["REGISTRY_HOST"], values["REGISTRY_CA"], Path(values["REGISTRY_CREDENTIALS"]),
                      Path(values["REGISTRY_RELEASE_DIR"]))


def helm_login(reg: CIRegistry, home: Path) -> list[str]:
    """helm's global flags for a registry config and a content cache of the test's own, logged into the registry
    (the password on stdin): the machine's own helm login and cache never answer for it."""
    flags = ["--registry-config", str(home / "registry.json"), "--content-cache", str(home / "content")]
    r = subprocess.run([tool("helm"), "registry", "login", reg.host, "--username", reg.secret("username"),
                        "--password-stdin", "--ca-file", reg.ca, *flags], input=reg.secret("password"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return flags


def create_pull_secret(core, namespace: str, reg: CIRegistry, password: str) -> None:
    """What `kubectl create secret docker-registry` makes, from the registry's credentials file."""
    user = reg.secret("username")
    config = {"auths": {reg.host: {"username": user, "password": password,
                                   "auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}
    core.create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name=SECRET), type="kubernetes.io/dockerconfigjson",
        data={".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()}))


class OciRelease(Release):
    """A release of the chart as pushed to the CI registry, its image from there through the pull Secret."""

    def __init__(self, api, core, apps, kubeconfig, namespace, reg: CIRegistry, helm_flags: list[str],
                 hooks_on_uninstall: bool = True):
        super().__init__(api, core, apps, kubeconfig, namespace, name=f"oci{uuid.uuid4().hex[:5]}")
        self.reg, self.helm_flags, self.hooks_on_uninstall = reg, helm_flags, hooks_on_uninstall

    def args(self, *extra):
        return ["--kubeconfig", self.kubeconfig, "-n", self.namespace, self.name,
                f"oci://{self.reg.host}/charts/gpu-agent", "--version", CHART_VERSION, "--ca-file", self.reg.ca,
                *self.helm_flags, "--set", "controlPlane.enabled=true", "--set", "image.pullPolicy=Always",
                "--set", f"global.imageRegistry={self.reg.host}", "--set", f"global.imagePullSecrets[0].name={SECRET}",
                "--set", "nodeAgent.gpuSource=fake", "--set", f"nodeAgent.fakeGpuStateDir={host_paths()['stateDir']}",
                "--set", "logVerbosity=2", *NODE_SCOPE, *extra]

    def uninstall(self):
        if self.hooks_on_uninstall:
            return super().uninstall()
        # the pre-delete cleanup hook would pull the image with the same wrong Secret
        return helm("uninstall", "--kubeconfig", self.kubeconfig, "-n", self.namespace, self.name, "--no-hooks",
                    "--wait", "--timeout", "120s")


def seconds(go_duration: str) -> float:
    """A Go duration as the kubelet prints it (231.5ms, 1.2s, 1m2.5s) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    parts = re.findall(r"([\d.]+)(ms|us|µs|ns|h|m|s)", go_duration)
    assert parts, go_duration
    return sum(float(n) * units[u] for n, u in parts)


def statuses(pod) -> list:
    return [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]


def test_helm_install_from_the_ci_registry_runs_the_image_the_nodes_pulled_through_the_pull_secret(
        registry, api, core, apps, kubeconfig, namespace, fake_gpus, tmp_path):
    fake_gpus.set(1)  # the cluster agent turns Ready, so --wait waits for every component
    digest = registry.manifest_digest(IMAGE_PATH, APP_VERSION)
    assert digest.startswith("sha256:"), (f"{registry.host}/{IMAGE_PATH}:{APP_VERSION} is not in the CI registry "
                                          f"(ci/scripts/e2e.sh registry_up pushes it)")
    keyring = registry.release_dir / "gpu-agent-release.pubring.gpg"
    assert keyring.exists(), f"no {keyring}: the charts were not pushed (ci/scripts/e2e.sh registry_up)"
    create_pull_secret(core, namespace, registry, registry.secret("password"))
    release = OciRelease(api, core, apps, kubeconfig, namespace, registry, helm_login(registry, tmp_path))
    try:
        started = time.monotonic()
        helm("install", *release.args("--verify", "--keyring", str(keyring), "--wait", "--timeout", "3m"))
        install = time.monotonic() - started
        pods = release.pods(f"app.kubernetes.io/instance={release.name}")
        components = {p.metadata.labels.get("app.kubernetes.io/component") for p in pods}
        assert {"cluster-agent", "node-agent", "control-plane"} <= components, components
        image = f"{registry.host}/{IMAGE_PATH}:{APP_VERSION}"
        for pod in pods:
            assert {s.name for s in pod.spec.image_pull_secrets or []} >= {SECRET}, pod.metadata.name
            assert pod.status.phase == "Running", (pod.metadata.name, pod.status.phase)
            assert any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []), pod.metadata.name
            for container in [*(pod.spec.init_containers or []), *pod.spec.containers]:
                assert (container.image, container.image_pull_policy) == (image, "Always"), (pod.metadata.name,
                                                                                            container.name)
            for status in statuses(pod):
                # the CRI's repo digest of the image the container runs: the registry's name and the pushed digest
                assert status.image_id == f"{registry.host}/{IMAGE_PATH}@{digest}", (
                    pod.metadata.name, status.name, status.image, status.image_id)
        # The kubelet's word for each pull (pullPolicy Always: one a container start, the hook Jobs' too)
        events = core.list_namespaced_event(namespace).items
        pulled = [e for e in events if e.reason == "Pulled" and e.message.startswith(f'Successfully pulled image "{image}"')]
        assert pulled, [(e.reason, e.message) for e in events if e.reason in ("Pulled", "Pulling", "Failed")]
        assert not [e.message for e in events if e.reason == "Failed" and "pull" in e.message.lower()]
        took = sorted(seconds(re.search(r" in (\S+) \(", e.message).group(1)) for e in pulled)
        print(f"helm install oci://{registry.host}/charts/gpu-agent --version {CHART_VERSION} --verify --wait: "
              f"{install:.1f} s; {len(pods)} pods Ready on {image}@{digest[:19]}...")
        print(f"pulls through the pull Secret: {len(pulled)} (kubelet events), {took[0]:.2f} s fastest, "
              f"{statistics.median(took):.2f} s median, {took[-1]:.2f} s slowest (the layers reused from the node's store)")
    finally:
        release.uninstall_if_installed()


def test_a_wrong_password_in_the_pull_secret_keeps_the_pod_in_image_pull_backoff_with_the_registrys_401(
        registry, api, core, apps, kubeconfig, namespace, fake_gpus, tmp_path):
    """The chart comes with the right login (helm's own); only the Secret the nodes pull with is wrong. The release's
    first pod, the pre-install hook Job's (CRDs), never starts: the kubelet's pulls are refused 401 again and again
    until the hook's deadline (shortened to 40 s here), and `helm install` fails on that hook."""
    create_pull_secret(core, namespace, registry, "not-the-password")
    release = OciRelease(api, core, apps, kubeconfig, namespace, registry, helm_login(registry, tmp_path),
                         hooks_on_uninstall=False)
    result: dict[str, subprocess.CompletedProcess] = {}
    started = time.monotonic()
    installing = threading.Thread(target=lambda: result.update(r=helm(
        "install", *release.args("--set", "hooks.activeDeadlineSeconds=40", "--timeout", "90s"), check=False)),
        daemon=True)
    installing.start()
    try:
        reasons: set[str] = set()
        ran: list[str] = []
        first_backoff = None
        while installing.is_alive() and time.monotonic() - started < 150:  # sampled until helm gives up
            for pod in core.list_namespaced_pod(namespace).items:
                for status in statuses(pod):
                    if status.state.waiting is not None:
                        reasons.add(status.state.waiting.reason)
                        if status.state.waiting.reason == "ImagePullBackOff" and first_backoff is None:
                            first_backoff = time.monotonic() - started
                    # (a container that never started may still read terminated once its pod is stopped: no start)
                    terminated = status.state.terminated
                    if status.state.running or (terminated and terminated.started_at) or status.image_id:
                        ran.append(f"{pod.metadata.name}/{status.name}")
            time.sleep(1)
        installing.join(30)
        assert not installing.is_alive(), "helm install still running after 150 s (its --timeout is 90 s)"
        r = result["r"]
        assert r.returncode != 0, r.stdout
        assert "pre-install" in r.stderr, r.stderr
        assert not ran, f"containers ran although their image could not be pulled: {ran}"
        assert "ImagePullBackOff" in reasons, reasons
        events = core.list_namespaced_event(namespace).items
        refused = [e for e in events if e.reason == "Failed" and e.message.startswith("Failed to pull image")]
        assert refused, [(e.reason, e.message) for e in events]
        message = refused[0].message
        assert f'"{registry.host}/{IMAGE_PATH}:{APP_VERSION}"' in message and "401 Unauthorized" in message, message
        attempts = sum(e.count or 1 for e in refused)
        assert attempts >= 2, f"one refused pull only: the pod did not stay in back-off ({message})"
        print(f"wrong password: ImagePullBackOff {first_backoff:.1f} s after helm install began, {attempts} pulls "
              f"refused 401 by {registry.host}, no container ran; helm install failed after "
              f"{time.monotonic() - started:.0f} s: {r.stderr.strip().splitlines()[-1][:160]}")
    finally:
        release.uninstall_if_installed()
