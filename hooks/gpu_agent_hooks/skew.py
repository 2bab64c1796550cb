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


def _served(crd: dict[str, Any]) -> set[str]:
    return {v["name"] for v in crd["spec"]["versions"] if v.get("served")}


def _storage(crd: dict[str, Any]) -> str:
    name: str = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
    return name


def check_storage_follows_previous_release(previous: list[dict[str, Any]], chart: list[dict[str, Any]],
                                           previous_version: str) -> list[str]:
    """The one-release-behind rule Kubernetes keeps for its own APIs, checked when a release is cut:
    a CRD may store a version only if the previous release already served it (so a rollback to that
    release can read every object), and must still serve the previous release's storage version (so
    the upgrade can read them). Returns one line per CRD; raises SkewError naming the CRD and the fix."""
    before = {c["metadata"]["name"]: c for c in previous}
    out = []
    for crd in chart:
        name = crd["metadata"]["name"]
        old = before.get(name)
        if old is None:
            out.append(f"{name}: new in this release (stores {_storage(crd)})")
            continue
        storage, old_storage = _storage(crd), _storage(old)
        if storage not in _served(old):
            raise SkewError(f"CRD {name} stores {storage}, which {previous_version} does not serve (it serves "
                            f"{', '.join(sorted(_served(old)))}): a rollback to {previous_version} could not read the "
                            f"objects. Keep storing {old_storage} and serve {storage} in this release; store it in the next")
        if old_storage not in _served(crd):
            raise SkewError(f"CRD {name} no longer serves {old_storage}, which {previous_version} stores: the upgrade "
                            f"could not read the objects. Serve {old_storage} for at least this release")
        out.append(f"{name}: stores {storage} ({previous_version} stored {old_storage} and served "
                   f"{', '.join(sorted(_served(old)))})")
    return out
