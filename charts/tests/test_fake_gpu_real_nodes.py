"""charts/fake-gpu as `helm template` renders it for issue 48, part 3 (fake-gpu cannot take over a real node): the
resource name reaches the daemon and the unlabel hook, the override reaches the daemon only when set, a bad resource
name is refused naming the value, the refused pod is not Ready but alive, and the node rights cover what the real-GPU
check calls (read the Node, annotate it, post an Event) with or without node labels. The daemon's side is
fake-gpu/tests/test_real_gpu_guard.py; a real cluster's, e2e/test_fake_gpu_real_node.py."""

from __future__ import annotations

import pytest
import yaml

from e2e.release import CHART, helm

FAKE_GPU_CHART = CHART.parent / "fake-gpu"
REFUSAL_FILE = "/run/fake-gpu-status/refused"


def render(*sets: str) -> list[dict]:
    out = helm("template", "t", str(FAKE_GPU_CHART), "--namespace", "ns", *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def daemon_container(docs: list[dict]) -> dict:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return container


def test_by_default_the_daemon_advertises_nvidia_gpu_and_refuses_real_gpu_nodes():
    args = daemon_container(render())["args"]
    assert "--resource-name=nvidia.com/gpu" in args
    assert f"--refusal-file={REFUSAL_FILE}" in args
    assert "--allow-real-gpu-nodes" not in args


def test_the_resource_name_reaches_the_daemon_and_the_unlabel_hook_and_the_override_the_daemon():
    docs = render("--set", "resourceName=example.com/fake-gpu", "--set", "allowRealGpuNodes=true")
    args = daemon_container(docs)["args"]
    assert "--resource-name=example.com/fake-gpu" in args and "--allow-real-gpu-nodes" in args
    assert args.index("--resource-name=example.com/fake-gpu") < args.index("daemon")  # a top-level option
    (hook,) = [d for d in docs if d["kind"] == "Job"]
    (unlabel,) = hook["spec"]["template"]["spec"]["containers"]
    assert "--resource-name=example.com/fake-gpu" in unlabel["args"]
    assert unlabel["args"].index("--resource-name=example.com/fake-gpu") < unlabel["args"].index("unlabel-nodes")


@pytest.mark.parametrize("device_plugin", ["true", "false"])
def test_a_refused_pod_is_not_ready_saying_why_and_alive(device_plugin):
    container = daemon_container(render("--set", f"devicePlugin.enabled={device_plugin}"))
    readiness = container["readinessProbe"]["exec"]["command"][-1]
    assert readiness.startswith(f"if test -f {REFUSAL_FILE}; then cat {REFUSAL_FILE}; exit 1; fi;")
    if device_plugin == "true":  # the socket is never made when refused: liveness must not restart it for that
        liveness = container["livenessProbe"]["exec"]["command"][-1]
        assert liveness.startswith(f"test -f {REFUSAL_FILE} ||")
    else:
        assert "livenessProbe" not in container
    # The refusal file lives in the pod's own folder (a new pod checks again), writable under a read-only root.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["status"] == "/run/fake-gpu-status"
    (ds,) = [d for d in render("--set", f"devicePlugin.enabled={device_plugin}") if d["kind"] == "DaemonSet"]
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes["status"]


def rights(docs: list[dict]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the DaemonSet's ServiceAccount holds through ClusterRoleBindings."""
    bound = {b["roleRef"]["name"] for b in docs if b["kind"] == "ClusterRoleBinding"
             and any(s["name"] == "t-fake-gpu" and s["namespace"] == "ns" for s in b["subjects"])}
    return {(g, r, v) for role in docs if role["kind"] == "ClusterRole" and role["metadata"]["name"] in bound
            for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


@pytest.mark.parametrize("labels", ["true", "false"])
def test_the_daemon_may_read_and_annotate_its_node_and_post_an_event_with_or_without_node_labels(labels):
    assert rights(render("--set", f"nodeLabels.enabled={labels}")) == {
        ("", "nodes", "get"), ("", "nodes", "patch"), ("events.k8s.io", "events", "create")}


BAD_RESOURCE_NAMES = ["gpu", "kubernetes.io/gpu", "x.kubernetes.io/gpu", "Example.com/gpu", "example.com/" + "g" * 56,
                      "example.com/gpu/x"]


@pytest.mark.parametrize("name", BAD_RESOURCE_NAMES)
def test_a_resource_name_that_is_no_extended_resource_name_is_refused_naming_the_value(name):
    r = helm("template", "t", str(FAKE_GPU_CHART), "--set", f"resourceName={name}", check=False)
    assert r.returncode != 0 and "/resourceName" in r.stderr, r.stderr


def test_allow_real_gpu_nodes_is_a_boolean():
    r = helm("template", "t", str(FAKE_GPU_CHART), "--set-string", "allowRealGpuNodes=yes", check=False)
    assert r.returncode != 0 and "/allowRealGpuNodes" in r.stderr, r.stderr


VAP = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"


def test_the_node_patch_policy_binds_the_daemons_account_to_its_own_node_and_its_own_keys():
    docs = render("--api-versions", VAP, "--set", "resourceName=example.com/fake")
    (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConditions"][0]["expression"] == 'request.userInfo.username == "system:serviceaccount:ns:t-fake-gpu"'
    rules = " ".join(v["expression"] for v in spec["validations"])
    assert "authentication.kubernetes.io/node-name" in rules and "object.spec == oldObject.spec" in rules
    assert '"example.com/fake."' in rules and '"fake-gpu.gpu-agent.io/advertises.example.com_fake"' in rules
    # Off, or on a cluster without the API (before 1.30): not rendered.
    for sets in (("--api-versions", VAP, "--set", "nodePatchPolicy.enabled=false"), ()):
        assert not [d for d in render(*sets) if d["kind"].startswith("ValidatingAdmissionPolicy")]
