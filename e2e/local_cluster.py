"""A local cluster for the e2e suite, kind or k3d: `make e2e CLUSTER=kind|k3d` (ci/scripts/e2e.sh) runs

    python3 e2e/local_cluster.py PROVIDER up            create the cluster unless it exists; write its kubeconfig
    python3 e2e/local_cluster.py PROVIDER load ARCHIVE  import an image archive into every node
    python3 e2e/local_cluster.py PROVIDER down          delete it
    python3 e2e/local_cluster.py PROVIDER preflight     as a normal user: stop before anything is made if this host
                                                        cannot run it without root, saying what and why (root: no-op)

Settings (environment): E2E_CLUSTER_NAME (default gpu-agent-e2e), E2E_NODE_IMAGE (the node image; default the
tool's own: kindest/node of the kind release, rancher/k3s of the k3d release), E2E_WORKERS (worker nodes beside
the control plane, default 1), E2E_KUBECONFIG (where `up` writes the kubeconfig, default
~/.kube/gpu-agent-e2e-<provider>.yaml), E2E_POD_SUBNET / E2E_SERVICE_SUBNET (the cluster's pod and Service ranges;
default the tool's own: kind's 10.244.0.0/16 and 10.96.0.0/16 are the CI cluster's too, so a kind cluster beside it
takes others), KIND / K3D (the binaries; default on PATH). With podman instead of
Docker, kind needs KIND_EXPERIMENTAL_PROVIDER=podman.

The commands are built by the pure functions below (no side effects), so that a unit test can check each one
against the tool's documented flags (ci/tests/test_local_cluster.py against k3d's command reference). Only the
standard library: e2e.sh runs this with the system's python3, before the project's virtual environment matters.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

PROVIDERS = ("kind", "k3d")
# kubelet refuses to start on a cgroup v1 host from Kubernetes 1.35 unless told (KEP-5573); on cgroup v2 the
# setting changes nothing, so every kind cluster gets it. Node status every second (default 10 s), as on the CI
# cluster (ci/scripts/node-config.sh): a device plugin's allocatable reaches the API server through it, and the
# GPU-health goals (allocatable within 2 s of an Xid) are set against it. k3d's nodes get the same through k3s'
# --kubelet-arg (k3d_create): at kubelet's default 10 s the Xid 79 test measured 8.8 s on kind.
NODE_STATUS_UPDATE_FREQUENCY = "1s"
KIND_KUBELET_PATCH = ("kind: KubeletConfiguration\nfailCgroupV1: false\n"
                      f"nodeStatusUpdateFrequency: {NODE_STATUS_UPDATE_FREQUENCY}\n")
# Node images assembled by ci/scripts/build-kind-node.sh carry the control plane's images under localhost/
# (no registry to pull registry.k8s.io's from): kubeadm is pointed there.
LOCAL_NODE_IMAGE_PREFIX = "localhost/gpu-agent-kind-node:"


def local_images_patch(etcd_tag: str) -> str:
    return ("kind: ClusterConfiguration\nimageRepository: localhost\n"
            f"etcd:\n  local:\n    imageRepository: localhost\n    imageTag: {etcd_tag}\n"
            "dns:\n  imageRepository: localhost\n  imageTag: ci\n")


@dataclass(frozen=True)
class Settings:
    provider: str
    name: str = "gpu-agent-e2e"
    image: str = ""
    workers: int = 1
    binary: str = ""
    kubeconfig: Path = Path()
    pod_subnet: str = ""
    service_subnet: str = ""

    @classmethod
    def from_env(cls, provider: str, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        if provider not in PROVIDERS:
            raise SystemExit(f"provider must be one of {', '.join(PROVIDERS)}; got {provider!r}")
        try:
            workers = int(env.get("E2E_WORKERS", "1"))
        except ValueError:
            raise SystemExit(f"E2E_WORKERS must be a whole number of worker nodes, e.g. 1; got {env['E2E_WORKERS']!r}") from None
        if not 0 <= workers <= 10:
            raise SystemExit(f"E2E_WORKERS must be between 0 and 10; got {workers}")
        name = env.get("E2E_CLUSTER_NAME", "gpu-agent-e2e")
        default_kubeconfig = Path(env.get("HOME", "/root")) / ".kube" / f"{name}-{provider}.yaml"
        subnets = {}
        for key, field in (("E2E_POD_SUBNET", "pod_subnet"), ("E2E_SERVICE_SUBNET", "service_subnet")):
            if value := env.get(key, ""):
                try:
                    ipaddress.ip_network(value)
                except ValueError:
                    raise SystemExit(f"{key} must be a network in CIDR form, e.g. 10.245.0.0/16; got {value!r}") from None
                subnets[field] = value
        return cls(provider=provider, name=name, image=env.get("E2E_NODE_IMAGE", ""), workers=workers,
                   binary=env.get(provider.upper(), provider), kubeconfig=Path(env.get("E2E_KUBECONFIG", default_kubeconfig)),
                   **subnets)


# --- kind ---------------------------------------------------------------------------------------------------
def kind_config(s: Settings, etcd_tag: str = "v3.6.8") -> str:
    """The kind cluster: one control plane and s.workers workers, kubelet allowed on cgroup v1 and reporting node
    status every second, and kubeadm pointed at the node image's own images when it is one ci/ assembled."""
    patches = [KIND_KUBELET_PATCH]
    if s.image.startswith(LOCAL_NODE_IMAGE_PREFIX):
        patches.append(local_images_patch(etcd_tag))
    nodes = "".join(f"- role: {role}\n" for role in ["control-plane"] + ["worker"] * s.workers)
    subnets = "".join(f"  {key}: {value}\n" for key, value in (("podSubnet", s.pod_subnet),
                                                              ("serviceSubnet", s.service_subnet)) if value)
    networking = f"networking:\n{subnets}" if subnets else ""
    body = "".join("- |\n" + "".join(f"  {line}\n" for line in p.splitlines()) for p in patches)
    return f"kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnodes:\n{nodes}{networking}kubeadmConfigPatches:\n{body}"


def kind_list(s: Settings) -> list[str]:
    return [s.binary, "get", "clusters"]


def kind_create(s: Settings, config: Path) -> list[str]:
    image = ["--image", s.image] if s.image else []
    return [s.binary, "create", "cluster", "--name", s.name, "--config", str(config), *image,
            "--kubeconfig", str(s.kubeconfig), "--wait", "5m"]


def kind_kubeconfig(s: Settings) -> list[str]:
    return [s.binary, "get", "kubeconfig", "--name", s.name]


def kind_load(s: Settings, archive: Path) -> list[str]:
    # into every node of the cluster (kind's default: --nodes narrows it)
    return [s.binary, "load", "image-archive", str(archive), "--name", s.name]


def kind_delete(s: Settings) -> list[str]:
    return [s.binary, "delete", "cluster", "--name", s.name]


# --- k3d ----------------------------------------------------------------------------------------------------
def k3d_list(s: Settings) -> list[str]:
    return [s.binary, "cluster", "list", "--output", "json"]


def k3d_create(s: Settings) -> list[str]:
    image = ["--image", s.image] if s.image else []
    # the default kubeconfig is left alone (the suite reads its own file); traefik is not needed by the suite
    subnets = [arg for flag, value in (("--cluster-cidr", s.pod_subnet), ("--service-cidr", s.service_subnet)) if value
               for arg in ("--k3s-arg", f"{flag}={value}@server:*")]
    # every node's kubelet reports status as often as kind's (KIND_KUBELET_PATCH): k3s passes --kubelet-arg on to
    # its kubelet, servers (which run workloads in k3s) and agents alike. kind's failCgroupV1: false is not passed:
    # a kubelet older than 1.31 (an older E2E_NODE_IMAGE) refuses the unknown flag and the node never starts.
    kubelet = [arg for role in ("server", "agent") for arg in
               ("--k3s-arg", f"--kubelet-arg=node-status-update-frequency={NODE_STATUS_UPDATE_FREQUENCY}@{role}:*")]
    return [s.binary, "cluster", "create", s.name, "--agents", str(s.workers), *image,
            "--k3s-arg", "--disable=traefik@server:*", *subnets, *kubelet, "--wait", "--timeout", "300s",
            "--kubeconfig-update-default=false", "--kubeconfig-switch-context=false"]


def k3d_kubeconfig(s: Settings) -> list[str]:
    return [s.binary, "kubeconfig", "get", s.name]


def k3d_load(s: Settings, archive: Path) -> list[str]:
    # a file argument is imported as an archive into every node of the cluster
    return [s.binary, "image", "import", str(archive), "--cluster", s.name]


def k3d_delete(s: Settings) -> list[str]:
    return [s.binary, "cluster", "delete", s.name]


def existing_clusters(s: Settings, listing: str) -> set[str]:
    """Cluster names from the output of kind_list / k3d_list."""
    if s.provider == "kind":
        return {line.strip() for line in listing.splitlines() if line.strip() and not line.startswith("No kind clusters")}
    return {c["name"] for c in json.loads(listing or "[]")}


# --- a normal user's run: what this host lets it do -----------------------------------------------------------
# kind's own refusal of a rootless provider on cgroup v1 (sigs.k8s.io/kind v0.33.0, pkg/cluster/internal/create/
# create.go, validateProvider), and of one whose cgroup lacks the memory, pids or cpu controller.
KIND_ROOTLESS_CGROUP_V2 = "running kind with rootless provider requires cgroup v2, see https://kind.sigs.k8s.io/docs/user/rootless/"
KIND_ROOTLESS_DELEGATE = ('running kind with rootless provider requires setting systemd property "Delegate=yes", '
                          "see https://kind.sigs.k8s.io/docs/user/rootless/")
LAPTOP_DOC = 'docs/testing.md, "Run it on your laptop"'


@dataclass(frozen=True)
class Engine:
    """The container engine a kind or k3d cluster would run on, as its `info` describes it (what kind reads)."""
    name: str                       # docker | podman | nerdctl
    error: str = ""                 # what `NAME info` said, when it failed: the engine cannot be used
    rootless: bool = False
    cgroup_v2: bool = True
    missing_controllers: tuple[str, ...] = ()   # of memory, pids, cpu: what kind needs a rootless node to limit
    uids: int | None = None         # rootless podman: how many user ids its user namespace maps (None: not known)


def engine_name(s: Settings, env: Mapping[str, str], which: Callable[[str], str | None] = shutil.which) -> str:
    """kind's choice: KIND_EXPERIMENTAL_PROVIDER, else the first of docker, nerdctl, podman on PATH (kind's
    DetectNodeProvider); k3d talks to Docker's API."""
    if s.provider == "k3d":
        return "docker"
    if chosen := env.get("KIND_EXPERIMENTAL_PROVIDER", ""):
        return chosen
    return next((name for name in ("docker", "nerdctl", "podman") if which(name)), "docker")


def parse_engine_info(name: str, out: str) -> Engine:
    """`podman info --format json` or `docker info --format '{{json .}}'`, read as kind reads them."""
    info = json.loads(out)
    if name == "podman":
        host = info.get("host", {})
        controllers = host.get("cgroupControllers")
        missing = () if controllers is None else tuple(c for c in ("memory", "pids", "cpu") if c not in controllers)
        uidmap = (host.get("idMappings") or {}).get("uidmap")
        uids = None if uidmap is None else sum(int(m.get("size", 0)) for m in uidmap)
        return Engine(name, rootless=bool(host.get("security", {}).get("rootless")),
                      cgroup_v2=host.get("cgroupVersion") == "v2", missing_controllers=missing, uids=uids)
    rootless = any("name=rootless" in option.split(",") for option in info.get("SecurityOptions") or [])
    limits = {"memory": "MemoryLimit", "pids": "PidsLimit", "cpu": "CPUShares"}
    none = info.get("CgroupDriver") == "none"
    return Engine(name, rootless=rootless, cgroup_v2=str(info.get("CgroupVersion")) == "2",
                  missing_controllers=tuple(c for c, key in limits.items() if none or not info.get(key)))


def preflight_problems(s: Settings, euid: int, engine: Engine, env: Mapping[str, str], lib_modules: bool) -> list[str]:
    """Why `make e2e CLUSTER=kind|k3d` cannot run as this user on this host, each reason naming what needs root
    or what kind requires; empty when it can (or when root runs it: root's path is not second-guessed)."""
    if euid == 0:
        return []
    problems = []
    if env.get("E2E_IMAGE_BUILD") == "ci":
        problems.append("E2E_IMAGE_BUILD=ci builds the image on a debootstrap root filesystem "
                        "(ci/scripts/build-base-rootfs.sh: debootstrap and chroot), which needs root; leave it unset "
                        "to build it with docker or podman (E2E_ENGINE)")
    if engine.name not in ("docker", "podman"):
        return problems  # nerdctl: not checked here; kind says what it lacks
    if engine.error:
        if engine.name == "docker":
            problems.append(f"`docker info` failed as uid {euid}: {engine.error}. kind needs a Docker daemon this user "
                            "may use: its socket's group (docker; adding a user to it needs root) or rootless Docker; "
                            "or rootless podman: KIND_EXPERIMENTAL_PROVIDER=podman")
            return problems  # whether it would run rootless is not known
        hint = ("the uidmap package (newuidmap, newgidmap) is missing, and installing it needs root "
                "(apt-get install uidmap)" if "newuidmap" in engine.error or "newgidmap" in engine.error else
                "kind runs every node through it")
        problems.append(f"`podman info` failed as uid {euid}: {engine.error}. Rootless podman must work first: {hint}")
    if s.provider == "kind" and engine.rootless:
        if not engine.cgroup_v2:
            problems.append(f"{engine.name} runs rootless on a cgroup v1 host, and kind refuses that (kind's own check: "
                            f'"{KIND_ROOTLESS_CGROUP_V2}"). It needs a host booted with cgroup v2 '
                            "(systemd.unified_cgroup_hierarchy=1), or root (sudo make e2e-kind-podman)")
        elif engine.missing_controllers:
            problems.append(f"{engine.name} runs rootless without the {', '.join(engine.missing_controllers)} cgroup "
                            f"controller(s) delegated to this user, and kind refuses that (kind's own check: "
                            f'"{KIND_ROOTLESS_DELEGATE}"); delegating them is a systemd drop-in, which needs root')
    if engine.name == "podman" and engine.rootless and engine.uids is not None and engine.uids < 65536:
        problems.append(f"rootless podman maps {engine.uids} user id(s) for this user (no range of its own in "
                        "/etc/subuid and /etc/subgid): a kind node's files belong to many users and cannot be unpacked "
                        "into that; adding a range (usermod --add-subuids 100000-165535 --add-subgids 100000-165535 "
                        "USER) needs root")
    if (engine.name == "podman" or engine.rootless) and not lib_modules:
        problems.append("/lib/modules is missing: kind mounts it into every node (--volume /lib/modules:/lib/modules:ro), "
                        f"which rootless {engine.name} cannot create; creating it (sudo mkdir /lib/modules) needs root")
    return problems


def engine_info(name: str) -> Engine:
    fmt = "json" if name == "podman" else "{{json .}}"
    try:
        done = subprocess.run([name, "info", "--format", fmt], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        return Engine(name, error=f"{name} is not installed (not on PATH)")
    except subprocess.TimeoutExpired:
        return Engine(name, error=f"{name} info did not answer in 120 s")
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        errors = [line for line in said.splitlines() if "error" in line.lower()]  # not podman's warnings
        return Engine(name, error=("; ".join(errors) or said)[-600:] or f"exit status {done.returncode}")
    try:
        return parse_engine_info(name, done.stdout)
    except (ValueError, AttributeError) as e:
        return Engine(name, error=f"its output is not the JSON kind reads ({e})")


def preflight(s: Settings) -> int:
    """As a normal user: say what this run will use, and stop (2) before anything is made when the host cannot run
    it without root. Root: nothing (its path is the CI's, checked by the kind stage on every run)."""
    euid = os.geteuid()
    if euid == 0:
        return 0
    engine = engine_name(s, os.environ)
    info = engine_info(engine) if engine in ("docker", "podman") else Engine(engine)
    if engine == "podman" and info.error:
        # podman as a normal user is rootless whatever stopped it: kind's cgroup rule still applies, read off the
        # host (a cgroup v2 host's root has cgroup.controllers)
        info = replace(info, rootless=True, cgroup_v2=Path("/sys/fs/cgroup/cgroup.controllers").exists())
    problems = preflight_problems(s, euid, info, os.environ, Path("/lib/modules").exists())
    mode = "" if info.error or engine not in ("docker", "podman") else \
        f" ({'rootless' if info.rootless else 'daemon as root'}, cgroup {'v2' if info.cgroup_v2 else 'v1'})"
    print(f"preflight: {s.provider} as uid {euid} (not root) on {engine}{mode}", file=sys.stderr)
    if not problems:
        return 0
    print(f"preflight: `make e2e CLUSTER={s.provider}` cannot run as this user here; nothing was made:", file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    print(f"  (what a normal user's run needs: {LAPTOP_DOC})", file=sys.stderr)
    return 2


# --- the actions --------------------------------------------------------------------------------------------
def run(argv: list[str], timeout: float, capture: bool = False) -> str:
    print("+ " + " ".join(argv), file=sys.stderr, flush=True)
    try:
        done = subprocess.run(argv, check=True, timeout=timeout, text=True, stdout=subprocess.PIPE if capture else None)
    except FileNotFoundError:
        raise SystemExit(f"{argv[0]} not found: install it or name it with {argv[0].upper()}=/path/to/{argv[0]}") from None
    return done.stdout or ""


def exists(s: Settings) -> bool:
    listing = run(kind_list(s) if s.provider == "kind" else k3d_list(s), 60, capture=True)
    return s.name in existing_clusters(s, listing)


def up(s: Settings) -> None:
    s.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
    if not exists(s):
        if s.provider == "kind":
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="kind-config-") as f:
                f.write(kind_config(s, os.environ.get("KIND_ETCD_VERSION", "v3.6.8")))
                f.flush()
                run(kind_create(s, Path(f.name)), 900)
        else:
            run(k3d_create(s), 900)
    config = run(kind_kubeconfig(s) if s.provider == "kind" else k3d_kubeconfig(s), 60, capture=True)
    s.kubeconfig.write_text(config)
    s.kubeconfig.chmod(0o600)


def load(s: Settings, archives: list[Path]) -> None:
    for archive in archives:
        run(kind_load(s, archive) if s.provider == "kind" else k3d_load(s, archive), 600)


def down(s: Settings) -> None:
    if exists(s):
        run(kind_delete(s) if s.provider == "kind" else k3d_delete(s), 300)
    s.kubeconfig.unlink(missing_ok=True)  # it would point at a cluster that is gone


def main(argv: list[str]) -> int:
    usage = "usage: local_cluster.py kind|k3d up | load ARCHIVE... | down | preflight | config"
    if len(argv) < 2:
        raise SystemExit(usage)
    s = Settings.from_env(argv[0])
    action = argv[1]
    if action == "up":
        up(s)
    elif action == "load" and len(argv) > 2:
        load(s, [Path(a) for a in argv[2:]])
    elif action == "down":
        down(s)
    elif action == "preflight":
        return preflight(s)
    elif action == "config" and s.provider == "kind":
        sys.stdout.write(kind_config(s, os.environ.get("KIND_ETCD_VERSION", "v3.6.8")))
    else:
        raise SystemExit(usage)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
