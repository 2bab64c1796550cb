"""`make release` on a clone of this checkout: a dirty tree is refused; a clean one gets both charts
packaged into dist/ with a Helm repository index that `helm --repo` installs from over HTTP, and
releases.yaml records the version with the commit it was cut from. (RELEASE_IMAGE=0: the image
build is `make images`' own, proven by every other e2e test.) No cluster needed."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from e2e.cluster import tool
from e2e.release import APP_VERSION, helm

REPO = Path(__file__).resolve().parents[2]


def release(clone: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/release.sh"], cwd=clone, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RELEASE_IMAGE": "0", "HELM": tool("helm"),
                                                          "PYTHON": sys.executable})


def test_release_packages_the_charts_into_a_helm_repository_and_records_the_commit(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=120)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True, check=True).stdout.strip()

    (clone / "README.md").write_text("changed\n")
    dirty = release(clone)
    assert dirty.returncode == 1 and "the tree is not clean" in dirty.stderr and "README.md" in dirty.stderr
    assert not (clone / "dist").exists()
    subprocess.run(["git", "checkout", "README.md"], cwd=clone, check=True)

    r = release(clone)
    assert r.returncode == 0, r.stderr
    dist = clone / "dist"
    assert {p.name for p in dist.iterdir()} == {f"gpu-agent-{APP_VERSION}.tgz", f"fake-gpu-{APP_VERSION}.tgz", "index.yaml"}
    index = yaml.safe_load((dist / "index.yaml").read_text())
    assert {name: [e["version"] for e in entries] for name, entries in index["entries"].items()} == {
        "gpu-agent": [APP_VERSION], "fake-gpu": [APP_VERSION]}
    recorded = yaml.safe_load((clone / "releases.yaml").read_text())["releases"]
    assert {"version": APP_VERSION, "commit": head} == {k: recorded[-1][k] for k in ("version", "commit")}

    # The folder served over HTTP is a chart repository.
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(dist))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = helm("template", "from-repo", "gpu-agent", "--repo", f"http://127.0.0.1:{server.server_port}",
                   "--version", APP_VERSION, "--set", "controlPlane.enabled=true").stdout
    finally:
        server.shutdown()
    assert f"helm.sh/chart: gpu-agent-{APP_VERSION}" in out

    # The same version again from another commit is refused; the recorded release stays.
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-am", "record"], cwd=clone,
                   check=True)
    again = release(clone)
    assert again.returncode == 1 and f"{APP_VERSION} was already cut from {head}" in again.stderr
