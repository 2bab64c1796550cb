"""The RBAC of a default install, every verb and every resource (issue 48), as scripts/rbac-table.py prints it from
`helm template`: the tables below are what each chart grants with its defaults. A rule made wider (a verb, a resource,
resourceNames dropped, a namespace rule made cluster-wide) fails here naming each right it adds; a narrower one fails
too, so that the table stays the one the docs point at. Update a table only with a reason in the commit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("rbac_table", REPO / "scripts" / "rbac-table.py")
assert spec and spec.loader
rbac = sys.modules["rbac_table"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
spec.loader.exec_module(rbac)

GPU_AGENT, FAKE_GPU = REPO / "charts" / "gpu-agent", REPO / "charts" / "fake-gpu"
CA, NODE, HOOKS = (f"ServiceAccount gpu-agent/gpu-agent-{n}" for n in ("cluster-agent", "node-agent", "hooks"))
CRDS = "gpudomains.gpu-agent.io, gpudomainmembers.gpu-agent.io, workfences.gpu-agent.io"

DEFAULT_INSTALL = {GPU_AGENT: f"""
| {CA} | cluster | core | nodes | get, list, watch |
| {CA} | namespace gpu-agent | apps | deployments [gpu-agent-cluster-agent] | get |
| {CA} | namespace gpu-agent | coordination.k8s.io | leases | create |
| {CA} | namespace gpu-agent | coordination.k8s.io | leases [gpu-agent-cluster-agent] | delete, get, list, update, watch |
| {CA} | namespace gpu-agent | core | pods | create, delete, get, list, patch, watch |
| {CA} | namespace gpu-agent | events.k8s.io | events | create, patch |
| {CA} | namespace gpu-agent | gpu-agent.io | workfences | create |
| {CA} | namespace gpu-agent | gpu-agent.io | workfences [gpu-agent-cluster-agent] | get, update |
| {HOOKS} | cluster (hook) | apiextensions.k8s.io | customresourcedefinitions [{CRDS}] | create |
| {HOOKS} | cluster (hook) | apiextensions.k8s.io | customresourcedefinitions [{CRDS}] | get, patch |
| {HOOKS} | cluster (hook) | apiextensions.k8s.io | customresourcedefinitions/status [{CRDS}] | patch |
| {HOOKS} | cluster (hook) | gpu-agent.io | gpudomains, gpudomainmembers, workfences | get, list, update |
| {HOOKS} | namespace gpu-agent (hook) | apps | deployments [gpu-agent-cluster-agent] | delete, get |
| {HOOKS} | namespace gpu-agent (hook) | coordination.k8s.io | leases [gpu-agent-cluster-agent] | delete, get |
| {HOOKS} | namespace gpu-agent (hook) | core | pods | delete, list, patch |
| {HOOKS} | namespace gpu-agent (hook) | gpu-agent.io | gpudomainmembers | delete, list |
| {HOOKS} | namespace gpu-agent (hook) | gpu-agent.io | gpudomains | list |
| {HOOKS} | namespace gpu-agent (hook) | gpu-agent.io | gpudomains/status | get, patch |
| {NODE} | cluster | events.k8s.io | events | create, patch |
| ServiceAccount gpu-agent/gpu-agent-test | namespace gpu-agent (hook) | discovery.k8s.io | endpointslices | list |
""", FAKE_GPU: """
| ServiceAccount fake-gpu/fake-gpu-fake-gpu | cluster | core | nodes | get, patch |
| ServiceAccount fake-gpu/fake-gpu-fake-gpu | cluster | events.k8s.io | events | create |
| ServiceAccount fake-gpu/fake-gpu-fake-gpu | namespace fake-gpu | core | configmaps | list, watch |
| ServiceAccount fake-gpu/fake-gpu-fake-gpu-unlabel | cluster (hook) | core | nodes | list, patch |
"""}

# Value sets that add rules: DRA, a domain whose members join by node labels, two cluster agents.
VALUE_SETS = {"defaults": [], "DRA and a domain": ["dra.enabled=true", "nodeAgent.gpuSource=fake", "domain.name=d1",
                                                  "domain.joinMatching=true", "clusterAgent.replicas=2"]}


def parse(table: str) -> list:
    return sorted(rbac.Row(*(c.strip() for c in line.strip("| ").split(" | "))) for line in table.strip().splitlines())


def table(chart: Path, *sets: str) -> list:
    name = "gpu-agent" if chart == GPU_AGENT else "fake-gpu"
    return rbac.rows(rbac.render(chart, list(sets)), name)


@pytest.mark.parametrize("chart", list(DEFAULT_INSTALL), ids=lambda c: c.name)
def test_a_default_install_grants_exactly_its_table(chart):
    rendered, expected = table(chart), parse(DEFAULT_INSTALL[chart])
    widened, narrowed = rbac.wider(rendered, expected), rbac.wider(expected, rendered)
    assert not widened, f"rights the default install did not grant: {sorted(widened)}"
    assert not narrowed, f"rights taken away or limited to names (update the table): {sorted(narrowed)}"
    assert rendered == expected, rbac.diff(expected, rendered)  # the same rights, split into other rules


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_no_wildcard_no_pods_create_but_the_cluster_agents_and_the_hooks_crd_rights_by_name(case):
    rows = table(GPU_AGENT, *VALUE_SETS[case])
    for r in rows:
        assert "*" not in f"{r.api_group} {r.resource} {r.verbs}", r
        if r.subject != CA:
            assert not ({"pods", "pods/ephemeralcontainers"} & set(r.resource.split(", ")) and "create" in r.verbs), r
        if r.subject == HOOKS and r.api_group == "apiextensions.k8s.io":
            assert r.resource.endswith(f" [{CRDS}]"), f"the hooks' CRD rights must name the chart's CRDs: {r}"
    assert any(r.subject == NODE for r in rows)  # the node agent's rows are there, none of them creates Pods
    assert any(r.subject == CA and r.resource == "pods" and "create" in r.verbs for r in rows)


def test_rows_and_wider_on_a_hand_made_render():
    """A RoleBinding of a ClusterRole grants it in the binding's namespace; a binding to a role the chart lacks and a
    role nothing binds are listed; a rule for any name is wider than the same rule for named objects."""
    role = {"kind": "ClusterRole", "metadata": {"name": "r"},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["a"], "verbs": ["get"]}]}
    sa = [{"kind": "ServiceAccount", "name": "sa", "namespace": "ns"}]
    docs = [role, {"kind": "Role", "metadata": {"name": "lone"}, "rules": [{"nonResourceURLs": ["/x"], "verbs": ["get"]}]},
            {"kind": "RoleBinding", "metadata": {"name": "b", "namespace": "ns"}, "subjects": sa,
             "roleRef": {"kind": "ClusterRole", "name": "r"}},
            {"kind": "ClusterRoleBinding", "metadata": {"name": "v"}, "subjects": sa,
             "roleRef": {"kind": "ClusterRole", "name": "view"}}]
    assert rbac.rows(docs, "ns") == [
        rbac.Row("(unbound)", "Role lone", "-", "/x", "get"),
        rbac.Row("ServiceAccount ns/sa", "cluster", "-", "(all of ClusterRole view, not in the chart)", "-"),
        rbac.Row("ServiceAccount ns/sa", "namespace ns", "core", "secrets [a]", "get")]
    named = rbac.rows(docs[:3], "ns")
    del role["rules"][0]["resourceNames"]
    anyname = rbac.rows(docs[:3], "ns")
    assert rbac.wider(named, anyname) == set()
    assert rbac.wider(anyname, named) == {("ServiceAccount ns/sa", "namespace ns", "core", "secrets", "*", "get")}
