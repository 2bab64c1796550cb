"""Fake GPUs on a real cluster: the device plugin, its runtime layout changes, and kubelet."""

from __future__ import annotations

import copy
import json
import statistics
import time

import pytest
from kubernetes import client

from e2e.cluster import host_paths, restart_kubelet
from e2e.helpers import apply, pod_http_get, pod_log, wait_until


def uuid_log(core, ns, name, timeout=60):
    wait_until(lambda: core.read_namespaced_pod(name, ns).status.phase in ("Succeeded", "Failed", "Running"), timeout,
               f"pod {name} to run")
    return wait_until(lambda: (lambda t: "UUID" in t and t)(pod_log(core, ns, name)), 30, f"pod {name} to print UUIDs")


def uuid_lines(text):
    return [line for line in text.splitlines() if "UUID: GPU-" in line]


def test_allocatable_follows_0_4_0_three_cycles_within_2s(fake_gpus):
    fake_gpus.set(0)
    latencies = []
    for _ in range(3):
        latencies.append(fake_gpus.set(4))
        latencies.append(fake_gpus.set(0))
    print(f"\nchange -> allocatable latency over {len(latencies)} changes: median {statistics.median(latencies):.3f}s, "
          f"worst {max(latencies):.3f}s")
    assert max(latencies) <= 2.0


def test_one_gpu_pod_sees_one_uuid_and_two_pods_get_different_gpus(fake_gpus, api, core, namespace):
    fake_gpus.set(2)
    apply(api, namespace, "gpu-pod.yaml.j2", name="one", gpus=1, sleep=60)
    apply(api, namespace, "gpu-pod.yaml.j2", name="two", gpus=1, sleep=60)
    first, second = uuid_lines(uuid_log(core, namespace, "one")), uuid_lines(uuid_log(core, namespace, "two"))
    assert len(first) == 1 and len(second) == 1
    assert first[0].split("UUID: ")[1] != second[0].split("UUID: ")[1]


def test_pod_asking_for_more_gpus_than_exist_stays_pending_with_the_schedulers_reason(fake_gpus, api, core, namespace):
    fake_gpus.set(2)
    apply(api, namespace, "gpu-pod.yaml.j2", name="greedy", gpus=5)

    def unschedulable():
        pod = core.read_namespaced_pod("greedy", namespace)
        cond = [c for c in pod.status.conditions or [] if c.type == "PodScheduled"]
        return cond and cond[0].status == "False" and cond[0].reason == "Unschedulable" and cond[0].message
    message = wait_until(unschedulable, 30, "the scheduler to report the pod unschedulable")
    assert "Insufficient nvidia.com/gpu" in message
    assert core.read_namespaced_pod("greedy", namespace).status.phase == "Pending"


def test_node_agent_reports_the_uuids_the_device_plugin_advertises(fake_gpus, api, core, apps, namespace):
    fake_gpus.set(3)
    apply(api, namespace, "node-agent.yaml.j2", state_dir=host_paths()["stateDir"])
    wait_until(lambda: (lambda d: d.status.number_ready == d.status.desired_number_scheduled >= 1)(
        apps.read_namespaced_daemon_set("node-agent", namespace)), 60, "node agent ready")
    agent = next(p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector="app=node-agent").items
                 if p.spec.node_name == fake_gpus.node)  # the node agent beside the GPUs the fixture set
    apply(api, namespace, "gpu-pod.yaml.j2", name="all", gpus=3, sleep=60)  # gets every advertised device
    advertised = sorted(line.split("UUID: ")[1].rstrip(")") for line in uuid_lines(uuid_log(core, namespace, "all")))
    code, health = pod_http_get(core, namespace, agent, 8081, "healthz")
    assert code == 200
    assert len(advertised) == 3
    assert health["components"]["gpus"]["details"]["uuids"] == advertised


@pytest.mark.disruptive
@pytest.mark.ci_host
def test_kubelet_restart_re_registers_the_plugin_without_touching_its_pod(fake_gpus, core):
    fake_gpus.set(3)
    pod = fake_gpus.plugin_pod()
    restarted_at = time.time()
    restart_kubelet()

    def plugin_log():  # kubelet serves logs again only once it is back
        return pod_log(core, fake_gpus.namespace, pod.metadata.name)

    def heartbeat_after_restart():
        node = core.read_node(fake_gpus.node)
        ready = next(c for c in node.status.conditions if c.type == "Ready")
        return ready.status == "True" and ready.last_heartbeat_time.timestamp() > restarted_at

    wait_until(lambda: "registration 2" in plugin_log(), 60, "the plugin to register again with the new kubelet")
    wait_until(heartbeat_after_restart, 60, "a node status from the restarted kubelet")
    wait_until(lambda: fake_gpus.allocatable() == 3, 30, "allocatable nvidia.com/gpu == 3 from the new kubelet")
    after = core.read_namespaced_pod(pod.metadata.name, fake_gpus.namespace)
    assert after.metadata.uid == pod.metadata.uid
    assert after.status.container_statuses[0].restart_count == pod.status.container_statuses[0].restart_count


def test_bad_layouts_are_refused_and_the_previous_layout_stays(fake_gpus, core):
    fake_gpus.set(2)
    for args, words in [(["--count", "-1"], "count must be 0 or more"),
                        (["--count", "17"], "at most maxCount=16"),
                        (["--count", "1", "--memory-mib", "0"], "memoryMiB must be a positive"),
                        (["--count", "1", "--node", "no-such-node"], "unknown node 'no-such-node'")]:
        argv = ["set", "--node", fake_gpus.node, *args] if "--node" not in args else ["set", *args]
        r = fake_gpus.command(*argv)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr)
    # An edit that bypasses the command is refused by the DaemonSet itself.
    core.patch_namespaced_config_map(fake_gpus.layout_configmap, fake_gpus.namespace,
                                     {"data": {fake_gpus.node: '{"count": "lots"}'}})
    pod = fake_gpus.plugin_pod()
    wait_until(lambda: "refusing layout" in pod_log(core, fake_gpus.namespace, pod.metadata.name), 10,
               "the DaemonSet to refuse the layout")
    assert fake_gpus.allocatable() == 2
    status = json.loads(fake_gpus.command("status", "--node", "any").stdout)
    assert status["nodes"][fake_gpus.node]["allocatable"] == "2"
    # Leave the layout valid for whoever comes next, through the command as a user would.
    fake_gpus.set(0)
    layout = core.read_namespaced_config_map(fake_gpus.layout_configmap, fake_gpus.namespace).data[fake_gpus.node]
    assert json.loads(layout)["count"] == 0


@pytest.mark.serial(reason="installs a second fake-gpu release, whose plugins register nvidia.com/gpu on every node")
def test_each_release_has_its_own_layout_and_the_command_asks_which_when_there_are_several(fake_gpus, core):
    """A second release's layout ConfigMap in the same namespace (made here as the chart would make
    it) neither collides with the first nor is picked silently by `fake-gpu set`."""
    other = client.V1ConfigMap(metadata=client.V1ObjectMeta(
        name="fg2-fake-gpu-layout", labels={"app.kubernetes.io/name": "fake-gpu", "app.kubernetes.io/component": "layout",
                                            "app.kubernetes.io/instance": "fg2"}), data={"maxCount": "16"})
    core.create_namespaced_config_map(fake_gpus.namespace, other)
    try:
        r = fake_gpus.command("set", "--node", fake_gpus.node, "--count", "1")
        assert r.returncode == 2 and "several fake-gpu releases (fg, fg2)" in r.stderr and "--release" in r.stderr, r.stderr
        r = fake_gpus.command("--release", "fg", "set", "--node", fake_gpus.node, "--count", "1")
        assert r.returncode == 0, r.stderr
        wait_until(lambda: fake_gpus.allocatable() == 1, 10, "allocatable nvidia.com/gpu == 1")
        assert fake_gpus.node not in (core.read_namespaced_config_map("fg2-fake-gpu-layout", fake_gpus.namespace).data or {})
    finally:
        core.delete_namespaced_config_map("fg2-fake-gpu-layout", fake_gpus.namespace)
    fake_gpus.set(0)


GFD_COUNT, GFD_PRESENT = "nvidia.com/gpu.count", "nvidia.com/gpu.present"


@pytest.mark.serial(reason="reads every node's GPU labels, which other workers' layouts change")
def test_fake_gpu_labels_its_nodes_as_gpu_feature_discovery_would_and_the_count_follows(fake_gpus, core):
    """Every node the DaemonSet runs on carries present/count/product/memory and the release marker;
    the count label follows `fake-gpu set`; present stays "true" at 0 GPUs (the node agent must stay
    to see them come back)."""
    def labels():
        return core.read_node(fake_gpus.node).metadata.labels or {}

    for node in core.list_node().items:
        mine = {k: v for k, v in (node.metadata.labels or {}).items() if k.startswith("nvidia.com/gpu.")}
        assert mine.get(GFD_PRESENT) == "true" and mine.get("nvidia.com/gpu.product") == "NVIDIA-H100-80GB-HBM3" \
            and mine.get("nvidia.com/gpu.memory") == "81559" and GFD_COUNT in mine, (node.metadata.name, mine)
        assert (node.metadata.labels or {}).get("gpu-agent.io/fake-gpu-release") == "fg"
    took, allocatable = [], []
    for count in (3, 0, 5, 0):
        allocatable.append(fake_gpus.set(count))
        started = time.monotonic()
        wait_until(lambda count=count: labels().get(GFD_COUNT) == str(count), 10, f"label {GFD_COUNT}={count}", interval=0.05)
        took.append(time.monotonic() - started)
        assert labels()[GFD_PRESENT] == "true"
    print(f"\ncount label followed 3, 0, 5, 0: current at most {max(took):.2f} s after allocatable was "
          f"(allocatable: at most {max(allocatable):.2f} s after `fake-gpu set`)")


@pytest.mark.serial(reason="sets GPUs on every node and installs with the chart's placement defaults")
def test_quick_start_fake_gpu_then_gpu_agent_with_its_placement_defaults_forms_the_domain(
        fake_gpus, api, core, apps, kubeconfig, namespace):
    """The README's quick start on a plain cluster: charts/fake-gpu (the session's), then charts/gpu-agent
    with a domain and no placement value and no label set by hand: one node agent per node, at
    system-node-critical, and the domain Ready with every node; NOTES count the nodes it runs on."""
    from e2e.release import Release

    nodes = sorted(n.metadata.name for n in core.list_node().items)
    for node in nodes:
        fake_gpus.set(2, node=node)
    release = Release(api, core, apps, kubeconfig, namespace, name="quick")
    try:
        started = time.monotonic()
        out = release.install("--set", "domain.name=gpus", "--set", f"domain.expectedNodes={len(nodes)}", "--wait").stdout
        assert f"now on {len(nodes)} of {len(nodes)} node(s)" in out, out
        ds = apps.read_namespaced_daemon_set(f"{release.fullname}-node-agent", namespace)
        assert ds.status.desired_number_scheduled == len(nodes)
        agents = release.pods("app.kubernetes.io/component=node-agent")
        assert sorted(p.spec.node_name for p in agents) == nodes
        assert {(p.spec.priority_class_name, p.spec.priority) for p in agents} == {("system-node-critical", 2000001000)}
        custom = client.CustomObjectsApi(api)

        def domain():
            try:
                return custom.get_namespaced_custom_object("gpu-agent.io", "v1beta1", namespace, "gpudomains", "gpus")
            except client.ApiException:
                return {}

        wait_until(lambda: (domain().get("status") or {}).get("status") == "Ready", 60, "the GPUDomain Ready")
        assert sorted(n["name"] for n in domain()["status"]["nodes"]) == nodes
        print(f"\nquick start: node agents on {len(nodes)} of {len(nodes)} node(s) at system-node-critical, "
              f"domain Ready {time.monotonic() - started:.1f} s after helm install began")
    finally:
        release.uninstall_if_installed()
        for node in nodes:
            fake_gpus.set(0, node=node)


@pytest.mark.serial(reason="counts the nodes the chart's default placement reaches: every node, not the worker's one")
def test_notes_warn_when_no_node_matches_the_node_agents_placement_and_say_how_to_fix_it(
        fake_gpus, api, core, apps, kubeconfig, namespace):
    """`helm install --dry-run=server` renders NOTES with the cluster's nodes: a nodeSelector no node
    carries, and an untolerated taint on the only GPU node, each warn with the fixes; the defaults do not."""
    from e2e.release import Release, helm

    release = Release(api, core, apps, kubeconfig, namespace, name="notes")
    every = len(core.list_node().items)

    def notes(*extra):
        return helm("install", *release.args(*extra), "--dry-run=server").stdout

    assert "WARNING: none of the cluster's" not in notes() and f"now on {every} of {every} node(s)" in notes()
    nowhere = notes("--set-string", "nodeAgent.nodeSelector.gpu-agent\\.io/e2e-nowhere=true")
    assert f"WARNING: none of the cluster's {every} node(s) matches" in nowhere
    assert "kubectl label node NODE nvidia.com/gpu.present=true" in nowhere and "nodeAgent.nodeSelector" in nowhere
    if every != 1:
        return  # tainting one of several nodes leaves the others matching
    node = fake_gpus.node
    # NoSchedule only, for the few seconds of two dry runs: running pods stay; nothing is scheduled meanwhile.
    taints = [{"key": t.key, "value": t.value, "effect": t.effect} for t in core.read_node(node).spec.taints or []]
    core.patch_node(node, {"spec": {"taints": [*taints, {"key": "gpu-agent.io/e2e-untolerated", "value": "x", "effect": "NoSchedule"}]}})
    try:
        assert "WARNING: none of the cluster's 1 node(s) matches" in notes()
        assert "now on 1 of 1 node(s)" in notes("--set", "nodeAgent.tolerations[0].operator=Exists")
    finally:
        core.patch_node(node, {"spec": {"taints": taints or None}})


def test_the_daemons_token_patches_only_its_own_nodes_fake_gpu_labels_and_claim(fake_gpus, api, core):
    """The daemon's RBAC may patch any Node; the chart's policy (nodePatchPolicy) holds a token bound to its pod to its
    own Node and to what fake-gpu owns there. Each attempt is made with such a token, as the pod would make it."""
    pod = fake_gpus.plugin_pod()
    bound = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
        audiences=[], expiration_seconds=600,
        bound_object_ref=client.V1BoundObjectReference(kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid)))
    token = core.create_namespaced_service_account_token(pod.spec.service_account_name, fake_gpus.namespace, bound).status.token
    config = copy.copy(api.configuration)
    config.api_key, config.api_key_prefix = {"authorization": token}, {"authorization": "Bearer"}
    config.cert_file = config.key_file = None
    as_daemon = client.CoreV1Api(client.ApiClient(config))
    own, other = fake_gpus.node, next(n.metadata.name for n in core.list_node().items if n.metadata.name != fake_gpus.node)

    def refused(node: str, patch: dict) -> str:
        try:
            as_daemon.patch_node(node, patch)
            return ""
        except client.ApiException as e:
            assert e.status in (403, 422), (e.status, e.body)
            return json.loads(e.body)["message"]

    probe = "nvidia.com/gpu.e2e-probe"
    try:
        assert refused(own, {"metadata": {"labels": {probe: "yes"}}}) == ""  # its own label on its own Node
        assert core.read_node(own).metadata.labels.get(probe) == "yes"
        rows = {
            "another Node": (other, {"metadata": {"labels": {probe: "yes"}}}, "only the Node its pod runs on"),
            "a taint": (own, {"spec": {"taints": [{"key": "e2e-taint", "effect": "NoSchedule"}]}}, "spec"),
            "unschedulable": (own, {"spec": {"unschedulable": True}}, "spec"),
            "a label not its own": (own, {"metadata": {"labels": {"e2e-foreign": "x"}}}, "not e2e-foreign"),
            "an annotation not its own": (own, {"metadata": {"annotations": {"e2e-foreign": "x"}}}, "not e2e-foreign"),
        }
        for what, (node, patch, says) in rows.items():
            message = refused(node, patch)
            assert says in message, (what, message)
            print(f"{what}: refused: {message.split('denied request: ')[-1][:160]}")
        after = core.read_node(own)
        assert not after.spec.taints and not after.spec.unschedulable and "e2e-foreign" not in after.metadata.labels
        assert probe not in (core.read_node(other).metadata.labels or {})
    finally:
        for node in (own, other):  # the other too: a broken policy let the patch land there
            core.patch_node(node, {"metadata": {"labels": {probe: None}}})
