"""The agent's HTTP endpoints, served from their own threads so a busy event loop cannot hide itself.

  /livez    200 while the event loop's heartbeat is fresh (the process works)
  /healthz  JSON, one entry per component; 200 only when every one is ready, else 503
  /version  version, commit, build date
  /metrics  Prometheus text format

GET and HEAD only (405 otherwise); served by waitress (foundations/http) with short timeouts:
none of these reads a body.

Slow clients cannot starve the probes (issue 48): a request must arrive whole within 5 s of its first
byte and a connection idle for 5 s is closed; past 64 connections a new one closes the one longest
without progress, so the kubelet's /livez and /healthz are answered while slow clients hold every
slot; answers left unread close their connection instead of holding one of the 4 workers; and the
probes' requests go before every other request waiting for a worker (clients that pipeline /metrics
cannot queue the probes behind them). Every answer here is computed in memory in a few milliseconds,
so a worker is never held for longer.
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
CONNECTION_LIMIT = 64
TIMEOUT_SECONDS = 5.0  # idle, and for a request to arrive whole (tests shorten it)
PROBES = ("/livez", "/healthz", "/readyz")  # served before anything else waiting for a worker


class EndpointServer:
    def __init__(self, host: str, port: int, health: HealthRegistry, metrics: NodeMetrics, *,
                 timeout: float = TIMEOUT_SECONDS) -> None:
        self.health = health
        self.metrics = metrics
        # No request here has a body: 64 KiB of headers and nothing else; 5 s to send a request. 64 connections
        # hold the kubelet's probes and a few scrapers with room to spare.
        self.listener = http.Listener(self._app, host, port, "endpoints", threads=4, timeout=timeout, max_body=0,
                                      connection_limit=CONNECTION_LIMIT, priority_paths=PROBES, read_chunk=1024)

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
