#!/usr/bin/env python3
"""Chart documentation from its sources: the `# name -- meaning` comments of values.yaml, the agents' settings tables
and the meaning of the Kubernetes fields a chart passes through.

For each chart it writes README.md (what `helm show readme` prints: every value with its default and meaning, then
the Argo CD health checks of health/*.lua, embedded verbatim) and gives every property of values.schema.json a
description, taken from the first of these sources that has one:

  1. the values.yaml comment naming the property's path (`# clusterAgent.replicas -- ...`);
  2. for a setting under clusterAgent.config or nodeAgent.config, that agent's own help text (the SETTINGS tables of
     agent/gpu_agent/roles/cluster_agent.py and node_agent.py, which `--help` prints too);
  3. for a field of a Kubernetes type the chart passes through (resources.requests, tolerations[].key, ...), the
     meaning of that field in KUBERNETES_FIELDS below.

It also declares `global` in the schema so the chart works as a subchart (open: an umbrella chart's globals reach
every subchart; the global values a chart reads are declared with their types). `--check` changes nothing and fails,
naming each file that is not what it would write and each schema property whose description is missing or differs
from its source (the unit tests run it). Needs the project's packages (it reads the agents' settings): run it with
the venv's python.

    .venv/bin/python scripts/chart-docs.py [--check] [charts/gpu-agent charts/fake-gpu]
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
COMMENT = re.compile(r"^\s*# ([A-Za-z0-9_.]+) -- (.*)$")
GLOBAL = {"type": "object", "description": "global values of an umbrella chart; this chart reads none of them"}


def documented(values_file: Path) -> dict[str, str]:
    """name -> meaning, continuation comment lines joined."""
    out: dict[str, str] = {}
    last = None
    for line in values_file.read_text().splitlines():
        m = COMMENT.match(line)
        if m:
            last = m.group(1)
            out[last] = m.group(2).strip()
        elif last and re.match(r"^\s*# ", line) and not COMMENT.match(line):
            out[last] += " " + line.strip()[2:].strip()
        else:
            last = None
    return out


UNSET = object()  # what lookup() returns for a name values.yaml does not set


def lookup(values: dict, name: str):
    node = values
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return UNSET
        node = node[part]
    return node


# The meaning of each Kubernetes field the chart passes to Kubernetes as it is, keyed by the last two steps of the
# property's path (`[]` for "an item of the list"): the field means the same under whichever value it sits, so it is
# written once here rather than once per value in values.yaml.
KUBERNETES_FIELDS = {
    "resources.requests": "resources the container is scheduled by, resource name to quantity (e.g. {cpu: 10m, "
                          "memory: 64Mi}); Kubernetes' ResourceRequirements.requests.",
    "resources.limits": "the most the container may use, resource name to quantity (e.g. {memory: 192Mi}); "
                        "Kubernetes' ResourceRequirements.limits.",
    "strategy.type": "Recreate (every old pod stops before a new one starts) or RollingUpdate; Kubernetes' "
                     "DeploymentStrategy.type.",
    "strategy.rollingUpdate": "maxSurge and maxUnavailable of a RollingUpdate; Kubernetes' "
                              "DeploymentStrategy.rollingUpdate.",
    "updateStrategy.type": "RollingUpdate (pods replaced node by node) or OnDelete (a pod is replaced only when deleted);"
                           " Kubernetes' DaemonSetUpdateStrategy.type.",
    "updateStrategy.rollingUpdate": "maxUnavailable and maxSurge of a RollingUpdate; Kubernetes' "
                                    "DaemonSetUpdateStrategy.rollingUpdate.",
    "tolerations[].key": "taint key the toleration matches; empty with operator Exists: every taint.",
    "tolerations[].operator": "Exists (any value) or Equal (the value given).",
    "tolerations[].value": "taint value the toleration matches (operator Equal).",
    "tolerations[].effect": "taint effect matched: NoSchedule, PreferNoSchedule or NoExecute; empty: every effect.",
    "tolerations[].tolerationSeconds": "with effect NoExecute, seconds the pod stays on the node after the taint "
                                       "appears; unset: for ever.",
    "affinity.nodeAffinity": "Kubernetes' NodeAffinity: the nodes the pod may or prefers to run on.",
    "affinity.podAffinity": "Kubernetes' PodAffinity: pods the pod is placed near.",
    "affinity.podAntiAffinity": "Kubernetes' PodAntiAffinity: pods the pod is kept away from.",
    "gpuNodeSelectorTerms[].matchExpressions": "node label requirements, all of which a node must meet; "
                                               "Kubernetes' NodeSelectorTerm.matchExpressions.",
    "gpuNodeSelectorTerms[].matchFields": "node field requirements (e.g. metadata.name), all of which a node must "
                                          "meet; Kubernetes' NodeSelectorTerm.matchFields.",
    "matchExpressions[].key": "node label the requirement reads.",
    "matchExpressions[].operator": "In, NotIn, Exists, DoesNotExist, Gt or Lt.",
    "matchExpressions[].values": "label values for In and NotIn, one number for Gt and Lt; empty for Exists and "
                                 "DoesNotExist.",
    "imagePullSecrets[].name": "name of a Secret of type kubernetes.io/dockerconfigjson in the release namespace.",
}

# The agents whose settings a chart value passes on by name: the value's path -> (the agent, its settings table).
AGENT_SETTINGS_VALUES = {"clusterAgent.config": "cluster agent", "nodeAgent.config": "node agent"}


def agent_settings() -> dict[str, dict[str, str]]:
    """`clusterAgent.config` -> setting name -> help, read from the agents' own settings tables."""
    sys.path.insert(0, str(REPO / "agent"))
    from gpu_agent.roles import cluster_agent, node_agent

    tables = {"clusterAgent.config": cluster_agent.SETTINGS, "nodeAgent.config": node_agent.SETTINGS}
    # A duration's help says what it times, not its unit, which `--help` shows beside it: the description says it.
    return {value: {s.name: s.help + (" (seconds)" if s.kind == "seconds" else "") for s in table}
            for value, table in tables.items()}


def schema_properties(node: object, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every property declared anywhere in a schema, as (its path, its schema): `a.b` for a property b of a,
    `a[].b` for a property of a's items; the alternatives of oneOf/anyOf/allOf share their parent's path."""
    if not isinstance(node, dict):
        return
    for key, sub in (node.get("properties") or {}).items():
        name = f"{path}.{key}" if path else key
        if isinstance(sub, dict):
            yield name, sub
            yield from schema_properties(sub, name)
    if isinstance(node.get("items"), dict):
        yield from schema_properties(node["items"], path + "[]")
    for keyword in ("oneOf", "anyOf", "allOf"):
        for alternative in node.get(keyword) or []:
            yield from schema_properties(alternative, path)
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_properties(node["additionalProperties"], path + ".*")


def description_source(path: str, docs: dict[str, str], settings: dict[str, dict[str, str]]) -> str | None:
    """The description a property's sources give it (see the module's docstring for their order); None: none."""
    if path in docs:
        return docs[path]
    parent, _, name = path.rpartition(".")
    if parent in AGENT_SETTINGS_VALUES and name in settings.get(parent, {}):
        return f"the {AGENT_SETTINGS_VALUES[parent]}'s setting {name}: {settings[parent][name]}."
    # workPods.tolerations[].key -> tolerations[].key: the Kubernetes type is known by the value holding the field.
    return KUBERNETES_FIELDS.get(f"{parent.rpartition('.')[2]}.{name}")


def with_descriptions(schema: dict, docs: dict[str, str],
                      settings: dict[str, dict[str, str]]) -> tuple[dict, list[str]]:
    """The schema with every property's description from its source, and the paths of those without a source."""
    schema = json.loads(json.dumps(schema))
    unsourced = []
    for path, sub in schema_properties(schema):
        if path == "global":
            continue  # its description is the values.yaml comment, or GLOBAL's below
        wanted = description_source(path, docs, settings)
        if wanted is None:
            unsourced.append(path)
        else:
            sub["description"] = wanted
    # A chart that reads global values declares them (open to the other charts' globals); one that does not, none.
    declared = schema.setdefault("properties", {}).get("global", {})
    if not declared.get("properties"):
        schema["properties"]["global"] = GLOBAL
    elif "global" in docs:
        declared["description"] = docs["global"]
    return schema, unsourced


def description_drift(current: dict, wanted: dict) -> list[str]:
    """One line per property whose description in the current schema is missing or not its source's."""
    have = {path: sub.get("description") for path, sub in schema_properties(current)}
    lines = []
    for path, sub in schema_properties(wanted):
        if "description" not in sub:
            continue  # reported as unsourced
        if have.get(path) is None:
            lines.append(f"{path}: no description (run `.venv/bin/python scripts/chart-docs.py` to write it)")
        elif have[path] != sub["description"]:
            lines.append(f"{path}: description differs from its source (edit the source, not the schema, then run "
                         "`.venv/bin/python scripts/chart-docs.py`)")
    return lines


def health_checks(chart: Path) -> list[str]:
    """The section on the Argo CD health checks the chart ships (health/<kind>.lua, one per custom resource of
    crds/), each embedded verbatim in the argocd-cm entry that installs it: README and script cannot disagree."""
    scripts = sorted((chart / "health").glob("*.lua"))
    if not scripts:
        return []
    kinds = {}
    for crd in sorted((chart / "crds").glob("*.yaml")):
        spec = yaml.safe_load(crd.read_text())["spec"]
        kinds[spec["names"]["kind"].lower()] = (spec["group"], spec["names"]["kind"])
    lines = [
        "## Health in Argo CD, Flux and kubectl", "",
        "The cluster agent writes a `Ready` condition (metav1.Condition: `status`, `reason`, `message`,"
        " `observedGeneration`) and `status.observedGeneration` on every GPUDomain. Flux (kstatus) and"
        " `kubectl wait --for=condition=Ready` read them with no configuration (kstatus calls a custom resource"
        " with no conditions at all Current: a GPUDomain is so only for the moment between its creation and the"
        " agent's first write, Ready=Unknown). Argo CD counts a custom resource without a health check as Healthy"
        " as soon as it exists; the chart ships health checks in `health/` (also inside the packaged chart). Add"
        " each to Argo CD's `argocd-cm` ConfigMap (with the Argo CD chart: under `configs.cm`):", ""]
    for script in scripts:
        if script.stem not in kinds:
            raise SystemExit(f"{script}: no custom resource of kind {script.stem!r} in {chart / 'crds'}")
        group, kind = kinds[script.stem]
        body = "\n".join("    " + line if line else "" for line in script.read_text().rstrip("\n").split("\n"))
        lines += [
            f"`health/{script.name}` ({kind}):", "",
            "```yaml", "apiVersion: v1", "kind: ConfigMap", "metadata:", "  name: argocd-cm", "  namespace: argocd",
            "  labels: {app.kubernetes.io/part-of: argocd}", "data:",
            f"  resource.customizations.health.{group}_{kind}: |", body, "```", ""]
    return lines


def readme(chart: Path, docs: dict[str, str], values: dict) -> str:
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    rows = []
    for name, meaning in docs.items():
        default = lookup(values, name)
        # A group whose members have rows of their own shows as {...}; a member values.yaml does not set (a known
        # key of a map that is empty by default, e.g. a feature gate) shows as unset.
        grouped = isinstance(default, dict) and any(k.startswith(name + ".") and lookup(values, k) is not UNSET
                                                    for k in docs)
        shown = "unset" if default is UNSET else "{...}" if grouped else json.dumps(default, sort_keys=True)
        rows.append(f"| `{name}` | `{shown}` | {meaning.replace('|', '/')} |")
    return "\n".join([
        f"# {meta['name']}", "", meta.get("description", ""), "",
        f"Chart version {meta['version']}, app version {meta.get('appVersion', '')}."
        " Generated by `scripts/chart-docs.py` from the comments in `values.yaml`; do not edit by hand.", "",
        "## Values", "", "| value | default | meaning |", "|---|---|---|", *rows, "", *health_checks(chart)])


def main(argv: list[str]) -> int:
    check = "--check" in argv
    charts = [Path(a) for a in argv if not a.startswith("--")] or [REPO / "charts/gpu-agent", REPO / "charts/fake-gpu"]
    settings = agent_settings()
    stale, problems = [], []
    for chart in charts:
        values_file = chart / "values.yaml"
        docs = documented(values_file)
        values = yaml.safe_load(values_file.read_text())
        undocumented = [k for k in values if k not in docs]
        if undocumented:
            print(f"{values_file}: top-level value(s) without a '# name -- meaning' comment: {', '.join(undocumented)}")
            return 1
        schema_file = chart / "values.schema.json"
        current = json.loads(schema_file.read_text())
        schema, unsourced = with_descriptions(current, docs, settings)
        problems += [f"{schema_file}: {path}: no description source: add a `# {path} -- meaning` comment to "
                     f"{values_file}" + (" (or its Kubernetes field to KUBERNETES_FIELDS in scripts/chart-docs.py)"
                                         if "[]" in path else "") for path in unsourced]
        if check:
            problems += [f"{schema_file}: {line}" for line in description_drift(current, schema)]
        wanted = {
            chart / "README.md": readme(chart, docs, values),
            schema_file: json.dumps(schema, indent=2) + "\n",
        }
        for path, text in wanted.items():
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
                if not check:
                    path.write_text(text)
    for problem in problems:
        print(problem)
    if check and stale:
        print("out of date (run `.venv/bin/python scripts/chart-docs.py`): " + ", ".join(stale))
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
