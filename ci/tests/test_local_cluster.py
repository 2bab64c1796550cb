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
import json
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


def test_k3d_nodes_report_status_as_often_as_kinds_which_the_xid_tests_2s_goal_is_set_against():
    """issue 50: a k3d user gets kind's node-status setting (KIND_KUBELET_PATCH), on servers and agents alike."""
    create = lc.k3d_create(lc.Settings.from_env("k3d", {"E2E_WORKERS": "2"}))
    args = [create[i + 1] for i, a in enumerate(create) if a == "--k3s-arg"]
    kind_value = yaml.safe_load(lc.KIND_KUBELET_PATCH)["nodeStatusUpdateFrequency"]
    assert f"--kubelet-arg=node-status-update-frequency={kind_value}@server:*" in args
    assert f"--kubelet-arg=node-status-update-frequency={kind_value}@agent:*" in args
    assert kind_value == "1s"


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


# --- a normal user's preflight (`make e2e CLUSTER=kind|k3d` as non-root): what it refuses, and why -------------------
# podman 4.3.1's answer to `podman info` as a fresh user of this CI machine (uidmap not installed), word for word
NO_NEWUIDMAP = ('Error: command required for rootless mode with multiple IDs: exec: "newuidmap": executable file not '
                'found in $PATH')


def podman_info(rootless=True, cgroup="v2", controllers=("cpu", "memory", "pids"), uids=(1, 65536)) -> str:
    """`podman info --format json`, the fields kind and the preflight read (podman's own key names)."""
    return json.dumps({"host": {"cgroupVersion": cgroup, "cgroupControllers": list(controllers),
                                "security": {"rootless": rootless, "seccompEnabled": True},
                                "idMappings": {"uidmap": [{"container_id": i, "host_id": 1000 + i, "size": n}
                                                          for i, n in enumerate(uids)]}},
                       "version": {"Version": "4.3.1"}})


KIND = lc.Settings.from_env("kind", {})
OK_PODMAN = lc.parse_engine_info("podman", podman_info())


def test_root_is_never_second_guessed_whatever_the_host():
    broken = lc.Engine("podman", error=NO_NEWUIDMAP, rootless=True, cgroup_v2=False)
    assert lc.preflight_problems(KIND, 0, broken, {"E2E_IMAGE_BUILD": "ci"}, lib_modules=False) == []


def test_rootless_podman_on_cgroup_v2_with_its_controllers_ids_and_lib_modules_passes():
    assert OK_PODMAN == lc.Engine("podman", rootless=True, cgroup_v2=True, uids=65537)
    assert lc.preflight_problems(KIND, 1000, OK_PODMAN, {}, lib_modules=True) == []


def test_rootless_podman_on_cgroup_v1_is_refused_in_kinds_own_words():
    engine = lc.parse_engine_info("podman", podman_info(cgroup="v1", controllers=()))
    [problem] = lc.preflight_problems(KIND, 1000, engine, {}, lib_modules=True)
    assert "running kind with rootless provider requires cgroup v2" in problem and "cgroup v1 host" in problem


def test_rootless_podman_without_delegated_controllers_is_refused_naming_them():
    engine = lc.parse_engine_info("podman", podman_info(controllers=("memory",)))
    [problem] = lc.preflight_problems(KIND, 1000, engine, {}, lib_modules=True)
    assert "pids, cpu" in problem and 'Delegate=yes' in problem


def test_rootless_podman_without_a_subuid_range_is_refused():
    engine = lc.parse_engine_info("podman", podman_info(uids=(1,)))
    [problem] = lc.preflight_problems(KIND, 1000, engine, {}, lib_modules=True)
    assert "maps 1 user id(s)" in problem and "/etc/subuid" in problem


def test_this_ci_machine_as_a_fresh_user_is_refused_for_uidmap_cgroup_v1_and_lib_modules():
    """What `podman info` failing leaves known: a normal user's podman is rootless, so kind's cgroup rule (read off the
    host) and the /lib/modules mount still apply, each named; nothing about the uid range is guessed."""
    engine = lc.Engine("podman", error=NO_NEWUIDMAP, rootless=True, cgroup_v2=False)
    problems = lc.preflight_problems(KIND, 1001, engine, {}, lib_modules=False)
    assert len(problems) == 3, problems
    assert "newuidmap" in problems[0] and "apt-get install uidmap" in problems[0]
    assert lc.KIND_ROOTLESS_CGROUP_V2 in problems[1]
    assert problems[2].startswith("/lib/modules is missing")


def test_docker_out_of_reach_is_refused_with_its_own_message_and_docker_as_root_on_cgroup_v1_is_kinds_warning_only():
    unreachable = lc.Engine("docker", error="Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
                                            "Is the docker daemon running?")
    [problem] = lc.preflight_problems(KIND, 1000, unreachable, {}, lib_modules=False)
    assert "Cannot connect to the Docker daemon" in problem and "docker" in problem
    # a daemon running as root that this user may reach (its group): kind only warns on cgroup v1, and Docker makes
    # a missing bind-mount source itself
    daemon = lc.parse_engine_info("docker", json.dumps({"CgroupVersion": "1", "CgroupDriver": "cgroupfs",
                                                        "MemoryLimit": True, "PidsLimit": True, "CPUShares": True,
                                                        "SecurityOptions": ["name=seccomp,profile=builtin"]}))
    assert not daemon.rootless and not daemon.cgroup_v2
    assert lc.preflight_problems(KIND, 1000, daemon, {}, lib_modules=False) == []
    rootless = lc.parse_engine_info("docker", json.dumps({"CgroupVersion": "1", "CgroupDriver": "cgroupfs",
                                                          "SecurityOptions": ["name=seccomp,profile=builtin",
                                                                              "name=rootless"]}))
    assert rootless.rootless
    assert lc.KIND_ROOTLESS_CGROUP_V2 in lc.preflight_problems(KIND, 1000, rootless, {}, lib_modules=True)[0]


def test_the_ci_image_build_needs_root_and_says_so():
    [problem] = lc.preflight_problems(KIND, 1000, OK_PODMAN, {"E2E_IMAGE_BUILD": "ci"}, lib_modules=True)
    assert problem.startswith("E2E_IMAGE_BUILD=ci") and "debootstrap" in problem


def test_the_engine_is_kinds_choice_explicit_or_the_first_on_path():
    def which(*present):
        return lambda name: f"/usr/bin/{name}" if name in present else None
    assert lc.engine_name(KIND, {"KIND_EXPERIMENTAL_PROVIDER": "podman"}, which("docker")) == "podman"
    assert lc.engine_name(KIND, {}, which("docker", "podman")) == "docker"
    assert lc.engine_name(KIND, {}, which("podman")) == "podman"
    assert lc.engine_name(SETTINGS, {"KIND_EXPERIMENTAL_PROVIDER": "podman"}, which("podman")) == "docker"  # k3d
