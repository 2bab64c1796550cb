"""A local cluster for the e2e suite, kind or k3d: `make e2e CLUSTER=kind|k3d` (ci/scripts/e2e.sh) runs

    python3 e2e/local_cluster.py PROVIDER up            create the cluster unless it exists; write its kubeconfig
    python3 e2e/local_cluster.py PROVIDER load ARCHIVE  import an image archive into every node
    python3 e2e/local_cluster.py PROVIDER down          delete it

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
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PROVIDERS = ("kind", "k3d")
# kubelet refuses to start on a cgroup v1 host from Kubernetes 1.35 unless told (KEP-5573); on cgroup v2 the
# setting changes nothing, so every kind cluster gets it. Node status every second (default 10 s), as on the CI
# cluster (ci/scripts/node-config.sh): a device plugin's allocatable reaches the API server through it, and the
# GPU-health goals (allocatable within 2 s of an Xid) are set against it.
KIND_KUBELET_PATCH = "kind: KubeletConfiguration\nfailCgroupV1: false\nnodeStatusUpdateFrequency: 1s\n"
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
    return [s.binary, "cluster", "create", s.name, "--agents", str(s.workers), *image,
            "--k3s-arg", "--disable=traefik@server:*", *subnets, "--wait", "--timeout", "300s",
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
    usage = "usage: local_cluster.py kind|k3d up | load ARCHIVE... | down | config"
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
    elif action == "config" and s.provider == "kind":
        sys.stdout.write(kind_config(s, os.environ.get("KIND_ETCD_VERSION", "v3.6.8")))
    else:
        raise SystemExit(usage)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
