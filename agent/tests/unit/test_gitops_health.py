"""GitOps health of a GPUDomain, per the status contract (a Ready condition and observedGeneration), as the tools
themselves compute it: the Argo CD health script the chart ships, run in Lua 5.1 through e2e/gitops.py, and
sigs.k8s.io/cli-utils' kstatus through the Go tool in ci/kstatus (skipped, saying how to build it, where absent)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
# e2e/ is not a package on the unit suite's path; gitops.py needs nothing of the e2e suite.
_spec = importlib.util.spec_from_file_location("e2e_gitops", REPO / "e2e" / "gitops.py")
assert _spec and _spec.loader
gitops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gitops)


def domain(status=None, generation=3, version="v1beta1"):
    obj = {"apiVersion": f"gpu-agent.io/{version}", "kind": "GPUDomain",
           "metadata": {"name": "d1", "namespace": "ns", "generation": generation},
           "spec": {"expectedNodes": 3}}
    if status is not None:
        obj["status"] = status
    return obj


def ready(status, reason, message="", observed=3):
    return {"type": "Ready", "status": status, "reason": reason, "message": message,
            "observedGeneration": observed, "lastTransitionTime": "2026-12-02T01:02:03Z"}


def folded(*conditions, observed=3, **extra):
    return {"observedGeneration": observed, "status": "NotReady", "readyNodes": 2, "nodes": [], "cliques": [],
            "conditions": list(conditions), **extra}


# (case, object, Argo CD status, Argo CD message or None, kstatus status)
CASES = [
    ("created, no status yet", domain(), "Progressing", "Waiting for the cluster agent's first status", "Current"),
    ("status null", {**domain(), "status": None}, "Progressing", "Waiting for the cluster agent's first status",
     "Current"),
    ("status without conditions", domain({"observedGeneration": 3}), "Progressing",
     "Waiting for the Ready condition", "Current"),
    ("initializing", domain(folded(ready("Unknown", "Initializing", "")), generation=1), "Progressing",
     None, "InProgress"),
    ("forming", domain(folded(ready("False", "MembersMissing", "1 of 3 nodes joined; missing 2 (expected 3)"))),
     "Progressing", "1 of 3 nodes joined; missing 2 (expected 3)", "InProgress"),
    ("formed", domain(folded(ready("True", "MembersReady", "3 of 3 nodes ready"), status="Ready")),
     "Healthy", "3 of 3 nodes ready", "Current"),
    ("formed, v1alpha1", domain(folded(ready("True", "MembersReady", "3 of 3 nodes ready")), version="v1alpha1"),
     "Healthy", "3 of 3 nodes ready", "Current"),
    # Ready second in the list: the script must walk a 1-based list, not read index 0.
    ("formed, Ready not first", domain(folded({"type": "Other", "status": "False", "reason": "X", "message": "other"},
                                              ready("True", "MembersReady", "3 of 3 nodes ready"))),
     "Healthy", "3 of 3 nodes ready", "Current"),
    ("lost a member", domain(folded(ready("False", "MembersMissing", "2 of 3 nodes joined; missing n3 (expected 3)"))),
     "Progressing", "2 of 3 nodes joined; missing n3 (expected 3)", "InProgress"),
    ("member not ready", domain(folded(ready("False", "MembersNotReady", "n2 NotReady: heartbeat silent for 31s"))),
     "Degraded", "n2 NotReady: heartbeat silent for 31s", "InProgress"),
    ("clique full", domain(folded(ready("False", "CliqueFull", "n4 waits for a place in clique c1 (4 of 4)"))),
     "Degraded", "n4 waits for a place in clique c1 (4 of 4)", "InProgress"),
    ("False without a message", domain(folded(ready("False", "MembersNotReady", ""))), "Degraded", "MembersNotReady",
     "InProgress"),
    ("spec changed, status behind", domain(folded(ready("True", "MembersReady", "3 of 3 nodes ready"), observed=2),
                                           generation=3),
     "Progressing", "Waiting for the cluster agent to fold generation 3 (status is of generation 2)", "InProgress"),
    ("Ready behind, status current", domain(folded(ready("True", "MembersReady", "ok", observed=2))),
     "Progressing", "Waiting for the cluster agent to fold generation 3 (Ready is of generation 2)", "Current"),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize(("obj", "status", "message"), [c[1:4] for c in CASES], ids=IDS)
def test_argocd_health_script(obj, status, message):
    health = gitops.argocd_health(obj)
    assert health["status"] == status, health
    if message is not None:
        assert health["message"] == message, health


def test_argocd_health_refuses_a_script_that_reaches_outside_argo_cds_sandbox(tmp_path):
    script = tmp_path / "gpudomain.lua"
    script.write_text('local hs = {}\nhs.status = "Healthy"\nhs.message = os.getenv("HOME")\nreturn hs\n')
    with pytest.raises(Exception, match="os"):
        gitops.argocd_health(domain(), script)
    script.write_text('return {status = "Fine", message = ""}\n')
    with pytest.raises(AssertionError, match="Fine"):
        gitops.argocd_health(domain(), script)


def test_the_readme_installs_exactly_the_shipped_script_under_argo_cds_key():
    readme = (REPO / "charts/gpu-agent/README.md").read_text()
    block = re.search(r"```yaml\n(apiVersion: v1\nkind: ConfigMap\n.*?)```", readme, re.S)
    assert block, "no argocd-cm snippet in the chart README"
    cm = yaml.safe_load(block.group(1))
    assert cm["metadata"]["name"] == "argocd-cm"
    # Argo CD's key: resource.customizations.health.<group>_<kind>
    assert cm["data"] == {"resource.customizations.health.gpu-agent.io_GPUDomain":
                          (REPO / "charts/gpu-agent/health/gpudomain.lua").read_text()}


# --- kstatus (cli-utils v0.37.2) ---------------------------------------------------------------------------------

def kstatus_or_skip():
    if not os.access(gitops.kstatus_bin(), os.X_OK):
        pytest.skip(f"kstatus not built at {gitops.kstatus_bin()}: run `{gitops.BUILD_COMMAND}` (needs Go)")
    return gitops.kstatus


@pytest.mark.parametrize(("obj", "expected"), [(c[1], c[4]) for c in CASES], ids=IDS)
def test_kstatus_of_a_gpudomain(obj, expected):
    [row] = kstatus_or_skip()([obj])
    assert (row["kind"], row["namespace"], row["name"], row["status"]) == ("GPUDomain", "ns", "d1", expected), row


def test_kstatus_and_argo_cd_agree_once_the_agent_has_written():
    """Whenever the agent has written a Ready condition, Flux and Argo CD call the domain ready together."""
    written = [c for c in CASES if (c[1].get("status") or {}).get("conditions")
               and c[1]["status"]["conditions"][-1]["observedGeneration"] == c[1]["metadata"]["generation"]]
    rows = kstatus_or_skip()([c[1] for c in written])
    assert len(written) >= 8
    for case, row in zip(written, rows, strict=True):
        assert (row["status"] == "Current") == (gitops.argocd_health(case[1])["status"] == "Healthy"), case[0]


def deployment(ready_replicas, generation=1, observed=1):
    return {"metadata": {"name": "web", "namespace": "ns", "generation": generation},
            "spec": {"replicas": 2},
            "status": {"observedGeneration": observed, "replicas": 2, "updatedReplicas": 2,
                       "readyReplicas": ready_replicas, "availableReplicas": ready_replicas,
                       "conditions": [{"type": "Available", "status": "True"},
                                      {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]}}


def test_kstatus_of_deployments_lists_and_streams():
    kstatus = kstatus_or_skip()
    typed = {"apiVersion": "apps/v1", "kind": "Deployment"}
    rows = kstatus([
        {**typed, **deployment(1)},
        {**typed, **deployment(2)},
        {**typed, **deployment(2, generation=2, observed=1)},
        # As the API server lists them: the items carry no apiVersion or kind.
        {"apiVersion": "apps/v1", "kind": "DeploymentList", "items": [deployment(1)]},
        # As `kubectl get -o json` lists them.
        {"apiVersion": "v1", "kind": "List", "items": [{**typed, **deployment(2)},
                                                       {"apiVersion": "v1", "kind": "ConfigMap",
                                                        "metadata": {"name": "c", "namespace": "ns"}}]},
    ])
    assert [(r["apiVersion"], r["kind"], r["status"]) for r in rows] == [
        ("apps/v1", "Deployment", "InProgress"), ("apps/v1", "Deployment", "Current"),
        ("apps/v1", "Deployment", "InProgress"), ("apps/v1", "Deployment", "InProgress"),
        ("apps/v1", "Deployment", "Current"), ("v1", "ConfigMap", "Current")]
    assert rows[0]["message"] == "Available: 1/2"
    assert "generation" in rows[2]["message"]


def test_kstatus_reports_what_it_cannot_compute_and_fails_on_what_is_no_object():
    kstatus = kstatus_or_skip()
    [row] = kstatus([{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "status": {"conditions": "x"}}])
    assert row["status"] == "Unknown" and row["error"], row
    with pytest.raises(RuntimeError, match=r"kstatus exited 1: .*decoding an object"):
        kstatus([[1, 2]])


def test_kstatus_absent_names_the_build_command(monkeypatch, tmp_path):
    monkeypatch.setenv("KSTATUS_BIN", str(tmp_path / "kstatus"))
    gitops.kstatus_bin.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match=re.escape("bash ci/scripts/build-kstatus.sh")):
            gitops.kstatus([domain()])
    finally:
        gitops.kstatus_bin.cache_clear()
