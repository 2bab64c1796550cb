"""The agent's HTTP endpoints, served from a thread so a busy event loop cannot hide itself.

  /livez    200 while the event loop's heartbeat is fresh (the process works)
  /healthz  JSON, one entry per component; 200 only when every one is ready, else 503
  /version  version, commit, build date
  /metrics  Prometheus text format
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.version import version_info


class EndpointServer:
    def __init__(self, host: str, port: int, health: HealthRegistry, metrics: AgentMetrics) -> None:
        def handler_factory(*args: Any) -> BaseHTTPRequestHandler:
            return _Handler(health, metrics, *args)

        self.httpd = ThreadingHTTPServer((host, port), handler_factory)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.1,), name="endpoints", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def __init__(self, health: HealthRegistry, metrics: AgentMetrics, *args: Any) -> None:
        self.health = health
        self.metrics = metrics
        super().__init__(*args)

    def log_message(self, fmt: str, *args: Any) -> None:
        return

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/livez":
            live, age = self.health.live()
            doc = {"status": "live" if live else "stalled", "heartbeatAgeSeconds": round(age, 3)}
            self._send(200 if live else 503, json.dumps(doc).encode())
        elif path in ("/healthz", "/readyz"):
            snap = self.health.snapshot()
            self._send(200 if snap["status"] == "ready" else 503, json.dumps(snap, indent=1).encode())
        elif path == "/version":
            self._send(200, json.dumps(version_info()).encode())
        elif path == "/metrics":
            self._send(200, self.metrics.render(), CONTENT_TYPE_LATEST)
        else:
            self._send(404, json.dumps({"error": f"no endpoint {path}; try /livez, /healthz, /version, /metrics"}).encode())

    do_HEAD = do_GET
