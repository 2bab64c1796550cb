"""charts/gpu-agent and its hooks, for real on the cluster."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import uuid

import pytest
import yaml
from kubernetes import client

from e2e.cluster import tool
from e2e.helpers import pod_http_get, wait_until
from e2e.release import APP_VERSION, BASE, CA, CHART, Release, helm


def render(*sets: str) -> list[dict]:
    out = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def cluster_agent_deployment(docs):
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-cluster-agent"))


def agent_config(docs, agent):
    """The settings in an agent's ConfigMap (what `--config` reads)."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"t-gpu-agent-{agent}"]
    return yaml.safe_load(cm["data"]["config.yaml"])


def test_helm_lint_and_rendered_manifests_pass_the_api_servers_validation(kubeconfig, namespace):
    assert "0 chart(s) failed" in helm("lint", str(CHART), *BASE).stdout
    rendered = helm("template", "v", str(CHART), "--namespace", namespace, *BASE, "--set", "gracefulNoGPU=true").stdout
    r = subprocess.run([tool("kubectl"), "--kubeconfig", str(kubeconfig), "apply", "--dry-run=server", "--validate=strict",
                        "-n", namespace, "-f", "-"], input=rendered, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("(server dry run)") == len([d for d in yaml.safe_load_all(rendered) if d])


BAD_VALUES = [
    (["--set", "logVerbosity=9"], "logVerbosity"),
    (["--set", "logVerbosity=-1"], "logVerbosity"),
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
    (["--set", "controlPlane.enabled=false", "--set", "controlPlane.url=http://cp"], "controlPlane.existingSecret is required"),
    (["--set", "unknownValue=1"], "unknownValue"),
    (["--set", "controlPlane.faultInjection=yes"], "faultInjection"),
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


def test_the_work_pod_fencing_policy_takes_the_agents_lease_as_its_param_and_renders_only_with_leader_election():
    def fencing(*sets):
        docs = render(*sets)
        return ([d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith("-work-pod-fence")],
                [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                 and d["metadata"]["name"].endswith("-work-pod-fence")], docs)

    [policy], [binding], docs = fencing()
    assert policy["spec"]["paramKind"] == {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]
    assert "'gpu-agent.io/leader' in object.metadata.annotations" in policy["spec"]["matchConditions"][0]["expression"]
    assert [v["reason"] for v in policy["spec"]["validations"]] == ["Forbidden"]
    lease = agent_config(docs, "cluster-agent")["leaderElectionLeaseName"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["paramRef"] == {"name": lease, "namespace": "ns", "parameterNotFoundAction": "Deny"}
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ns"}},
        "objectSelector": {"matchLabels": {"gpu-agent.io/work-item": "true", "app.kubernetes.io/instance": "t"}}}
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-cluster-agent"))
    assert "patch" in next(r for r in role["rules"] if r["resources"] == ["pods"])["verbs"]  # the finalizer's release
    assert fencing("--set", "clusterAgent.workPodFencing=false")[:2] == ([], [])
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
    assert set(ca_config) == {"listenAddress", "clusterId", "gpuSource", "executor", "executorJournal", "workNamespace",
                              "workImage", "releaseName", "controlPlaneUrl", "controlPlaneTokenFile",
                              "leaderElectionLeaseName", "leaderElectionNamespace", "leaderElectionOwner"}
    assert set(na_config) == {"listenAddress", "gpuSource", "fakeGpuStateFile"}
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
    (["--set", "clusterAgent.config.listenAddress=0.0.0.0:1"], "listenAddress"),
    (["--set", "nodeAgent.config.noSuchSetting=1"], "noSuchSetting"),
    (["--set", "clusterAgent.config.leaseSeconds=0"], "leaseSeconds"),
    (["--set", "clusterAgent.leaderElection.leaseDuration=5", "--set", "clusterAgent.config.leaderElectionRenewDeadline=6"],
     "retryPeriod < renewDeadline < leaseDuration"),
]


@pytest.mark.parametrize("sets,named", CONFIG_REFUSED, ids=[n[:40] for _, n in CONFIG_REFUSED])
def test_a_config_setting_the_chart_wires_or_a_conflicting_one_is_refused_naming_it(sets, named):
    r = helm("template", "t", str(CHART), *BASE, *sets, check=False)
    assert r.returncode != 0
    assert named in r.stderr, r.stderr


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


@pytest.fixture
def release(api, core, apps, kubeconfig, namespace, fake_gpus):
    fake_gpus.set(0)
    r = Release(api, core, apps, kubeconfig, namespace, name=f"ga{uuid.uuid4().hex[:5]}")
    yield r
    helm("uninstall", "--kubeconfig", str(kubeconfig), "-n", namespace, r.name, "--wait", "--timeout", "120s", check=False)


def test_install_at_zero_gpus_is_live_not_ready_then_gpus_run_a_queued_item_as_a_pod(release, fake_gpus, core):
    started = time.monotonic()
    release.install("--set", "gracefulNoGPU=true")
    wait_until(release.all_running, 60, "every release pod Running")
    wait_until(lambda: all(c.ready for p in release.pods("app.kubernetes.io/component=node-agent")
                           for c in p.status.container_statuses or []), 30, "node agents Ready")
    wait_until(lambda: release.agent_pod() and pod_http_get(core, release.namespace, release.agent_pod(), 8080, "livez")[0] == 200,
               30, "cluster agent live")
    install_to_running = time.monotonic() - started
    # Live comes first: the GPU component says "starting" until the agent's first look at the nodes.
    def first_gpu_look():
        code, health = release.healthz()
        return (code, health) if health and health["components"]["gpus"]["reason"] != "starting" else None
    code, health = wait_until(first_gpu_look, 30, "the cluster agent's first look at the GPUs")
    assert code == 503 and health["components"]["queues"]["reason"].startswith("paused")
    assert health["components"]["gpus"]["reason"].startswith("no GPUs available")
    print(f"\ninstall -> all pods running, node agents Ready, cluster agent live: {install_to_running:.1f}s")

    release.control_plane("print(c.enqueue(t, 'e2e-chart-item', {'gpus': 1}))")
    # The item waits while the queue is paused: still queued after several of the agent's lease polls.
    held_from = time.monotonic()
    while time.monotonic() - held_from < 3:
        assert '"queued": 1' in release.control_plane("import json; print(json.dumps(c.status(t)['items']))")
        assert not release.pods("gpu-agent.io/work-item=true")
    fake_gpus.set(2)
    arrived = time.monotonic()
    wait_until(lambda: release.healthz()[0] == 200, 20, "cluster agent Ready once GPUs arrive")
    print(f"GPUs -> cluster agent Ready: {time.monotonic() - arrived:.1f}s")
    wait_until(lambda: '"done": 1' in release.control_plane("import json; print(json.dumps(c.status(t)['items']))"), 60,
               "the queued item to be executed and acknowledged")
    events = core.list_namespaced_event(release.namespace).items
    work = {e.involved_object.name for e in events if e.involved_object.name.startswith("gpu-work-e2e-chart-item-")}
    assert len(work) == 1  # one Pod, with the deterministic name
    assert any(e.reason == "Started" and e.involved_object.name in work for e in events)
    wait_until(lambda: not release.pods("gpu-agent.io/work-item=true"), 30, "the work Pod to be cleaned up")

    # no token in any pod log or event of this release
    tokens = release.tokens()
    texts = [e.message or "" for e in core.list_namespaced_event(release.namespace).items]
    for p in release.pods(f"app.kubernetes.io/instance={release.name}"):
        for c in p.spec.containers:
            texts.append(core.read_namespaced_pod_log(p.metadata.name, release.namespace, container=c.name) or "")
    assert texts and not [t for t in texts for tok in tokens if tok in t]

    # pre-delete cleanup removes leftover work Pods of the release, releasing the finalizer the agent keeps on each
    # until its item's ack (without the hook nobody would, and the Pod would stay Terminating)
    core.create_namespaced_pod(release.namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "gpu-work-leftover", "labels": {"gpu-agent.io/work-item": "true", "app.kubernetes.io/instance": release.name},
        "finalizers": ["gpu-agent.io/work-item"]},
        "spec": {"containers": [{"name": "c", "image": "localhost/gpu-agent:dev", "imagePullPolicy": "Never",
                                 "command": ["sleep", "600"]}]}})
    leases = client.CoordinationV1Api(release.api)
    assert leases.read_namespaced_lease(f"{release.fullname}-cluster-agent", release.namespace).spec.holder_identity
    release.uninstall()
    wait_until(lambda: not release.pods("gpu-agent.io/work-item=true"), 30,
               "leftover work Pod released (its finalizer removed) and deleted by the pre-delete hook")
    wait_until(lambda: not release.pods(f"app.kubernetes.io/instance={release.name}"), 60, "every release pod gone after uninstall")
    # ...and the leader-election Lease the agents made (not a release object) goes with them
    assert not [x.metadata.name for x in leases.list_namespaced_lease(release.namespace).items]


def test_upgrade_with_graceful_no_gpu_while_not_ready_never_runs_two_agents(release, apps):
    release.install("--set", "gracefulNoGPU=true")
    wait_until(release.all_running, 60, "every release pod Running")
    wait_until(lambda: release.healthz()[0] == 503, 30, "the cluster agent to answer /healthz (NotReady: no GPUs)")
    first = release.agent_pod()
    samples, sets, stop = [], [], threading.Event()

    def sample():
        while not stop.is_set():
            pods = release.pods(CA)
            samples.append([p.metadata.name for p in pods if p.status.phase not in ("Succeeded", "Failed")])
            rs = apps.list_namespaced_replica_set(release.namespace, label_selector=CA).items
            sets.append(sum(1 for r in rs if (r.status.replicas or 0) > 0))
            stop.wait(0.25)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    release.upgrade("--set", "gracefulNoGPU=true", "--set", "logVerbosity=3")  # a new pod template
    wait_until(lambda: release.agent_pod() not in (None, first), 90, "the replacement cluster agent")
    wait_until(lambda: release.healthz()[0] == 503, 30, "the replacement to answer /healthz")
    stop.set()
    t.join()
    assert len(samples) >= 20 and len(sets) == len(samples), f"the sampler took only {len(samples)} samples"
    print(f"\nRecreate sampler: {len(samples)} samples, max non-terminal agent pods {max(map(len, samples))}, "
          f"max active ReplicaSets {max(sets)}")
    assert max(len(s) for s in samples) <= 1
    assert max(sets) <= 1
    code, health = release.healthz()
    assert code == 503 and health["components"]["queues"]["reason"].startswith("paused")


@pytest.mark.disruptive
def test_crd_upgrade_applies_the_new_field_by_server_side_apply(release, tmp_path, api):
    ext = client.ApiextensionsV1Api(api)
    old_chart = tmp_path / "gpu-agent"
    shutil.copytree(CHART, old_chart)
    crd_file = old_chart / "crds" / "gpudomain.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    del crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["nodeSelector"]
    crd_file.write_text(yaml.safe_dump(crd))
    try:
        ext.delete_custom_resource_definition("gpudomains.gpu-agent.io")
        wait_until(lambda: not [c for c in ext.list_custom_resource_definition().items
                                if c.metadata.name == "gpudomains.gpu-agent.io"], 30, "the CRD to go")
    except client.ApiException as e:
        assert e.status == 404

    def spec_fields():
        c = ext.read_custom_resource_definition("gpudomains.gpu-agent.io")
        return set(c.spec.versions[0].schema.open_apiv3_schema.properties["spec"].properties)

    args = release.args()
    args[args.index(str(CHART))] = str(old_chart)
    helm("install", *args, "--timeout", "120s")
    current = set(yaml.safe_load((CHART / "crds" / "gpudomain.yaml").read_text())["spec"]["versions"][0]["schema"]
                  ["openAPIV3Schema"]["properties"]["spec"]["properties"])
    assert spec_fields() == current - {"nodeSelector"}
    release.upgrade()
    assert spec_fields() == current
    managers = {m.manager for m in ext.read_custom_resource_definition("gpudomains.gpu-agent.io").metadata.managed_fields}
    assert "gpu-agent-hooks" not in managers, "the hook must apply as Helm does, or Helm's next CRD install conflicts"

    # Uninstalled, the CRDs stay; a fresh install of a chart whose CRDs differ from them (a newer one, or this
    # older copy) is Helm 4's own server-side apply of crds/: under one field manager it is no conflict.
    release.uninstall()
    helm("install", *args, "--timeout", "120s")
    assert spec_fields() == current - {"nodeSelector"}
    release.uninstall()
    release.install()
    assert spec_fields() == current


def test_skew_check_refuses_an_upgrade_that_skips_a_major_version(release, tmp_path, core):
    release.install()
    wait_until(release.all_running, 60, "every release pod Running")
    future = tmp_path / "gpu-agent"
    shutil.copytree(CHART, future)
    chart_yaml = yaml.safe_load((future / "Chart.yaml").read_text())
    chart_yaml["appVersion"] = "2.0.0"
    (future / "Chart.yaml").write_text(yaml.safe_dump(chart_yaml))
    args = release.args()
    args[args.index(str(CHART))] = str(future)
    r = helm("upgrade", *args, "--set", "hooks.backoffLimit=0", "--timeout", "120s", check=False)
    assert r.returncode != 0 and "pre-upgrade" in r.stderr
    job_pods = core.list_namespaced_pod(release.namespace, label_selector=f"job-name={release.fullname}-crds").items
    log = core.read_namespaced_pod_log(job_pods[0].metadata.name, release.namespace)
    assert f"refused: upgrade from {APP_VERSION} to 2.0.0 skips major version 1" in log
    history = json.loads(helm("history", "--kubeconfig", release.kubeconfig, "-n", release.namespace, release.name, "-o", "json").stdout)
    assert history[0]["status"] == "deployed" and history[0]["app_version"] == APP_VERSION


def can_i(api, namespace, sa, verb, resource, ns=None, group=""):
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=f"system:serviceaccount:{namespace}:{sa}",
        groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
        resource_attributes=client.V1ResourceAttributes(verb=verb, resource=resource, group=group, namespace=ns)))
    return client.AuthorizationV1Api(api).create_subject_access_review(review).status.allowed


def test_each_service_account_can_do_what_its_component_needs_and_nothing_more(release, api):
    release.install()
    ns, other = release.namespace, f"other-{uuid.uuid4().hex[:4]}"
    table = [
        ("cluster-agent", "list", "nodes", None, True), ("cluster-agent", "watch", "nodes", None, True),
        ("cluster-agent", "create", "pods", ns, True), ("cluster-agent", "delete", "pods", ns, True),
        ("cluster-agent", "patch", "pods", ns, True), ("cluster-agent", "patch", "pods", other, False),
        ("cluster-agent", "create", "pods", other, False), ("cluster-agent", "get", "secrets", ns, False),
        ("cluster-agent", "patch", "nodes", None, False), ("cluster-agent", "delete", "nodes", None, False),
        ("node-agent", "list", "pods", ns, False), ("node-agent", "get", "nodes", None, False),
        ("control-plane", "get", "secrets", ns, False), ("control-plane", "list", "pods", ns, False),
    ]
    rows = []
    for component, verb, resource, where, expected in table:
        allowed = can_i(api, ns, f"{release.fullname}-{component}", verb, resource, where)
        rows.append(f"{component:<14}{verb:<8}{resource:<10}{where or '(cluster)':<44}{'yes' if allowed else 'no'}")
        assert allowed == expected, rows[-1]
    print("\n" + "\n".join(rows))


def test_node_agents_form_the_charts_gpudomain_through_the_cluster_agent(release, fake_gpus, api):
    """Every node's agent (one GPU each) is a member, numbered 0..N-1; one node losing its GPU turns its
    member NotReady, and the domain with it."""
    every = sorted(n.metadata.name for n in release.core.list_node().items)
    for node in every:
        fake_gpus.set(1, node=node)
    release.install("--set", "domain.name=gpus", "--set", f"domain.expectedNodes={len(every)}")
    custom = client.CustomObjectsApi(api)

    def domain():
        try:
            return custom.get_namespaced_custom_object("gpu-agent.io", "v1beta1", release.namespace, "gpudomains", "gpus")
        except client.ApiException:
            return {}

    try:
        wait_until(lambda: (domain().get("status") or {}).get("status") == "Ready", 60, "the chart's GPUDomain Ready")
        nodes = domain()["status"]["nodes"]
        assert sorted((n["name"], n["status"]) for n in nodes) == [(node, "Ready") for node in every], nodes
        assert sorted(n["index"] for n in nodes) == list(range(len(every))), nodes
        assert all(len(n["gpuUUIDs"]) == 1 and n["gpuUUIDs"][0].startswith("GPU-") for n in nodes), nodes
        fake_gpus.set(0)  # a node without GPUs is NotReady in the domain, and the domain with it
        wait_until(lambda: (domain().get("status") or {}).get("status") == "NotReady", 30, "the GPUDomain NotReady")
        assert [n["status"] for n in domain()["status"]["nodes"] if n["name"] == fake_gpus.node] == ["NotReady"]
    finally:
        for node in every:
            fake_gpus.set(0, node=node)


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


def test_the_nvml_node_agent_runs_unprivileged_under_the_nvidia_runtime_class():
    (ds,) = [d for d in render() if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    ctx = spec["containers"][0]["securityContext"]
    assert ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]} and ctx["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (fake,) = [d for d in render("--set", "nodeAgent.gpuSource=fake") if d["kind"] == "DaemonSet"]
    assert "runtimeClassName" not in fake["spec"]["template"]["spec"]
    assert fake["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_a_50_character_release_name_keeps_every_name_within_63_and_the_api_server_accepts_it(kubeconfig, namespace):
    name = "a-release-name-as-long-as-a-platform-team-would-ok"
    assert len(name) == 50
    docs = [d for d in yaml.safe_load_all(helm("template", name, str(CHART), "--namespace", namespace, *BASE,
                                                "--set", "domain.name=d1").stdout) if d]
    docs += [d for d in yaml.safe_load_all(helm("template", name, str(CHART.parent / "fake-gpu"), "--namespace",
                                                 namespace).stdout) if d]
    too_long = [(d["kind"], d["metadata"]["name"]) for d in docs if len(d["metadata"]["name"]) > 63]
    assert not too_long, too_long
    labels = [v for d in docs for v in (d["metadata"].get("labels") or {}).values()]
    assert all(len(v) <= 63 for v in labels)
    # The API server itself validates every object (names, labels) without creating anything.
    # (No domain here: its CRD may not exist yet on this cluster, issue 10.)
    r = helm("install", name, str(CHART), "--kubeconfig", str(kubeconfig), "-n", namespace, *BASE,
             "--dry-run=server", "--no-hooks", check=False)
    assert r.returncode == 0, r.stderr


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
    """GitOps renders with `helm template`, where `lookup` finds nothing: the chart's own tokens
    would change on every render, an existing Secret does not."""
    first, second = (helm("template", "t", str(CHART), *BASE, "--set", "controlPlane.existingTokensSecret=cp-tokens").stdout
                     for _ in range(2))
    assert first == second
    docs = [d for d in yaml.safe_load_all(first) if d]
    assert not [d for d in docs if d["kind"] == "Secret"]
    mounted = [v["secret"]["secretName"] for d in docs if d["kind"] in ("Deployment", "Job")
               for v in d["spec"]["template"]["spec"].get("volumes", []) if "secret" in v]
    assert mounted and set(mounted) == {"cp-tokens"}
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


def test_cluster_agent_and_control_plane_run_in_a_namespace_that_enforces_restricted(api, core, apps, kubeconfig,
                                                                                      namespace, fake_gpus):
    core.patch_namespace(namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                                             "pod-security.kubernetes.io/enforce-version": "latest"}}})
    fake_gpus.set(1)
    # Tokens from a Secret made outside the chart, as a GitOps user would (sealed or external secrets).
    core.create_namespaced_secret(namespace, client.V1Secret(metadata=client.V1ObjectMeta(name="gitops-tokens"), string_data={
        "registrationToken": uuid.uuid4().hex, "adminToken": uuid.uuid4().hex}))
    r = Release(api, core, apps, kubeconfig, namespace, name=f"ps{uuid.uuid4().hex[:5]}")
    r.install("--set", "gracefulNoGPU=true", "--set", "nodeAgent.enabled=false",  # the node agent needs a hostPath
              "--set", "controlPlane.existingTokensSecret=gitops-tokens")
    secrets = [s.metadata.name for s in core.list_namespaced_secret(namespace).items if s.type != "helm.sh/release.v1"]
    assert secrets == ["gitops-tokens"]  # the chart made none of its own
    wait_until(lambda: r.all_running(at_least=2), 90, "cluster agent and control plane Running under restricted")
    wait_until(lambda: r.healthz()[0] == 200, 60, "the cluster agent Ready")
    # A work Pod the agent creates is admitted too.
    r.control_plane("print(c.enqueue(t, 'restricted-item', {'gpus': 1}))")
    wait_until(lambda: '"done": 1' in r.control_plane("import json; print(json.dumps(c.status(t)['items']))"), 60,
               "the work Pod admitted, run and acknowledged")
    refused = [e.message for e in core.list_namespaced_event(namespace).items if "violates PodSecurity" in (e.message or "")]
    assert not refused, refused
    r.uninstall()
    fake_gpus.set(0)
