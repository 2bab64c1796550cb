#!/usr/bin/env python3
"""The RBAC a chart installs, as a Markdown table (issue 48: "the RBAC of the default install, every verb, every
resource"): `helm template` of the chart with its defaults, every Role and ClusterRole it renders joined to the
bindings that grant it, one row per subject and rule, sorted.

    .venv/bin/python scripts/rbac-table.py [--chart DIR] [--set KEY=VALUE ...] [--diff OLD_CHART_DIR]

The release is named after the chart and installed in a namespace of that name (`helm install gpu-agent
charts/gpu-agent -n gpu-agent`). The gpu-agent chart's bare defaults need a control-plane URL, so it is rendered with
`controlPlane.enabled=true` (the reference control plane, as the e2e suite installs it); `--set` comes after and
may change it. Hooks render too: a row whose scope says "(hook)" is granted only while the Helm hooks run.
A rule of a role nothing binds is listed under "(unbound)". Under the table: the ValidatingAdmissionPolicies the
chart renders beside the rules (as for a 1.30+ cluster), which hold some rights tighter than RBAC can.

`--diff` renders OLD_CHART_DIR (another checkout of the same chart, e.g. `git archive REV charts | tar -x -C
/tmp/old`, then /tmp/old/charts/gpu-agent) with the same values and prints the rows removed and added, how many
single rights (subject, scope, group, resource, name, verb) were taken away or limited to names, and how many were
granted that nothing before granted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from e2e.cluster import tool  # noqa: E402  (helm from the CI cache, else PATH)

DEFAULT_SETS = {"gpu-agent": ["controlPlane.enabled=true"]}
# As on a cluster of Kubernetes 1.30+ (the CI cluster's): fake-gpu renders its Node-patch policy only where the API is.
VAP = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
HOOK = "helm.sh/hook"


@dataclass(frozen=True, order=True)
class Row:
    subject: str  # "ServiceAccount ns/name" (or the subject's kind and name)
    scope: str  # "cluster" or "namespace NS", then " (hook)" where the role or binding is a Helm hook
    api_group: str  # "core" for ""; several joined with ", "
    resource: str  # "pods, pods/log" then " [name, ...]" for resourceNames; nonResourceURLs as they are
    verbs: str


def render(chart: Path, sets: list[str]) -> list[dict]:
    name = yaml.safe_load((chart / "Chart.yaml").read_text())["name"]
    args = [a for s in [*DEFAULT_SETS.get(name, []), *sets] for a in ("--set", s)]
    r = subprocess.run([tool("helm"), "template", name, str(chart), "--namespace", name, "--api-versions", VAP, *args],
                       capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise SystemExit(f"helm template {chart} failed: {r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def rows(docs: list[dict], namespace: str) -> list[Row]:
    def hook(d: dict) -> bool:
        return HOOK in (d["metadata"].get("annotations") or {})

    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out, bound = [], set()
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        key = (b["roleRef"]["kind"], b["roleRef"]["name"])
        bound.add(key)
        role = roles.get(key)
        in_ns = b["metadata"].get("namespace", namespace)
        scope = "cluster" if b["kind"] == "ClusterRoleBinding" else f"namespace {in_ns}"
        scope += " (hook)" if hook(b) or (role and hook(role)) else ""
        for s in b.get("subjects") or []:
            where = f"{s.get('namespace', namespace)}/" if s["kind"] == "ServiceAccount" else ""
            subject = f"{s['kind']} {where}{s['name']}"
            if role is None:  # a built-in ClusterRole, or one the chart does not render
                out.append(Row(subject, scope, "-", f"(all of {key[0]} {key[1]}, not in the chart)", "-"))
            else:
                out += [rule_row(subject, scope, rule) for rule in role.get("rules") or []]
    for key, role in roles.items():
        if key not in bound:
            out += [rule_row("(unbound)", f"{key[0]} {key[1]}", rule) for rule in role.get("rules") or []]
    return sorted(out)


def rule_row(subject: str, scope: str, rule: dict) -> Row:
    if "nonResourceURLs" in rule:
        return Row(subject, scope, "-", ", ".join(rule["nonResourceURLs"]), ", ".join(sorted(rule["verbs"])))
    names = f" [{', '.join(rule['resourceNames'])}]" if rule.get("resourceNames") else ""
    return Row(subject, scope, ", ".join(g or "core" for g in rule.get("apiGroups", [])),
               ", ".join(rule.get("resources", [])) + names, ", ".join(sorted(rule["verbs"])))


def rights(table: list[Row]) -> set[tuple[str, ...]]:
    """Each single right of the rows: (subject, scope, group, resource, name or "*", verb)."""
    out = set()
    for r in table:
        resources, _, names = r.resource.partition(" [")
        for group in r.api_group.split(", "):
            for resource in resources.split(", "):
                for name in names.rstrip("]").split(", ") if names else ["*"]:
                    out |= {(r.subject, r.scope, group, resource, name, verb) for verb in r.verbs.split(", ")}
    return out


def wider(new: list[Row], old: list[Row]) -> set[tuple[str, ...]]:
    """The single rights of `new` that no right of `old` grants (one for any name grants it for each name)."""
    have = rights(old)
    return {r for r in rights(new) if r not in have and (*r[:4], "*", r[5]) not in have}


def policies(docs: list[dict]) -> list[str]:
    """The admission policies rendered beside the rules, which hold some of them tighter than RBAC can."""
    bound = {d["spec"]["policyName"]: d["spec"].get("validationActions", []) for d in docs
             if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    return sorted(f"{n} ({', '.join(bound.get(n, ['unbound']))})"
                  for n in (d["metadata"]["name"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"))


def markdown(table: list[Row]) -> str:
    lines = ["| subject | scope | apiGroup | resource | verbs |", "|---|---|---|---|---|"]
    return "\n".join(lines + [f"| {r.subject} | {r.scope} | {r.api_group} | {r.resource} | {r.verbs} |" for r in table])


def diff(old: list[Row], new: list[Row]) -> str:
    removed, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    return "\n\n".join([
        f"{len(removed)} rows removed, {len(added)} added ({len(old)} rows before, {len(new)} after). Single rights "
        f"(subject, scope, group, resource, name, verb): {len(wider(old, new))} taken away or limited to names, "
        f"{len(wider(new, old))} granted that nothing before granted.",
        "### Removed", markdown(removed) if removed else "(none)",
        "### Added", markdown(added) if added else "(none)"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chart", type=Path, default=REPO / "charts" / "gpu-agent")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--diff", type=Path, metavar="OLD_CHART_DIR")
    a = p.parse_args()
    name = yaml.safe_load((a.chart / "Chart.yaml").read_text())["name"]
    new = render(a.chart, a.sets)
    old = render(a.diff, a.sets) if a.diff else []
    print(diff(rows(old, name), rows(new, name)) if a.diff else markdown(rows(new, name)))
    for label, docs in ([("Before", old), ("After", new)] if a.diff else [("", new)]):
        print(f"\n{label + ': ' if label else ''}ValidatingAdmissionPolicies beside these rules: "
              f"{', '.join(policies(docs)) or 'none'}.")


if __name__ == "__main__":
    main()
