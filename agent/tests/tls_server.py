"""An HTTPS server of the test's own on loopback (http.server under an ssl context, on a daemon thread), with
certificates from throwaway CAs (trustme): what the control plane's clients are checked against. The project's own
listener is left out on purpose: these tests are about the clients' side of TLS."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import trustme

# (method, path, headers, body) -> (status, JSON document)
Answer = Callable[[str, str, dict[str, str], bytes], tuple[int, Any]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    context: ssl.SSLContext

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        # The handshake is left to the request's thread, so that a client refusing the certificate fails there
        # (quietly, see handle_error) and never holds up the accepting loop. The context is read per connection:
        # `TlsServer.use` swaps the certificate as a control plane restarted with a new one would.
        return self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that refuses the certificate: what several tests want


class TlsServer:
    """Serves `answer` over HTTPS on 127.0.0.1 with a certificate of `ca` (for 127.0.0.1 and localhost); every
    request is recorded in `requests` as (method, path, headers). HTTP/1.0: each call is a connection of its own."""

    def __init__(self, ca: trustme.CA, answer: Answer) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        served = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = dict(self.headers.items())
                served.requests.append((self.command, self.path, headers))
                status, doc = answer(self.command, self.path, headers, body)
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _serve  # http.server calls do_<METHOD>

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = _Server(("127.0.0.1", 0), Handler)
        self.use(ca)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        self._thread.start()

    def use(self, ca: trustme.CA) -> None:
        """From the next connection on, a certificate of `ca`."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
        self._httpd.context = context

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self._httpd.server_address[1]}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def write_ca(ca: trustme.CA, path: Path) -> str:
    """`ca`'s certificate as a PEM file at `path`, replaced whole (as the kubelet swaps a mounted ConfigMap)."""
    partial = path.with_name(path.name + ".new")
    ca.cert_pem.write_to_path(str(partial))
    partial.replace(path)
    return str(path)
