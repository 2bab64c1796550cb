"""Both charts as a platform team's linters see them, over a matrix of value sets:
`helm lint --strict`, kubeconform `-strict` against Kubernetes' own schemas (from the
kubernetes-validate package, so no network is needed), and checkov with no finding except those a
chart suppresses on the object with a one-line reason (`checkov.io/skipN: ID=reason`).

Each case is rendered and checked twice: for the CI cluster's Kubernetes and for the oldest one the case
supports (its chart's `kubeVersion`, 1.34 with `dra.enabled`), so a chart never admits a version whose API
server would refuse what it renders.

No cluster is needed; the tools come from the CI cache (ci/scripts/install-tools.sh) or PATH."""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from e2e.cluster import tool
from e2e.release import CHART, helm

FAKE_GPU_CHART = CHART.parent / "fake-gpu"
# The CI cluster's minor version (ci/scripts/common.sh, K8S_VERSION); kubernetes-validate ships
# one schema set per minor.
SCHEMA_VERSION = "1.36.0"
# dra.enabled renders resource.k8s.io/v1 (DeviceClass), served from 1.34; templates/checks.yaml refuses it below.
DRA_MIN_VERSION = "1.34.0"
# monitoring.coreos.com kinds: no schema for them is available offline; everything else is checked.
NO_SCHEMA_KINDS = "ServiceMonitor,PodMonitor,PrometheusRule"

EXTERNAL_CP = ["--set", "controlPlane.url=https://cp.example:8700", "--set", "controlPlane.existingSecret=cp-token"]
MATRIX = {
    "gpu-agent defaults (nvml, external control plane)": (CHART, EXTERNAL_CP),
    "gpu-agent reference control plane (fault injection on), fake GPUs, a domain": (CHART, [
        "--set", "controlPlane.enabled=true", "--set", "nodeAgent.gpuSource=fake", "--set", "domain.name=d1",
        "--set", "domain.expectedNodes=2", "--set", "controlPlane.faultInjection=true"]),
    "gpu-agent production shape": (CHART, [
        "--set", "controlPlane.enabled=true", "--set", "controlPlane.persistence.enabled=true",
        "--set", "controlPlane.existingTokensSecret=tokens", "--set", "gracefulNoGPU=true",
        "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
        "--set", "metrics.prometheusRule.enabled=true", "--set", "image.digest=sha256:" + "0" * 64, "--set", "image.pullPolicy=Always",
        "--set", "clusterAgent.serviceAccount.annotations.example\\.com/role=agent",
        "--set", "imagePullSecrets[0].name=regcred", "--set", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
        "--set", "clusterAgent.extraVolumes[0].name=ca", "--set", "clusterAgent.extraVolumes[0].configMap.name=ca",
        "--set", "clusterAgent.extraVolumeMounts[0].name=ca", "--set", "clusterAgent.extraVolumeMounts[0].mountPath=/etc/ssl/custom",
        "--set", "fullnameOverride=gpu-agent"]),
    "gpu-agent high availability (disruption budget, critical-priority quota)": (CHART, [*EXTERNAL_CP, "--set", "clusterAgent.replicas=2", "--set", "nodeAgent.priorityQuota.enabled=true"]),
    "gpu-agent NVML through the nvidia RuntimeClass": (CHART, [*EXTERNAL_CP, "--set", "nodeAgent.runtimeClassName=nvidia"]),
    "gpu-agent NVML from the host's driver (privileged)": (CHART, [*EXTERNAL_CP, "--set", "nodeAgent.nvml.driverRoot=/run/nvidia/driver"]),
    "gpu-agent without node agents or skew check": (CHART, [*EXTERNAL_CP, "--set", "nodeAgent.enabled=false", "--set", "hooks.skewCheck=false"]),
    "gpu-agent as the DRA driver (fake GPUs, an extended resource, a domain)": (CHART, [
        *EXTERNAL_CP, "--set", "dra.enabled=true", "--set", "nodeAgent.gpuSource=fake",
        "--set", "dra.extendedResourceName=nvidia.com/gpu", "--set", "domain.name=d1"]),
    "gpu-agent with the chart conventions (commonLabels, extraObjects, global registry and pull secrets)": (CHART, [
        *EXTERNAL_CP, "--set", "commonLabels.team=gpu", "--set", "global.imageRegistry=registry.example:5000",
        "--set", "global.imagePullSecrets[0]=mirror-pull", "--set", "imagePullSecrets[0].name=regcred",
        "--set-json", 'extraObjects=[{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "{{ .Release.Name }}-extra",'
        ' "namespace": "{{ .Release.Namespace }}", "labels": {"app.kubernetes.io/instance": "{{ .Release.Name }}"}}, "data": {"chart": "{{ .Chart.Name }}"}}]']),
    "fake-gpu defaults": (FAKE_GPU_CHART, []),
    "fake-gpu with a default count": (FAKE_GPU_CHART, ["--set", "defaultCount=4", "--set", "maxCount=8"]),
    "fake-gpu without its device plugin (nodes served by DRA)": (FAKE_GPU_CHART, ["--set", "devicePlugin.enabled=false"]),
    "fake-gpu with the chart conventions": (FAKE_GPU_CHART, [
        "--set", "commonLabels.team=gpu", "--set", "global.imageRegistry=registry.example:5000",
        "--set", "global.imagePullSecrets[0].name=mirror-pull",
        "--set-json", 'extraObjects=["apiVersion: v1\\nkind: ConfigMap\\nmetadata:\\n  name: {{ .Release.Name }}-extra\\n  namespace: {{ .Release.Namespace }}\\n"]']),
}


def lowest_version(chart: Path, sets: list[str]) -> str:
    """The oldest Kubernetes a case supports: its chart's kubeVersion floor (`>=X.Y.Z-0`), 1.34 with DRA."""
    constraint = yaml.safe_load((chart / "Chart.yaml").read_text())["kubeVersion"]
    m = re.fullmatch(r">=(\d+\.\d+\.\d+)-0", constraint)
    assert m, f"{chart}/Chart.yaml kubeVersion {constraint!r}: expected a plain floor, >=X.Y.Z-0"
    floor = m.group(1)
    if "dra.enabled=true" in sets:
        floor = max(floor, DRA_MIN_VERSION, key=lambda v: tuple(int(x) for x in v.split(".")))
    return floor


CHECKS = [(case, version) for case, (chart, sets) in MATRIX.items()
          for version in dict.fromkeys((lowest_version(chart, sets), SCHEMA_VERSION))]


def render(chart: Path, sets: list[str], release: str = "lint", kube_version: str = SCHEMA_VERSION) -> str:
    return helm("template", release, str(chart), "--namespace", "gpu-agent", "--kube-version", kube_version, *sets).stdout


@pytest.fixture(scope="module")
def schemas(tmp_path_factory):
    """version -> a folder of standalone schemas for kubeconform: kubernetes-validate's files refer to one shared
    definitions file by a path kubeconform cannot follow, so each definition is inlined
    (a recursive one is cut to `{}` at its second appearance on a path). The GPUDomain schema is
    the chart's own CRD's. A kind the version has no schema for is left out, so kubeconform fails on it."""
    kinds = {doc["kind"] + "|" + doc["apiVersion"] for chart, sets in MATRIX.values()
             for doc in yaml.safe_load_all(render(chart, sets)) if doc}

    @cache
    def for_version(version: str) -> Path:
        return write_schemas(version, kinds, tmp_path_factory.mktemp(f"schemas-{version}"))

    return for_version


def write_schemas(version: str, kinds: set[str], out: Path) -> Path:
    import kubernetes_validate

    source = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local-strict"
    assert source.is_dir(), f"kubernetes-validate has no schemas for Kubernetes {version}: {source}"
    defs = json.loads((source / "_definitions.json").read_text())["$defs"]

    def inline(node, path=()):
        if isinstance(node, dict):
            ref = node.get("$ref")  # (a property may be named "$ref" too: then it is a dict)
            if isinstance(ref, str) and "#/$defs/" in ref:
                name = ref.rsplit("/", 1)[1]
                return {} if name in path else inline(defs[name], (*path, name))
            return {k: inline(v, path) for k, v in node.items() if k != "$schema"}
        if isinstance(node, list):
            return [inline(v, path) for v in node]
        return node

    for kind_version in kinds:
        kind, api_version = kind_version.split("|")
        group_version = api_version.split("/")
        suffix = "-" + group_version[0].split(".")[0].lower() + ("-" + group_version[1].lower() if len(group_version) > 1 else "")
        name = f"{kind.lower()}{suffix}.json"
        if kind == "GPUDomain":
            crd = yaml.safe_load((CHART / "crds" / "gpudomain.yaml").read_text())
            served = next(v for v in crd["spec"]["versions"] if v["name"] == group_version[1])
            schema = served["schema"]["openAPIV3Schema"]
            schema.setdefault("properties", {}).update({"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                        "metadata": {"type": "object"}})
        elif (source / name).exists():
            schema = inline(json.loads((source / name).read_text()))
        else:
            continue
        (out / name).write_text(json.dumps(schema))
    return out


@pytest.mark.parametrize("case,version", CHECKS, ids=[f"{case} @{version}" for case, version in CHECKS])
def test_helm_lint_strict_and_kubeconform_strict(case, version, schemas, tmp_path):
    chart, sets = MATRIX[case]
    lint = helm("lint", "--strict", str(chart), "--namespace", "gpu-agent", "--kube-version", version, *sets, check=False)
    assert lint.returncode == 0 and "0 chart(s) failed" in lint.stdout, lint.stdout + lint.stderr
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(render(chart, sets, kube_version=version))
    kinds = [d["kind"] for d in yaml.safe_load_all(manifest.read_text()) if d]
    r = subprocess.run([tool("kubeconform"), "-strict", "-summary", "-output", "json", "-skip", NO_SCHEMA_KINDS,
                        "-schema-location", str(schemas(version)) + "/{{ .ResourceKind }}{{ .KindSuffix }}.json",
                        str(manifest)],
                       capture_output=True, text=True, timeout=120)
    report = json.loads(r.stdout)
    problems = [f"{x['kind']} {x['name']}: {x['msg']}" for x in report["resources"] if x["status"] != "statusValid"
                and not (x["status"] == "statusSkipped" and x["kind"] in NO_SCHEMA_KINDS)]
    assert r.returncode == 0 and not problems, "\n".join(problems) or r.stderr
    # every object was checked against a schema, not passed over
    assert report["summary"]["valid"] == len([k for k in kinds if k not in NO_SCHEMA_KINDS.split(",")]), report["summary"]


def test_checkov_finds_nothing_the_charts_do_not_suppress_with_a_reason(tmp_path):
    for i, (chart, sets) in enumerate(MATRIX.values()):
        # a release name per case, so that no case's NetworkPolicy covers another's pods
        (tmp_path / f"{i}.yaml").write_text(render(chart, sets, release=f"lint{i}"))
    r = subprocess.run([tool("checkov"), "-d", str(tmp_path), "--framework", "kubernetes", "--compact",
                        "-o", "json", "--skip-download"], capture_output=True, text=True, timeout=300)
    results = json.loads(r.stdout)
    results = results if isinstance(results, list) else [results]
    failed = [f"{f['check_id']} {f['resource']}: {f['check_name']}" for res in results for f in res["results"]["failed_checks"]]
    skipped = [s for res in results for s in res["results"].get("skipped_checks", [])]
    print(f"checkov: {sum(res['summary']['passed'] for res in results)} passed, {len(failed)} failed, "
          f"{len(skipped)} suppressed in the charts")
    assert not failed, "\n".join(failed)
    reasons = [s["check_result"].get("suppress_comment", "") for s in skipped]
    assert skipped and all(len(reason) > 10 for reason in reasons), reasons
