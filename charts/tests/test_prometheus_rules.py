"""The chart's alerts (issue 50, part 2): `metrics.prometheusRule` renders one monitoring.coreos.com/v1 PrometheusRule
with the alerts docs/alerts.md lists, each following the kube-prometheus convention (a GPUAgent name, a severity label,
summary, description and a runbook_url at its section of docs/alerts.md), and nothing without it. The rendered rule
passes `promtool check rules` and the `promtool test rules` cases of charts/tests/promtool/ (each alert firing and not
firing). promtool comes from the CI cache (ci/scripts/install-tools.sh) or PATH. `helm template` only: no cluster."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e.cluster import CI_TOOLS
from e2e.release import BASE, CHART, helm

REPO = CHART.parent.parent
PROMTOOL_TESTS = Path(__file__).resolve().parent / "promtool"
ALERTS_DOC = REPO / "docs" / "alerts.md"
ON = ["--set", "metrics.prometheusRule.enabled=true"]
# values key -> alert name, severity by default
ALERTS = {
    "clusterAgentNotReady": ("GPUAgentClusterAgentNotReady", "warning"),
    "noActiveLeader": ("GPUAgentNoActiveLeader", "critical"),
    "gpuUnhealthy": ("GPUAgentGPUUnhealthy", "warning"),
    "gpuCriticalErrors": ("GPUAgentGPUCriticalErrors", "warning"),
    "domainNotReady": ("GPUAgentDomainNotReady", "warning"),
    "registrationFailing": ("GPUAgentRegistrationFailing", "warning"),
    "queueBlocked": ("GPUAgentQueueBlocked", "critical"),
    "workItemsFailing": ("GPUAgentWorkItemsFailing", "warning"),
    "controlPlaneUnreachable": ("GPUAgentControlPlaneUnreachable", "critical"),
}


def promtool() -> str:
    found = CI_TOOLS / "promtool" if (CI_TOOLS / "promtool").exists() else shutil.which("promtool")
    if not found:
        pytest.skip(f"promtool not found: run `bash ci/scripts/install-tools.sh` (it caches it in {CI_TOOLS})")
    return str(found)


def render(*sets: str, release: str = "t", namespace: str = "ns") -> list[dict]:
    out = helm("template", release, str(CHART), "--namespace", namespace, *BASE, *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def the_rule(docs: list[dict]) -> dict:
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return rule


def alerts_of(rule: dict) -> dict[str, dict]:
    (group,) = rule["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"] or []}


def doc_anchors() -> set[str]:
    """docs/alerts.md's anchors, as scripts/check-doc-links.py (and GitHub) make them."""
    spec = importlib.util.spec_from_file_location("check_doc_links", REPO / "scripts" / "check-doc-links.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.anchors_of(ALERTS_DOC)


# --- what is rendered ------------------------------------------------------------------------------------------------


def test_nothing_is_rendered_by_default():
    assert not [d for d in render() if d["kind"] == "PrometheusRule"]


def test_enabled_one_prometheus_rule_holds_every_alert_with_its_severity_annotations_and_runbook():
    rule = the_rule(render(*ON))
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == "t-gpu-agent" and rule["metadata"]["namespace"] == "ns"
    assert rule["metadata"]["labels"]["app.kubernetes.io/component"] == "alerts"
    alerts = alerts_of(rule)
    assert sorted(alerts) == sorted(name for name, _ in ALERTS.values())
    anchors = doc_anchors()
    for name, severity in ALERTS.values():
        alert = alerts[name]
        assert alert["labels"] == {"severity": severity}, name
        assert set(alert["annotations"]) == {"summary", "description", "runbook_url"}, name
        assert all(alert["annotations"][k].strip() for k in ("summary", "description")), name
        url = alert["annotations"]["runbook_url"]
        assert url == f"docs/alerts.md#{name.lower()}", name
        assert name.lower() in anchors, f"{name}: docs/alerts.md has no section {name} (anchor #{name.lower()})"
        assert alert["for"], name
        # every series it reads is this release's: the namespace and the jobs its monitors give the agents
        assert 'namespace="ns"' in alert["expr"] and 'job=~"(ns/)?t-gpu-agent-(cluster|node)-agent"' in alert["expr"], name
    # the table of docs/alerts.md lists the rendered alerts, each with its default severity and `for`
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in ALERTS_DOC.read_text().splitlines()
            if line.startswith("| [GPUAgent")]
    listed = {row[0].split("](#")[0].lstrip("["): (row[1], row[2]) for row in rows}
    assert listed == {name: (a["labels"]["severity"], a["for"]) for name, a in alerts.items()}


def test_namespace_labels_alert_labels_runbook_url_and_selector_are_values():
    rule = the_rule(render(*ON, "--set", "metrics.prometheusRule.namespace=monitoring",
                           "--set", "metrics.prometheusRule.labels.release=prometheus",
                           "--set", "metrics.prometheusRule.alertLabels.team=gpu",
                           "--set", "metrics.prometheusRule.runbookUrl=https://example.com/alerts.md",
                           "--set", "metrics.prometheusRule.selector=job=\"gpu-agent\""))
    assert rule["metadata"]["namespace"] == "monitoring" and rule["metadata"]["labels"]["release"] == "prometheus"
    for name, alert in alerts_of(rule).items():
        assert alert["labels"]["team"] == "gpu" and alert["labels"]["severity"] in ("warning", "critical"), name
        assert alert["annotations"]["runbook_url"] == f"https://example.com/alerts.md#{name.lower()}"
        assert 'job="gpu-agent"' in alert["expr"] and 'namespace="ns"' not in alert["expr"], name


def test_for_severity_and_thresholds_are_values():
    rule = the_rule(render(*ON, "--set", "metrics.prometheusRule.alerts.clusterAgentNotReady.for=3m",
                           "--set", "metrics.prometheusRule.alerts.clusterAgentNotReady.severity=critical",
                           "--set-json", "metrics.prometheusRule.alerts.workItemsFailing.ratio=0.9",
                           "--set", "metrics.prometheusRule.alerts.workItemsFailing.window=30m",
                           "--set", "metrics.prometheusRule.alerts.controlPlaneUnreachable.window=7m",
                           "--set", "metrics.prometheusRule.alerts.gpuCriticalErrors.window=1h"))
    alerts = alerts_of(rule)
    assert alerts["GPUAgentClusterAgentNotReady"]["for"] == "3m"
    assert alerts["GPUAgentClusterAgentNotReady"]["labels"]["severity"] == "critical"
    assert alerts["GPUAgentClusterAgentNotReady"]["annotations"]["description"].count("3m") == 1
    failing = alerts["GPUAgentWorkItemsFailing"]["expr"]
    assert failing.rstrip().endswith("> 0.9") and failing.count("[30m]") == 2
    assert alerts["GPUAgentControlPlaneUnreachable"]["expr"].count("[7m]") == 2
    assert "[1h]" in alerts["GPUAgentGPUCriticalErrors"]["expr"]


def test_each_alert_can_be_turned_off_alone_and_all_off_leaves_an_empty_group():
    keys = list(ALERTS)
    for off in (keys[0::2], keys[1::2]):
        sets = [a for key in off for a in ("--set", f"metrics.prometheusRule.alerts.{key}.enabled=false")]
        assert set(alerts_of(the_rule(render(*ON, *sets)))) == {ALERTS[k][0] for k in keys if k not in off}, off
    sets = [a for key in keys for a in ("--set", f"metrics.prometheusRule.alerts.{key}.enabled=false")]
    assert alerts_of(the_rule(render(*ON, *sets))) == {}


@pytest.mark.parametrize("sets,named", [
    (["--set", "metrics.prometheusRule.alerts.queueBlocked.severity=page"], "severity"),
    (["--set", "metrics.prometheusRule.alerts.queueBlocked.for=5"], "for"),
    (["--set", "metrics.prometheusRule.alerts.workItemsFailing.ratio=2"], "ratio"),
    (["--set", "metrics.prometheusRule.alerts.noSuchAlert.enabled=true"], "noSuchAlert"),
    (["--set", "metrics.prometheusRule.alertLabels.severity=critical"], "alertLabels"),
])
def test_bad_values_are_refused_naming_the_value(sets, named):
    r = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *ON, *sets, check=False)
    assert r.returncode != 0 and named in r.stderr, r.stderr


# --- what Prometheus makes of it -------------------------------------------------------------------------------------


def test_every_alert_has_promtool_cases_firing_and_not_firing():
    cases = yaml.safe_load((PROMTOOL_TESTS / "alerts.test.yaml").read_text())["tests"]
    fired, quiet = set(), set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {name for name, _ in ALERTS.values()}
    assert fired == names, f"alerts without a firing case: {names - fired}"
    assert quiet == names, f"alerts without a case that does not fire: {names - quiet}"


def test_the_rendered_rules_pass_promtool_check_and_their_unit_tests(tmp_path):
    """The release the cases' series come from: "ga" in namespace "gpu-agent", every alert at its default."""
    tool = promtool()
    rule = the_rule(render(*ON, release="ga", namespace="gpu-agent"))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    for case in PROMTOOL_TESTS.glob("*.test.yaml"):
        shutil.copy(case, tmp_path / case.name)
    checked = subprocess.run([tool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
    assert checked.returncode == 0, f"promtool check rules:\n{checked.stdout}{checked.stderr}"
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout, checked.stdout
    tested = subprocess.run([tool, "test", "rules", *sorted(p.name for p in PROMTOOL_TESTS.glob("*.test.yaml"))],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert tested.returncode == 0, f"promtool test rules:\n{tested.stdout}{tested.stderr}"
