#!/usr/bin/env python3
"""releases.yaml, read without third-party modules (the CI scripts run on the host's python3).

    releases.py last-stable     "VERSION COMMIT" of the newest release older than the checkout's version
    releases.py current         the checkout's version (pyproject.toml)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"^(\d+)\.(\d+)\.(\d+)", v).groups())


def releases() -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for line in (REPO / "releases.yaml").read_text().splitlines():
        m = re.match(r"^\s*(-\s+)?(version|commit|date):\s*(\S+)\s*$", line)
        if not m:
            continue
        if m.group(1):
            out.append({})
        out[-1][m.group(2)] = m.group(3)
    return out


def current() -> str:
    return re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def last_stable() -> dict[str, str]:
    older = [r for r in releases() if version_tuple(r["version"]) < version_tuple(current())]
    if not older:
        raise SystemExit(f"releases.yaml has no release older than {current()}")
    return max(older, key=lambda r: version_tuple(r["version"]))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "last-stable"
    if what == "current":
        print(current())
    elif what == "last-stable":
        r = last_stable()
        print(r["version"], r["commit"])
    else:
        raise SystemExit(__doc__)
