#!/usr/bin/env python3
"""Chart documentation from one source: the `# name -- meaning` comments of values.yaml.

For each chart it writes README.md (what `helm show readme` prints: every value with its default
and meaning, then the Argo CD health checks of health/*.lua, embedded verbatim) and puts each meaning into values.schema.json as the property's description, and
it declares `global` in the schema so the chart works as a subchart (open: an umbrella chart's globals reach every
subchart; the global values a chart reads are declared with their types). `--check` changes nothing
and fails, naming the files, when they are not what it would write (the test command runs it).

    python3 scripts/chart-docs.py [--check] [charts/gpu-agent charts/fake-gpu]
"""

from __future__ import annotations

import json
import re
import sys
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


def lookup(values: dict, name: str):
    node = values
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def with_descriptions(schema: dict, docs: dict[str, str]) -> dict:
    def walk(node: dict, prefix: str) -> None:
        for key, sub in (node.get("properties") or {}).items():
            name = f"{prefix}{key}"
            if name in docs and isinstance(sub, dict):
                sub["description"] = docs[name]
            if isinstance(sub, dict):
                walk(sub, name + ".")

    schema = json.loads(json.dumps(schema))
    walk(schema, "")
    # A chart that reads global values declares them (open to the other charts' globals); one that does not, none.
    declared = schema.setdefault("properties", {}).get("global", {})
    if not declared.get("properties"):
        schema["properties"]["global"] = GLOBAL
    return schema


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
        # A group whose members have rows of their own shows as {...}.
        grouped = isinstance(default, dict) and any(k.startswith(name + ".") for k in docs)
        shown = "{...}" if grouped else json.dumps(default, sort_keys=True)
        rows.append(f"| `{name}` | `{shown}` | {meaning.replace('|', '/')} |")
    return "\n".join([
        f"# {meta['name']}", "", meta.get("description", ""), "",
        f"Chart version {meta['version']}, app version {meta.get('appVersion', '')}."
        " Generated by `scripts/chart-docs.py` from the comments in `values.yaml`; do not edit by hand.", "",
        "## Values", "", "| value | default | meaning |", "|---|---|---|", *rows, "", *health_checks(chart)])


def main(argv: list[str]) -> int:
    check = "--check" in argv
    charts = [Path(a) for a in argv if not a.startswith("--")] or [REPO / "charts/gpu-agent", REPO / "charts/fake-gpu"]
    stale = []
    for chart in charts:
        values_file = chart / "values.yaml"
        docs = documented(values_file)
        values = yaml.safe_load(values_file.read_text())
        undocumented = [k for k in values if k not in docs]
        if undocumented:
            print(f"{values_file}: top-level value(s) without a '# name -- meaning' comment: {', '.join(undocumented)}")
            return 1
        schema_file = chart / "values.schema.json"
        wanted = {
            chart / "README.md": readme(chart, docs, values),
            schema_file: json.dumps(with_descriptions(json.loads(schema_file.read_text()), docs), indent=2) + "\n",
        }
        for path, text in wanted.items():
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
                if not check:
                    path.write_text(text)
    if check and stale:
        print("out of date (run `python3 scripts/chart-docs.py`): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
