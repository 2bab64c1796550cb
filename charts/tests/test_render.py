"""charts/gpu-agent as `helm template` renders it: values refused naming the value, and what each value
set puts in the manifests. No cluster is needed (the unit stage runs these); the tests that install the chart
are in e2e/test_chart.py."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from e2e.release import APP_VERSION, BASE, CHART, helm
from gpu_agent_hooks.cli import parser as hook_parser


def render(*sets: str) -> list[dict]:
    out = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def cluster_agent_deployment(docs):
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-cluster-agent"))


def agent_config(docs, agent):
    """The settings in an agent's ConfigMap (what `--config` reads)."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"t-gpu-agent-{agent}"]
    return yaml.safe_load(cm["data"]["config.yaml"])


BAD_VALUES = [
    (["--set", "logVerbosity=9"], "logVerbosity"),
    (["--set", "logVerbosity=-1"], "logVerbosity"),
    (["--set", "logFormat=xml"], "/logFormat"),
    (["--set", "gracefulNoGPU=maybe"], "gracefulNoGPU"),
    (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "clusterAgent.gpuSource=tpu"], "gpuSource"),
    (["--set", "clusterAgent.executor=shell"], "executor"),
    (["--set", "clusterAgent.registrationRetryMax=0"], "registrationRetryMax"),
    (["--set", "clusterAgent.strategy.type=BlueGreen"], "strategy"),
    (["--set", "clusterAgent.leaderElection.enabled=false", "--set", "clusterAgent.strategy.type=RollingUpdate"],
     "clusterAgent.strategy"),
    (["--set", "clusterAgent.clusterId=Not_A_Name"], "clusterId"),
    (["--set", "nodeAgent.gpuSource=cuda"], "gpuSource"),
    (["--set", "nodeAgent.fakeGpuStateDir=relative/dir"], "fakeGpuStateDir"),
    (["--set", "featureGates.WarpDrive=true"], "featureGates"),
    (["--set", "hooks.activeDeadlineSeconds=1"], "activeDeadlineSeconds"),
    (["--set", "controlPlane.url=ftp://x"], "url"),
    (["--set", "controlPlane.enabled=false"], "controlPlane.url is required"),
    (["--set", "controlPlane.enabled=false", "--set", "controlPlane.url=https://cp"], "controlPlane.existingSecret is required"),
    (["--set", "unknownValue=1"], "unknownValue"),
    (["--set", "controlPlane.faultInjection=yes"], "faultInjection"),
    (["--set", "dra.enabled=yes"], "/dra/enabled"),
    (["--set", "dra.enabled=true", "--set", "dra.driverName=GPU.Example.com"], "/dra/driverName"),
    (["--set", "dra.enabled=true", "--set", "dra.driverName=gpu_example"], "/dra/driverName"),
    (["--set", "dra.enabled=true", "--set", "dra.driverName="], "/dra/driverName"),
    (["--set", "dra.driverName=" + "g" * 61 + ".io"], "/dra/driverName"),  # over 63: refused even while DRA is off
    (["--set", "dra.deviceClassName=Class"], "/dra/deviceClassName"),
    (["--set", "dra.channelDeviceClassName=Channel_Class"], "/dra/channelDeviceClassName"),
    (["--set", "dra.enabled=true", "--set", "dra.channelDeviceClassName=gpu.gpu-agent.io"],
     "dra.channelDeviceClassName and dra.deviceClassName are both"),  # two DeviceClasses, one name
    (["--set", "clusterAgent.config.channelDeviceClassName=x"], "channelDeviceClassName"),  # wired: set dra.*
    (["--set", "dra.extendedResourceName=gpu"], "/dra/extendedResourceName"),  # an extended resource has a domain
    (["--set", "dra.kubeletRegistryDir=var/lib/kubelet/plugins_registry"], "/dra/kubeletRegistryDir"),
    (["--set", "dra.kubeletPluginsDir=plugins"], "/dra/kubeletPluginsDir"),
    (["--set", "dra.cdiDir=cdi"], "/dra/cdiDir"),
    (["--set", "dra.socketDir=/x"], "socketDir"),
    (["--set", "nodeAgent.config.draDriverName=x"], "draDriverName"),  # the chart wires it: set dra.driverName
    (["--set", "clusterAgent.config.gracefulNoGPU=true"], "gracefulNoGPU"),  # the chart wires it: set gracefulNoGPU
    (["--set", "nodeAgent.runtimeClassName=Nvidia_CDI"], "/nodeAgent/runtimeClassName"),  # not a DNS subdomain
    (["--set", "nodeAgent.runtimeClassName=true"], "/nodeAgent/runtimeClassName': got boolean, want null or string"),
    (["--set", "nodeAgent.runtimeClassName=" + "r" * 254], "/nodeAgent/runtimeClassName"),
    (["--set", "nodeAgent.nvml.driverRoot=run/nvidia/driver"], "/nodeAgent/nvml/driverRoot"),  # a host path is absolute
    (["--set", "nodeAgent.nvml.libraryPath=/usr/lib64/libnvidia-ml.so.1"], "/nodeAgent/nvml/libraryPath"),  # relative
    (["--set", "nodeAgent.nvml.libraryPath=usr/lib64"], "/nodeAgent/nvml/libraryPath"),  # the file, not its folder
    (["--set", "nodeAgent.nvml.driverDir=/"], "additional properties 'driverDir' not allowed"),
    (["--set", "clusterAgent.kubeAPI.burst=0"], "/clusterAgent/kubeAPI/burst"),  # a bucket of 0 admits nothing
    (["--set", "nodeAgent.kubeAPI.qps=-2"], "/nodeAgent/kubeAPI/qps"),
    (["--set", "nodeAgent.kubeAPI.limit=1"], "additional properties 'limit' not allowed"),
    (["--set", "nodeAgent.gpuHealthEvents=sometimes"], "/nodeAgent/gpuHealthEvents"),
]


@pytest.mark.parametrize("sets,named", BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_bad_values_are_refused_naming_the_value(sets, named):
    r = helm("template", "t", str(CHART), *BASE, *sets, check=False)
    assert r.returncode != 0
    assert named in r.stderr, r.stderr


def test_rendered_strategy_follows_the_readiness_model():
    hand_over = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert cluster_agent_deployment(render())["spec"]["strategy"] == hand_over  # leader election is on by default
    assert cluster_agent_deployment(render("--set", "clusterAgent.replicas=2"))["spec"]["strategy"] == hand_over
    graceful = cluster_agent_deployment(render("--set", "gracefulNoGPU=true"))
    assert graceful["spec"]["strategy"] == {"type": "Recreate"}
    alone = cluster_agent_deployment(render("--set", "clusterAgent.leaderElection.enabled=false"))
    assert alone["spec"]["strategy"] == {"type": "Recreate"}
    explicit = cluster_agent_deployment(render("--set", "gracefulNoGPU=true", "--set", "clusterAgent.strategy.type=RollingUpdate"))
    assert explicit["spec"]["strategy"] == {"type": "RollingUpdate"}
    no_surge = cluster_agent_deployment(render("--set", "clusterAgent.leaderElection.enabled=false",
                                               "--set", "clusterAgent.strategy.type=RollingUpdate",
                                               "--set", "clusterAgent.strategy.rollingUpdate.maxSurge=0"))
    assert no_surge["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0}


def test_graceful_no_gpu_reaches_the_cluster_agents_config_in_both_states_and_the_notes_say_what_each_means():
    assert agent_config(render(), "cluster-agent")["gracefulNoGPU"] is False  # NVCA's default: fail fast at start
    assert agent_config(render("--set", "gracefulNoGPU=true"), "cluster-agent")["gracefulNoGPU"] is True
    assert "gracefulNoGPU" not in agent_config(render(), "node-agent")  # the cluster agent's alone
    off, on = notes(), notes("--set", "gracefulNoGPU=true")
    assert "gracefulNoGPU is off (NVCA's default): a cluster agent that starts with no GPUs in the cluster exits" in off
    assert "so on a cluster whose GPU nodes have not joined yet it crash-loops" in off
    assert "Set gracefulNoGPU=true for clusters whose GPU nodes come and go" in off
    assert "gracefulNoGPU is on: with no GPUs the cluster agent stays live but NotReady" in on
    assert "gracefulNoGPU is off" not in on and "gracefulNoGPU is on" not in off


def test_rendered_placement_finds_gpu_nodes_by_any_common_label_and_a_users_selector_wins():
    def node_agent(*sets):
        return next(d for d in render(*sets) if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]

    spec = node_agent()
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = [t["matchExpressions"][0]["key"] for t in terms]
    assert keys[0] == "nvidia.com/gpu.present" and "feature.node.kubernetes.io/pci-10de.present" in keys
    assert "nodeSelector" not in spec and spec["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in spec["tolerations"]  # any value, any effect
    chosen = node_agent("--set", "nodeAgent.nodeSelector.pool=gpu")
    assert chosen["nodeSelector"] == {"pool": "gpu"} and "affinity" not in chosen
    mine = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}
    users = node_agent("--set-json", f"nodeAgent.affinity={json.dumps({'nodeAffinity': mine})}")
    assert users["affinity"] == {"nodeAffinity": mine}
    spread = node_agent("--set-json", 'nodeAgent.affinity={"podAntiAffinity": {}}')
    assert spread["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == terms
    assert "affinity" not in node_agent("--set", "nodeAgent.gpuNodeSelectorTerms=null")  # every node


def test_the_work_pod_fencing_policy_takes_the_releases_workfence_as_its_param_and_renders_only_with_leader_election():
    def fencing(*sets):
        docs = render(*sets)
        return ([d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith("-work-pod-fence")],
                [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                 and d["metadata"]["name"].endswith("-work-pod-fence")], docs)

    [policy], [binding], docs = fencing()
    # A kind of our own, not the Lease: Kubernetes up to 1.36.2 stops watching a built-in param kind for good once no
    # binding names it (kubernetes#130887), and a release installed after that had every work Pod refused.
    assert policy["spec"]["paramKind"] == {"apiVersion": "gpu-agent.io/v1alpha1", "kind": "WorkFence"}
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]
    assert "'gpu-agent.io/leader' in object.metadata.annotations" in policy["spec"]["matchConditions"][0]["expression"]
    assert [v["reason"] for v in policy["spec"]["validations"]] == ["Forbidden"]
    config = agent_config(docs, "cluster-agent")
    fence = config["workPodFence"]  # the agent writes its token into the very object the binding names
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["paramRef"] == {"name": fence, "namespace": "ns", "parameterNotFoundAction": "Deny"}
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ns"}},
        "objectSelector": {"matchLabels": {"gpu-agent.io/work-item": "true", "app.kubernetes.io/instance": "t"}}}
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-cluster-agent"))
    assert "patch" in next(r for r in role["rules"] if r["resources"] == ["pods"])["verbs"]  # the finalizer's release
    assert {"create"} <= {v for r in role["rules"] if r["resources"] == ["workfences"] for v in r["verbs"]}
    assert any(r.get("resourceNames") == [fence] and set(r["verbs"]) == {"get", "update"} for r in role["rules"]
               if r["resources"] == ["workfences"])
    unfenced = fencing("--set", "clusterAgent.workPodFencing=false")
    assert unfenced[:2] == ([], []) and "workPodFence" not in agent_config(unfenced[2], "cluster-agent")
    assert fencing("--set", "clusterAgent.leaderElection.enabled=false")[:2] == ([], [])


def test_the_member_policy_renders_whenever_node_agents_write_members_and_checks_before_and_after():
    def policy(*sets):
        docs = render(*sets)
        return ([d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith("-own-member")],
                [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["metadata"]["name"].endswith("-own-member")])

    assert policy() == ([], [])  # no domain: node agents write no member
    [joining], [binding] = policy("--set", "domain.joinMatching=true")  # no chart domain, members all the same
    assert binding["spec"]["policyName"] == joining["metadata"]["name"]
    assert policy("--set", "domain.name=fabric")[0] == [joining]
    assert policy("--set", "domain.name=fabric", "--set", "domain.writeStrategy=dra") == ([], [])
    assert policy("--set", "domain.joinMatching=true", "--set", "domain.memberAdmissionPolicy=false") == ([], [])
    assert policy("--set", "domain.joinMatching=true", "--set", "nodeAgent.enabled=false") == ([], [])
    spec = joining["spec"]
    assert spec["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE", "UPDATE", "DELETE"]
    assert spec["matchConditions"][0]["expression"] == (
        "request.userInfo.username == 'system:serviceaccount:ns:t-gpu-agent-node-agent'")
    checks = " ".join(v["expression"] for v in spec["validations"])
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "oldObject.spec.node" in variables["nodeBefore"] and "object.spec.node" in variables["nodeAfter"]
    assert "variables.nodeBefore == variables.node" in checks and "variables.nodeAfter == variables.node" in checks
    assert "variables.label == variables.domain" in checks and "!variables.domain.contains('.')" in checks
    assert "request.operation == 'UPDATE' && variables.legacy" in checks  # 0.1's names: never on CREATE


def test_a_default_install_renders_a_handful_of_args_and_only_the_settings_a_user_set_reach_the_config():
    def agents(*sets):
        docs = render(*sets)
        (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
        return ([cluster_agent_deployment(docs), ds], [agent_config(docs, "cluster-agent"), agent_config(docs, "node-agent")])

    (ca, na), (ca_config, na_config) = agents()
    container = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0] for d in (ca, na)}
    # The hooks (and 0.2's) tell an agent that elects by its --leader-election=true; the rest is in the ConfigMap.
    assert container["t-gpu-agent-cluster-agent"]["args"] == [
        "cluster-agent", "--config=/etc/gpu-agent/config.yaml", "--leader-election=true"]
    assert container["t-gpu-agent-node-agent"]["args"] == ["node-agent", "--config=/etc/gpu-agent/config.yaml"]
    for d in (ca, na):
        mounts = d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "config", "mountPath": "/etc/gpu-agent", "readOnly": True} in mounts
    # Only the chart's wiring: no tuning setting is rendered when nobody set it (the agent's default applies).
    # gracefulNoGPU is a value of the chart's own, always passed (test_graceful_no_gpu_reaches_...), and so is
    # gpuHealthEvents, which the Role that lets the node agents record them goes with (test_gpu_health_events_...).
    assert set(ca_config) == {"listenAddress", "clusterId", "gpuSource", "executor", "executorJournal", "workNamespace",
                              "workImage", "releaseName", "controlPlaneUrl", "controlPlaneTokenFile", "controlPlaneCaFile", "gracefulNoGPU",
                              "leaderElectionLeaseName", "leaderElectionNamespace", "leaderElectionOwner", "workPodFence",
                              "workServiceAccount"}
    assert set(na_config) == {"listenAddress", "gpuSource", "fakeGpuStateFile", "gpuHealthEvents"}
    assert ca_config["listenAddress"] == "0.0.0.0:8080" and ca_config["leaderElectionLeaseName"] == "t-gpu-agent-cluster-agent"

    (ca2, na2), (ca2_config, na2_config) = agents(
        "--set", "clusterAgent.registrationRetryMax=40", "--set", "clusterAgent.config.leaseSeconds=60",
        "--set", "logVerbosity=2", "--set", "domain.name=d1", "--set", "domain.heartbeatInterval=1")
    assert ca2_config["registrationRetryMax"] == 40 and ca2_config["leaseSeconds"] == 60 and ca2_config["verbosity"] == 2
    assert na2_config["domainHeartbeatInterval"] == 1 and na2_config["verbosity"] == 2
    rendered = yaml.safe_dump_all([ca2, na2])
    assert "registration-retry-max" not in rendered and "lease-seconds" not in rendered and "-v=" not in rendered
    assert "registrationRetryInitial" not in ca2_config and "domainHeartbeatTtl" not in ca2_config  # set nowhere
    assert "reregistration" not in yaml.safe_dump_all(render("--set", "clusterAgent.registrationRetryMax=40"))
    # A changed setting rolls the pods (a new pod template), an unchanged one does not.
    checksum = [d["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for d in (ca, na, ca2, na2)]
    assert checksum[0] != checksum[2] and checksum[1] != checksum[3]
    assert checksum[:2] == [d["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for d in agents()[0]]


CONFIG_REFUSED = [
    (["--set", "logVerbosity=2", "--set", "clusterAgent.config.verbosity=3"], "clusterAgent.config.verbosity (3) and logVerbosity (2)"),
    (["--set", "logFormat=json", "--set", "nodeAgent.config.logFormat=text"], "nodeAgent.config.logFormat (text) and logFormat (json)"),
    (["--set", "clusterAgent.config.logFormat=yaml"], "/clusterAgent/config/logFormat"),
    (["--set", "clusterAgent.config.listenAddress=0.0.0.0:1"], "listenAddress"),
    (["--set", "nodeAgent.config.noSuchSetting=1"], "noSuchSetting"),
    (["--set", "clusterAgent.config.leaseSeconds=0"], "leaseSeconds"),
    (["--set", "clusterAgent.leaderElection.leaseDuration=5", "--set", "clusterAgent.config.leaderElectionRenewDeadline=6"],
     "retryPeriod < renewDeadline < leaseDuration"),
    (["--set", "nodeAgent.kubeAPI.qps=5", "--set", "nodeAgent.config.kubeApiQps=6"],
     "nodeAgent.config.kubeApiQps (6) and nodeAgent.kubeAPI.qps (5)"),
    (["--set", "nodeAgent.config.gpuHealthEvents=false"], "gpuHealthEvents"),  # wired: nodeAgent.gpuHealthEvents
]


@pytest.mark.parametrize("sets,named", CONFIG_REFUSED, ids=[n[:40] for _, n in CONFIG_REFUSED])
def test_a_config_setting_the_chart_wires_or_a_conflicting_one_is_refused_naming_it(sets, named):
    r = helm("template", "t", str(CHART), *BASE, *sets, check=False)
    assert r.returncode != 0
    assert named in r.stderr, r.stderr


def test_the_kube_api_limit_values_reach_each_agents_settings(tmp_path):
    """clusterAgent.kubeAPI and nodeAgent.kubeAPI, read by the agent's own loader from the ConfigMap it mounts."""
    import argparse

    from gpu_agent.foundations.config import load
    from gpu_agent.roles import cluster_agent, node_agent

    roles = {"cluster-agent": (cluster_agent.SETTINGS, cluster_agent.ClusterAgentConfig),
             "node-agent": (node_agent.SETTINGS, node_agent.NodeAgentConfig)}

    def limits(docs):
        out = {}
        for role, (settings, as_) in roles.items():
            path = tmp_path / f"{role}.yaml"
            config = agent_config(docs, role)
            config.pop("controlPlaneTokenFile", None)  # the pod's Secret mount, not on this machine
            path.write_text(yaml.safe_dump(config))
            cfg = load(settings, argparse.Namespace(config=str(path)), environ={}, as_=as_)
            out[role] = (cfg.kubeApiQps, cfg.kubeApiBurst)
        return out

    docs = render()
    assert not {"kubeApiQps", "kubeApiBurst"} & {*agent_config(docs, "cluster-agent"), *agent_config(docs, "node-agent")}
    assert limits(docs) == {"cluster-agent": (100.0, 200), "node-agent": (10.0, 20)}  # unset: the agents' defaults
    docs = render("--set", "clusterAgent.kubeAPI.qps=40", "--set", "clusterAgent.kubeAPI.burst=60",
                  "--set", "nodeAgent.kubeAPI.qps=-1", "--set", "nodeAgent.kubeAPI.burst=3")
    assert limits(docs) == {"cluster-agent": (40.0, 60), "node-agent": (-1.0, 3)}  # -1: no limit
    docs = render("--set", "clusterAgent.config.kubeApiBurst=7")  # or through the free-form config
    assert limits(docs)["cluster-agent"] == (100.0, 7)


def test_gpu_health_events_grant_the_node_agents_create_and_patch_on_events_alone_with_no_object_outside_the_namespace(
        tmp_path):
    """nodeAgent.gpuHealthEvents (on by default): the setting reaches the node agent, and a ClusterRole lets its
    ServiceAccount create and patch events.k8s.io Events and nothing else (a Node's Events live in namespace default,
    where a Role would be the chart's one object outside its namespace: `kubectl apply -n` of the rendered chart, the
    GitOps path, refuses such an object); off: the setting says so and no such ClusterRole or binding renders."""
    import argparse

    from gpu_agent.foundations.config import load
    from gpu_agent.roles import node_agent

    def setting(docs):
        path = tmp_path / "node-agent.yaml"
        path.write_text(yaml.safe_dump(agent_config(docs, "node-agent")))
        return load(node_agent.SETTINGS, argparse.Namespace(config=str(path)), environ={},
                    as_=node_agent.NodeAgentConfig).gpuHealthEvents

    def events_rbac(docs):
        return {d["kind"]: d for d in docs if d["metadata"]["name"] == "t-gpu-agent-node-agent-events"}

    def event_rules(docs, who):
        return [(d["kind"], d["metadata"].get("namespace"), r) for d in docs if d["kind"] in ("Role", "ClusterRole")
                and who in d["metadata"]["name"] for r in d["rules"] if "events" in r["resources"]]

    events = {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}
    for sets in ([], ["--set", "domain.name=d1", "--set", "dra.enabled=true", "--set", "domain.joinMatching=true"]):
        docs = render(*sets)
        assert setting(docs) is True, sets
        rbac = events_rbac(docs)
        assert sorted(rbac) == ["ClusterRole", "ClusterRoleBinding"], sets
        assert "namespace" not in rbac["ClusterRole"]["metadata"] and "namespace" not in rbac["ClusterRoleBinding"]["metadata"]
        assert rbac["ClusterRole"]["rules"] == [events]
        assert rbac["ClusterRoleBinding"]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                         "name": "t-gpu-agent-node-agent-events"}
        assert rbac["ClusterRoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "t-gpu-agent-node-agent",
                                                           "namespace": "ns"}]
        assert event_rules(docs, "node-agent") == [("ClusterRole", None, events)], "no other right on events"
        # every namespaced object of the chart is in the release's namespace (kubectl apply -n ns takes them all)
        assert {d["metadata"].get("namespace") for d in docs} <= {None, "ns"}, sets
    off = render("--set", "nodeAgent.gpuHealthEvents=false")
    assert setting(off) is False and events_rbac(off) == {} and event_rules(off, "node-agent") == []
    # The token goes with the right: without a domain, DRA or Events the node agent needs no API access.
    for docs, mounted in ((render(), True), (off, False)):
        (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
        (sa,) = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "t-gpu-agent-node-agent"]
        assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is sa["automountServiceAccountToken"] is mounted
    assert events_rbac(render("--set", "nodeAgent.enabled=false")) == {}
    named = render("--set", "nodeAgent.serviceAccount.create=false", "--set", "nodeAgent.serviceAccount.name=gpu-nodes")
    assert events_rbac(named)["ClusterRoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-nodes", "namespace": "ns"}]


def test_two_cluster_agents_get_a_disruption_budget_and_prefer_different_nodes():
    def budget(*sets):
        return [d for d in render(*sets) if d["kind"] == "PodDisruptionBudget"]

    assert budget() == [] and "affinity" not in cluster_agent_deployment(render())["spec"]["template"]["spec"]
    two = render("--set", "clusterAgent.replicas=2")
    [pdb] = [d for d in two if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["selector"]["matchLabels"] == cluster_agent_deployment(two)["spec"]["selector"]["matchLabels"]
    preferred = cluster_agent_deployment(two)["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert budget("--set", "clusterAgent.replicas=2", "--set", "clusterAgent.podDisruptionBudget.enabled=false") == []


def test_both_charts_render_as_subcharts_of_an_umbrella_chart_with_global_values(tmp_path):
    umbrella = tmp_path / "umbrella"
    (umbrella / "charts").mkdir(parents=True)
    for chart in ("gpu-agent", "fake-gpu"):
        shutil.copytree(CHART.parent / chart, umbrella / "charts" / chart)
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({"apiVersion": "v2", "name": "umbrella", "version": "0.0.1",
                                                         "dependencies": [{"name": "gpu-agent", "version": APP_VERSION},
                                                                          {"name": "fake-gpu", "version": APP_VERSION}]}))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({"global": {"imageRegistry": "registry.example", "x": 1},
                                                         "gpu-agent": {"controlPlane": {"enabled": True}}}))
    docs = [d for d in yaml.safe_load_all(helm("template", "u", str(umbrella)).stdout) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "DaemonSet", "Service"} <= kinds
    assert any(d["metadata"]["name"].startswith("u-fake-gpu") for d in docs)


def test_pull_secrets_pod_metadata_and_extra_env_reach_every_workload():
    docs = render("--set", "imagePullSecrets[0].name=regcred", "--set", "clusterAgent.podAnnotations.a=b",
                  "--set", "nodeAgent.podLabels.team=gpu", "--set", "controlPlane.extraEnv[0].name=HTTPS_PROXY",
                  "--set", "controlPlane.extraEnv[0].value=http://proxy:3128")
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "DaemonSet", "Job")}
    assert len(pods) >= 5  # 3 workloads, the crds (with the skew check) and cleanup hook Jobs
    assert all(t["spec"].get("imagePullSecrets") == [{"name": "regcred"}] for t in pods.values()), "a workload lacks the pull secret"
    by_suffix = {name.rsplit("-gpu-agent-", 1)[1]: t for name, t in pods.items()}
    assert by_suffix["cluster-agent"]["metadata"]["annotations"] == {
        "a": "b", "checksum/config": by_suffix["cluster-agent"]["metadata"]["annotations"]["checksum/config"]}
    assert by_suffix["node-agent"]["metadata"]["labels"]["team"] == "gpu"
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in by_suffix["control-plane"]["spec"]["containers"][0]["env"]


def test_the_nvml_node_agent_runs_unprivileged_and_a_runtime_class_it_is_given_wins():
    spec = node_agent_pod(render("--set", "nodeAgent.runtimeClassName=nvidia"))
    assert spec["runtimeClassName"] == "nvidia"
    ctx = spec["containers"][0]["securityContext"]
    assert ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]} and ctx["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in spec["containers"][0]["env"]
    assert node_agent_pod(render("--set", "nodeAgent.runtimeClassName=nvidia-cdi"))["runtimeClassName"] == "nvidia-cdi"
    fake = node_agent_pod(render("--set", "nodeAgent.gpuSource=fake", "--set", "nodeAgent.runtimeClassName=nvidia"))
    assert "runtimeClassName" not in fake  # NVML's alone
    assert fake["securityContext"]["runAsNonRoot"] is True


def test_by_default_the_node_agent_needs_no_runtime_class_that_may_not_exist():
    """Issue 45: `nvidia` outright made every node agent pod "RuntimeClass not found" on a cluster without the GPU
    operator, and `helm install --wait` fail. The default (null) takes `nvidia` only where `lookup` finds it, and
    `helm template` has no cluster to ask: no runtimeClassName, with the toolkit's environment still set."""
    for sets in ([], ["--set", "nodeAgent.runtimeClassName=null"], ["--set", "nodeAgent.runtimeClassName="],
                 ["--set", "dra.enabled=true"]):
        spec = node_agent_pod(render(*sets))
        assert "runtimeClassName" not in spec, sets
        env = spec["containers"][0]["env"]
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in env, sets
        assert {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"} in env, sets
        assert spec["containers"][0]["securityContext"]["privileged"] is False, sets
    assert yaml.safe_load((CHART / "values.yaml").read_text())["nodeAgent"]["runtimeClassName"] is None


def test_the_host_driver_mounts_the_nvml_library_alone_and_runs_privileged_only_when_asked():
    default = node_agent_pod(render())
    assert not [v for v in default["volumes"] if v["name"] == "nvml-library"]
    assert not [e for e in default["containers"][0]["env"] if e["name"] == "LD_LIBRARY_PATH"]
    for root, library, host_path in (
            ("/", None, "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
            ("/run/nvidia/driver/", None, "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
            ("/home/kubernetes/bin/nvidia", "lib64/libnvidia-ml.so.1", "/home/kubernetes/bin/nvidia/lib64/libnvidia-ml.so.1")):
        sets = ["--set", f"nodeAgent.nvml.driverRoot={root}"] + (["--set", f"nodeAgent.nvml.libraryPath={library}"] if library else [])
        docs = render(*sets)
        (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
        spec = ds["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert {"name": "nvml-library", "hostPath": {"path": host_path, "type": "File"}} in spec["volumes"], root
        assert {"name": "nvml-library", "mountPath": "/opt/nvml/libnvidia-ml.so.1", "readOnly": True} in container["volumeMounts"]
        assert {"name": "LD_LIBRARY_PATH", "value": "/opt/nvml"} in container["env"]
        ctx = container["securityContext"]
        assert ctx["privileged"] is True and ctx["allowPrivilegeEscalation"] is True  # the API server wants both
        assert ctx["readOnlyRootFilesystem"] is True
        assert "runtimeClassName" not in spec
        skipped = [v.split("=", 1)[0] for k, v in ds["metadata"]["annotations"].items() if k.startswith("checkov.io/skip")]
        assert {"CKV_K8S_16", "CKV_K8S_20"} <= set(skipped)
    values = yaml.safe_load((CHART / "values.yaml").read_text())["nodeAgent"]
    assert values["nvml"]["driverRoot"] == "" and values["securityContext"]["privileged"] is False
    fake = node_agent_pod(render("--set", "nodeAgent.gpuSource=fake", "--set", "nodeAgent.nvml.driverRoot=/"))
    assert fake["containers"][0]["securityContext"]["privileged"] is False  # NVML's alone
    assert not [v for v in fake["volumes"] if v["name"] == "nvml-library"]


def notes(*sets: str) -> str:
    """NOTES as `helm install --dry-run=client` prints them: no cluster to ask (the kubeconfig names none), so every
    `lookup` finds nothing, as under `helm template` and GitOps renderers."""
    out = helm("install", "t", str(CHART), "--namespace", "ns", "--dry-run=client", "--kubeconfig", "/nonexistent/kubeconfig",
               *BASE, *sets).stdout
    return out.split("\nNOTES:\n", 1)[1]


def test_notes_say_how_the_node_agent_reaches_nvml_and_what_to_set_when_nothing_brings_it():
    default = notes()
    assert "NVML without a RuntimeClass: see the warning below" in default
    assert "WARNING: the node agents (gpuSource nvml) have no RuntimeClass: rendered without a cluster" in default
    assert "the GPU operator is installed" in default and "--set nodeAgent.runtimeClassName=nvidia" in default
    assert "--set nodeAgent.nvml.driverRoot=/" in default and "--set nodeAgent.gpuSource=fake" in default
    assert 'the cluster has none named "nvidia"' not in default  # nothing was asked
    empty = notes("--set", "nodeAgent.runtimeClassName=")
    assert 'have no RuntimeClass: nodeAgent.runtimeClassName is "".' in empty
    assert "--set nodeAgent.runtimeClassName=nvidia" in empty
    given = notes("--set", "nodeAgent.runtimeClassName=nvidia")
    assert "NVML through RuntimeClass nvidia\n" in given and "no RuntimeClass" not in given
    assert 'the cluster has no RuntimeClass "nvidia"' not in given  # nothing was asked: no claim it is missing
    host = notes("--set", "nodeAgent.nvml.driverRoot=/run/nvidia/driver")
    assert ("NVML from the host's driver: /run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 "
            "(nodeAgent.nvml.driverRoot), privileged") in host
    assert "no RuntimeClass" not in host
    for sets in (["--set", "nodeAgent.gpuSource=fake"], ["--set", "nodeAgent.enabled=false"]):
        assert "NVML" not in notes(*sets) and "RuntimeClass" not in notes(*sets), sets


def test_each_component_takes_its_own_image_service_account_and_extra_volumes():
    digest = "sha256:" + "a" * 64
    docs = render("--set", f"image.digest={digest}", "--set", "clusterAgent.image.tag=ca1",
                  "--set", "nodeAgent.image.repository=registry.example/node-agent", "--set", "nodeAgent.image.pullPolicy=Always",
                  "--set", "clusterAgent.serviceAccount.create=false", "--set", "clusterAgent.serviceAccount.name=platform-sa",
                  "--set", "nodeAgent.serviceAccount.annotations.iam\\.example/role=gpu",
                  "--set", "controlPlane.extraVolumes[0].name=ca", "--set", "controlPlane.extraVolumes[0].configMap.name=corp-ca",
                  "--set", "controlPlane.extraVolumeMounts[0].name=ca", "--set", "controlPlane.extraVolumeMounts[0].mountPath=/etc/ssl/corp")
    pods = {d["metadata"]["name"].rsplit("-gpu-agent-", 1)[1]: d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in ("Deployment", "DaemonSet", "Job")}
    container = {name: spec["containers"][0] for name, spec in pods.items()}
    assert container["cluster-agent"]["image"] == f"localhost/gpu-agent:ca1@{digest}"
    assert container["node-agent"]["image"] == "registry.example/node-agent:dev"  # another repository: no inherited digest
    assert container["node-agent"]["imagePullPolicy"] == "Always" and container["control-plane"]["imagePullPolicy"] == "IfNotPresent"
    assert container["control-plane"]["image"] == container["crds"]["image"] == f"localhost/gpu-agent:dev@{digest}"
    assert pods["cluster-agent"]["serviceAccountName"] == "platform-sa"
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert "platform-sa" not in accounts and not any(n.endswith("-cluster-agent") for n in accounts)
    subjects = [s["name"] for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
                and d["metadata"]["name"].endswith("-cluster-agent") for s in d["subjects"]]
    assert subjects and set(subjects) == {"platform-sa"}
    assert accounts["t-gpu-agent-node-agent"]["metadata"]["annotations"] == {"iam.example/role": "gpu"}
    assert {"name": "ca", "configMap": {"name": "corp-ca"}} in pods["control-plane"]["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ssl/corp"} in container["control-plane"]["volumeMounts"]
    r = helm("template", "t", str(CHART), *BASE, "--set", "clusterAgent.serviceAccount.create=false", check=False)
    assert r.returncode and "clusterAgent.serviceAccount.name is required" in r.stderr


def test_an_existing_tokens_secret_makes_every_render_the_same_and_the_chart_makes_none():
    """GitOps renders with `helm template`, where `lookup` finds nothing: the chart's own tokens and its control
    plane's certificate would change on every render, existing Secrets do not."""
    first, second = (helm("template", "t", str(CHART), *BASE, "--set", "controlPlane.existingTokensSecret=cp-tokens",
                          "--set", "controlPlane.tls.existingSecret=cp-tls").stdout
                     for _ in range(2))
    assert first == second
    docs = [d for d in yaml.safe_load_all(first) if d]
    assert not [d for d in docs if d["kind"] == "Secret"]
    mounted = [v["secret"]["secretName"] for d in docs if d["kind"] in ("Deployment", "Job")
               for v in d["spec"]["template"]["spec"].get("volumes", []) if "secret" in v]
    assert mounted and set(mounted) == {"cp-tokens", "cp-tls"}
    own = [helm("template", "t", str(CHART), *BASE).stdout for _ in range(2)]
    assert own[0] != own[1]  # the limitation the value exists for


def test_name_overrides_rename_every_object():
    docs = render("--set", "fullnameOverride=acme-gpus")
    names = {d["metadata"]["name"] for d in docs if d["kind"] not in ("CustomResourceDefinition",)}
    assert all(n.startswith("acme-gpus") for n in names), names
    docs = render("--set", "nameOverride=gpuagent")
    assert all(d["metadata"]["labels"]["app.kubernetes.io/name"] == "gpuagent" for d in docs if "labels" in d["metadata"])


def test_hook_jobs_have_resources_and_placement_values():
    docs = render("--set", "hooks.tolerations[0].operator=Exists", "--set", "hooks.nodeSelector.pool=system")
    jobs = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Job"]
    assert len(jobs) == 2  # crds (the skew check runs first in it) and cleanup
    for spec in jobs:
        assert spec["containers"][0]["resources"]["requests"] and spec["containers"][0]["resources"]["limits"]
        assert spec["tolerations"] == [{"operator": "Exists"}] and spec["nodeSelector"] == {"pool": "system"}


def test_hook_jobs_take_the_proxy_and_extra_volumes_the_agents_take_beside_their_own():
    """A control plane behind a proxy: the uninstall's cleanup hook deregisters through it as the cluster agent does
    (hooks.extraEnv); extra volumes and mounts come after the hook's own (the cleanup hook's token, the CA)."""
    proxy = [{"name": "HTTPS_PROXY", "value": "http://proxy.example:3128"}, {"name": "NO_PROXY", "value": ".svc"}]
    docs = render("--set-json", f"hooks.extraEnv={json.dumps(proxy)}",
                  "--set-json", 'hooks.extraVolumes=[{"name":"corp","configMap":{"name":"corp-ca"}}]',
                  "--set-json", 'hooks.extraVolumeMounts=[{"name":"corp","mountPath":"/etc/corp","readOnly":true}]')
    jobs = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Job"}
    assert sorted(jobs) == ["t-gpu-agent-cleanup", "t-gpu-agent-crds"]
    for name, spec in jobs.items():
        (container,) = spec["containers"]
        assert container["env"] == proxy, name
        assert container["volumeMounts"][-1] == {"name": "corp", "mountPath": "/etc/corp", "readOnly": True}, name
        assert spec["volumes"][-1] == {"name": "corp", "configMap": {"name": "corp-ca"}}, name
    cleanup = jobs["t-gpu-agent-cleanup"]
    assert [m["name"] for m in cleanup["containers"][0]["volumeMounts"]] == ["token", "control-plane-ca", "corp"]
    # and none unless asked
    for spec in (d["spec"]["template"]["spec"] for d in render() if d["kind"] == "Job"):
        assert "env" not in spec["containers"][0] and "corp" not in json.dumps(spec)


def test_the_control_planes_fault_injection_is_off_unless_asked_for():
    def control_plane_args(*sets):
        (cp,) = [d for d in render(*sets) if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-control-plane")]
        return cp["spec"]["template"]["spec"]["containers"][0]["args"]

    assert not [a for a in control_plane_args() if "fault" in a]
    assert not [a for a in control_plane_args("--set", "controlPlane.faultInjection=false") if "fault" in a]
    assert "--fault-injection=true" in control_plane_args("--set", "controlPlane.faultInjection=true")


def test_monitors_and_the_control_planes_claim_render_only_when_asked():
    kinds = [d["kind"] for d in render()]
    assert not {"ServiceMonitor", "PodMonitor", "PersistentVolumeClaim"} & set(kinds)
    docs = render("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
                  "--set", "metrics.serviceMonitor.labels.release=prom", "--set", "controlPlane.persistence.enabled=true")
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert sorted((d["kind"], d["metadata"]["name"].rsplit("-", 2)[-2]) for d in monitors) == [
        ("PodMonitor", "cluster"), ("PodMonitor", "node"), ("ServiceMonitor", "cluster"), ("ServiceMonitor", "node")]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for sm in (d for d in monitors if d["kind"] == "ServiceMonitor"):
        assert sm["metadata"]["labels"]["release"] == "prom"
        target = services[sm["metadata"]["name"]]
        assert sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in target["spec"]["ports"]]
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    (cp,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-control-plane")]
    data = next(v for v in cp["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert data["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_a_gpu_node_selector_reaches_the_cluster_agents_config_only_when_set_and_a_bad_one_is_refused():
    assert "gpuNodeSelector" not in agent_config(render(), "cluster-agent")
    config = agent_config(render("--set", "clusterAgent.gpuNodeSelector.gpu-agent\\.io/pool=a"), "cluster-agent")
    assert config["gpuNodeSelector"] == {"gpu-agent.io/pool": "a"}
    r = helm("template", "t", str(CHART), *BASE, "--set", "clusterAgent.gpuNodeSelector.pool=" + "x" * 64, check=False)
    assert r.returncode != 0 and "gpuNodeSelector" in r.stderr, r.stderr


DRA_PATHS = {"dra-registry": "/var/lib/kubelet/plugins_registry", "dra-plugins": "/var/lib/kubelet/plugins",
             "dra-cdi": "/var/run/cdi"}


def dra_objects(docs):
    """The DRA objects the chart renders, by kind."""
    out = {}
    for d in docs:
        name = d["metadata"]["name"]
        if d["kind"] == "DeviceClass" or name.endswith(("-node-agent-dra", "-dra-own-slices")):
            out.setdefault(d["kind"], []).append(d)
    return out


def node_agent_pod(docs):
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds["spec"]["template"]["spec"]


def test_dra_is_off_by_default_and_renders_nothing_of_its_own():
    for sets in ([], ["--set", "nodeAgent.gpuSource=fake"], ["--set", "dra.enabled=true", "--set", "nodeAgent.enabled=false"]):
        docs = render(*sets)
        assert dra_objects(docs) == {}, sets
        assert not [d for d in docs if d["apiVersion"].startswith("resource.k8s.io")]
    docs = render()
    pod = node_agent_pod(docs)
    host_paths = [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v]
    assert not [p for p in host_paths if p.startswith(("/var/lib/kubelet", "/var/run/cdi"))], host_paths
    assert not [v for v in pod["volumes"] if v["name"].startswith("dra-")]
    assert pod["automountServiceAccountToken"] is True  # GPU health Events on its Node (the default)
    assert not [k for k in agent_config(docs, "node-agent") if k.startswith("dra")]
    rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
    assert not [r for r in rules if "resource.k8s.io" in r["apiGroups"]]


def test_dra_renders_the_device_class_the_rbac_the_slice_policy_the_kubelets_folders_and_the_settings():
    docs = render("--set", "dra.enabled=true")
    objects = dra_objects(docs)
    assert sorted(objects) == ["ClusterRole", "ClusterRoleBinding", "DeviceClass", "ValidatingAdmissionPolicy",
                               "ValidatingAdmissionPolicyBinding"]
    assert len(objects.pop("DeviceClass")) == 2  # the GPUs' and the channels' (test_the_device_classes_...)
    assert all(len(v) == 1 for v in objects.values()), objects

    (role,) = objects["ClusterRole"]
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): r for r in role["rules"]}
    assert len(rules) == len(role["rules"]) == 4
    assert rules[("resource.k8s.io",), ("resourceslices",)]["verbs"] == [
        "get", "list", "watch", "create", "update", "patch", "delete"]
    assert rules[("resource.k8s.io",), ("resourceclaims",)]["verbs"] == ["get", "list", "watch"]
    status = rules[("resource.k8s.io",), ("resourceclaims/driver",)]
    assert status["verbs"] == ["associated-node:update", "associated-node:patch"]
    assert status["resourceNames"] == ["gpu.gpu-agent.io"]
    assert rules[("",), ("nodes",)]["verbs"] == ["get"]
    assert "resourceNames" not in rules[("resource.k8s.io",), ("resourceslices",)]
    (binding,) = objects["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "t-gpu-agent-node-agent", "namespace": "ns"}]

    (policy,) = objects["ValidatingAdmissionPolicy"]
    (policy_binding,) = objects["ValidatingAdmissionPolicyBinding"]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [{"apiGroups": ["resource.k8s.io"], "apiVersions": ["*"],
                                                          "operations": ["CREATE", "UPDATE", "DELETE"],
                                                          "resources": ["resourceslices"]}]
    assert spec["matchConditions"] == [{"name": "this-releases-node-agents", "expression": (
        "request.userInfo.username == 'system:serviceaccount:ns:t-gpu-agent-node-agent'")}]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "request.userInfo.extra['authentication.kubernetes.io/node-name'][0]" in variables["node"]
    assert "oldObject.spec.nodeName" in variables["nodeBefore"] and "request.operation != 'CREATE'" in variables["nodeBefore"]
    assert "object.spec.nodeName" in variables["nodeAfter"] and "oldObject" not in variables["nodeAfter"]
    assert "request.operation == 'DELETE' ? (has(oldObject.spec)" in variables["driver"]
    checks = [v["expression"] for v in spec["validations"]]
    assert checks == ["variables.node != ''",
                      "request.operation == 'CREATE' || variables.nodeBefore == variables.node",  # UPDATE, DELETE: before
                      "request.operation == 'DELETE' || variables.nodeAfter == variables.node",  # CREATE, UPDATE: after
                      "variables.driver == 'gpu.gpu-agent.io'"]
    assert {v["reason"] for v in spec["validations"]} == {"Forbidden"}
    assert policy_binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert len(policy["metadata"]["name"]) <= 63

    pod = node_agent_pod(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    for name, path in DRA_PATHS.items():
        assert volumes[name]["hostPath"] == {"path": path, "type": "DirectoryOrCreate"}
        assert mounts[name] == {"name": name, "mountPath": path}  # at the host path, read-write
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsUser"] == 0 and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ctx = pod["containers"][0]["securityContext"]
    assert ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
    assert "add" not in ctx["capabilities"]
    config = agent_config(docs, "node-agent")
    assert {k: v for k, v in config.items() if k.startswith("dra")} == {
        "draDriverName": "gpu.gpu-agent.io", "draRegistryDir": DRA_PATHS["dra-registry"],
        "draPluginDir": DRA_PATHS["dra-plugins"], "draCdiDir": DRA_PATHS["dra-cdi"], "draDomainChannels": True}
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "t-gpu-agent-node-agent"]
    assert sa["automountServiceAccountToken"] is True


def gpu_selector(driver: str) -> str:
    return (f"device.driver == '{driver}' && (!('type' in device.attributes['{driver}']) || "
            f"device.attributes['{driver}'].type == 'gpu')")


def channel_selector(driver: str) -> str:
    return (f"device.driver == '{driver}' && 'type' in device.attributes['{driver}'] && "
            f"device.attributes['{driver}'].type == 'channel'")


def test_the_device_classes_split_the_drivers_devices_by_type_gpus_and_untyped_ones_in_one_channels_in_the_other():
    """Node agents publish a channel-0 device (type channel) beside their GPUs (type gpu); slices published before
    that have no type. The GPU class must never hand out a channel, nor the channel class a GPU."""
    docs = render("--set", "dra.enabled=true")
    classes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DeviceClass"}
    assert sorted(classes) == ["channel.gpu-agent.io", "gpu.gpu-agent.io"]
    for d in classes.values():
        assert d["apiVersion"] == "resource.k8s.io/v1"
        assert d["metadata"]["labels"]["app.kubernetes.io/component"] == "node-agent"
    assert classes["gpu.gpu-agent.io"]["spec"] == {"selectors": [{"cel": {"expression": gpu_selector("gpu.gpu-agent.io")}}]}
    assert classes["channel.gpu-agent.io"]["spec"] == {
        "selectors": [{"cel": {"expression": channel_selector("gpu.gpu-agent.io")}}]}

    # Each class in a template of its own (one resource per template), both only where node agents serve DRA.
    for template in ("templates/deviceclass.yaml", "templates/deviceclass-channel.yaml"):
        shown = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, "--set", "dra.enabled=true",
                     "--show-only", template).stdout
        assert [d["kind"] for d in yaml.safe_load_all(shown) if d] == ["DeviceClass"], template
    named = render("--set", "dra.enabled=true", "--set", "dra.channelDeviceClassName=imex.example.com")
    assert sorted(d["metadata"]["name"] for d in named if d["kind"] == "DeviceClass") == [
        "gpu.gpu-agent.io", "imex.example.com"]
    for sets in ([], ["--set", "dra.enabled=true", "--set", "nodeAgent.enabled=false"]):
        assert not [d for d in render(*sets) if d["kind"] == "DeviceClass"], sets


def test_dra_values_reach_every_object_that_names_them_and_fake_gpus_run_as_root_too():
    docs = render("--set", "dra.enabled=true", "--set", "nodeAgent.gpuSource=fake", "--set", "dra.driverName=gpu.example.com",
                  "--set", "dra.deviceClassName=fast-gpus", "--set", "dra.extendedResourceName=nvidia.com/gpu",
                  "--set", "dra.kubeletRegistryDir=/k/registry", "--set", "dra.kubeletPluginsDir=/k/plugins",
                  "--set", "dra.cdiDir=/etc/cdi")
    objects = dra_objects(docs)
    classes = {d["metadata"]["name"]: d["spec"] for d in objects["DeviceClass"]}
    assert classes == {"fast-gpus": {"selectors": [{"cel": {"expression": gpu_selector("gpu.example.com")}}],
                                     "extendedResourceName": "nvidia.com/gpu"},
                       "channel.gpu-agent.io": {"selectors": [{"cel": {"expression": channel_selector("gpu.example.com")}}]}}
    (role,) = objects["ClusterRole"]
    assert [r["resourceNames"] for r in role["rules"] if "resourceNames" in r] == [["gpu.example.com"]]
    (policy,) = objects["ValidatingAdmissionPolicy"]
    assert policy["spec"]["validations"][-1]["expression"] == "variables.driver == 'gpu.example.com'"
    config = agent_config(docs, "node-agent")
    assert (config["draDriverName"], config["draRegistryDir"], config["draPluginDir"], config["draCdiDir"]) == (
        "gpu.example.com", "/k/registry", "/k/plugins", "/etc/cdi")
    pod = node_agent_pod(docs)
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    for name, path in (("dra-registry", "/k/registry"), ("dra-plugins", "/k/plugins"), ("dra-cdi", "/etc/cdi")):
        assert volumes[name] == mounts[name] == path
    assert "fake-gpu-state" in volumes  # the fake source still reads fake-gpu's state file
    assert pod["securityContext"]["runAsUser"] == 0 and "runAsNonRoot" not in pod["securityContext"]
    assert "runtimeClassName" not in pod  # NVML's, not DRA's


def test_with_dra_the_cluster_agent_counts_slices_claims_work_gpus_through_templates_and_the_hook_deletes_them():
    docs = render("--set", "dra.enabled=true", "--set", "dra.driverName=gpus.example.com",
                  "--set", "dra.deviceClassName=example-gpu")
    config = agent_config(docs, "cluster-agent")
    assert config["draDriverName"] == "gpus.example.com" and config["draDeviceClassName"] == "example-gpu"
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "t-gpu-agent-cluster-agent"]
    assert {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["get", "list", "watch"]} \
        in cluster_role["rules"]
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Role"}
    templates = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"]}
    # the work Pods' templates and (dra.domainChannels, on by default) the GPUDomains' channel templates: one rule
    assert {**templates, "verbs": ["get", "list", "watch", "create", "delete"]} in roles["t-gpu-agent-cluster-agent"]["rules"]
    assert {**templates, "verbs": ["list", "delete"]} in roles["t-gpu-agent-hooks"]["rules"]
    (cleanup,) = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("-cleanup")]
    assert "--work-claim-templates=true" in cleanup["spec"]["template"]["spec"]["containers"][0]["args"]

    # without DRA, or with a source or executor that has no use for them: neither setting nor right
    for sets in ([], ["--set", "dra.enabled=true", "--set", "clusterAgent.gpuSource=fake",
                      "--set", "clusterAgent.executor=record", "--set", "dra.domainChannels=false"]):
        docs = render(*sets)
        assert not [k for k in agent_config(docs, "cluster-agent") if k.startswith("dra")], sets
        rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role") and "cluster-agent" in d["metadata"]["name"]
                 for r in d["rules"]]
        assert not [r for r in rules if "resource.k8s.io" in r["apiGroups"]], sets
    (cleanup,) = [d for d in render() if d["kind"] == "Job" and d["metadata"]["name"].endswith("-cleanup")]
    assert "--work-claim-templates=false" in cleanup["spec"]["template"]["spec"]["containers"][0]["args"]


def cluster_agent_template_rules(docs):
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "t-gpu-agent-cluster-agent"]
    return [r for r in role["rules"] if "resourceclaimtemplates" in r["resources"]]


def test_where_it_folds_domains_with_dra_the_cluster_agent_gets_the_channel_settings_and_the_rights_to_its_templates():
    """The cluster agent makes each folded GPUDomain's channel ResourceClaimTemplate: it watches the ones it made
    (list, watch), reads one of a domain's name (get), makes (create) and replaces or cleans up (delete) them. One
    rule, merged with the work Pods' templates' one, no verb twice."""
    templates = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"]}
    channel_verbs = ["get", "list", "watch", "create", "delete"]
    for sets in ([], ["--set", "domain.name=d1"], ["--set", "domain.joinMatching=true"],
                 ["--set", "domain.name=d1", "--set", "clusterAgent.executor=record"]):
        docs = render("--set", "dra.enabled=true", "--set", "dra.driverName=gpus.example.com",
                      "--set", "dra.channelDeviceClassName=imex.example.com", *sets)
        config = agent_config(docs, "cluster-agent")
        assert (config["draDriverName"], config["channelDeviceClassName"]) == ("gpus.example.com", "imex.example.com")
        assert cluster_agent_template_rules(docs) == [{**templates, "verbs": channel_verbs}], sets

    # no DRA, no node agents (no channel class), no folded domain or another write strategy: no setting, no right
    # beyond the work Pods' templates
    for sets, rules in (
            (["--set", "domain.name=d1"], []),
            (["--set", "dra.enabled=true", "--set", "nodeAgent.enabled=false", "--set", "domain.name=d1",
              "--set", "clusterAgent.gpuSource=fake"], [{**templates, "verbs": ["create", "get", "delete"]}]),
            (["--set", "dra.enabled=true", "--set", "clusterAgent.gpuSource=fake", "--set", "clusterAgent.executor=record",
              "--set", "dra.domainChannels=false"], []),
            (["--set", "dra.enabled=true", "--set", "domain.name=d1", "--set", "dra.domainChannels=false",
              "--set", "clusterAgent.gpuSource=fake"], [{**templates, "verbs": ["create", "get", "delete"]}]),
            (["--set", "dra.enabled=true", "--set", "domain.name=d1", "--set", "domain.writeStrategy=fulljitter",
              "--set", "clusterAgent.gpuSource=fake"], [{**templates, "verbs": ["create", "get", "delete"]}])):
        docs = render(*sets)
        assert "channelDeviceClassName" not in agent_config(docs, "cluster-agent"), sets
        assert "draDriverName" not in agent_config(docs, "cluster-agent"), sets
        assert cluster_agent_template_rules(docs) == rules, sets


WORK_PODS = {
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"kubernetes.io/hostname": "gpu-1", "pool": "a100"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}},
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "regcred"}, "mirror"],
    "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "priorityClassName": "batch-high",
    "labels": {"team": "ml", "cost-center": "42"},
    "annotations": {"example.com/owner": "me"},
}
EMPTY_WORK_PODS = {"tolerations": [], "nodeSelector": {}, "affinity": {}, "runtimeClassName": "", "imagePullSecrets": [],
                   "resources": {}, "priorityClassName": "", "labels": {}, "annotations": {}}


def values_file(tmp_path, values: dict) -> list[str]:
    path = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def cluster_agent_configmap_text(*args: str) -> str:
    return helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *args,
                "--show-only", "templates/configmap-cluster-agent.yaml").stdout


def test_with_the_work_pods_block_empty_the_cluster_agents_configmap_is_byte_for_byte_the_default(tmp_path):
    default = cluster_agent_configmap_text()
    assert "workPods" not in default
    assert cluster_agent_configmap_text(*values_file(tmp_path, {"workPods": EMPTY_WORK_PODS})) == default
    assert cluster_agent_configmap_text("--set-json", "workPods={}") == default
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["workPods"]
    # the defaults are empty; the account and the policy switch are the chart's (test_work_pod_shape.py)
    assert EMPTY_WORK_PODS == {k: v for k, v in defaults.items() if k not in ("serviceAccount", "admissionPolicy")}


def test_every_work_pods_value_reaches_the_cluster_agents_config_and_the_agent_reads_it_back(tmp_path):
    from gpu_agent.foundations.work_pods import parse_work_pods

    args = values_file(tmp_path, {"workPods": WORK_PODS,
                                  "clusterAgent": {"gpuNodeSelector": {"kubernetes.io/hostname": "gpu-1"}}})
    docs = render(*args)
    config = agent_config(docs, "cluster-agent")
    assert config["workPods"] == WORK_PODS
    assert config["gpuNodeSelector"] == {"kubernetes.io/hostname": "gpu-1"}  # the same key at the same value: fine
    assert parse_work_pods(config["workPods"])["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    # Only the keys set reach the config; a changed shape rolls the cluster agent (its config checksum).
    only = agent_config(render("--set", "workPods.priorityClassName=batch"), "cluster-agent")
    assert only["workPods"] == {"priorityClassName": "batch"}
    checksum = [cluster_agent_deployment(d)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for d in (docs, render())]
    assert checksum[0] != checksum[1]


WORK_PODS_REFUSED = [
    (["--set", "workPods.labels.gpu-agent\\.io/work-item=x"],
     'workPods.labels: "gpu-agent.io/work-item" is a label key the agent sets on every work Pod'),
    (["--set", "workPods.labels.app\\.kubernetes\\.io/instance=other"],
     'workPods.labels: "app.kubernetes.io/instance" is a label key the agent sets'),
    (["--set", "workPods.labels.app\\.kubernetes\\.io/managed-by=me"],
     'workPods.labels: "app.kubernetes.io/managed-by" is a label key the agent sets'),
    (["--set", "workPods.annotations.gpu-agent\\.io/leader=me"],
     'workPods.annotations: "gpu-agent.io/leader" is an annotation key the agent sets'),
    (["--set", "workPods.resources.limits.nvidia\\.com/gpu=8"], "workPods.resources.limits: nvidia.com/gpu is the agent's own"),
    (["--set", "workPods.resources.requests.nvidia\\.com/gpu=8"], "workPods.resources.requests: nvidia.com/gpu"),
    (["--set", "clusterAgent.gpuNodeSelector.pool=a", "--set", "workPods.nodeSelector.pool=b"],
     'workPods.nodeSelector: "pool" is "b", but clusterAgent.gpuNodeSelector sets it to "a"'),
    (["--set-json", 'workPods.resources={"claims":[{"name":"gpus"}]}'], "additional properties 'claims' not allowed"),
    (["--set", "workPods.podSecurityContext.runAsUser=0"], "additional properties 'podSecurityContext' not allowed"),
    (["--set", "workPods.runtimeClassName=Nvidia_CDI"], "/workPods/runtimeClassName"),
    (["--set-json", 'workPods.tolerations=[{"key":"a","operator":"Maybe"}]'], "/workPods/tolerations/0/operator"),
    (["--set", "workPods.labels.team=" + "x" * 64], "/workPods/labels/team"),
    (["--set", "clusterAgent.config.workPods.labels.team=ml"], "workPods"),  # the chart wires it: set workPods
]


@pytest.mark.parametrize("sets,named", WORK_PODS_REFUSED, ids=[n[:48] for _, n in WORK_PODS_REFUSED])
def test_a_work_pods_value_that_is_the_agents_own_or_malformed_is_refused_at_render_naming_it(sets, named):
    r = helm("template", "t", str(CHART), *BASE, *sets, check=False)
    assert r.returncode != 0
    assert named in r.stderr, r.stderr


def pod_specs(docs):
    """(object name, pod spec) of every workload and hook Job the render holds."""
    for d in docs:
        if d["kind"] in ("Deployment", "DaemonSet", "Job", "StatefulSet"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]
        elif d["kind"] == "Pod":
            yield d["metadata"]["name"], d["spec"]


@pytest.mark.parametrize("extra", [[], ["--set", "domain.name=d1"], ["--set", "dra.enabled=true", "--kube-version", "1.34.0"]],
                         ids=["default", "domain", "dra"])
def test_log_format_reaches_every_container_that_runs_gpu_agent_and_is_absent_unless_set(extra):
    """logFormat=json reaches each container whose command is gpu-agent: the agents through the config file their
    --config names (the ConfigMap), the control plane through its --log-format flag; and the hook Jobs, which run
    gpu-agent-hook, through its --log-format (issue 50, part 2: the same value, so that one setting makes every line
    of the release JSON). Unset, nothing about the format is rendered: the agents' and the hooks' default, text, and
    the same pod templates as before the value existed."""
    docs = render("--set", "logFormat=json", *extra)
    configs = {f"t-gpu-agent-{a}": agent_config(docs, a) for a in ("cluster-agent", "node-agent")}
    reached, hooks, tests = [], [], []
    for name, spec in pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c.get("command") == ["gpu-agent-hook"]:
                hooks.append(name)
                assert [a for a in c["args"] if "log-format" in a] == ["--log-format=json"], (name, c["args"])
                assert hook_parser().parse_args(c["args"]).log_format == "json"  # where the hook's CLI takes it
                continue
            args = c.get("args", [])
            if args[:1] == ["chart-test"]:  # `helm test`'s Pod prints plain ok/note/FAIL lines, no klog
                tests.append(name)
                assert not any("log-format" in a for a in args), (name, args)
                continue
            assert args and args[0] in ("cluster-agent", "node-agent", "control-plane"), (name, c)
            if "--config=/etc/gpu-agent/config.yaml" in args:
                assert configs[name]["logFormat"] == "json", name
                assert not any(a.startswith("--log-format") for a in args)  # one source: the file
            else:
                assert "--log-format=json" in args, (name, args)
            reached.append(args[0])
    assert sorted(reached) == ["cluster-agent", "control-plane", "node-agent"]
    assert sorted(hooks) == ["t-gpu-agent-cleanup", "t-gpu-agent-crds"] and tests == ["t-gpu-agent-test"]

    default = yaml.safe_dump_all(render(*extra))
    assert "logFormat" not in default and "log-format" not in default
    assert yaml.safe_dump_all(render("--set", "logFormat=text", *extra)).count("logFormat: text") == 2
