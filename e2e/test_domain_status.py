"""A GPUDomain as platform tools read it: its Ready condition through each transition, the Events
`kubectl events` shows, `kubectl wait --for=condition=Ready`, and the verdicts of the real kstatus
(Flux, helm 4's --wait; built from sigs.k8s.io/cli-utils by ci/) and of the chart's Argo CD health
script (run by lupa) on the same live objects."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest
from kubernetes import client

from e2e import gitops
from e2e.cluster import tool
from e2e.helpers import wait_until
from e2e.release import Release

pytestmark = pytest.mark.lane("every-node", nodes=2, reason="sets GPUs on every node its release runs on: beside the "
                                                          "parallel phase, a lane's nodes")

GROUP, VERSION = "gpu-agent.io", "v1beta1"


@pytest.fixture
def nodes(fake_gpus) -> list[str]:
    return fake_gpus.nodes  # every node, or its lane's


def test_a_gpudomains_ready_condition_events_kubectl_wait_and_gitops_health_follow_each_transition(
        api, core, apps, kubeconfig, namespace, fake_gpus, nodes):
    label, value = "gpu-agent.io/e2e-status", uuid.uuid4().hex[:8]
    members = nodes[1:] if len(nodes) > 1 else nodes
    release = Release(api, core, apps, kubeconfig, namespace, name=f"st{uuid.uuid4().hex[:5]}")
    custom = client.CustomObjectsApi(api)
    kubectl = [tool("kubectl"), "--kubeconfig", str(kubeconfig), "-n", namespace]
    name = "rack"

    def read() -> dict:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomains", name)

    def ready() -> dict:
        return next((c for c in (read().get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})

    def wait_for_ready(timeout: str) -> tuple[int, float]:
        started = time.monotonic()
        r = subprocess.run([*kubectl, "wait", "--for=condition=Ready", f"gpudomain/{name}", f"--timeout={timeout}"],
                           capture_output=True, text=True, timeout=120)
        return r.returncode, time.monotonic() - started

    rows: list[str] = []

    def verdicts(state: str, condition: tuple[str, str], kstatus: str, argo: str) -> None:
        """The condition, then kstatus's and the Lua script's verdicts, all on one read of the object."""
        obj = read()
        cond = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
        seen_kstatus = gitops.kstatus([obj])[0]
        seen_argo = gitops.argocd_health(obj)
        rows.append(f"{state:<22} Ready={cond['status']:<7} {cond['reason']:<16} kstatus={seen_kstatus['status']:<11} "
                    f"argo={seen_argo['status']:<12} {cond['message']}")
        assert (cond["status"], cond["reason"]) == condition, cond
        assert cond["observedGeneration"] == obj["metadata"]["generation"] == obj["status"]["observedGeneration"]
        assert seen_kstatus["status"] == kstatus, seen_kstatus
        assert seen_argo["status"] == argo, seen_argo

    try:
        for node in nodes:
            fake_gpus.set(1, node=node)
        release.install("--set", "domain.joinMatching=true", "--set", "domain.heartbeatInterval=1")
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomains", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomain", "metadata": {"name": name},
            "spec": {"expectedNodes": len(members), "nodeSelector": {label: value}}})
        created = time.monotonic()
        # Nobody matches yet: the folder's first write says Initializing, never Ready.
        wait_until(lambda: ready().get("reason") == "Initializing", 60, "the new domain Initializing")
        initializing = time.monotonic() - created
        verdicts("fresh", ("Unknown", "Initializing"), "InProgress", "Progressing")
        code, _ = wait_for_ready("3s")
        assert code == 1, "kubectl wait returned 0 for a domain nobody has joined"

        for node in members:
            core.patch_node(node, {"metadata": {"labels": {label: value}}})
        code, took = wait_for_ready("60s")
        assert code == 0, "kubectl wait --for=condition=Ready did not return 0 once the nodes joined"
        rows.append(f"kubectl wait returned 0 {took:.1f} s after the nodes were labelled")
        verdicts("formed", ("True", "MembersReady"), "Current", "Healthy")

        # One member's node agent reports NotReady (its GPUs gone): the domain loses readiness.
        fake_gpus.set(0, node=members[-1])
        wait_until(lambda: ready().get("reason") == "MembersNotReady", 30, "the domain NotReady with a NotReady member")
        verdicts("member NotReady", ("False", "MembersNotReady"), "InProgress", "Degraded")
        code, _ = wait_for_ready("3s")
        assert code == 1
        fake_gpus.set(1, node=members[-1])
        wait_until(lambda: ready().get("status") == "True", 30, "the domain Ready again")

        # One member leaves (its node relabelled out): missing.
        core.patch_node(members[-1], {"metadata": {"labels": {label: "elsewhere"}}})
        wait_until(lambda: ready().get("reason") == "MembersMissing", 60, "the domain NotReady with a member missing")
        verdicts("member left", ("False", "MembersMissing"), "InProgress", "Progressing")

        # The user lowers expectedNodes: the folder answers the new generation at once.
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomains", name,
                                              {"spec": {"expectedNodes": len(members) - 1 or 1}})
        respec = time.monotonic()
        wait_until(lambda: (read().get("status") or {}).get("observedGeneration") == read()["metadata"]["generation"]
                   and ready().get("status") == ("True" if len(members) > 1 else "False"), 30, "the new spec answered")
        answered = time.monotonic() - respec
        if len(members) > 1:
            verdicts("expectedNodes lowered", ("True", "MembersReady"), "Current", "Healthy")

        # The Events of each change, as kubectl shows them.
        def reasons() -> list[str]:
            r = subprocess.run([*kubectl, "events", "--for", f"gpudomain/{name}", "-o", "json"], capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            return [e["reason"] for e in json.loads(r.stdout).get("items", [])]
        wanted = {"NodeJoined", "DomainReady", "NodeNotReady", "DomainNotReady", "NodeReady", "NodeLeft"}
        wait_until(lambda: wanted <= set(reasons()), 30, f"the events {sorted(wanted)}")
        shown = subprocess.run([*kubectl, "events", "--for", f"gpudomain/{name}"], capture_output=True, text=True, timeout=60)
        got = subprocess.run([*kubectl, "get", "gpudomains"], capture_output=True, text=True, timeout=60)
        described = subprocess.run([*kubectl, "describe", "gpudomain", name], capture_output=True, text=True, timeout=60)
        for r in (shown, got, described):
            assert r.returncode == 0, r.stderr
        print(f"\nInitializing written {initializing:.1f} s after the domain was created (the release installed just before, "
              f"without --wait); new spec answered in "
              f"{answered:.1f} s\n"
              + "\n".join(rows) + "\n\n$ kubectl events --for gpudomain/rack\n" + shown.stdout
              + "\n$ kubectl get gpudomains\n" + got.stdout + "\n$ kubectl describe gpudomain rack\n" + described.stdout)
        assert got.stdout.split()[:7] == ["NAME", "READY", "REASON", "NODES", "EXPECTED", "CLIQUES", "AGE"], got.stdout
        assert "NodeJoined" in described.stdout, "kubectl describe shows no history of the domain"
    finally:
        for node in nodes:
            core.patch_node(node, {"metadata": {"labels": {label: None}}})
        release.uninstall_if_installed()
        for node in nodes:
            fake_gpus.set(0, node=node)
