"""What GitOps tools would say about live objects, computed by their own code, not by a copy of their rules.

  kstatus(objs)        Flux's (and cli-utils') verdict: InProgress, Current, Failed, Terminating, ... per object,
                       from sigs.k8s.io/cli-utils' kstatus itself (the Go tool in ci/kstatus, built by
                       ci/scripts/build-kstatus.sh into the CI cache; KSTATUS_BIN overrides where it is).
  argocd_health(obj)   Argo CD's verdict (Healthy, Progressing, Degraded, ...) from the health script the chart
                       ships (charts/gpu-agent/health/<kind>.lua), run in Lua 5.1, the dialect of Argo CD's
                       gopher-lua, with `obj` made as Argo CD makes it (objects as tables, lists 1-based, nulls
                       absent).
  live(manifest, ns)   the live objects of a manifest (`helm get manifest`), as the API server returns them.

Objects are plain dicts, as the Kubernetes client's `api_client.sanitize_for_serialization` or `kubectl get -o
json` give them.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HEALTH_SCRIPTS = REPO / "charts" / "gpu-agent" / "health"
BUILD_COMMAND = "bash ci/scripts/build-kstatus.sh"
# Argo CD's health statuses (its health.HealthStatusCode); anything else from a script is a bug in the script.
ARGOCD_STATUSES = ("Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown")


@functools.cache
def kstatus_bin() -> Path:
    """KSTATUS_BIN, else the path ci/scripts/common.sh gives it (which carries a digest of ci/kstatus: a
    binary built from other sources is not found, rather than run)."""
    path = os.environ.get("KSTATUS_BIN") or subprocess.run(
        ["bash", "-c", 'source ci/scripts/common.sh && printf %s "$KSTATUS_BIN"'],
        cwd=REPO, check=True, capture_output=True, text=True).stdout
    return Path(path)


def kstatus(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per object (a List's items each count): {apiVersion, kind, namespace, name, status, message},
    plus `error` where kstatus could not compute one (status Unknown then)."""
    binary = kstatus_bin()
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(f"kstatus is not built at {binary}: run `{BUILD_COMMAND}` (needs Go; "
                                "`make cluster-up` and the e2e suite run it)")
    out = subprocess.run([str(binary)], input="\n".join(json.dumps(o) for o in objs), capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"kstatus exited {out.returncode}: {out.stderr.strip()}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def _to_lua(lua: Any, value: Any) -> Any:
    # As Argo CD's decodeValue: maps and lists become tables (a list's items at 1..n), null becomes nil, so a
    # field that is null reads as absent (and a null list item leaves a hole at its index).
    if isinstance(value, dict | list):
        table = lua.table()
        for key, item in value.items() if isinstance(value, dict) else enumerate(value, 1):
            if item is not None:
                table[key] = _to_lua(lua, item)
        return table
    return value


def argocd_health(obj: dict[str, Any], script: Path | None = None) -> dict[str, Any]:
    """{"status", "message"} as Argo CD would show them, from the chart's health script for obj's kind."""
    from lupa import lua51  # the e2e and dev extras; imported here so the rest of the module needs no Lua

    script = script or HEALTH_SCRIPTS / f"{obj['kind'].lower()}.lua"
    if not script.exists():
        raise FileNotFoundError(f"no Argo CD health script for {obj['kind']}: {script}")
    lua = lua51.LuaRuntime(register_eval=False, register_builtins=False)
    globals_ = lua.globals()
    # Only what every Argo CD sandbox offers (base, string, table, math): a script that reaches for files,
    # the OS or modules fails here rather than in someone's Argo CD.
    for name in ("io", "os", "debug", "package", "require", "dofile", "loadfile", "load", "loadstring"):
        globals_[name] = None
    globals_.obj = _to_lua(lua, obj)
    hs = lua.execute(script.read_text())
    if hs is None or lua.eval("type")(hs) != "table":
        raise AssertionError(f"{script.name} returned {hs!r}, not a table")
    result = {"status": hs["status"], "message": hs["message"]}
    if result["status"] not in ARGOCD_STATUSES:
        raise AssertionError(f"{script.name} returned status {result['status']!r}, not one of {ARGOCD_STATUSES}")
    return result


def live(manifest: str, namespace: str, kubectl: str = "kubectl", kubeconfig: str | None = None) -> list[dict[str, Any]]:
    """The live objects of a multi-document manifest, in its order (objects without a namespace take `namespace`,
    as Helm installs them)."""
    cmd = [kubectl, "get", "-f", "-", "-n", namespace, "-o", "json"]
    if kubeconfig:
        cmd += ["--kubeconfig", kubeconfig]
    out = subprocess.run(cmd, input=manifest, capture_output=True, text=True, check=True, timeout=60)
    doc = json.loads(out.stdout)
    return list(doc["items"]) if doc.get("kind") == "List" else [doc]


def table(rows: list[dict[str, Any]]) -> str:
    """kstatus verdicts as a table, for a test's output."""
    lines = [f"{'STATUS':<12} {'KIND':<28} {'NAMESPACE/NAME':<60} MESSAGE"]
    for row in rows:
        where = f"{row['namespace']}/{row['name']}" if row["namespace"] else row["name"]
        lines.append(f"{row['status']:<12} {row['kind']:<28} {where:<60} {row.get('error') or row['message']}")
    return "\n".join(lines)
