"""Both charts against what a platform team expects of any chart (issue 50 part 4) and the Kubernetes versions they
admit (issue 48 part 6): `kubeVersion` as low as what the render needs and no lower, `dra.enabled` refused below
1.34, `commonLabels` on every object, `extraObjects` rendered with `tpl`, `global.imageRegistry` on every image
and `global.imagePullSecrets` on every pod spec; with none of them set, the render is what it was without them.
`helm template` only: no cluster is needed."""

from __future__ import annotations

import json

import pytest
import yaml

from e2e.release import BASE, CHART, helm

FAKE_GPU_CHART = CHART.parent / "fake-gpu"
# Every optional object of the gpu-agent chart that renders without a cluster: the control plane with its claim,
# two cluster agents (disruption budget), the quota, a domain (member policy), DRA, both monitors, the alerts.
EVERYTHING = ["--set", "controlPlane.persistence.enabled=true", "--set", "clusterAgent.replicas=2",
              "--set", "nodeAgent.priorityQuota.enabled=true", "--set", "domain.name=d1", "--set", "dra.enabled=true",
              "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
              "--set", "metrics.prometheusRule.enabled=true"]
CHARTS = {"gpu-agent": (CHART, [*BASE, *EVERYTHING]), "fake-gpu": (FAKE_GPU_CHART, [])}


def template(chart, *args: str, check: bool = True):
    return helm("template", "t", str(chart), "--namespace", "ns", *args, check=check)


def docs_of(chart, *args: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(template(chart, *args).stdout) if d]


def pod_specs(docs) -> dict[str, dict]:
    """kind/name -> pod spec of every workload (Deployments, DaemonSets, Jobs: the hook Jobs too)."""
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job", "CronJob")}


def images(docs) -> dict[str, str]:
    return {f"{where}/{c['name']}": c["image"] for where, spec in pod_specs(docs).items()
            for c in (*spec.get("initContainers", []), *spec["containers"])}


# --- the Kubernetes versions each chart admits ------------------------------------------------------------------


def test_gpu_agent_needs_kubernetes_1_30_whose_admission_policies_its_default_render_has():
    r = template(CHART, *BASE, "--kube-version", "1.29.0", check=False)
    assert r.returncode != 0
    assert "chart requires kubeVersion: >=1.30.0-0 which is incompatible with Kubernetes v1.29.0" in r.stderr, r.stderr
    docs = docs_of(CHART, *BASE, "--kube-version", "1.30.0")
    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    assert policies and {d["apiVersion"] for d in policies} == {"admissionregistration.k8s.io/v1"}  # GA in 1.30
    assert template(CHART, *BASE, "--kube-version", "1.30.0-gke.1").returncode == 0  # a provider's pre-release tag


@pytest.mark.parametrize("sets", [[], ["--set", "nodeAgent.enabled=false"]], ids=["node agents", "cluster agent alone"])
def test_dra_is_refused_below_kubernetes_1_34_naming_the_value_and_the_fix(sets):
    """resource.k8s.io/v1 is served from 1.34: the DeviceClass and ResourceSlices, and the cluster agent's
    ResourceClaimTemplates, so also without node agents."""
    r = template(CHART, *BASE, "--set", "dra.enabled=true", *sets, "--kube-version", "1.33.0", check=False)
    assert r.returncode != 0
    assert "dra.enabled=true needs Kubernetes 1.34 or later" in r.stderr and "this cluster is v1.33.0" in r.stderr, r.stderr
    assert "set dra.enabled=false" in r.stderr and "upgrade the cluster to 1.34+" in r.stderr
    assert "--kube-version" in r.stderr  # what a `helm template` user passes
    docs = docs_of(CHART, *BASE, "--set", "dra.enabled=true", *sets, "--kube-version", "1.34.0")
    device_classes = [d for d in docs if d["kind"] == "DeviceClass" and d["apiVersion"] == "resource.k8s.io/v1"]
    assert len(device_classes) == (0 if sets else 2)  # the node agents' DeviceClasses (GPUs, channels); the cluster
    # agent's templates
    assert template(CHART, *BASE, "--kube-version", "1.33.0").returncode == 0  # without DRA 1.33 is fine


def test_fake_gpu_admits_the_oldest_kubernetes_the_lint_checks_and_renders_only_long_served_apis():
    r = template(FAKE_GPU_CHART, "--kube-version", "1.24.0", check=False)
    assert r.returncode != 0 and "chart requires kubeVersion: >=1.25.0-0" in r.stderr, r.stderr
    for sets in ([], ["--set", "devicePlugin.enabled=false"]):
        docs = docs_of(FAKE_GPU_CHART, "--kube-version", "1.25.0", *sets)
        assert {d["apiVersion"] for d in docs} <= {"v1", "apps/v1", "batch/v1", "networking.k8s.io/v1",
                                                   "rbac.authorization.k8s.io/v1"}, sets


# --- commonLabels ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHARTS))
def test_common_labels_reach_every_object_and_pod_but_no_selector(name):
    chart, sets = CHARTS[name]
    docs = docs_of(chart, *sets, "--set", "commonLabels.team=gpu", "--set", "commonLabels.example\\.com/cost=c1")
    # CRDs (crds/) are files Helm applies as they are: no template reaches them.
    objects = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    assert len(objects) > (30 if name == "gpu-agent" else 10)
    for d in objects:
        labels = d["metadata"].get("labels", {})
        assert labels.get("team") == "gpu" and labels.get("example.com/cost") == "c1", (d["kind"], d["metadata"]["name"])
        assert labels["app.kubernetes.io/instance"] == "t"  # the chart's own labels stay
    workloads = [d for d in objects if "template" in d.get("spec", {})]
    assert workloads
    for d in workloads:
        assert d["spec"]["template"]["metadata"]["labels"]["team"] == "gpu", d["metadata"]["name"]
        if "selector" in d["spec"]:  # a selector is immutable: a label added later must not change it
            assert "team" not in d["spec"]["selector"]["matchLabels"], d["metadata"]["name"]
    policies = [d for d in objects if d["kind"] == "NetworkPolicy"]
    assert policies and all("team" not in json.dumps(p["spec"]) for p in policies)


def test_a_pods_own_labels_win_over_common_labels_and_the_charts_own_labels_cannot_be_overridden():
    docs = docs_of(CHART, *BASE, "--set", "commonLabels.team=gpu", "--set", "clusterAgent.podLabels.team=mine",
                   "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.labels.team=prom")
    (ca,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-gpu-agent-cluster-agent"]
    assert ca["metadata"]["labels"]["team"] == "gpu" and ca["spec"]["template"]["metadata"]["labels"]["team"] == "mine"
    assert {d["metadata"]["labels"]["team"] for d in docs if d["kind"] == "ServiceMonitor"} == {"prom"}
    for chart, sets in CHARTS.values():
        for key in ("app.kubernetes.io/instance", "app.kubernetes.io/component", "helm.sh/chart"):
            r = template(chart, *sets, "--set", f"commonLabels.{key.replace('.', chr(92) + '.')}=x", check=False)
            assert r.returncode != 0
            assert f"commonLabels: {key} is a label the chart sets itself" in r.stderr, (chart.name, key, r.stderr)


# --- extraObjects ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHARTS))
def test_extra_objects_are_rendered_with_tpl_as_objects_or_as_strings(name):
    chart, sets = CHARTS[name]
    extra = [{"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "{{ .Release.Name }}-extra", "namespace": "{{ .Release.Namespace }}"},
              "data": {"chart": "{{ .Chart.Name }}", "verbosity": "{{ .Values.logVerbosity }}"}},
             "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ .Release.Name }}-extra-secret\n"
             "stringData:\n  release: {{ .Release.Name | upper }}\n"]
    docs = docs_of(chart, *sets, "--set", "logVerbosity=2", "--set-json", f"extraObjects={json.dumps(extra)}")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "t-extra"]
    assert cm["metadata"]["namespace"] == "ns" and cm["data"] == {"chart": name, "verbosity": "2"}
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "t-extra-secret"]
    assert secret["stringData"] == {"release": "T"}
    # each its own document, in the order given, after nothing of the chart's is lost
    assert len(docs) == len(docs_of(chart, *sets, "--set", "logVerbosity=2")) + 2


# --- global.imageRegistry and global.imagePullSecrets ------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHARTS))
def test_the_global_registry_is_the_registry_of_every_container_image(name):
    chart, sets = CHARTS[name]
    before = images(docs_of(chart, *sets))
    after = images(docs_of(chart, *sets, "--set", "global.imageRegistry=mirror.example:5000/gpu/"))
    assert len(before) >= (5 if name == "gpu-agent" else 2) and set(before) == set(after)
    for where, image in before.items():
        assert image.startswith("localhost/gpu-agent:"), (where, image)  # the default: as today
        # the registry host of the repository (localhost) replaced, path, tag and digest kept
        assert after[where] == "mirror.example:5000/gpu/" + image.removeprefix("localhost/"), (where, after[where])


def test_the_global_registry_replaces_a_named_registry_prefixes_a_bare_path_and_keeps_digests():
    digest = "sha256:" + "b" * 64
    docs = docs_of(CHART, *BASE, "--set", "global.imageRegistry=mirror.example", "--set", f"image.digest={digest}",
                   "--set", "nodeAgent.image.repository=ghcr.io/acme/gpu-agent",
                   "--set", "controlPlane.image.repository=acme/control-plane")
    by_name = {k.split("/")[1]: v for k, v in images(docs).items()}
    assert by_name["t-gpu-agent-cluster-agent"] == f"mirror.example/gpu-agent:dev@{digest}"
    assert by_name["t-gpu-agent-node-agent"] == "mirror.example/acme/gpu-agent:dev"
    assert by_name["t-gpu-agent-control-plane"] == "mirror.example/acme/control-plane:dev"
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "t-gpu-agent-cluster-agent"]
    assert yaml.safe_load(cm["data"]["config.yaml"])["workImage"] == f"mirror.example/gpu-agent:dev@{digest}"
    docs = docs_of(CHART, *BASE, "--set", "global.imageRegistry=mirror.example", "--set", "clusterAgent.workImage=busybox:1")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "t-gpu-agent-cluster-agent"]
    assert yaml.safe_load(cm["data"]["config.yaml"])["workImage"] == "busybox:1"  # named by the user: as given
    fake = images(docs_of(FAKE_GPU_CHART, "--set", "global.imageRegistry=mirror.example", "--set", "image.repository=acme/gpu"))
    assert set(fake.values()) == {"mirror.example/acme/gpu:dev"}


@pytest.mark.parametrize("name", list(CHARTS))
def test_global_pull_secrets_reach_every_pod_spec_after_the_charts_own_each_once(name):
    chart, sets = CHARTS[name]
    assert not [w for w, spec in pod_specs(docs_of(chart, *sets)).items() if "imagePullSecrets" in spec]
    own = ["--set", "imagePullSecrets[0].name=regcred"] if name == "gpu-agent" else []  # fake-gpu has none of its own
    docs = docs_of(chart, *sets, *own, "--set", "global.imagePullSecrets[0].name=mirror",
                   "--set", "global.imagePullSecrets[1]=corp", "--set", "global.imagePullSecrets[2].name=regcred")
    specs = pod_specs(docs)
    kinds = {w.split("/")[0] for w in specs}
    assert kinds == ({"Deployment", "DaemonSet", "Job"} if name == "gpu-agent" else {"DaemonSet", "Job"})
    hooks = [f"Job/{d['metadata']['name']}" for d in docs
             if d["kind"] == "Job" and "helm.sh/hook" in d["metadata"].get("annotations", {})]
    assert len(hooks) == (2 if name == "gpu-agent" else 1) and set(hooks) <= set(specs)  # crds, cleanup; unlabel
    want = ([{"name": "regcred"}] if own else []) + [{"name": "mirror"}, {"name": "corp"}] + ([] if own else [{"name": "regcred"}])
    for where, spec in specs.items():
        assert spec.get("imagePullSecrets") == want, (where, spec.get("imagePullSecrets"))


# --- defaults, and values refused ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHARTS))
def test_with_the_new_values_at_their_defaults_the_render_is_the_one_without_them(name):
    """The defaults in values.yaml (empty) change nothing: the same bytes as values that set them empty explicitly,
    no label of the user's, no pull secret, every image from localhost (the commit that added them compared the
    defaults' render with the previous chart's: byte-identical)."""
    chart, sets = CHARTS[name]
    fixed = (["--set", "controlPlane.existingTokensSecret=cp-tokens", "--set", "controlPlane.tls.existingSecret=cp-tls"]
             if name == "gpu-agent" else [])  # no random tokens or certificate
    default = template(chart, *sets, *fixed).stdout
    empty = template(chart, *sets, *fixed, "--set-json", 'global={"imageRegistry": "", "imagePullSecrets": []}',
                     "--set-json", "commonLabels={}", "--set-json", "extraObjects=[]").stdout
    assert default == empty
    docs = [d for d in yaml.safe_load_all(default) if d]
    assert not [d for d in docs if {"team"} & set(d["metadata"].get("labels", {}))]
    assert all(i.startswith("localhost/gpu-agent:") for i in images(docs).values())
    assert "extra-objects.yaml" not in default


BAD = [
    (CHART, ["--set", "commonLabels.team=" + "x" * 64], "/commonLabels/team"),
    (CHART, ["--set", "commonLabels.team=-x"], "/commonLabels/team"),
    (CHART, ["--set", "commonLabels.bad\\ key=x"], "invalid propertyName 'bad key'"),
    (CHART, ["--set-json", 'global.imagePullSecrets=[{"secret": "x"}]'], "/global/imagePullSecrets/0"),
    (CHART, ["--set", "global.imageRegistry=https://mirror.example"], "/global/imageRegistry"),
    (CHART, ["--set", "extraObjects[0]=1"], "/extraObjects/0"),
    (FAKE_GPU_CHART, ["--set", "commonLabels.team=" + "x" * 64], "/commonLabels/team"),
    (FAKE_GPU_CHART, ["--set-json", "global.imagePullSecrets=[3]"], "/global/imagePullSecrets/0"),
    (FAKE_GPU_CHART, ["--set", "extraObjects=x"], "/extraObjects"),
]


@pytest.mark.parametrize("chart,sets,named", BAD, ids=[f"{c.name} {n}" for c, _, n in BAD])
def test_bad_convention_values_are_refused_naming_the_value(chart, sets, named):
    r = template(chart, *(BASE if chart == CHART else []), *sets, check=False)
    assert r.returncode != 0 and named in r.stderr, r.stderr


def test_an_umbrella_charts_other_globals_still_pass_both_schemas():
    for chart, sets in CHARTS.values():
        assert template(chart, *sets, "--set", "global.somethingElse=1", "--set", "global.storageClass=x").returncode == 0
