"""A test's own API server on loopback and the kubeconfig that points a real Kubernetes client at it (plain HTTP, a
bearer token): what the unit tests that serve an API server's answers themselves hand to `api_client`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def loopback_kubeconfig(port: int, folder: Path) -> str:
    path = folder / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}]}))
    return str(path)


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing and answers JSON bodies whole."""

    def send_json(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class LoopbackApiServer:
    """Serves `handler` on a free loopback port, on a daemon thread, until `close`."""

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        self.thread.start()

    def kubeconfig(self, tmp_path: Path) -> str:
        return loopback_kubeconfig(self.httpd.server_address[1], tmp_path)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
