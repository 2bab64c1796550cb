"""Least privilege, as `helm template` renders it (issue 48, part 4): the hooks' rights on CustomResourceDefinitions
name the chart's own CRDs, every Secret volume is mode 0440 or tighter and still readable by its pod's user, the
cleanup hook mounts the one token it uses, and the hooks' RBAC is there for each hook Job and deleted after it.

No cluster is needed; what the API server and Helm do with these objects is exercised by the e2e suite (install,
upgrade, rollback and uninstall run the hooks with exactly these rights; a refused upgrade leaves no hook RBAC)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from e2e.release import BASE, CHART, helm

HOOKS_CODE = Path(__file__).resolve().parents[2] / "hooks" / "gpu_agent_hooks"
CRD_GROUP, CRDS, CRD_STATUS = "apiextensions.k8s.io", "customresourcedefinitions", "customresourcedefinitions/status"
# Verbs whose request names its object when it is authorized: a rule for them can, and here must, carry
# resourceNames. (create carries a name only through server-side apply, the one way the hooks create a CRD.)
NAMED_VERBS = {"get", "patch", "update", "delete", "create"}

# Value sets with different pods, Secrets and hooks: the defaults with the reference control plane (what the e2e
# suite installs), an external control plane, tokens from an existing Secret, DRA with a domain.
VALUE_SETS = {
    "reference control plane": [],
    "external control plane": ["--set", "controlPlane.enabled=false", "--set", "controlPlane.url=https://cp.example:8700",
                               "--set", "controlPlane.existingSecret=cp-token"],
    "existing tokens Secret": ["--set", "controlPlane.existingTokensSecret=cp-tokens"],
    "DRA, a domain, two cluster agents": ["--set", "dra.enabled=true", "--set", "nodeAgent.gpuSource=fake",
                                          "--set", "domain.name=d1", "--set", "clusterAgent.replicas=2"],
}


def render(*sets: str) -> list[dict]:
    out = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def chart_crd_names() -> set[str]:
    return {d["metadata"]["name"] for p in (CHART / "crds").glob("*.yaml") for d in yaml.safe_load_all(p.read_text()) if d}


def hooks_cluster_role(docs: list[dict]) -> dict:
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "t-gpu-agent-hooks"]
    return role


def crd_rights(role: dict) -> dict[tuple[str, str], set[str] | None]:
    """(resource, verb) -> the names a rule of `role` grants it for (None: any name), over the CRD rules."""
    rights: dict[tuple[str, str], set[str] | None] = {}
    for rule in role["rules"]:
        if CRD_GROUP not in rule["apiGroups"] and "*" not in rule["apiGroups"]:
            continue
        names = set(rule["resourceNames"]) if rule.get("resourceNames") else None
        for resource in rule["resources"]:
            for verb in rule["verbs"]:
                before = rights.get((resource, verb), set())
                rights[(resource, verb)] = None if names is None or before is None else before | names
    return rights


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_the_hooks_crd_rights_name_the_charts_own_crds_for_every_verb_that_takes_a_name(case):
    crds = chart_crd_names()
    assert crds == {"gpudomains.gpu-agent.io", "gpudomainmembers.gpu-agent.io", "workfences.gpu-agent.io"}
    rights = crd_rights(hooks_cluster_role(render(*VALUE_SETS[case])))
    assert set(rights) == {(CRDS, "get"), (CRDS, "patch"), (CRDS, "create"), (CRD_STATUS, "patch")}, rights
    for (resource, verb), names in rights.items():
        assert verb in NAMED_VERBS, f"{verb} {resource} cannot be limited by name"
        assert names == crds, f"{verb} {resource} is granted for {names or 'any CRD'}, not just the chart's {crds}"


def test_the_hooks_call_nothing_on_crds_their_rights_leave_out():
    """Each API call the hook code makes on CRDs, and the right it needs: a new call (a list, a delete) fails here
    until the ClusterRole grants it; one the rights have but no code calls would be a right too many."""
    needs = {"read_custom_resource_definition": (CRDS, "get"),
             "patch_custom_resource_definition": (CRDS, "patch"),  # a server-side apply; one that creates: create
             "patch_custom_resource_definition_status": (CRD_STATUS, "patch")}
    called = {m for p in HOOKS_CODE.glob("*.py") for m in re.findall(r"\.(\w*custom_resource_definition\w*)\(", p.read_text())}
    assert called == set(needs), f"calls on CRDs without a known right: {called - set(needs)}; rights for none: {set(needs) - called}"
    rights = crd_rights(hooks_cluster_role(render()))
    assert {needs[m] for m in called} | {(CRDS, "create")} == set(rights)


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    specs = {}
    for d in docs:
        spec = d.get("spec", {})
        if d["kind"] == "Pod":
            specs[d["metadata"]["name"]] = spec
        elif d["kind"] == "CronJob":
            specs[d["metadata"]["name"]] = spec["jobTemplate"]["spec"]["template"]["spec"]
        elif "template" in spec:
            specs[d["metadata"]["name"]] = spec["template"]["spec"]
    return specs


def secret_volumes(spec: dict) -> list[tuple[str, dict, int | None]]:
    """(volume, the Secret source, its mode) for each Secret a pod mounts, plain or projected; one entry per item
    with a mode of its own."""
    out = []
    for v in spec.get("volumes", []):
        sources = [(v["secret"], v["secret"].get("defaultMode"))] if "secret" in v else []
        if "projected" in v:
            sources += [(s["secret"], v["projected"].get("defaultMode")) for s in v["projected"]["sources"] if "secret" in s]
        for source, mode in sources:
            out.append((v["name"], source, mode))
            out += [(v["name"], source, item["mode"]) for item in source.get("items", []) if "mode" in item]
    return out


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_every_secret_volume_in_every_rendered_pod_is_0440_or_tighter_and_its_user_can_read_it(case):
    """Without a mode a Secret's files are 0644, readable by any user in the container. 0440 leaves root and the
    file's group: with an fsGroup the kubelet makes that the pod's fsGroup (and keeps the mode, a read-only volume's
    files get g+r), so a non-root user reads its token through the fsGroup; without one the file stays root's."""
    checked = 0
    for name, spec in pod_specs(render(*VALUE_SETS[case])).items():
        pod_context = spec.get("securityContext") or {}
        for volume, _source, mode in secret_volumes(spec):
            checked += 1
            assert mode is not None and mode & ~0o440 == 0, f"{name}: Secret volume {volume} has mode {mode and oct(mode)}"
            for container in spec["containers"] + spec.get("initContainers", []):
                if not any(m["name"] == volume for m in container.get("volumeMounts", [])):
                    continue
                user = (container.get("securityContext") or {}).get("runAsUser", pod_context.get("runAsUser"))
                assert user == 0 or pod_context.get("fsGroup"), \
                    f"{name}/{container['name']} runs as {user} without an fsGroup: it cannot read {volume} at 0440"
    assert checked >= 2, checked  # the cluster agent's token at least, and the cleanup hook's


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_the_cleanup_hook_mounts_the_registration_token_alone_and_the_crds_hook_no_secret(case):
    """The cleanup hook deregisters with the registration token (--token-file) and reads no other file of the
    tokens Secret, which holds the admin token too; the CRDs hook reads no Secret at all."""
    jobs = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in render(*VALUE_SETS[case]) if d["kind"] == "Job"}
    assert set(jobs) == {"t-gpu-agent-cleanup", "t-gpu-agent-crds"}
    mounted = {(job, v, s["secretName"], tuple(i["key"] for i in s.get("items", [])) or "every key")
               for job, spec in jobs.items() for v, s, _ in secret_volumes(spec)}
    secret = {"external control plane": "cp-token", "existing tokens Secret": "cp-tokens"}.get(
        case, "t-gpu-agent-control-plane-tokens")
    # and, where the chart's control plane serves HTTPS, its CA certificate (public) to verify it with, never its key
    ca = ({("t-gpu-agent-cleanup", "control-plane-ca", "t-gpu-agent-control-plane-tls", ("ca.crt",))}
          if case != "external control plane" else set())
    assert mounted == {("t-gpu-agent-cleanup", "token", secret, ("registrationToken",))} | ca, mounted
    cleanup = jobs["t-gpu-agent-cleanup"]
    volume = cleanup["volumes"][0]
    assert volume["secret"]["items"] == [{"key": "registrationToken", "path": "registrationToken"}]
    mount = cleanup["containers"][0]["volumeMounts"][0]
    assert f"--token-file={mount['mountPath']}/registrationToken" in cleanup["containers"][0]["args"]
    assert mount["readOnly"] is True


def test_the_hooks_rbac_is_there_for_each_hook_job_and_deleted_after_it():
    """Each hook Job runs as the hooks' ServiceAccount, whose RBAC is made (a lower weight) in every phase the Job
    runs in, then deleted on success; and, with Helm 4, when the Job fails: a failed hook makes Helm delete the
    hooks that succeeded before it in that phase by their hook-succeeded policy (the Job itself is kept, for its
    log). before-hook-creation replaces whatever a killed Helm left, at the next run."""
    docs = render()

    def hook(d):
        a = d["metadata"].get("annotations") or {}
        return (set(a.get("helm.sh/hook", "").split(",")) - {""}, int(a.get("helm.sh/hook-weight", 0)),
                set(a.get("helm.sh/hook-delete-policy", "").split(",")))

    access = [d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
              and d["metadata"]["name"] == "t-gpu-agent-hooks"]
    assert sorted(d["kind"] for d in access) == ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"]
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert jobs and all(d["spec"]["template"]["spec"]["serviceAccountName"] == "t-gpu-agent-hooks" for d in jobs)
    for obj in access:
        events, weight, policy = hook(obj)
        assert {"before-hook-creation", "hook-succeeded"} <= policy, (obj["kind"], policy)
        for job in jobs:
            job_events, job_weight, _ = hook(job)
            assert job_events <= events and weight < job_weight, (obj["kind"], job["metadata"]["name"])
