"""Serving HTTP: waitress does the framing, limits and timeouts; our apps are small WSGI callables.

Why waitress: it is a well-kept, pure-Python HTTP/1.1 server (Pylons) with no dependencies and a
footprint of about 1 MiB, and it does what a hand-written server got wrong here: request framing
(Content-Length and chunked bodies, pipelining), a body limit answered with 413 before the body
is buffered whole, header size limits, idle and slow-client timeouts, a bounded worker pool fed by
an event loop (so slow clients hold a socket, not a thread), and tracebacks that never reach a
client. FastAPI/uvicorn would bring OpenAPI generation too, but no body limit or header timeout and
three times the memory; aiohttp has neither a header timeout.

`Listener` runs one app on its own threads; `json_response` and `error` build the only bodies an
app answers with (JSON, errors as `{"error": ...}`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, cast

from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import create_server
from waitress.task import ErrorTask

from gpu_agent.foundations.threads import start_thread

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 413: "Content Too Large",
           415: "Unsupported Media Type", 422: "Unprocessable Content", 429: "Too Many Requests",
           500: "Internal Server Error", 503: "Service Unavailable"}


# waitress's outbuf_overflow: a response buffer this large never turns into a temporary file (see Listener).
NEVER_SPILL = 1 << 62


class ListenError(Exception):
    """The listen address cannot be used; the message names the address and the reason."""


def status_line(code: int) -> str:
    return f"{code} {REASONS.get(code, 'Status')}"


def json_response(start_response: StartResponse, code: int, doc: Any, headers: list[tuple[str, str]] | None = None,
                  body: bytes | None = None, content_type: str = "application/json") -> list[bytes]:
    if body is None:
        body = b"" if doc is None else json.dumps(doc, allow_nan=False).encode()
    head = [("Content-Length", str(len(body)))] + ([("Content-Type", content_type)] if body else []) + (headers or [])
    start_response(status_line(code), head)
    return [body]


def error(start_response: StartResponse, code: int, message: str, headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    return json_response(start_response, code, {"error": message}, headers)


class _JSONErrorTask(ErrorTask):
    """waitress's own refusals (413 body too large, 400 bad framing, 431 headers too large) as
    JSON like every other error of ours, instead of its text/plain page. A 413 names the body's size,
    the limit in bytes and, where the listener gives one, what to send instead (`hint`)."""

    max_body = 0
    hint = ""

    def execute(self) -> None:
        # types-waitress gives an ErrorTask's request the type of the error; it is the parser holding it.
        parser: Any = self.request
        e = parser.error
        if e.code == 413:
            size = (f"the request body of {parser.content_length} bytes" if parser.content_length
                    else f"the request body (chunked, {parser.body_bytes_received} bytes so far)")
            message = f"{size} is over this server's limit of {self.max_body} bytes" + (f"; {self.hint}" if self.hint else "")
        else:
            message = f"{e.reason}: {e.body}".strip().rstrip(":")
        body = json.dumps({"error": message}).encode()
        self.status = f"{e.code} {e.reason}"
        self.response_headers = [*self.response_headers, ("Content-Type", "application/json")]
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


def _channel_class(max_body: int, hint: str) -> type[HTTPChannel]:
    """A channel whose error task knows this listener's body limit (waitress builds channels and
    tasks itself, so the limit travels as class attributes)."""
    task = type("_JSONErrorTask", (_JSONErrorTask,), {"max_body": max_body, "hint": hint})
    return type("_Channel", (HTTPChannel,), {"error_task_class": task})


class Listener:
    """One WSGI app served on HOST:PORT by waitress, on daemon threads; `start()` returns at once.

    `timeout` closes a connection that sends nothing for that long (a half-sent request
    included); a body over `max_body` bytes is answered with 413 naming the limit and `body_hint`
    (what to send instead); `threads` bounds concurrent requests (a long-polled call holds one for
    its wait).

    Bodies and responses stay in memory, never in a temporary file: waitress spills a request body
    over its `inbuf_overflow` (512 KiB by default) and a response over `outbuf_overflow` (1 MiB) to
    a tempfile, and the chart's pods have a read-only root filesystem and (the control plane) no
    writable /tmp, so a spill failed and waitress reset the connection (registrations of 4,000 GPUs
    and more, issue 45). Memory is bounded instead: at most `max_body` per connection whose body is
    arriving (waitress reads a body whole before the app, and so the token, sees it: connection_limit
    clients sending at once hold connection_limit x max_body). A response is built whole in memory
    by our apps before waitress sees it, so buffering it in memory costs at most one more copy."""

    def __init__(self, app: WSGIApp, host: str, port: int, name: str, *, threads: int = 4, timeout: float = 10.0,
                 max_body: int = 1 << 20, max_header: int = 64 << 10, connection_limit: int = 1000,
                 body_hint: str = "") -> None:
        self.name = name
        try:
            # A TcpWSGIServer (one host and port); types-waitress lacks the effective_host/_map this reads.
            # waitress refuses a body of max_request_body_size bytes or more and spills one of inbuf_overflow
            # bytes or more: both one past max_body, so that max_body itself is accepted, in memory.
            self._server = cast(Any, create_server(
                app, host=host, port=port, threads=threads, channel_timeout=int(max(1, timeout)),
                cleanup_interval=max(1, int(timeout) // 2), max_request_body_size=max_body + 1,
                inbuf_overflow=max_body + 1, outbuf_overflow=NEVER_SPILL,
                max_request_header_size=max_header, connection_limit=connection_limit, expose_tracebacks=False,
                ident=name, asyncore_use_poll=True, clear_untrusted_proxy_headers=True))
        except OSError as e:
            raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        except ValueError as e:  # waitress refuses an address it cannot resolve
            raise ListenError(f"cannot listen on {host}:{port}: {e}") from None
        self._server.channel_class = _channel_class(max_body, body_hint)
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def address(self) -> str:
        return f"{self._server.effective_host}:{self._server.effective_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self) -> None:
        self._thread = start_thread(f"{self._name}-http", self._server.run, self._stopping)

    def stop(self) -> None:
        # Requests in progress finish first (their responses still need the loop and its trigger),
        # then the listening socket and every connection close.
        self._stopping.set()
        self._server.task_dispatcher.shutdown(cancel_pending=True, timeout=2)
        self._server.close()
        wasyncore.close_all(self._server._map)
        if self._thread is not None:
            self._thread.join(5)


def route_waitress_logs(handler: logging.Handler) -> None:
    """waitress logs to the `waitress` loggers; send its warnings (queue depth, bad requests)
    through our handler instead of Python's last-resort stderr printer."""
    for name in ("waitress", "waitress.queue"):
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            logger.removeHandler(h)
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False
