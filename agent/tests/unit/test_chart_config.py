"""The chart's clusterAgent.config / nodeAgent.config (values.schema.json) admit exactly the agents' settings that the
chart does not wire itself, each with the type and range of its setting in the table, so that a value the schema
admits is one the agent accepts from its config file."""

import json
from pathlib import Path

import pytest

from gpu_agent.foundations.config import Setting
from gpu_agent.foundations.xids import MAX_XID
from gpu_agent.roles import cluster_agent, node_agent

CHART = Path(__file__).resolve().parents[3] / "charts" / "gpu-agent"

# What the chart sets for the release (templates/_helpers.tpl, gpu-agent.clusterAgentConfig and .nodeAgentConfig),
# or what the agent reads from the pod's environment (identity, nodeName, nodeIp, podName, podUid), or a flag
# (leaderElection, which the hooks look for). workPods and workServiceAccount come from the chart's workPods values;
# controlPlaneCaFile and controlPlaneAllowInsecure from its controlPlane TLS values (set only where a CA is mounted, or
# plain HTTP allowed). gpuHealthEvents comes from nodeAgent.gpuHealthEvents, with the Role that lets the node agents
# record them.
WIRED = {
    "cluster-agent": {"listenAddress", "clusterId", "gpuSource", "executor", "executorJournal", "workNamespace",
                      "workImage", "releaseName", "controlPlaneUrl", "controlPlaneCaFile", "controlPlaneAllowInsecure",
                      "controlPlaneTokenFile", "gracefulNoGPU", "domainName",
                      "gpuNodeSelector", "workPods", "workServiceAccount",
                      "draDriverName", "draDeviceClassName", "channelDeviceClassName",
                      "domainNamespace", "foldAllDomains", "kubeconfig", "identity", "leaderElection",
                      "leaderElectionLeaseName", "leaderElectionNamespace", "leaderElectionOwner", "workPodFence"},
    "node-agent": {"listenAddress", "gpuSource", "fakeGpuStateFile", "gpuHealthEvents", "domainName", "joinMatchingDomains",
                   "domainNamespace", "domainWriteStrategy", "peersFile", "kubeconfig", "nodeName", "nodeIp",
                   "podName", "podUid", "draDriverName", "draRegistryDir", "draPluginDir", "draCdiDir", "draDomainChannels"},
}
ROLES = {"cluster-agent": (cluster_agent.SETTINGS, "clusterAgent"), "node-agent": (node_agent.SETTINGS, "nodeAgent")}


def expected(s: Setting) -> dict[str, object]:
    if s.kind in ("seconds", "number"):
        return {"type": "number", "minimum": s.min, "maximum": s.max}
    if s.kind == "int":
        return {"type": "integer", "minimum": s.min, "maximum": s.max}
    if s.kind == "bool":
        return {"type": "boolean"}
    if s.kind == "choice":
        return {"type": "string", "enum": list(s.choices)}
    if s.kind == "xids":
        return {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": MAX_XID}}
    return {"type": "string"}


@pytest.mark.parametrize("role", ROLES)
def test_the_config_value_admits_each_unwired_setting_with_its_type_and_range(role):
    settings, key = ROLES[role]
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"][key]["properties"]["config"]
    assert config["type"] == "object" and config["additionalProperties"] is False
    names = {s.name for s in settings}
    assert WIRED[role] <= names, WIRED[role] - names
    wanted = {s.name: expected(s) for s in settings if s.kind != "secret" and s.name not in WIRED[role]}
    got = {name: {k: v for k, v in prop.items() if k != "description"} for name, prop in config["properties"].items()}
    assert got == wanted


def test_every_wired_setting_is_one_the_chart_renders():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    from_env = {"identity", "nodeName", "nodeIp", "podName", "podUid", "kubeconfig", "leaderElection"}
    for role, names in WIRED.items():
        for name in sorted(names - from_env):
            assert f'"{name}"' in helpers, (role, name)


# The chart's named values of agent settings, which values.yaml leaves null: the comment gives the agent's default.
NAMED = {
    "logVerbosity": ("cluster-agent", "verbosity"),
    "logFormat": ("cluster-agent", "logFormat"),
    "clusterAgent.registrationRetryInitial": ("cluster-agent", "registrationRetryInitial"),
    "clusterAgent.registrationRetryMax": ("cluster-agent", "registrationRetryMax"),
    "clusterAgent.reregistrationInterval": ("cluster-agent", "reregistrationInterval"),
    "clusterAgent.credentialRenewInterval": ("cluster-agent", "credentialRenewInterval"),
    "clusterAgent.leaderElection.leaseDuration": ("cluster-agent", "leaderElectionLeaseDuration"),
    "clusterAgent.leaderElection.renewDeadline": ("cluster-agent", "leaderElectionRenewDeadline"),
    "clusterAgent.leaderElection.retryPeriod": ("cluster-agent", "leaderElectionRetryPeriod"),
    "domain.heartbeatTTL": ("cluster-agent", "domainHeartbeatTtl"),
    "queue.maxInFlight": ("cluster-agent", "queueMaxInFlight"),
    "domain.heartbeatInterval": ("node-agent", "domainHeartbeatInterval"),
    "clusterAgent.kubeAPI.qps": ("cluster-agent", "kubeApiQps"),
    "clusterAgent.kubeAPI.burst": ("cluster-agent", "kubeApiBurst"),
    "nodeAgent.kubeAPI.qps": ("node-agent", "kubeApiQps"),
    "nodeAgent.kubeAPI.burst": ("node-agent", "kubeApiBurst"),
}


@pytest.mark.parametrize("value", NAMED)
def test_a_named_value_is_unset_and_its_comment_gives_the_agents_default(value):
    import yaml

    role, setting = NAMED[value]
    (s,) = [s for s in ROLES[role][0] if s.name == setting]
    node = yaml.safe_load((CHART / "values.yaml").read_text())
    for part in value.split("."):
        node = node[part]
    assert node is None, f"{value} repeats a default in values.yaml; leave it null so the agent's default applies"
    row = next(line for line in (CHART / "README.md").read_text().splitlines() if line.startswith(f"| `{value}` |"))
    default = s.default if isinstance(s.default, str) else f"{s.default:g}"
    assert f"the agent's default, {default}." in row or f"the components' default, {default}." in row, row
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert f'(list "{setting}" ' in helpers and f' "{value}")' in helpers
