"""The chart's `helm test` (templates/tests/, issue 50): a test Pod that runs `gpu-agent chart-test` in the cluster
agent's image, its ServiceAccount, Role, RoleBinding and NetworkPolicy, all test hooks deleted before the next test
and when it passes; the components' NetworkPolicies admit it; test.enabled=false renders none of it. `helm template`
only (the e2e test that runs `helm test` on a cluster is in e2e/test_chart.py)."""

from __future__ import annotations

import pytest
import yaml

from e2e.release import BASE, CHART, helm

TEST_KINDS = {"Pod", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy"}
COMPONENT = "app.kubernetes.io/component"


def render(*sets: str) -> list[dict]:
    out = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def objects_of(docs) -> dict[str, dict]:
    return {d["kind"]: d for d in docs if d["metadata"].get("labels", {}).get(COMPONENT) == "test"}


def the_test_pod(docs) -> dict:
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    return pod


def restricted(pod_spec: dict) -> list[str]:
    """What the restricted Pod Security Standard would refuse in a pod spec (the checks that apply to a pod
    without host namespaces, volumes of its own or ports)."""
    bad = []
    pod_ctx = pod_spec.get("securityContext", {})
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        ctx = c.get("securityContext", {})
        if ctx.get("privileged"):
            bad.append(f"{c['name']}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{c['name']}: allowPrivilegeEscalation is not false")
        if ctx.get("capabilities", {}).get("drop") != ["ALL"] or set(ctx.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{c['name']}: capabilities do not drop ALL")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            bad.append(f"{c['name']}: runAsNonRoot is not true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            bad.append(f"{c['name']}: runs as root")
        if ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{c['name']}: no RuntimeDefault seccomp profile")
    if pod_spec.get("hostNetwork") or pod_spec.get("hostPID") or pod_spec.get("hostIPC"):
        bad.append("host namespaces")
    if any("hostPath" in v for v in pod_spec.get("volumes", [])):
        bad.append("hostPath volumes")
    return bad


def test_with_the_defaults_the_test_pod_runs_chart_test_against_the_releases_services_as_a_test_hook():
    docs = render()
    objects = objects_of(docs)
    assert set(objects) == TEST_KINDS
    for kind, obj in objects.items():
        notes = obj["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "test", kind
        assert notes["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded", kind
        assert obj["metadata"]["name"] == "t-gpu-agent-test", kind
    # The RBAC and the policy exist before the Pod (lower weights); the Pod is at the default, 0.
    weights = {k: int(o["metadata"]["annotations"].get("helm.sh/hook-weight", "0")) for k, o in objects.items()}
    assert max(weights[k] for k in TEST_KINDS - {"Pod"}) < weights["Pod"] == 0

    pod = objects["Pod"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert c["command"] == ["gpu-agent"]
    assert c["args"] == ["chart-test", "--namespace=ns", "--fullname=t-gpu-agent",
                         "--control-plane-url=https://t-gpu-agent-control-plane.ns.svc:8700",
                         "--admin-token-file=/var/run/secrets/gpu-agent/adminToken",
                         "--control-plane-ca-file=/var/run/gpu-agent/control-plane-ca/ca.crt",
                         "--cluster-agent-service=t-gpu-agent-cluster-agent",
                         "--node-agent-service=t-gpu-agent-node-agent", "--graceful-no-gpu=false", "--timeout=60"]
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-gpu-agent-cluster-agent")
    assert c["image"] == deployment["spec"]["template"]["spec"]["containers"][0]["image"]  # the release's own image
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 90
    # The admin token alone, read-only, 0440: one work item end to end; and the CA it verifies the control plane with.
    tokens, ca = spec["volumes"]
    assert ca["secret"] == {"secretName": "t-gpu-agent-control-plane-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}],
                            "defaultMode": 0o440}
    assert tokens["secret"]["items"] == [{"key": "adminToken", "path": "adminToken"}]
    assert tokens["secret"]["defaultMode"] == 0o440 and c["volumeMounts"][0]["readOnly"] is True
    assert spec["serviceAccountName"] == "t-gpu-agent-test" and spec["automountServiceAccountToken"] is True
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # The Role lists EndpointSlices (the agents behind their Services) and nothing else.
    assert objects["Role"]["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}]
    assert objects["RoleBinding"]["subjects"][0]["name"] == "t-gpu-agent-test"


def test_the_test_pod_passes_the_restricted_pod_security_shape_the_other_pods_have():
    docs = render()
    pod = the_test_pod(docs)
    assert restricted(pod["spec"]) == []
    ctx = pod["spec"]["containers"][0]["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    # The same shape as the hook Jobs', whose values it takes.
    hook = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]
    assert pod["spec"]["securityContext"] == hook["securityContext"]
    assert ctx == hook["containers"][0]["securityContext"]


def test_restricted_catches_what_the_standard_refuses():
    """The shape check above refuses what it should (else it proves nothing)."""
    pod = the_test_pod(render())["spec"]
    for broken in ({"allowPrivilegeEscalation": True}, {"capabilities": {"drop": []}}, {"runAsUser": 0}):
        spec = {**pod, "containers": [{**pod["containers"][0], "securityContext": {**pod["containers"][0]["securityContext"], **broken}}]}
        assert restricted(spec), broken


@pytest.mark.parametrize("sets", [["--set", "test.enabled=false"],
                                  ["--set", "test.enabled=false", "--set", "networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prom"]],
                         ids=["defaults", "metricsFrom"])
def test_test_enabled_false_renders_nothing_of_the_test_and_no_policy_names_it(sets):
    docs = render(*sets)
    assert objects_of(docs) == {}
    assert not [d for d in docs if d["kind"] == "Pod"]
    assert "component: test" not in str(docs) and "'app.kubernetes.io/component': 'test'" not in str(docs)


def test_placement_image_values_and_the_timeout_reach_the_test_pod():
    docs = render("--set", "test.timeoutSeconds=120", "--set", "hooks.nodeSelector.pool=system",
                  "--set", "hooks.tolerations[0].operator=Exists", "--set", "hooks.priorityClassName=low",
                  "--set", "global.imageRegistry=mirror.example", "--set", "global.imagePullSecrets[0]=pull",
                  "--set", "clusterAgent.image.tag=9.9", "--set", "gracefulNoGPU=true")
    spec = the_test_pod(docs)["spec"]
    assert spec["nodeSelector"] == {"pool": "system"} and spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["priorityClassName"] == "low" and spec["imagePullSecrets"] == [{"name": "pull"}]
    assert spec["activeDeadlineSeconds"] == 150
    (c,) = spec["containers"]
    assert c["image"] == "mirror.example/gpu-agent:9.9"
    assert "--timeout=120" in c["args"] and "--graceful-no-gpu=true" in c["args"]


def test_without_the_charts_control_plane_or_node_agents_the_test_skips_them_and_still_lists_the_cluster_agents():
    docs = render("--set", "controlPlane.enabled=false", "--set", "controlPlane.url=https://cp.example:8700",
                  "--set", "controlPlane.existingSecret=cp", "--set", "nodeAgent.enabled=false")
    objects = objects_of(docs)
    assert set(objects) == TEST_KINDS  # the Role lists the cluster agents' endpoints
    spec = objects["Pod"]["spec"]
    args = spec["containers"][0]["args"]
    assert not any(a.startswith(("--control-plane-url", "--node-agent-service", "--admin-token-file")) for a in args)
    assert "volumes" not in spec  # no admin token of an external control plane
    assert "--cluster-agent-service=t-gpu-agent-cluster-agent" in args and spec["automountServiceAccountToken"] is True


def policy(docs, component):
    return next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == f"t-gpu-agent-{component}")


def admits_test_pod(peers) -> bool:
    return any(p.get("podSelector", {}).get("matchLabels", {}).get(COMPONENT) == "test" for p in peers)


def test_the_network_policies_admit_the_test_pod_to_each_port_it_asks():
    docs = render()
    (cp_rule,) = policy(docs, "control-plane")["spec"]["ingress"]
    assert admits_test_pod(cp_rule["from"])
    for agent in ("cluster-agent", "node-agent"):  # anyone may reach them by default: the test Pod too
        (rule,) = policy(docs, agent)["spec"]["ingress"]
        assert "from" not in rule, agent
    # Limited to a monitoring namespace, they still admit the test Pod, by the component label it carries.
    docs = render("--set", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring")
    labels = the_test_pod(docs)["metadata"]["labels"]
    for agent in ("cluster-agent", "node-agent"):
        (rule,) = policy(docs, agent)["spec"]["ingress"]
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
        assert {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}} in rule["from"], agent
        assert admits_test_pod(rule["from"]), agent
        selector = next(p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p)
        assert selector.items() <= labels.items(), agent
    # The test Pod's own policy: no ingress (it listens on nothing).
    own = policy(docs, "test")
    assert own["spec"]["podSelector"]["matchLabels"].items() <= labels.items() and "ingress" not in own["spec"]
