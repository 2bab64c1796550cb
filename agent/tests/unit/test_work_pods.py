"""The workPods setting (foundations/work_pods.py) and the work Pod it shapes (PodExecutor._pod): every value reaches
the Pod, what the agent sets wins on every key it owns, the gpuNodeSelector merges in and wins, an empty shape leaves
the Pod as it was, and bad input stops the start with a ConfigError naming the setting, the key and the fix."""

import argparse
import json

import pytest

from gpu_agent.foundations.config import ConfigError, load
from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.work_pods import parse_work_pods
from gpu_agent.mechanisms.queues.pod_executor import FINALIZER, PodExecutor, pod_name
from gpu_agent.mechanisms.queues.work_claims import DraWorkClaims
from gpu_agent.roles.cluster_agent import SETTINGS, ClusterAgentConfig

ITEM = WorkItem(7, "job-1", {"gpus": 2, "command": ["run"]}, "l", 1)
LEADER = LeaderToken("agent-0", "uid-1", 3)
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}}
EVERY_VALUE = {
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"pool": "a100", "kubernetes.io/os": "linux"},
    "affinity": AFFINITY,
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "regcred"}, "mirror"],
    "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "priorityClassName": "batch-high",
    "labels": {"team": "ml", "cost-center": 42},
    "annotations": {"example.com/owner": "me"},
}


def pod(work_pods=None, node_selector="", claims=None, item=ITEM, leader=LEADER, service_account=""):
    ex = PodExecutor(None, "work", "img", release="rel", node_selector=node_selector, claims=claims,
                     work_pods=work_pods, service_account=service_account)
    return ex._pod(item, leader)


# The work Pod before workPods existed, for ITEM under LEADER in release "rel": an empty shape must give exactly this
# (no token and no Service links since issue 48: the chart's shape policy refuses a work Pod with either).
TODAYS_POD = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": pod_name("job-1"), "finalizers": [FINALIZER],
                 "labels": {"gpu-agent.io/work-item": "true", "app.kubernetes.io/managed-by": "gpu-agent",
                            "app.kubernetes.io/instance": "rel"},
                 "annotations": {"gpu-agent.io/idempotency-key": "job-1", "gpu-agent.io/item-id": "7", "gpu-agent.io/gpus": "2",
                                 "gpu-agent.io/leader": "agent-0", "gpu-agent.io/lease-uid": "uid-1",
                                 "gpu-agent.io/lease-transitions": "3"}},
    "spec": {"automountServiceAccountToken": False, "enableServiceLinks": False,
             "restartPolicy": "Never", "terminationGracePeriodSeconds": 5, "containers": [{
        "name": "work", "image": "img", "imagePullPolicy": "IfNotPresent", "command": ["run"],
        "resources": {"limits": {"nvidia.com/gpu": "2"}},
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
                            "seccompProfile": {"type": "RuntimeDefault"}}}]},
}


@pytest.mark.parametrize("shape", [None, {}, parse_work_pods({}), parse_work_pods(
    {"tolerations": [], "nodeSelector": {}, "affinity": {}, "runtimeClassName": "", "imagePullSecrets": [],
     "resources": {}, "priorityClassName": "", "labels": {}, "annotations": {}})])
def test_with_no_work_pod_values_the_pod_is_todays(shape):
    assert pod(shape) == TODAYS_POD
    assert parse_work_pods(None) == {} and load(SETTINGS, argparse.Namespace(), {}, as_=ClusterAgentConfig).workPods == {}


def test_the_work_service_account_is_the_pods_and_no_token_is_mounted_with_or_without_it():
    named = pod(service_account="rel-gpu-agent-work")
    assert named["spec"]["serviceAccountName"] == "rel-gpu-agent-work"
    assert {k: v for k, v in named["spec"].items() if k != "serviceAccountName"} == TODAYS_POD["spec"]
    assert "serviceAccountName" not in pod()["spec"]  # the namespace's default (make run, the simulation)
    for spec in (named["spec"], pod()["spec"]):
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert load(SETTINGS, argparse.Namespace(), {}, as_=ClusterAgentConfig).workServiceAccount == ""


def test_every_work_pod_value_reaches_the_pod_beside_what_the_agent_sets():
    got = pod(parse_work_pods(EVERY_VALUE))
    spec, (container,) = got["spec"], got["spec"]["containers"]
    assert spec["tolerations"] == EVERY_VALUE["tolerations"]
    assert spec["nodeSelector"] == {"pool": "a100", "kubernetes.io/os": "linux"}
    assert spec["affinity"] == AFFINITY
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    assert spec["priorityClassName"] == "batch-high"
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"},
                                      "limits": {"memory": "2Gi", "nvidia.com/gpu": "2"}}
    assert got["metadata"]["labels"] == {**TODAYS_POD["metadata"]["labels"], "team": "ml", "cost-center": "42"}
    assert got["metadata"]["annotations"] == {**TODAYS_POD["metadata"]["annotations"], "example.com/owner": "me"}
    # Everything else is today's Pod.
    assert spec["restartPolicy"] == "Never" and got["metadata"]["finalizers"] == [FINALIZER]
    added = {"tolerations", "nodeSelector", "affinity", "runtimeClassName", "imagePullSecrets", "priorityClassName"}
    assert {k: v for k, v in spec.items() if k not in added | {"containers"}} == \
        {k: v for k, v in TODAYS_POD["spec"].items() if k != "containers"}


def test_what_the_agent_sets_wins_over_a_shape_that_did_not_come_through_the_settings():
    # The loader refuses these keys (below); a shape handed to the executor directly still cannot override them.
    hostile = {"labels": {"gpu-agent.io/work-item": "false", "app.kubernetes.io/managed-by": "me",
                          "app.kubernetes.io/instance": "other", "team": "ml"},
               "annotations": {"gpu-agent.io/leader": "someone", "gpu-agent.io/item-id": "999", "gpu-agent.io/gpus": "0",
                               "gpu-agent.io/idempotency-key": "x", "example.com/owner": "me"},
               "resources": {"limits": {"nvidia.com/gpu": "8", "memory": "1Gi"}},
               "nodeSelector": {"kubernetes.io/hostname": "elsewhere", "pool": "a"}}
    got = pod(hostile, node_selector="kubernetes.io/hostname=gpu-1")
    assert got["metadata"]["labels"] == {**TODAYS_POD["metadata"]["labels"], "team": "ml"}
    assert got["metadata"]["annotations"] == {**TODAYS_POD["metadata"]["annotations"], "example.com/owner": "me"}
    assert got["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "2", "memory": "1Gi"}}
    # The user's nodeSelector merges with the gpuNodeSelector, which wins on the key both set.
    assert got["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "gpu-1", "pool": "a"}
    assert got["spec"]["restartPolicy"] == "Never" and got["metadata"]["finalizers"] == [FINALIZER]


def test_a_user_node_selector_merges_with_the_gpu_node_selector():
    got = pod(parse_work_pods({"nodeSelector": {"zone": "z1"}}), node_selector="gpu-agent.io/pool=a")
    assert got["spec"]["nodeSelector"] == {"zone": "z1", "gpu-agent.io/pool": "a"}
    assert pod(parse_work_pods({"nodeSelector": {"zone": "z1"}}))["spec"]["nodeSelector"] == {"zone": "z1"}


def test_with_dra_the_users_resources_keep_the_agents_claim_and_a_zero_gpu_item_gets_the_users_alone():
    claims = DraWorkClaims(None, "work", "gpu.example.com", release="rel")
    shape = parse_work_pods({"resources": {"requests": {"cpu": "1"}}})
    got = pod(shape, claims=claims)
    assert got["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1"}, **claims.pod_parts(2)[1]}
    assert got["spec"]["resourceClaims"] == claims.pod_parts(2)[0]["resourceClaims"]
    none = pod(shape, item=WorkItem(8, "cpu-only", {"gpus": 0}, "l", 1))
    assert none["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1"}}


def config(environ=None, tmp_path=None, doc=None):
    args = argparse.Namespace()
    if doc is not None:
        path = tmp_path / "config.yaml"
        path.write_text(json.dumps(doc))  # JSON is YAML
        args.config = str(path)
    return load(SETTINGS, args, environ or {}, as_=ClusterAgentConfig)


def test_the_setting_comes_from_the_config_file_as_a_mapping_and_from_the_environment_as_json(tmp_path):
    assert config(doc={"workPods": EVERY_VALUE}, tmp_path=tmp_path).workPods == parse_work_pods(EVERY_VALUE)
    assert config({"GPU_AGENT_WORK_PODS": json.dumps({"labels": {"team": "ml"}})}).workPods == {"labels": {"team": "ml"}}
    assert config({"GPU_AGENT_WORK_PODS": ""}).workPods == {}


BAD = [
    ({"labels": {"gpu-agent.io/work-item": "x"}}, "labels key 'gpu-agent.io/work-item' is the agent's own"),
    ({"labels": {"app.kubernetes.io/instance": "x"}}, "labels key 'app.kubernetes.io/instance' is the agent's own"),
    ({"annotations": {"gpu-agent.io/leader": "x"}}, "annotations key 'gpu-agent.io/leader' is the agent's own"),
    ({"resources": {"limits": {"nvidia.com/gpu": 4}}}, "resources.limits.nvidia.com/gpu is the agent's own"),
    ({"resources": {"claims": [{"name": "x"}]}}, "resources.claims is the agent's own"),
    ({"resources": {"requests": {"cpu": True}}}, "resources.requests.cpu must be a resource name with a quantity"),
    ({"podSecurityContext": {}}, "unknown key 'podSecurityContext'; known: tolerations, nodeSelector"),
    ({"tolerations": {"key": "a"}}, "tolerations must be a list"),
    ({"tolerations": [{"key": "a", "effects": "NoSchedule"}]}, "tolerations[0] has unknown field 'effects'"),
    ({"affinity": {"nodeAfinity": {}}}, "affinity has unknown field 'nodeAfinity'"),
    ({"nodeSelector": {"pool": "a b"}}, "nodeSelector.pool value 'a b' is not a Kubernetes label value"),
    ({"nodeSelector": ["pool=a"]}, "nodeSelector must be a mapping"),
    ({"labels": {"bad key": "x"}}, "labels key 'bad key' is not a Kubernetes qualified name"),
    ({"labels": {"team": {"a": 1}}}, "labels.team must be a string, got dict"),
    ({"runtimeClassName": "Nvidia_CDI"}, "runtimeClassName must be a lowercase DNS subdomain name"),
    ({"priorityClassName": 3}, "priorityClassName must be a lowercase DNS subdomain name"),
    ({"imagePullSecrets": [{"secret": "x"}]}, "imagePullSecrets entry {'secret': 'x'} is not a Secret name"),
    (["tolerations"], "it must be a mapping of tolerations"),
]


@pytest.mark.parametrize("value,named", BAD, ids=[n[:40] for _, n in BAD])
def test_a_bad_value_stops_the_start_naming_the_setting_the_key_and_the_fix(value, named, tmp_path):
    for source in ("file", "env"):
        with pytest.raises(ConfigError) as e:
            if source == "file":
                config(doc={"workPods": value}, tmp_path=tmp_path)
            else:
                config({"GPU_AGENT_WORK_PODS": json.dumps(value)})
        text = str(e.value)
        assert text.startswith("invalid value for workPods (from "), text
        assert named in text, text
        assert "fix it in the chart's workPods values" in text and "GPU_AGENT_WORK_PODS" in text, text


def test_json_that_does_not_parse_names_the_setting_and_how_to_set_it():
    with pytest.raises(ConfigError) as e:
        config({"GPU_AGENT_WORK_PODS": "{labels: team=ml"})
    assert "invalid value for workPods (from environment GPU_AGENT_WORK_PODS)" in str(e.value)
    assert "a mapping (JSON in a flag or the environment) of tolerations" in str(e.value)
    assert "--work-pods" in str(e.value)
