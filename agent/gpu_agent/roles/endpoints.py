"""The agent's HTTP endpoints, served from their own threads so a busy event loop cannot hide itself.

  /livez    200 while the event loop's heartbeat is fresh (the process works)
  /healthz  JSON, one entry per component; 200 only when every one is ready, else 503
  /version  version, commit, build date
  /metrics  Prometheus text format

GET and HEAD only (405 otherwise); served by waitress (foundations/http) with short timeouts:
none of these reads a body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from gpu_agent.foundations import http
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import NodeMetrics
from gpu_agent.foundations.version import version_info

PATHS = ("/livez", "/healthz", "/readyz", "/version", "/metrics")


class EndpointServer:
    def __init__(self, host: str, port: int, health: HealthRegistry, metrics: NodeMetrics) -> None:
        self.health = health
        self.metrics = metrics
        # No request here has a body: 64 KiB of headers and nothing else; 5 s to send a request.
        self.listener = http.Listener(self._app, host, port, "endpoints", threads=4, timeout=5.0, max_body=0)

    @property
    def address(self) -> str:
        return self.listener.address

    def start(self) -> None:
        self.listener.start()

    def stop(self) -> None:
        self.listener.stop()

    def _app(self, environ: dict[str, Any], start_response: http.StartResponse) -> list[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if path not in PATHS:
            return http.error(start_response, 404, f"no endpoint {path}; try {', '.join(p for p in PATHS if p != '/readyz')}")
        if method not in ("GET", "HEAD"):
            return http.error(start_response, 405, f"{method} is not allowed; use GET", [("Allow", "GET, HEAD")])
        doc: Mapping[str, object]
        if path == "/livez":
            live, age = self.health.live()
            code, doc = (200 if live else 503), {"status": "live" if live else "stalled", "heartbeatAgeSeconds": round(age, 3)}
        elif path in ("/healthz", "/readyz"):
            doc = self.health.snapshot()
            code = 200 if doc["status"] == "ready" else 503
            return http.json_response(start_response, code, None, body=json.dumps(doc, indent=1).encode())
        elif path == "/version":
            code, doc = 200, version_info()
        else:
            return http.json_response(start_response, 200, None, body=self.metrics.render(), content_type=CONTENT_TYPE_LATEST)
        return http.json_response(start_response, code, doc)
