"""A kubeconfig that points a real Kubernetes client at a test's own HTTP server on loopback (plain HTTP, a bearer
token): what the unit tests that serve an API server's answers themselves hand to `api_client`."""

from __future__ import annotations

import json
from pathlib import Path


def loopback_kubeconfig(port: int, folder: Path) -> str:
    path = folder / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}]}))
    return str(path)
