#!/usr/bin/env python3
"""The CRDs' one-release-behind rule against the previous release (`make release` runs it; so does
`make lint`): a CRD may store a version only if the previous release already served it.

    python3 scripts/crd-storage-rule.py [--previous-dir DIR --previous-version V]

Without flags the previous release is the newest one in releases.yaml older than this checkout's
version, its CRDs read from git at the commit releases.yaml records (0.1.x kept them under
charts/gpu-agent/files/crds, later releases under charts/gpu-agent/crds).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "hooks"), str(REPO / "ci" / "tools")]

import releases  # noqa: E402 - after the sys.path line above

from gpu_agent_hooks.skew import SkewError, check_storage_follows_previous_release  # noqa: E402 - after the sys.path line above

CRD_DIRS = ("charts/gpu-agent/crds", "charts/gpu-agent/files/crds")


def crds_in(texts: list[str]) -> list[dict]:
    return [d for t in texts for d in yaml.safe_load_all(t) if d and d.get("kind") == "CustomResourceDefinition"]


def crds_at(commit: str) -> list[dict]:
    for folder in CRD_DIRS:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{commit}:{folder}"],
                                capture_output=True, text=True)
        if listed.returncode == 0 and listed.stdout.strip():
            return crds_in([subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{folder}/{name}"],
                                           capture_output=True, text=True, check=True).stdout
                            for name in listed.stdout.split() if name.endswith(".yaml")])
    raise SystemExit(f"crd-storage-rule: no CRDs at {commit} under {' or '.join(CRD_DIRS)} (is the history fetched?)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--previous-dir", type=Path, help="the previous release's CRDs (default: from git)")
    p.add_argument("--previous-version", default="", help="its version, for the messages")
    p.add_argument("--chart-dir", type=Path, default=REPO / CRD_DIRS[0], help="this release's CRDs")
    a = p.parse_args(argv)
    if a.previous_dir:
        previous, version = crds_in([f.read_text() for f in sorted(a.previous_dir.glob("*.yaml"))]), a.previous_version
    else:
        last = releases.last_stable()
        previous, version = crds_at(last["commit"]), last["version"]
    chart = crds_in([f.read_text() for f in sorted(a.chart_dir.glob("*.yaml"))])
    try:
        for line in check_storage_follows_previous_release(previous, chart, version or "the previous release"):
            print(f"crd-storage-rule: {line}")
    except SkewError as e:
        print(f"crd-storage-rule: refused: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
