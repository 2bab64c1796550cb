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

The registry's image is not the imported one: registry_up pushes a copy with one label added to its config
(ci/tools/oci_relabel.py), so its image ID (the config's digest) differs. Pushed identical, a pull of it through the
Secret made each node's kubelet (Kubernetes >= 1.35, KubeletEnsureSecretPulledImages with its default policy
NeverVerifyPreloadedImages) record that image ID as pulled with credentials; from then on every pod of that node on
localhost/gpu-agent:dev with pullPolicy Never, which carries no such Secret, failed ErrImageNeverPull (the fake-gpu
uninstall hook and every later test there). The good-password test checks both: the two image IDs differ on every node
that pulled, and a pod on localhost/gpu-agent:dev with pullPolicy Never still starts on each of those nodes afterwards.

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
from e2e.helpers import wait_until
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

    def _manifest(self, path: str, tag: str, method: str) -> tuple[str, bytes]:
        request = urllib.request.Request(f"https://{self.host}/v2/{path}/manifests/{tag}", method=method, headers={
            "Accept": "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json",
            "Authorization": "Basic " + base64.b64encode(
                f"{self.secret('username')}:{self.secret('password')}".encode()).decode()})
        try:
            with urllib.request.urlopen(request, timeout=10, context=ssl.create_default_context(cafile=self.ca)) as r:
                return r.headers.get("Docker-Content-Digest", ""), r.read()
        except urllib.error.HTTPError:
            return "", b""

    def manifest_digest(self, path: str, tag: str) -> str:
        """The registry's digest of PATH:TAG (Docker-Content-Digest), "" when it has none."""
        return self._manifest(path, tag, "HEAD")[0]

    def config_digest(self, path: str, tag: str) -> str:
        """The digest of PATH:TAG's config: the image ID a node's containerd gives the image once pulled."""
        return json.loads(self._manifest(path, tag, "GET")[1] or b"{}").get("config", {}).get("digest", "")


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


PRELOADED = "localhost/gpu-agent:dev"  # what ci/scripts/build-images.sh imports into every node, as the suite uses it


def node_images(core, node: str, registry_image: str) -> tuple[list[str], list[list[str]]]:
    """(the names the node lists for the image named `registry_image`, the names of each image it lists under
    localhost/gpu-agent), from the Node's status.images: the kubelet lists one entry per image ID (containerd's CRI
    groups every name of an image under its config digest), its repo digests first, five names at most. [] while the
    kubelet has not listed the pulled image yet (its image list is refreshed every 30 s)."""
    images = core.read_node(node).status.images or []
    named = [i.names for i in images if i.names]  # an image the kubelet lists without a name (untagged) has None
    pulled = next((names for names in named if registry_image in names), [])
    local = [names for names in named if any(n.startswith("localhost/gpu-agent") for n in names)]
    return pulled, local


def start_preloaded_pod(core, namespace: str, node: str) -> str:
    """A pod on PRELOADED with pullPolicy Never and no pull Secret, bound to `node`, running `gpu-agent --version`."""
    name = f"preloaded-{node}"[:63].rstrip("-.")
    core.create_namespaced_pod(namespace, client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={PRELOADED_CHECK: "true"}),
        spec=client.V1PodSpec(
            node_name=node, restart_policy="Never", termination_grace_period_seconds=0,
            tolerations=[client.V1Toleration(operator="Exists")],
            containers=[client.V1Container(name="version", image=PRELOADED, image_pull_policy="Never",
                                           args=["--version"])])))
    return name


PRELOADED_CHECK = "e2e.gpu-agent.io/preloaded-check"


def wait_preloaded_pod(core, namespace: str, name: str, since: float, timeout: float = 60) -> float:
    """Seconds from `since` until the pod of start_preloaded_pod succeeded. Fails at once on an image error
    (ErrImageNeverPull: the kubelet wants credentials for the preloaded image)."""
    while True:
        pod = core.read_namespaced_pod(name, namespace)
        for status in statuses(pod):
            waiting = status.state.waiting
            assert waiting is None or waiting.reason not in (
                "ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName"), (
                f"{pod.spec.node_name}: a pod on {PRELOADED} with pullPolicy Never no longer starts after the pull "
                f"through the Secret: {waiting.reason}: {waiting.message} (the kubelet ties the preloaded image to "
                f"the Secret: has the registry's image the same image ID again?)")
        if pod.status.phase in ("Succeeded", "Failed"):
            assert pod.status.phase == "Succeeded", (pod.spec.node_name, [s.state for s in statuses(pod)])
            return time.monotonic() - since
        assert time.monotonic() - since < timeout, (
            f"{pod.spec.node_name}: the pod on {PRELOADED} did not finish within {timeout:.0f} s: {pod.status.phase}, "
            f"{[(s.name, s.state) for s in statuses(pod)]}")
        time.sleep(0.5)


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

        # The registry's image must be another image than the preloaded one (see the module's doc): pushed identical
        # (the same config digest), the kubelet of each node that pulls it through the Secret records that image ID
        # as pulled with credentials, and then refuses every pod on localhost/gpu-agent:dev with pullPolicy Never
        # there (ErrImageNeverPull). This fails if someone pushes the imported archive itself again.
        config = registry.config_digest(IMAGE_PATH, APP_VERSION)
        assert config.startswith("sha256:"), f"no config digest for {image}"
        nodes = sorted({(e.source.host if e.source else None) or e.reporting_instance for e in pulled} - {None, ""})
        assert nodes, [(e.source, e.reporting_instance) for e in pulled]
        pulled_name = f"{registry.host}/{IMAGE_PATH}@{digest}"
        started = time.monotonic()
        for node in nodes:
            # the node's own word: one entry per image ID, so the registry's name and localhost/gpu-agent's are
            # never in the same entry unless the two are the same image
            def listed_on(n: str = node) -> tuple[list[str], list[list[str]]] | None:
                names, local = node_images(core, n, pulled_name)
                return (names, local) if names else None
            names, local = wait_until(listed_on, 75, f"{node} listing {pulled_name} in status.images (the kubelet's "
                                                     f"image list is refreshed every 30 s)", interval=1)
            assert not [n for n in names if n.startswith("localhost/gpu-agent")], (
                f"{node} lists {image} and localhost/gpu-agent as one image ID ({names}): the registry holds the "
                f"imported image itself, whose pull through the Secret ties {PRELOADED} to that Secret "
                f"(ci/scripts/e2e.sh registry_up must push ci/tools/oci_relabel.py's copy)")
            assert any(PRELOADED in entry for entry in local), (f"{node} lists no {PRELOADED} beside {names}", local)
        listed = time.monotonic() - started
        # The regression check of that defect: after those pulls through the Secret, a pod on the preloaded image
        # with pullPolicy Never and no Secret still starts on each of those nodes. (A pod of this test's own
        # namespace, bound to a node another worker may own: it takes no GPU and changes nothing there.)
        started = time.monotonic()
        checks = {node: start_preloaded_pod(core, namespace, node) for node in nodes}
        ran = {node: wait_preloaded_pod(core, namespace, name, started) for node, name in checks.items()}
        for pod in core.list_namespaced_pod(namespace, label_selector=PRELOADED_CHECK).items:
            for status in statuses(pod):
                # the preloaded image's ID as the CRI reports it (its repo digest, or its config digest without one)
                local_id = status.image_id.rsplit("@", 1)[-1]
                assert local_id not in (digest, config), (pod.spec.node_name, status.image_id, digest, config)
        print(f"the registry's image: config {config[:19]}..., another image ID than {PRELOADED}'s on "
              f"{len(nodes)} node(s) that pulled it ({', '.join(nodes)}; listed within {listed:.0f} s); a pod on "
              f"{PRELOADED} with pullPolicy Never then ran to completion on each, in "
              f"{', '.join(f'{t:.1f} s' for t in ran.values())}")
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
