"""The work Pods' shape (issue 48, part 2) as `helm template` renders it, and the shape policy's CEL evaluated without a
cluster: the work ServiceAccount and the cluster agent's setting naming it, the policy and its binding, then every
expression of the rendered policy run by cel-expr-python (the CEL team's C++ runtime, with the strings and optional
libraries Kubernetes' CEL has) on the Pod the agent's own builder makes, which is admitted in every shape the chart can
give it, and on one Pod per refused feature (e2e/work_pod_shapes.py, the table the e2e test sends to a real API
server), each refused by the check that names it.

What this cannot show is how a real API server reads the policy (its type check, its defaults, its admission
plugins' order): e2e/test_work_pod_shape.py does, with the same table."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from cel_expr_python import cel
from cel_expr_python.ext import ext_optional, ext_strings

from e2e.release import BASE, CHART, helm
from e2e.work_pod_shapes import ATTEMPTS, Names, as_admitted, work_pod
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.work_pods import parse_work_pods
from gpu_agent.mechanisms.queues.work_claims import DraWorkClaims

NAMES = Names(release="t", namespace="ns")
AGENT = "system:serviceaccount:ns:t-gpu-agent-cluster-agent"
LEADER = LeaderToken("t-gpu-agent-cluster-agent-7d9f-x2", "0b5c2a8e-uid", 4)
EVERY_WORK_PODS_VALUE = {
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"pool": "a100"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}},
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "regcred"}],
    "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "priorityClassName": "batch-high",
    "labels": {"team": "ml"},
    "annotations": {"example.com/owner": "me"},
}


def render(*sets: str) -> list[dict[str, Any]]:
    out = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def named(docs: list[dict[str, Any]], kind: str, suffix: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]


def shape_policy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (policy,) = named(docs, "ValidatingAdmissionPolicy", "-work-pod-shape")
    return policy


def cluster_agent_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "t-gpu-agent-cluster-agent"]
    config: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
    return config


# --- the policy's CEL, evaluated ---------------------------------------------------------------------------------

DYN = cel.Type.DYN
# What a ValidatingAdmissionPolicy's expressions see: every object as an untyped (dyn) value, as the API server compiles
# them (object, oldObject, request, params, namespaceObject, variables), with its strings (join) and optional libraries.
ENV = cel.NewEnv(variables={name: DYN for name in ("object", "oldObject", "request", "params", "namespaceObject",
                                                    "variables")},
                 extensions=[ext_strings.ExtStrings(), ext_optional.ExtOptional()])


class EvaluationError(AssertionError):
    """An expression that failed: the API server would deny (failurePolicy Fail) without the policy's message."""


def evaluate(expression: str, activation: dict[str, Any]) -> Any:
    value = ENV.compile(expression).eval(data=activation)
    if value.type() == cel.Type.ERROR:
        raise EvaluationError(f"{expression!r} failed: {value.value()}")
    return value.plain_value()


@dataclass
class Decision:
    matched: bool
    refusals: list[tuple[int, str]]  # (index of the validation, its message), in the policy's order

    @property
    def admitted(self) -> bool:
        return not self.refusals

    @property
    def message(self) -> str:
        """What the API server answers: the first refusing validation's message."""
        return self.refusals[0][1] if self.refusals else ""


def decide(policy: dict[str, Any], pod: dict[str, Any], username: str = AGENT) -> Decision:
    """The policy's decision on creating `pod` as `username`: its match conditions, its variables in order (each may
    read the ones before), then every validation, with the message of each that refuses."""
    spec = policy["spec"]
    activation: dict[str, Any] = {"object": pod, "oldObject": None, "params": None, "namespaceObject": None,
                                  "request": {"operation": "CREATE", "userInfo": {"username": username},
                                              "namespace": pod["metadata"].get("namespace", "ns")}}
    if not all(evaluate(c["expression"], activation) for c in spec.get("matchConditions", [])):
        return Decision(False, [])
    variables: dict[str, Any] = {}
    activation["variables"] = variables
    for variable in spec.get("variables", []):
        variables[variable["name"]] = evaluate(variable["expression"], activation)
    refusals = []
    for i, validation in enumerate(spec["validations"]):
        if evaluate(validation["expression"], activation) is True:
            continue
        message = evaluate(validation["messageExpression"], activation) if "messageExpression" in validation \
            else validation["message"]
        assert isinstance(message, str) and message.strip() and "\n" not in message, message
        refusals.append((i, message))
    return Decision(True, refusals)


GOOD = {
    "one GPU": {},
    "eight GPUs": {"gpus": 8},
    "no GPU": {"gpus": 0},
    "every workPods value": {"work_pods": parse_work_pods(EVERY_WORK_PODS_VALUE)},
    "a gpuNodeSelector": {"node_selector": "kubernetes.io/hostname=gpu-1"},
    "GPUs through DRA": {"claims": DraWorkClaims(None, "ns", "gpu.example.com", release="t")},
    "DRA, every workPods value": {"claims": DraWorkClaims(None, "ns", "gpu.example.com", release="t"),
                                  "work_pods": parse_work_pods(EVERY_WORK_PODS_VALUE)},
}


@pytest.fixture(scope="module")
def policies() -> dict[str, dict[str, Any]]:
    return {"fencing": shape_policy(render()),
            "no fencing": shape_policy(render("--set", "clusterAgent.workPodFencing=false"))}


@pytest.mark.parametrize("case", list(GOOD))
@pytest.mark.parametrize("fencing", ["fencing", "no fencing"])
def test_the_pod_the_agent_builds_is_admitted_as_built_and_as_admission_sees_it(policies, case, fencing):
    pod = work_pod(NAMES, LEADER, **GOOD[case])
    for seen in (pod, as_admitted(pod)):
        decision = decide(policies[fencing], seen)
        assert decision.matched and decision.admitted, decision.refusals


def test_without_fencing_the_agents_pod_needs_no_token_and_with_it_a_pod_without_one_is_refused(policies):
    bare = work_pod(NAMES, None)
    assert decide(policies["no fencing"], bare).admitted
    refused = decide(policies["fencing"], bare)
    assert "lacks the annotation gpu-agent.io/leader, gpu-agent.io/lease-uid, gpu-agent.io/lease-transitions" \
        in refused.message, refused


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.what for a in ATTEMPTS])
def test_each_refused_feature_is_refused_by_the_check_that_names_it(policies, attempt):
    good = as_admitted(work_pod(NAMES, LEADER))
    pod = attempt.pod(good, NAMES)
    decision = decide(policies["fencing"], as_admitted(pod))
    assert decision.matched and not decision.admitted, f"{attempt.what}: admitted"
    assert attempt.named(NAMES) in decision.message, (attempt.what, decision.message)
    if not attempt.fencing:
        assert not decide(policies["no fencing"], as_admitted(pod)).admitted, attempt.what


# The chart's floor, DRA's (resource claims kept), and the CI cluster's (charts/tests/test_lint.py SCHEMA_VERSION).
SCHEMA_VERSIONS = ((1, 30), (1, 34), (1, 36))


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.what for a in ATTEMPTS])
def test_each_attempt_is_a_pod_the_api_schema_takes_from_the_version_the_e2e_test_sends_it_to(attempt):
    """What the e2e test sends must reach the policy: a Pod its schema refuses (a field misplaced or not served yet)
    would be refused before it, 422, and prove nothing about it."""
    import kubernetes_validate

    good = work_pod(NAMES, LEADER)
    for version in SCHEMA_VERSIONS:
        if attempt.since is not None and version >= attempt.since:
            kubernetes_validate.validate(good, f"{version[0]}.{version[1]}.0", strict=True)
            kubernetes_validate.validate(attempt.pod(good, NAMES), f"{version[0]}.{version[1]}.0", strict=True)


def test_every_check_decides_some_attempt_so_none_can_go_unnoticed(policies):
    """For each validation, an attempt that it refuses first (so without it the answer changes: admitted, or refused
    by a message that does not name the feature), and, but for the privileged check, one that it alone refuses (so
    without it that Pod is admitted). A privileged container is refused by the allowPrivilegeEscalation check as well:
    the API server's own validation refuses privileged beside allowPrivilegeEscalation false, before any policy, so
    the privileged check is there for its message."""
    policy = policies["fencing"]
    good = as_admitted(work_pod(NAMES, LEADER))
    decisions = [decide(policy, as_admitted(a.pod(good, NAMES))) for a in ATTEMPTS]
    every = set(range(len(policy["spec"]["validations"])))
    assert {d.refusals[0][0] for d in decisions} == every
    (privileged,) = [i for i, v in enumerate(policy["spec"]["validations"]) if "variables.privileged" in v["expression"]]
    assert {d.refusals[0][0] for d in decisions if len(d.refusals) == 1} == every - {privileged}


def test_others_pods_are_not_matched_the_agents_account_of_another_namespace_included(policies):
    host_path = next(a for a in ATTEMPTS if a.what == "a hostPath volume of /")
    hostile = as_admitted(host_path.pod(work_pod(NAMES, LEADER), NAMES))
    for user in ("kubernetes-admin", "system:serviceaccount:ns:t-gpu-agent-node-agent",
                 "system:serviceaccount:other:t-gpu-agent-cluster-agent", "system:serviceaccount:ns:t-gpu-agent-work"):
        assert not decide(policies["fencing"], hostile, username=user).matched, user
    assert decide(policies["fencing"], hostile).matched


def types(policy: dict[str, Any]) -> tuple[list[cel.Type], list[tuple[str, cel.Type, cel.Type | None]]]:
    """The checked types of the policy's match conditions, and of each validation and its messageExpression, as the
    API server's type checker sees them: `object` dyn, each variable typed as its expression (here: the expression put
    in its place)."""
    inlined: dict[str, str] = {}

    def inline(expression: str) -> str:
        return re.sub(r"variables\.(\w+)", lambda m: f"({inlined[m.group(1)]})", expression)

    for variable in policy["spec"]["variables"]:
        inlined[variable["name"]] = inline(variable["expression"])
    conditions = [ENV.compile(c["expression"]).return_type() for c in policy["spec"]["matchConditions"]]
    checks = [(v["expression"], ENV.compile(inline(v["expression"])).return_type(),
               ENV.compile(inline(v["messageExpression"])).return_type() if "messageExpression" in v else None)
              for v in policy["spec"]["validations"]]
    return conditions, checks


def test_each_expression_has_the_type_the_api_server_requires_of_it(policies):
    """The API server refuses a policy whose match condition or validation is not a bool, or whose messageExpression
    is not a string."""
    for policy in policies.values():
        conditions, checks = types(policy)
        assert conditions == [cel.Type.BOOL]
        for expression, check, message in checks:
            assert check == cel.Type.BOOL and (message is None or message == cel.Type.STRING), (expression, check, message)


def test_an_expression_that_cannot_evaluate_is_told_apart_from_a_refusal():
    """The harness itself: a field read without has() fails, as it would at the API server (a deny without the
    policy's message), rather than passing for admitted or refused."""
    with pytest.raises(EvaluationError, match="hostNetwork"):
        evaluate("object.spec.hostNetwork", {"object": work_pod(NAMES, LEADER)})


# --- the render --------------------------------------------------------------------------------------------------


def test_the_work_service_account_holds_nothing_and_the_agent_is_told_its_name():
    docs = render()
    (account,) = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "t-gpu-agent-work"]
    assert account["automountServiceAccountToken"] is False and account["metadata"]["namespace"] == "ns"
    assert account["metadata"]["labels"]["app.kubernetes.io/component"] == "work"
    bound = [s for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding") for s in d["subjects"]]
    assert all(s["name"] != "t-gpu-agent-work" for s in bound), bound
    assert cluster_agent_config(docs)["workServiceAccount"] == "t-gpu-agent-work"
    assert "workPods" not in cluster_agent_config(docs)  # the chart's own keys of the block are no agent shape

    mine = render("--set", "workPods.serviceAccount.create=false", "--set", "workPods.serviceAccount.name=batch",
                  "--set", "workPods.admissionPolicy=true")
    assert not [d for d in mine if d["kind"] == "ServiceAccount" and d["metadata"]["name"] in ("batch", "t-gpu-agent-work")]
    assert cluster_agent_config(mine)["workServiceAccount"] == "batch"
    assert "variables.serviceAccount == 'batch'" in shape_policy(mine)["spec"]["validations"][0]["expression"]
    annotated = render("--set", "workPods.serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account=w@p.iam")
    (account,) = [d for d in annotated if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "t-gpu-agent-work"]
    assert account["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": "w@p.iam"}


@pytest.mark.parametrize("sets,refused", [
    (["--set", "workPods.serviceAccount.create=false"], "workPods.serviceAccount.name is required"),
    (["--set", "workPods.serviceAccount.name=t-gpu-agent-node-agent"],
     'workPods.serviceAccount.name: "t-gpu-agent-node-agent" is nodeAgent.serviceAccount\'s'),
    (["--set", "workPods.serviceAccount.name=shared", "--set", "clusterAgent.serviceAccount.name=shared"],
     'workPods.serviceAccount.name: "shared" is clusterAgent.serviceAccount\'s'),
    (["--set", "workPods.serviceAccount.name=Bad_Name"], "/workPods/serviceAccount/name"),
    (["--set", "workPods.admissionPolicy=maybe"], "/workPods/admissionPolicy"),
], ids=["no name", "the node agents' account", "the cluster agent's account", "a bad name", "a bad switch"])
def test_a_work_account_that_is_missing_or_holds_rights_is_refused_at_render_naming_it(sets, refused):
    r = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *sets, check=False)
    assert r.returncode != 0 and refused in r.stderr, r.stderr


def test_the_shape_policy_matches_the_cluster_agents_pod_creates_in_the_release_namespace_and_denies_with_403():
    docs = render()
    policy = shape_policy(docs)
    (binding,) = named(docs, "ValidatingAdmissionPolicyBinding", "-work-pod-shape")
    spec = policy["spec"]
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"  # GA in 1.30
    assert len(policy["metadata"]["name"]) <= 63 and "namespace" not in policy["metadata"]
    assert spec["failurePolicy"] == "Fail" and "paramKind" not in spec
    assert spec["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]
    assert [c["expression"] for c in spec["matchConditions"]] == [f"request.userInfo.username == '{AGENT}'"]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"],
                               "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ns"}}}}
    # Every refusal is 403 Forbidden with a message of its own (a static message has no line break: the API server
    # refuses one that has).
    for v in spec["validations"]:
        assert v["reason"] == "Forbidden" and ("messageExpression" in v or "\n" not in v["message"]), v
    checks = " ".join(v["expression"] for v in spec["validations"])
    for wanted in ("variables.serviceAccount == 't-gpu-agent-work'", "object.spec.automountServiceAccountToken == false",
                   "size(variables.volumes) == 0", "size(variables.hostNamespaces) == 0", "size(variables.privileged) == 0",
                   "size(variables.escalation) == 0", "size(variables.capabilities) == 0", "size(variables.secretEnv) == 0",
                   "size(variables.claims) == 0", "variables.labels['app.kubernetes.io/instance'] == 't'",
                   "size(variables.missingToken) == 0"):
        assert wanted in checks, wanted
    admitted_volumes = next(v["expression"] for v in spec["variables"] if v["name"] == "volumes")
    assert "has(v.emptyDir) || has(v.configMap) || has(v.downwardAPI)" in admitted_volumes
    claims = next(v["expression"] for v in spec["variables"] if v["name"] == "claims")
    assert "startsWith('t-work-gpus-')" in claims and "substring(12)" in claims  # work_claims.py's template_name
    kinds = next(v["expression"] for v in spec["variables"] if v["name"] == "containers")
    assert "initContainers" in kinds and "ephemeralContainers" in kinds


def test_a_custom_cluster_agent_account_is_the_one_matched_and_the_fencing_check_follows_fencing():
    custom = shape_policy(render("--set", "clusterAgent.serviceAccount.create=false",
                                 "--set", "clusterAgent.serviceAccount.name=platform-sa"))
    assert custom["spec"]["matchConditions"][0]["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:ns:platform-sa'")
    for sets in (["--set", "clusterAgent.workPodFencing=false"], ["--set", "clusterAgent.leaderElection.enabled=false"]):
        spec = shape_policy(render(*sets))["spec"]
        assert "missingToken" not in yaml.safe_dump(spec), sets


def test_the_shape_policy_is_off_only_when_asked():
    docs = render("--set", "workPods.admissionPolicy=false")
    assert named(docs, "ValidatingAdmissionPolicy", "-work-pod-shape") == []
    assert named(docs, "ValidatingAdmissionPolicyBinding", "-work-pod-shape") == []
    # the account and the agent's setting stay: a work Pod still runs as it, without a token
    assert cluster_agent_config(docs)["workServiceAccount"] == "t-gpu-agent-work"
    with_record = render("--set", "clusterAgent.executor=record")  # its Role still may create Pods: still checked
    assert named(with_record, "ValidatingAdmissionPolicy", "-work-pod-shape")
