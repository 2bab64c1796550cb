"""The commands e2e/local_cluster.py runs for `make e2e CLUSTER=k3d` (and the kind config it writes), checked
against what the tools document, not against the module's own idea of them.

No k3s image can be built on the CI machines (the Go module proxy does not serve k3s), so the k3d path cannot
run there; its commands are checked here, flag by flag, against k3d v5.9.0's command reference
(docs/usage/commands/*.md of github.com/k3d-io/k3d at tag v5.9.0, commit 15dd1e2d, copied unchanged into
k3d-docs/): the subcommand exists, each flag is documented for it, a flag that takes a value gets one of the
documented form, and the positional arguments are the ones its usage line names.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = Path(__file__).resolve().parent / "k3d-docs"


def _load():
    # by path: e2e/ is not a package the unit tests' import path holds
    spec = importlib.util.spec_from_file_location("local_cluster", REPO / "e2e" / "local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_cluster"] = module
    spec.loader.exec_module(module)
    return module


lc = _load()


def documented(page: str) -> tuple[list[str], dict[str, str | None]]:
    """(usage words, {flag: value type or None for a boolean}) of one k3d command page, options inherited
    from the parent commands included."""
    text = (DOCS / f"{page}.md").read_text()
    usage = re.search(r"```\n(k3d [^\n]+)\n```", text)
    assert usage, f"{page}: no usage line"
    flags: dict[str, str | None] = {}
    for block in re.findall(r"### Options[^\n]*\n\n```\n(.*?)```", text, re.S):
        for m in re.finditer(r"^\s+(?:-(\w), )?--([\w-]+)(?: (\S+))?\s{2,}", block, re.M):
            short, name, kind = m.groups()
            flags["--" + name] = kind
            if short:
                flags["-" + short] = kind
    assert flags, f"{page}: no options parsed"
    return usage.group(1).split(), flags


VALUE_FORMS = {
    "int": r"\d+",
    "duration": r"(\d+(ns|us|µs|ms|s|m|h))+",
    "string": r".+",
    "stringArray": r".+",
    # k3d's node filter syntax (docs/usage/configfile.md, "nodefilters"): server, agent, all or loadbalancer,
    # with an index, a list or a range of them, or *
    "ARG@NODEFILTER[;@NODEFILTER]": r"[^@]+@(server|agent|all|loadbalancer)(:(\*|\d+([,-]\d+)*))?(;(server|agent|all|loadbalancer)(:(\*|\d+([,-]\d+)*))?)*",
}


def check(argv: list[str], page: str) -> None:
    usage, flags = documented(page)
    words = usage[1:]  # after "k3d"
    command = [w for w in words if re.fullmatch(r"[a-z]+", w)]
    positional_spec = words[len(command):]
    assert argv[0] == "k3d"
    assert argv[1:1 + len(command)] == command, f"{argv} is not `k3d {' '.join(command)}`"
    rest, positional = argv[1 + len(command):], []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("-"):
            positional.append(arg)
            i += 1
            continue
        name, _, inline = arg.partition("=")
        assert name in flags, f"{name} is not a documented flag of `k3d {' '.join(command)}` (documented: {sorted(flags)})"
        kind = flags[name]
        if kind is None:  # boolean: bare, or =true/=false
            assert inline in ("", "true", "false"), f"{arg}: a boolean flag takes =true or =false"
            i += 1
            continue
        value = inline if inline else rest[i + 1]
        assert kind in VALUE_FORMS, f"{name} takes a {kind}, which this test does not know how to check"
        assert re.fullmatch(VALUE_FORMS[kind], value), f"{name} {value!r} is not a {kind}"
        i += 1 if inline else 2
    # `NAME` outside brackets is required; a bracketed part with `...` takes any number more
    spec = re.sub(r"\[flags\]", "", " ".join(positional_spec))
    required = [w for w in re.sub(r"\[.*\]", "", spec).split() if w.isupper()]
    assert len(positional) >= len(required), f"{argv}: `{' '.join(usage)}` needs {required}"
    assert "..." in spec or len(positional) <= len(required), \
        f"{argv}: more positional arguments than `{' '.join(usage)}` takes"


SETTINGS = lc.Settings.from_env("k3d", {"HOME": "/home/u", "K3D": "k3d"})


@pytest.mark.parametrize("argv, page", [
    (lc.k3d_create(SETTINGS), "k3d_cluster_create"),
    (lc.k3d_create(lc.Settings.from_env("k3d", {"E2E_NODE_IMAGE": "rancher/k3s:v1.33.1-k3s1", "E2E_WORKERS": "2",
                                                "K3D": "k3d"})), "k3d_cluster_create"),
    (lc.k3d_list(SETTINGS), "k3d_cluster_list"),
    (lc.k3d_kubeconfig(SETTINGS), "k3d_kubeconfig_get"),
    (lc.k3d_load(SETTINGS, Path("/tmp/gpu-agent.oci.tar")), "k3d_image_import"),
    (lc.k3d_delete(SETTINGS), "k3d_cluster_delete"),
], ids=["create", "create-image-workers", "list", "kubeconfig", "import", "delete"])
def test_each_k3d_command_uses_only_documented_flags_with_values_of_the_documented_form(argv, page):
    check(argv, page)


def test_the_checker_refuses_what_k3d_does_not_document():
    """The negative controls: the check above must be able to fail."""
    create = lc.k3d_create(SETTINGS)
    for broken in ([*create, "--workers", "1"],            # kind's vocabulary, not k3d's
                   [a.replace("300s", "5 minutes") for a in create],   # not a Go duration
                   [a.replace("@server:*", "@control-plane") for a in create],  # not a node filter
                   ["k3d", "image", "load", "/tmp/x.tar"],          # no such subcommand
                   [*lc.k3d_delete(SETTINGS), "--force"]):
        with pytest.raises(AssertionError):
            check(broken, "k3d_cluster_create" if broken[1] == "cluster" and broken[2] == "create" else
                  "k3d_image_import" if broken[1] == "image" else "k3d_cluster_delete")


def test_the_k3d_commands_name_the_cluster_and_load_into_it():
    s = lc.Settings.from_env("k3d", {"E2E_CLUSTER_NAME": "mine", "K3D": "/opt/k3d"})
    assert lc.k3d_create(s)[:4] == ["/opt/k3d", "cluster", "create", "mine"]
    assert lc.k3d_load(s, Path("/a.tar"))[-2:] == ["--cluster", "mine"]
    assert lc.k3d_delete(s) == ["/opt/k3d", "cluster", "delete", "mine"]
    assert lc.existing_clusters(s, '[{"name": "mine", "serversCount": 1}, {"name": "other"}]') == {"mine", "other"}


def test_the_kind_config_has_the_nodes_asked_for_the_cgroup_v1_patch_and_local_images_only_for_a_local_node():
    plain = lc.Settings.from_env("kind", {"E2E_WORKERS": "2"})
    config = yaml.safe_load(lc.kind_config(plain))
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert [n["role"] for n in config["nodes"]] == ["control-plane", "worker", "worker"]
    patches = [yaml.safe_load(p) for p in config["kubeadmConfigPatches"]]
    assert patches == [{"kind": "KubeletConfiguration", "failCgroupV1": False, "nodeStatusUpdateFrequency": "1s"}]
    local = lc.Settings.from_env("kind", {"E2E_NODE_IMAGE": lc.LOCAL_NODE_IMAGE_PREFIX + "v1.36.2-abc"})
    patches = [yaml.safe_load(p) for p in yaml.safe_load(lc.kind_config(local, "v3.6.8"))["kubeadmConfigPatches"]]
    assert patches[1] == {"kind": "ClusterConfiguration", "imageRepository": "localhost",
                          "etcd": {"local": {"imageRepository": "localhost", "imageTag": "v3.6.8"}},
                          "dns": {"imageRepository": "localhost", "imageTag": "ci"}}
    assert lc.kind_create(local, Path("/c.yaml"))[lc.kind_create(local, Path("/c.yaml")).index("--image") + 1] == local.image


def test_bad_settings_are_refused_naming_the_variable():
    with pytest.raises(SystemExit, match="E2E_WORKERS must be a whole number"):
        lc.Settings.from_env("kind", {"E2E_WORKERS": "two"})
    with pytest.raises(SystemExit, match="E2E_WORKERS must be between 0 and 10"):
        lc.Settings.from_env("kind", {"E2E_WORKERS": "99"})
    with pytest.raises(SystemExit, match="provider must be one of kind, k3d"):
        lc.Settings.from_env("minikube", {})
    with pytest.raises(SystemExit, match="E2E_POD_SUBNET must be a network in CIDR form"):
        lc.Settings.from_env("kind", {"E2E_POD_SUBNET": "10.245.0.0/33"})


def test_pod_and_service_ranges_apart_from_the_ci_clusters_reach_kind_and_k3d_and_none_leaves_the_tools_own():
    """A kind cluster beside the CI cluster (make test's kind stage) must not route the CI cluster's pod range: its
    bridged pod traffic would be judged by the CI cluster's NetworkPolicy enforcer on the host."""
    env = {"E2E_POD_SUBNET": "10.245.0.0/16", "E2E_SERVICE_SUBNET": "10.97.0.0/16"}
    config = yaml.safe_load(lc.kind_config(lc.Settings.from_env("kind", env)))
    assert config["networking"] == {"podSubnet": "10.245.0.0/16", "serviceSubnet": "10.97.0.0/16"}
    assert "networking" not in yaml.safe_load(lc.kind_config(lc.Settings.from_env("kind", {})))
    create = lc.k3d_create(lc.Settings.from_env("k3d", env))
    args = [create[i + 1] for i, a in enumerate(create) if a == "--k3s-arg"]
    assert "--cluster-cidr=10.245.0.0/16@server:*" in args and "--service-cidr=10.97.0.0/16@server:*" in args
    assert not any("cidr" in a for a in lc.k3d_create(lc.Settings.from_env("k3d", {})))
