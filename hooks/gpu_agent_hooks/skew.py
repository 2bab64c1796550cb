"""Version-skew and stored-version rules, as pure functions of what the cluster holds."""

from __future__ import annotations

import re
from typing import Any

SEMVER = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:[-+].*)?$")


class SkewError(Exception):
    """An upgrade or downgrade that must not happen; the message says why and what to do."""


def parse(version: str) -> tuple[int, int, int]:
    m = SEMVER.match(version.strip())
    if not m:
        raise SkewError(f"cannot read version {version!r}: expected MAJOR.MINOR.PATCH")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def check_versions(deployed: str, target: str) -> str:
    """Returns a one-line verdict for an allowed change; raises SkewError otherwise."""
    d, t = parse(deployed), parse(target)
    if t == d:
        return f"same version {target}"
    if t > d:
        if t[0] - d[0] > 1:
            raise SkewError(f"upgrade from {deployed} to {target} skips major version {d[0] + 1}: "
                            f"upgrade to the latest {d[0] + 1}.x first, then to {target}")
        return f"upgrade {deployed} -> {target}"
    if t[0] != d[0]:
        raise SkewError(f"downgrade from {deployed} to {target} crosses a major version, whose stored state the older "
                        f"agent cannot read: uninstall and reinstall {target}, or stay on {d[0]}.x")
    if d[1] - t[1] > 1:
        raise SkewError(f"downgrade from {deployed} to {target} goes back more than one minor version: "
                        f"downgrade one minor version at a time ({d[0]}.{d[1] - 1}.x first)")
    return f"downgrade {deployed} -> {target}"


def check_stored_versions(existing_crd: dict[str, Any] | None, chart_crd: dict[str, Any]) -> str:
    """Every version objects are stored at must still be served by the chart's CRD."""
    name = chart_crd["metadata"]["name"]
    if not existing_crd:
        return f"{name}: not installed yet"
    stored = set((existing_crd.get("status") or {}).get("storedVersions") or [])
    served = {v["name"] for v in chart_crd["spec"]["versions"] if v.get("served")}
    missing = sorted(stored - served)
    if missing:
        kind = chart_crd["spec"]["names"]["kind"]
        raise SkewError(f"{kind} objects are stored at version(s) {', '.join(missing)}, which this chart's CRD "
                        f"{name} does not serve (it serves {', '.join(sorted(served))}): migrate the stored objects to a "
                        "served version first, or use a chart version that still serves them")
    return f"{name}: stored versions {', '.join(sorted(stored)) or 'none'} all served"
