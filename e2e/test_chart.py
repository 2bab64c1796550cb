"""charts/gpu-agent and its hooks, for real on the cluster."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import uuid

import pytest
import trustme
import yaml
from kubernetes import client

from e2e.cluster import tool
from e2e.helpers import pod_http_get, wait_until
from e2e.release import APP_VERSION, BASE, CA, CHART, Release, helm


def test_helm_lint_and_rendered_manifests_pass_the_api_servers_validation(kubeconfig, namespace):
    assert "0 chart(s) failed" in helm("lint", str(CHART), *BASE).stdout
    # Without the `helm test` hooks: their Pod names their ServiceAccount, which a dry run does not keep, and a bare
    # Pod's account is looked up at admission (test_helm_test.py installs and runs them).
    rendered = helm("template", "v", str(CHART), "--namespace", namespace, *BASE, "--set", "gracefulNoGPU=true",
                    "--skip-tests").stdout
    r = subprocess.run([tool("kubectl"), "--kubeconfig", str(kubeconfig), "apply", "--dry-run=server", "--validate=strict",
                        "-n", namespace, "-f", "-"], input=rendered, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("(server dry run)") == len([d for d in yaml.safe_load_all(rendered) if d])


# The `release` fixture's tests start their cluster agent with no GPUs: without gracefulNoGPU it would exit and
# crash-loop (its default fails fast at start), which none of them is about.
GRACEFUL = ("--set", "gracefulNoGPU=true")


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

    args = release.args(*GRACEFUL)
    args[args.index(str(CHART))] = str(old_chart)
    helm("install", *args, "--timeout", "120s")
    current = set(yaml.safe_load((CHART / "crds" / "gpudomain.yaml").read_text())["spec"]["versions"][0]["schema"]
                  ["openAPIV3Schema"]["properties"]["spec"]["properties"])
    assert spec_fields() == current - {"nodeSelector"}
    release.upgrade(*GRACEFUL)
    assert spec_fields() == current
    managers = {m.manager for m in ext.read_custom_resource_definition("gpudomains.gpu-agent.io").metadata.managed_fields}
    assert "gpu-agent-hooks" not in managers, "the hook must apply as Helm does, or Helm's next CRD install conflicts"

    # Uninstalled, the CRDs stay; a fresh install of a chart whose CRDs differ from them (a newer one, or this
    # older copy) is Helm 4's own server-side apply of crds/: under one field manager it is no conflict.
    release.uninstall()
    helm("install", *args, "--timeout", "120s")
    assert spec_fields() == current - {"nodeSelector"}
    release.uninstall()
    release.install(*GRACEFUL)
    assert spec_fields() == current


def hook_rbac_left(release) -> list[str]:
    """The kinds of the hooks' ServiceAccount and RBAC (hook resources, <fullname>-hooks) still in the cluster."""
    rbac, core, name, ns = client.RbacAuthorizationV1Api(release.api), release.core, f"{release.fullname}-hooks", release.namespace
    reads = {"ClusterRole": lambda: rbac.read_cluster_role(name), "ClusterRoleBinding": lambda: rbac.read_cluster_role_binding(name),
             "Role": lambda: rbac.read_namespaced_role(name, ns), "RoleBinding": lambda: rbac.read_namespaced_role_binding(name, ns),
             "ServiceAccount": lambda: core.read_namespaced_service_account(name, ns)}
    left = []
    for kind, read in reads.items():
        try:
            read()
            left.append(kind)
        except client.ApiException as e:
            if e.status != 404:
                raise
    return left


def test_skew_check_refuses_an_upgrade_that_skips_a_major_version(release, tmp_path, core):
    release.install(*GRACEFUL)
    wait_until(release.all_running, 60, "every release pod Running")
    wait_until(lambda: not hook_rbac_left(release), 15, "the hooks' RBAC deleted after the install (hook-succeeded)")
    future = tmp_path / "gpu-agent"
    shutil.copytree(CHART, future)
    chart_yaml = yaml.safe_load((future / "Chart.yaml").read_text())
    chart_yaml["appVersion"] = "2.0.0"
    (future / "Chart.yaml").write_text(yaml.safe_dump(chart_yaml))
    args = release.args(*GRACEFUL)
    args[args.index(str(CHART))] = str(future)
    r = helm("upgrade", *args, "--set", "hooks.backoffLimit=0", "--timeout", "120s", check=False)
    assert r.returncode != 0 and "pre-upgrade" in r.stderr
    job_pods = core.list_namespaced_pod(release.namespace, label_selector=f"job-name={release.fullname}-crds").items
    log = core.read_namespaced_pod_log(job_pods[0].metadata.name, release.namespace)
    assert f"refused: upgrade from {APP_VERSION} to 2.0.0 skips major version 1" in log
    # The failed Job stays (for its log); the hooks' ServiceAccount and RBAC, which succeeded before it, do not: Helm 4
    # deletes them by their hook-succeeded policy when a later hook of the phase fails (issue 48).
    wait_until(lambda: not hook_rbac_left(release), 15, "the hooks' RBAC deleted after the failed hook")
    history = json.loads(helm("history", "--kubeconfig", release.kubeconfig, "-n", release.namespace, release.name, "-o", "json").stdout)
    assert history[0]["status"] == "deployed" and history[0]["app_version"] == APP_VERSION


@pytest.mark.disruptive
def test_the_hooks_crd_rights_limited_by_name_let_them_create_and_apply_a_named_crd_and_no_other(api, kubeconfig, namespace,
                                                                                                    tmp_path):
    """The hooks' ClusterRole names the chart's CRDs for create too: the hooks create a CRD only by server-side apply,
    which the API server authorizes as a create with the object's name. Proven with the hooks' own code (apply_crds)
    as a ServiceAccount bound to the chart's rendered CRD rules, their names swapped for a throwaway CRD's: it creates
    and then applies that CRD (were the name not part of the create's authorization, the named create rule would not
    match and the create would be refused); another CRD is refused (403)."""
    from kubernetes import config

    from gpu_agent_hooks.cli import apply_crds

    tag = uuid.uuid4().hex[:8]
    crds = {k: {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{k}{tag}s.leastpriv.e2e.gpu-agent.io"},
                "spec": {"group": "leastpriv.e2e.gpu-agent.io", "scope": "Namespaced",
                         "names": {"plural": f"{k}{tag}s", "singular": f"{k}{tag}", "kind": f"{k.title()}{tag}"},
                         "versions": [{"name": "v1", "served": True, "storage": True,
                                       "schema": {"openAPIV3Schema": {"type": "object"}}}]}} for k in ("named", "other")}
    named = crds["named"]["metadata"]["name"]
    (role,) = [d for d in yaml.safe_load_all(helm("template", "t", str(CHART), *BASE, "-s", "templates/clusterrole-hooks.yaml").stdout) if d]
    rules = [{**r, "resourceNames": [named]} for r in role["rules"] if "apiextensions.k8s.io" in r["apiGroups"]]
    assert rules and all(len(r["resourceNames"]) == 1 for r in rules)
    rbac, ext, core = client.RbacAuthorizationV1Api(api), client.ApiextensionsV1Api(api), client.CoreV1Api(api)
    sa, cluster_role = f"crd-applier-{tag}", f"leastpriv-{tag}"
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=sa)))
    rbac.create_cluster_role({"metadata": {"name": cluster_role}, "rules": rules})
    rbac.create_cluster_role_binding({"metadata": {"name": cluster_role},
                                      "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
                                      "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]})
    as_sa = config.new_client_from_config(str(kubeconfig))
    as_sa.set_default_header("Impersonate-User", f"system:serviceaccount:{namespace}:{sa}")
    try:
        for k in ("named", "other"):
            (tmp_path / k).mkdir()
            (tmp_path / k / "crd.yaml").write_text(yaml.safe_dump(crds[k]))
        wait_until(lambda: client.AuthorizationV1Api(api).create_subject_access_review(client.V1SubjectAccessReview(
            spec=client.V1SubjectAccessReviewSpec(user=f"system:serviceaccount:{namespace}:{sa}", resource_attributes=client.V1ResourceAttributes(
                verb="patch", group="apiextensions.k8s.io", resource="customresourcedefinitions", name=named)))).status.allowed,
            30, "the binding in effect")
        apply_crds(as_sa, tmp_path / "named")  # creates it (server-side apply)
        assert ext.read_custom_resource_definition(named).metadata.name == named
        apply_crds(as_sa, tmp_path / "named")  # applies it again (a patch)
        with pytest.raises(client.ApiException) as refused:
            apply_crds(as_sa, tmp_path / "other")
        assert refused.value.status == 403, refused.value
    finally:
        for k in ("named", "other"):
            try:
                ext.delete_custom_resource_definition(crds[k]["metadata"]["name"])
            except client.ApiException as e:
                if e.status != 404:
                    raise
        rbac.delete_cluster_role_binding(cluster_role)
        rbac.delete_cluster_role(cluster_role)


def can_i(api, namespace, sa, verb, resource, ns=None, group=""):
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=f"system:serviceaccount:{namespace}:{sa}",
        groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
        resource_attributes=client.V1ResourceAttributes(verb=verb, resource=resource, group=group, namespace=ns)))
    return client.AuthorizationV1Api(api).create_subject_access_review(review).status.allowed


EVENTS = "events.k8s.io"


def test_each_service_account_can_do_what_its_component_needs_and_nothing_more(release, api):
    release.install(*GRACEFUL)
    ns, other = release.namespace, f"other-{uuid.uuid4().hex[:4]}"
    table = [
        ("cluster-agent", "list", "nodes", None, True), ("cluster-agent", "watch", "nodes", None, True),
        ("cluster-agent", "create", "pods", ns, True), ("cluster-agent", "delete", "pods", ns, True),
        ("cluster-agent", "patch", "pods", ns, True), ("cluster-agent", "patch", "pods", other, False),
        # ... and lists and watches them: its work Pods, and the node agents' Pods its domain folder checks members by
        ("cluster-agent", "list", "pods", ns, True), ("cluster-agent", "watch", "pods", ns, True),
        ("cluster-agent", "create", "pods", other, False), ("cluster-agent", "get", "secrets", ns, False),
        ("cluster-agent", "patch", "nodes", None, False), ("cluster-agent", "delete", "nodes", None, False),
        ("node-agent", "list", "pods", ns, False), ("node-agent", "get", "nodes", None, False),
        # nodeAgent.gpuHealthEvents (the default): its Node's Events (which the API server keeps in default), create and
        # patch of events.k8s.io's only; cluster-wide, as the kubelet's (a Role in default would break kubectl apply -n)
        ("node-agent", "create", "events", "default", True, EVENTS), ("node-agent", "patch", "events", "default", True, EVENTS),
        ("node-agent", "delete", "events", "default", False, EVENTS), ("node-agent", "list", "events", "default", False, EVENTS),
        ("node-agent", "get", "events", ns, False, EVENTS),
        ("node-agent", "create", "events", "default", False),  # the core group's: not granted
        ("control-plane", "get", "secrets", ns, False), ("control-plane", "list", "pods", ns, False),
    ]
    rows = []
    for component, verb, resource, where, expected, *group in table:
        allowed = can_i(api, ns, f"{release.fullname}-{component}", verb, resource, where, *group)
        rows.append(f"{component:<14}{verb:<8}{(group[0] + '/' if group else '') + resource:<18}{where or '(cluster)':<44}"
                    f"{'yes' if allowed else 'no'}")
        assert allowed == expected, rows[-1]
    print("\n" + "\n".join(rows))


@pytest.mark.lane("every-node", nodes=2, reason="sets GPUs on every node its release runs on: beside the "
                                                          "parallel phase, a lane's nodes")
def test_node_agents_form_the_charts_gpudomain_through_the_cluster_agent(release, fake_gpus, api):
    """Every node's agent (one GPU each) is a member, numbered 0..N-1; one node losing its GPU turns its
    member NotReady, and the domain with it."""
    every = fake_gpus.nodes  # every node, or its lane's
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


def test_cluster_agent_and_control_plane_run_in_a_namespace_that_enforces_restricted(api, core, apps, kubeconfig,
                                                                                      namespace, fake_gpus):
    core.patch_namespace(namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                                             "pod-security.kubernetes.io/enforce-version": "latest"}}})
    fake_gpus.set(1)
    # Tokens and the control plane's certificate from Secrets made outside the chart, as a GitOps user would (sealed
    # or external secrets, the user's own PKI): the cluster agent verifies the control plane with that CA.
    core.create_namespaced_secret(namespace, client.V1Secret(metadata=client.V1ObjectMeta(name="gitops-tokens"), string_data={
        "registrationToken": uuid.uuid4().hex, "adminToken": uuid.uuid4().hex}))
    r = Release(api, core, apps, kubeconfig, namespace, name=f"ps{uuid.uuid4().hex[:5]}")
    ca = trustme.CA()
    service = f"{r.fullname}-control-plane"
    leaf = ca.issue_cert(f"{service}.{namespace}.svc", "localhost", "127.0.0.1")
    core.create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="gitops-tls"), type="kubernetes.io/tls", string_data={
            "tls.crt": leaf.cert_chain_pems[0].bytes().decode(), "tls.key": leaf.private_key_pem.bytes().decode(),
            "ca.crt": ca.cert_pem.bytes().decode()}))
    r.install("--set", "gracefulNoGPU=true", "--set", "nodeAgent.enabled=false",  # the node agent needs a hostPath
              "--set", "controlPlane.existingTokensSecret=gitops-tokens", "--set", "controlPlane.tls.existingSecret=gitops-tls")
    secrets = sorted(s.metadata.name for s in core.list_namespaced_secret(namespace).items if s.type != "helm.sh/release.v1")
    assert secrets == ["gitops-tls", "gitops-tokens"]  # the chart made none of its own
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


def runtime_class(api, name: str = "nvidia"):
    """The cluster's RuntimeClass of that name, or None."""
    try:
        return client.NodeV1Api(api).read_runtime_class(name)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def node_agents(core, namespace: str, release: str):
    return core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={release},"
                                                              f"app.kubernetes.io/component=node-agent").items


@pytest.mark.serial(reason="installs with the chart's pure defaults: its node agents run on every GPU node and its "
                           "cluster agent counts every node's GPUs")
@pytest.mark.every_cluster
def test_install_wait_with_the_charts_pure_defaults_succeeds_without_a_nvidia_runtime_class(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    """Issue 45: the README's first install, `helm install --wait` with only controlPlane.enabled=true (gpuSource nvml),
    on a cluster whose driver the GPU operator does not manage. `nodeAgent.runtimeClassName: nvidia` made every node
    agent pod "RuntimeClass not found" and --wait fail; now the chart takes nvidia only where the cluster has it, the
    node agents run under the default runtime, Ready with 0 GPUs (no NVML library: fake GPUs), and NOTES say what to
    set. On a cluster with a RuntimeClass nvidia of its own, the node agents run under it."""
    existing = runtime_class(api)
    fake_gpus.set(1)  # the cluster agent is Ready only with GPUs (and --wait waits for it)
    name = f"pd{uuid.uuid4().hex[:5]}"
    try:
        r = helm("install", name, str(CHART), "--kubeconfig", str(kubeconfig), "-n", namespace,
                 "--set", "controlPlane.enabled=true", "--wait", "--timeout", "3m", check=False)
        assert r.returncode == 0, f"helm install --wait with the chart's defaults failed: {r.stderr}"
        ds = apps.read_namespaced_daemon_set(f"{name}-gpu-agent-node-agent", namespace)
        assert ds.status.desired_number_scheduled >= 1, "no GPU node: the node agent's placement matched none"
        assert ds.status.number_ready == ds.status.desired_number_scheduled
        pods = node_agents(core, namespace, name)
        assert {p.spec.runtime_class_name for p in pods} == {"nvidia" if existing else None}
        if existing is None:
            assert 'have no RuntimeClass: the cluster has none named "nvidia"' in r.stdout, r.stdout
            assert "--set nodeAgent.runtimeClassName=nvidia" in r.stdout
            code, health = pod_http_get(core, namespace, pods[0].metadata.name, 8081, "healthz")
            assert code == 200 and "NVML library not found" in health["components"]["gpus"]["reason"], health
        else:
            assert "NVML through RuntimeClass nvidia (found in the cluster" in r.stdout, r.stdout
    finally:
        helm("uninstall", "--kubeconfig", str(kubeconfig), "-n", namespace, name, "--wait", "--timeout", "120s",
             check=False)
        fake_gpus.set(0)


@pytest.mark.serial(reason="creates the cluster-scoped RuntimeClass nvidia, which every release installed meanwhile "
                           "would look up and take")
def test_a_nvidia_runtime_class_in_the_cluster_is_found_at_install_and_an_explicit_value_still_wins(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    """The `lookup` branch, which `helm template` cannot reach: with a RuntimeClass nvidia in the cluster (handler runc
    here, so the pods still run), the default node agent (gpuSource nvml) gets runtimeClassName nvidia; an explicit
    "" renders none and an explicit name renders that name (`helm install --dry-run=server`, which looks up too)."""
    if runtime_class(api) is not None:
        pytest.skip("the cluster has a RuntimeClass nvidia of its own (the GPU operator's?): not this test's to replace")
    node_api = client.NodeV1Api(api)
    node_api.create_runtime_class(client.V1RuntimeClass(
        metadata=client.V1ObjectMeta(name="nvidia", labels={"e2e": "true"}), handler="runc"))
    fake_gpus.set(1)
    release = Release(api, core, apps, kubeconfig, namespace, name=f"rc{uuid.uuid4().hex[:5]}")
    try:
        out = release.install("--set", "nodeAgent.gpuSource=nvml", "--wait").stdout
        pods = node_agents(core, namespace, release.name)
        assert pods and {p.spec.runtime_class_name for p in pods} == {"nvidia"}
        assert all(c.ready for p in pods for c in p.status.container_statuses or []), "node agents Ready under runc"
        assert "NVML through RuntimeClass nvidia (found in the cluster; nodeAgent.runtimeClassName is null)" in out, out

        def dry_run(*extra):
            other = Release(api, core, apps, kubeconfig, namespace, name=f"dr{uuid.uuid4().hex[:5]}")
            out = helm("install", *other.args("--set", "nodeAgent.gpuSource=nvml", *extra), "--dry-run=server").stdout
            manifest, notes = out.split("\nNOTES:\n", 1)
            (ds,) = [d for d in yaml.safe_load_all(manifest.split("\nMANIFEST:\n", 1)[1]) if d and d["kind"] == "DaemonSet"]
            return ds["spec"]["template"]["spec"].get("runtimeClassName"), notes

        assert dry_run()[0] == "nvidia"
        none, notes = dry_run("--set", "nodeAgent.runtimeClassName=")
        assert none is None and 'have no RuntimeClass: nodeAgent.runtimeClassName is "".' in notes, notes
        named, notes = dry_run("--set", "nodeAgent.runtimeClassName=gpu-agent-e2e-missing")
        assert named == "gpu-agent-e2e-missing"
        assert 'WARNING: the cluster has no RuntimeClass "gpu-agent-e2e-missing"' in notes, notes
    finally:
        try:
            release.uninstall_if_installed()
        finally:
            node_api.delete_runtime_class("nvidia")  # cluster-scoped: the namespace's deletion does not take it
            fake_gpus.set(0)
