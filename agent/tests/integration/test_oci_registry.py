"""The CI's OCI registry (ci/scripts/registry.sh: Debian's docker-registry on loopback, TLS from the CI's CA, htpasswd
basic auth) and the release path into it (`make release-oci`: scripts/release.sh with RELEASE_REGISTRY, which runs
scripts/release-oci.sh), with the real registry and the real helm, no cluster. Every helm call here runs with helm's
config, cache and registry login in the test's own folder, so nothing of the machine's own helm state answers for it.

Integration stage (real processes on loopback, bounded waits): not beside the e2e stage, where a starved registry start
would fail its deadline."""

from __future__ import annotations

import io
import os
import shlex
import ssl
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from e2e.cluster import tool
from tests.integration.harness import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
REGISTRY_SH = REPO / "ci" / "scripts" / "registry.sh"
VERSION = yaml.safe_load((REPO / "charts" / "gpu-agent" / "Chart.yaml").read_text())["version"]


def helm_env(home: Path) -> dict[str, str]:
    """helm's config, caches and registry login under `home`."""
    return {**os.environ, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_DATA_HOME": str(home / "data"), "HELM_REGISTRY_CONFIG": str(home / "config" / "registry.json"),
            "HELM_CONTENT_CACHE": str(home / "cache" / "content")}


def helm(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args], env=helm_env(home), input=stdin, capture_output=True, text=True,
                          timeout=120)


@dataclass
class Registry:
    base: Path   # the test's folder for it: CLUSTER_DIR (its PKI, state and log) and TMPDIR (its storage) below
    env: dict[str, str]
    host: str = ""
    ca: str = ""
    cert_dir: str = ""
    credentials: str = ""

    def run(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(REGISTRY_SH), command], env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def start(self) -> subprocess.CompletedProcess[str]:
        r = self.run("start")
        if r.returncode == 0:
            env = self.run("env")
            assert env.returncode == 0, env.stderr
            values = dict(line.split(" ", 1)[1].split("=", 1) for line in env.stdout.splitlines())
            values = {k: shlex.split(v)[0] for k, v in values.items()}
            self.host, self.ca = values["REGISTRY_HOST"], values["REGISTRY_CA"]
            self.cert_dir, self.credentials = values["REGISTRY_CERT_DIR"], values["REGISTRY_CREDENTIALS"]
        return r

    def secret(self, key: str) -> str:
        return dict(line.split("=", 1) for line in Path(self.credentials).read_text().splitlines())[key]

    def login(self, home: Path) -> None:
        r = helm(home, "registry", "login", self.host, "--username", self.secret("username"), "--password-stdin",
                 "--ca-file", self.ca, stdin=self.secret("password"))
        assert r.returncode == 0, r.stderr

    def get(self, path: str, auth: tuple[str, str] | None = None, ca: bool = True) -> int:
        """The HTTP status of GET https://host/path, TLS verified against the registry's CA (ca=False: the system's)."""
        request = urllib.request.Request(f"https://{self.host}/{path}")
        if auth:
            request.add_header("Authorization", "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
        context = ssl.create_default_context(cafile=self.ca if ca else None)
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                return int(response.status)
        except urllib.error.HTTPError as e:
            return e.code


def new_registry(base: Path) -> Registry:
    (base / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CLUSTER_DIR": str(base / "cluster"), "TMPDIR": str(base / "tmp")}
    reg = Registry(base, env)
    installed = reg.run("install", timeout=600)
    if installed.returncode:
        pytest.skip(f"the registry's binary (Debian's docker-registry) could not be installed: {installed.stderr[-800:]}")
    for _ in range(3):  # a port found free can be taken before the registry binds it: another one then
        env["REGISTRY_ADDR"] = f"127.0.0.1:{free_port()}"
        r = reg.start()
        if r.returncode == 0:
            return reg
        assert "address already in use" in (base / "cluster" / "logs" / "registry.log").read_text(), r.stderr
    raise AssertionError(f"the registry did not start: {r.stderr}")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = new_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.run("stop", timeout=60)


@pytest.fixture(scope="module")
def signed(registry, tmp_path_factory):
    """Both charts signed with a throwaway key and pushed to oci://host/charts by scripts/release-oci.sh: the folder
    of the .tgz, .prov and public keyring files."""
    dist = tmp_path_factory.mktemp("signed")
    r = subprocess.run(["bash", str(REPO / "scripts" / "release-oci.sh"), registry.host, str(dist)], cwd=REPO,
                       env={**helm_env(dist / ".helm"), "HELM": tool("helm"), "REGISTRY_CA": registry.ca,
                            "REGISTRY_CREDENTIALS": registry.credentials}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return dist


def test_start_serves_verified_tls_and_basic_auth_only_and_stop_removes_everything(tmp_path):
    reg = new_registry(tmp_path)
    try:
        creds = Path(reg.credentials)
        assert creds.stat().st_mode & 0o777 == 0o600
        assert (Path(reg.env["CLUSTER_DIR"]) / "registry" / "htpasswd").stat().st_mode & 0o777 == 0o600
        user, password = reg.secret("username"), reg.secret("password")
        assert len(password) >= 32
        assert reg.get("v2/") == 401  # anonymous
        assert reg.get("v2/", (user, "wrong")) == 401
        assert reg.get("v2/", (user, password)) == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            reg.get("v2/", (user, password), ca=False)  # a real CA of its own, not one the system trusts
        assert list(Path(reg.cert_dir).iterdir()) == [Path(reg.cert_dir) / "ca.crt"]  # podman --cert-dir: the CA alone
        again = reg.run("start")
        assert again.returncode == 0 and "already running" in again.stderr
        assert reg.secret("password") == password  # the running registry's login stands
        pid = int((Path(reg.env["CLUSTER_DIR"]) / "registry" / "pid").read_text())
        storage = Path((Path(reg.env["CLUSTER_DIR"]) / "registry" / "storage").read_text().strip())
        assert storage.is_dir() and storage.parent == tmp_path / "tmp"
    finally:
        stopped = reg.run("stop", timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert not Path(f"/proc/{pid}").exists()
    assert not storage.exists() and not (Path(reg.env["CLUSTER_DIR"]) / "registry").exists()
    assert reg.run("stop").returncode == 0  # idempotent
    gone = reg.run("env")
    assert gone.returncode == 1 and "no registry running" in gone.stderr


def test_make_release_oci_signs_pushes_and_reads_back_both_charts(registry, tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=120)
    r = subprocess.run(["bash", "scripts/release.sh"], cwd=clone, capture_output=True, text=True, timeout=300,
                       env={**helm_env(tmp_path / "release-helm"), "RELEASE_IMAGE": "0", "HELM": tool("helm"),
                            "PYTHON": sys.executable, "RELEASE_REGISTRY": registry.host, "REGISTRY_CA": registry.ca,
                            "REGISTRY_CREDENTIALS": registry.credentials})
    assert r.returncode == 0, r.stderr
    dist = clone / "dist"
    assert {p.name for p in dist.iterdir()} == {
        f"{name}-{VERSION}{ext}" for name in ("gpu-agent", "fake-gpu") for ext in (".tgz", ".tgz.prov")
    } | {"index.yaml", "gpu-agent-release.pubring.gpg"}
    for name in ("gpu-agent", "fake-gpu"):
        assert f"pushed oci://{registry.host}/charts/{name}:{VERSION} (sha256:" in r.stderr
    password = registry.secret("password")
    assert password not in r.stdout + r.stderr
    assert password not in (Path(registry.env["CLUSTER_DIR"]) / "logs" / "registry.log").read_text()

    # What a user does: log in, show the chart, pull it and verify it with the published keyring.
    home = tmp_path / "user-helm"
    registry.login(home)
    (tmp_path / "pulled").mkdir()
    for name in ("gpu-agent", "fake-gpu"):
        shown = helm(home, "show", "chart", f"oci://{registry.host}/charts/{name}", "--version", VERSION,
                     "--ca-file", registry.ca)
        assert shown.returncode == 0, shown.stderr
        chart = yaml.safe_load(shown.stdout)
        assert (chart["name"], chart["version"]) == (name, VERSION)
    pulled = helm(home, "pull", f"oci://{registry.host}/charts/gpu-agent", "--version", VERSION, "--verify",
                  "--keyring", str(dist / "gpu-agent-release.pubring.gpg"), "--ca-file", registry.ca,
                  "--destination", str(tmp_path / "pulled"))
    assert pulled.returncode == 0, pulled.stderr
    assert "Chart Hash Verified" in pulled.stdout + pulled.stderr


def test_a_wrong_password_is_refused_with_a_clear_error(registry, signed, tmp_path):
    ref = f"oci://{registry.host}/charts/gpu-agent"
    wrong = helm(tmp_path, "pull", ref, "--version", VERSION, "--username", registry.secret("username"),
                 "--password", "not-the-password", "--ca-file", registry.ca, "--destination", str(tmp_path))
    assert wrong.returncode != 0
    assert "401" in wrong.stderr and "unauthorized" in wrong.stderr.lower(), wrong.stderr
    login = helm(tmp_path, "registry", "login", registry.host, "--username", registry.secret("username"),
                 "--password-stdin", "--ca-file", registry.ca, stdin="not-the-password")
    assert login.returncode != 0 and "401" in login.stderr, login.stderr
    # The control: the same pull with the right password gets the chart.
    registry.login(tmp_path)
    right = helm(tmp_path, "pull", ref, "--version", VERSION, "--ca-file", registry.ca, "--destination", str(tmp_path))
    assert right.returncode == 0 and (tmp_path / f"gpu-agent-{VERSION}.tgz").exists(), right.stderr


def test_a_push_without_login_is_refused_and_stores_nothing(registry, signed, tmp_path):
    tgz = signed / f"gpu-agent-{VERSION}.tgz"
    anonymous = helm(tmp_path / "anonymous", "push", str(tgz), f"oci://{registry.host}/anonymous", "--ca-file", registry.ca)
    assert anonymous.returncode != 0
    assert "credential" in anonymous.stderr or "401" in anonymous.stderr, anonymous.stderr
    wrong = helm(tmp_path / "wrong", "push", str(tgz), f"oci://{registry.host}/anonymous", "--ca-file", registry.ca,
                 "--username", registry.secret("username"), "--password", "not-the-password")
    assert wrong.returncode != 0 and "401" in wrong.stderr, wrong.stderr
    # Logged in, the repository those pushes named is not there.
    registry.login(tmp_path / "user")
    shown = helm(tmp_path / "user", "show", "chart", f"oci://{registry.host}/anonymous/gpu-agent", "--version", VERSION,
                 "--ca-file", registry.ca)
    assert shown.returncode != 0 and "not found" in shown.stderr.lower(), shown.stderr


def retar_with(tgz: Path, out: Path, member: str, edit: bytes) -> None:
    """`tgz` rewritten to `out` with `edit` appended to `member`: a chart changed after it was signed."""
    with tarfile.open(tgz) as src, tarfile.open(out, "w:gz") as dst:
        for info in src.getmembers():
            data = src.extractfile(info).read() if info.isfile() else None  # type: ignore[union-attr]
            if info.name == member and data is not None:
                data += edit
                info.size = len(data)
            dst.addfile(info, io.BytesIO(data) if data is not None else None)


def test_helm_verify_fails_on_a_tampered_package_here_and_pulled_from_the_registry(registry, signed, tmp_path):
    tgz, keyring = signed / f"gpu-agent-{VERSION}.tgz", str(signed / "gpu-agent-release.pubring.gpg")
    assert helm(tmp_path, "verify", str(tgz), "--keyring", keyring).returncode == 0  # the control: signed as made

    tampered = tmp_path / "tampered" / tgz.name
    tampered.parent.mkdir()
    retar_with(tgz, tampered, "gpu-agent/values.yaml", b"\nextraObjects: []  # added after signing\n")
    (tampered.parent / f"{tgz.name}.prov").write_bytes((signed / f"{tgz.name}.prov").read_bytes())
    verify = helm(tmp_path, "verify", str(tampered), "--keyring", keyring)
    assert verify.returncode != 0 and "sha256 sum does not match" in verify.stderr, verify.stderr

    # The same tampered package with the original .prov, pushed to the registry: `helm pull --verify` refuses it.
    registry.login(tmp_path)
    (tmp_path / "pulled").mkdir()
    pushed = helm(tmp_path, "push", str(tampered), f"oci://{registry.host}/tampered", "--ca-file", registry.ca)
    assert pushed.returncode == 0, pushed.stderr
    pulled = helm(tmp_path, "pull", f"oci://{registry.host}/tampered/gpu-agent", "--version", VERSION, "--verify",
                  "--keyring", keyring, "--ca-file", registry.ca, "--destination", str(tmp_path / "pulled"))
    assert pulled.returncode != 0 and "sha256 sum does not match" in pulled.stderr, pulled.stderr
