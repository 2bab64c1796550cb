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

What waitress leaves open, and `Listener` closes (issue 48: slow clients starved the probes):

- its `channel_timeout` is an idle timeout: a client that trickles one header byte every few seconds
  resets it and holds its connection for ever (slowloris). Here a request must also arrive whole
  within `read_timeout` of its first byte (Go's ReadTimeout, Apache's mod_reqtimeout), or the
  connection is closed;
- at `connection_limit` waitress stops accepting, so a probe waits in the kernel's backlog until a
  slow client lets go. Here the listener keeps accepting, and a new connection past the cap closes
  (with a reset) the one that has gone longest without progress (a request arriving slowest, or idle
  longest), connections less than a second old last. A probe sends its request as it connects, so it
  is not the one closed, and every probe the chart makes (/livez, /healthz) is answered while slow
  clients hold every slot. (The alternative, a second, probe-only listener, meant one more port in
  the chart, its Service and NetworkPolicy, and slow clients could fill that one as well; eviction
  protects every path on the one port.)
- a client that pipelines requests and never reads the answers made a worker thread wait, for as
  long as the client liked, for the output to drain below 16 MiB; with every worker so held nothing
  else was answered. Here a connection with more than `max_unread` bytes of answers unread is closed
  instead: no worker ever waits on a client, only on the app. (And a connection that times out with
  its answer unread is shut with a reset: waitress waited for its socket to turn writable to close it.)
- requests wait for a worker in arrival order. Here the probes' paths (`priority_paths`) go first,
  so a probe waits for a worker to finish one request, not for every request queued before it.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask, ThreadedTaskDispatcher

from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.threads import start_thread

log = get_logger(__name__)

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
           404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 413: "Content Too Large",
           415: "Unsupported Media Type", 422: "Unprocessable Content", 429: "Too Many Requests",
           500: "Internal Server Error", 503: "Service Unavailable"}


# waitress's outbuf_overflow: a response buffer this large never turns into a temporary file (see Listener).
NEVER_SPILL = 1 << 62
# How often the listener looks for connections past their timeouts (so a connection is closed at most this
# long after its timeout), and how often it logs what it closed.
SWEEP_SECONDS = 1
REPORT_SECONDS = 60.0
# Connections this young are the last ones closed to make room at the cap (their request may still be on its
# way), and those younger than FRESH_SECONDS last of all (see _Server.handle_accept).
NEWCOMER_SECONDS = 1.0
FRESH_SECONDS = 0.05


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


# types-waitress gets several of what these subclasses use wrong or leaves it out (active_channels typed as one
# channel, no _flush_some, integer times): they subclass waitress's classes untyped.
_HTTPChannel: Any = HTTPChannel
_TcpWSGIServer: Any = TcpWSGIServer


class _Channel(_HTTPChannel):  # type: ignore[misc]  # untyped base, above
    """waitress's connection, bounded: `arriving_since` is when the first byte of the request now arriving
    came (0.0: none is arriving), for the listener's read deadline; answers left unread past the output
    watermark close the connection instead of making a worker wait."""

    arriving_since = 0.0
    _arriving: Any = None  # the parser of the request now arriving

    def received(self, data: bytes) -> bool:
        done = bool(super().received(data))
        if self.request is None:
            self._arriving, self.arriving_since = None, 0.0
        elif self.request is not self._arriving:
            self._arriving, self.arriving_since = self.request, time.time()
        return done

    def service(self) -> None:
        super().service()
        # While a request was being answered the server read nothing more: a next request that was cut
        # short by that is not the client's delay.
        if self._arriving is not None:
            self.arriving_since = time.time()

    def handle_read(self) -> None:
        # The loop reads a connection its poll found readable; at the cap the listener may have read it first in the
        # same turn (_Server._read_pending). Nothing to read then is not an error (waitress closes the connection on
        # any error of its read, EAGAIN included).
        try:
            self.socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            pass  # waitress's own read meets it and closes the connection
        super().handle_read()

    def progress_since(self) -> float:
        """When this connection last moved towards an answer: its request began arriving, else its last activity."""
        return self.arriving_since or self.last_activity

    def _flush_outbufs_below_high_watermark(self) -> None:
        # waitress waits here, on the worker thread, until the client has read enough; a client that never
        # reads held the worker for ever. Flush what the socket takes, and close a connection still over.
        if self.total_outbufs_len > self.adj.outbuf_high_watermark:
            with self.outbuf_lock:
                self._flush_exception(self._flush_some, do_close=False)
                if self.total_outbufs_len > self.adj.outbuf_high_watermark:
                    self.server.closed_unread += 1
                    self.will_close = True
                    self.connected = False  # write_soon raises ClientDisconnected; no further request runs
                    _shut_with_reset(self)


def _channel_class(max_body: int, hint: str) -> type[HTTPChannel]:
    """A channel whose error task knows this listener's body limit (waitress builds channels and
    tasks itself, so the limit travels as class attributes)."""
    task = type("_JSONErrorTask", (_JSONErrorTask,), {"max_body": max_body, "hint": hint})
    return type("_Channel", (_Channel,), {"error_task_class": task})


def _reset_on_close(channel: Any) -> None:
    """Close with a reset (SO_LINGER 0): the connection is given up, and its unsent answer with it, instead of the
    kernel keeping the socket and its buffers after the close until a client that does not read takes them."""
    try:
        channel.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


def _shut_with_reset(channel: Any) -> None:
    """End a connection whose client does not read: shut, the next poll reports a hang-up and waitress closes it, with
    a reset. (waitress closes a channel marked `will_close` once its socket is writable, which one whose client has
    stopped reading may never be again; and a FIN would wait behind the unsent answer.)"""
    _reset_on_close(channel)
    try:
        channel.socket.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Dispatcher(ThreadedTaskDispatcher):
    """waitress's worker pool, with the probes' paths first in line: a request for one of `priority` goes to the
    front of the queue, so a probe waits for a worker to finish what it is doing, never for every request
    queued before it (64 connections pipelining /metrics delayed /livez by up to 850 ms). waitress's warning
    on every task queued behind busy workers (a line per request under load) is left out."""

    priority: frozenset[str] = frozenset()

    def add_task(self, task: Any) -> None:
        requests = getattr(task, "requests", None)
        first = requests[0] if requests else None
        with self.lock:
            if first is not None and first.path in self.priority:
                self.queue.appendleft(task)
            else:
                self.queue.append(task)
            self.queue_cv.notify()


class _Server(_TcpWSGIServer):  # type: ignore[misc]  # untyped base, above
    """waitress's server with the read deadline and eviction at the cap (see the module's docstring)."""

    read_timeout = 10.0
    name = "http"
    closed_slow = closed_evicted = closed_unread = 0
    next_channel_cleanup = 0.0
    _reported_at = 0.0

    def readable(self) -> bool:
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.adj.cleanup_interval
            self.maintenance(now)
        # Never stop accepting at the cap, as waitress does: handle_accept makes room.
        return bool(self.accepting)

    def maintenance(self, now: float) -> None:
        super().maintenance(now)  # idle: nothing being answered and no activity for channel_timeout
        cutoff = now - self.read_timeout
        for channel in list(self.active_channels.values()):
            if not channel.requests and 0.0 < channel.arriving_since < cutoff and not channel.will_close:
                channel.will_close = True
                self.closed_slow += 1
            if channel.will_close and channel.total_outbufs_len:  # idle, its answer unread: see _shut_with_reset
                _shut_with_reset(channel)
        if now - self._reported_at >= REPORT_SECONDS and (self.closed_slow or self.closed_evicted or self.closed_unread):
            log.warning("%s: closed %d connection(s) whose request did not arrive within %gs, %d to make room at the "
                        "cap of %d connections, %d that left more than %d bytes of answers unread (since the last report)",
                        self.name, self.closed_slow, self.read_timeout, self.closed_evicted, self.adj.connection_limit,
                        self.closed_unread, self.adj.outbuf_high_watermark)
            self.closed_slow = self.closed_evicted = self.closed_unread = 0
            self._reported_at = now

    def handle_accept(self) -> None:
        before = set(self.active_channels)
        super().handle_accept()
        if len(self.active_channels) <= self.adj.connection_limit:
            return
        # Over the cap: close one, accepted first and closed after, so that the closed socket's number is not
        # reused within this loop iteration. What each has sent is read first (the loop would read it next): a
        # probe's request that arrived with its connection makes it one being answered, not a silent newcomer.
        self._read_pending(before)
        # Which one: the first of
        #   1. a connection NEWCOMER_SECONDS old or more, not being answered, the longest without progress (a
        #      slow request, an idle keep-alive);
        #   2. one as old, being answered, the oldest (a client that pipelines faster than it is answered);
        #   3. a younger one not being answered but older than FRESH_SECONDS, the oldest (a burst of new
        #      connections);
        #   4. one not being answered younger than FRESH_SECONDS, the oldest (it has sent nothing yet);
        #   5. a younger one being answered, the oldest: last of all, since its request is in and its answer on
        #      its way (a probe made during a burst of new connections, when everything else is younger still).
        now = time.time()

        def rank(c: Any) -> tuple[int, float]:
            age, busy = now - c.creation_time, bool(c.requests)
            if age >= NEWCOMER_SECONDS:
                return (1, c.creation_time) if busy else (0, c.progress_since())
            if busy:
                return 4, c.creation_time
            return (2 if age >= FRESH_SECONDS else 3), c.creation_time

        candidates = [c for fd, c in self.active_channels.items() if fd in before]
        if not candidates:  # every earlier one closed while its data was read: room made
            return
        victim = min(candidates, key=rank)
        _reset_on_close(victim)
        victim.handle_close()
        self.closed_evicted += 1

    def _read_pending(self, fds: set[int]) -> None:
        """Read what the connections `fds` have waiting, as the event loop would on its next turn (poll, not select:
        no limit on descriptor numbers)."""
        poller = select.poll()
        for fd in fds:
            if fd in self.active_channels:
                poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(0):
            channel = self.active_channels.get(fd)
            if channel is not None and channel.readable():  # as the loop asks before it reads
                channel.handle_read()


class Listener:
    """One WSGI app served on HOST:PORT by waitress, on daemon threads; `start()` returns at once.

    Per connection: `timeout` closes one that sends nothing (and is answered nothing) for that long;
    `read_timeout` (default `timeout`) closes one whose request has not arrived whole that long after its
    first byte, however it trickles; past `connection_limit` connections the one longest without progress is
    closed to make room for the new one; more than `max_unread` bytes of answers left unread close it. A
    body over `max_body` bytes is answered with 413 naming the limit and `body_hint` (what to send instead);
    `threads` bounds concurrent requests (a long-polled call holds one for its wait, and nothing else does:
    a worker never waits on a client, since waitress reads a request whole before a worker sees it and
    writes the answer from its event loop); a request for one of `priority_paths` (the probes') is served
    before every request queued for a worker. waitress parses every request in what one read brings (`read_chunk`
    bytes) before it reads again: a listener whose requests are small reads little at a time, so that a client
    pipelining hundreds of requests costs it a few dozen parses per read, not hundreds.

    Bodies and responses stay in memory, never in a temporary file: waitress spills a request body
    over its `inbuf_overflow` (512 KiB by default) and a response over `outbuf_overflow` (1 MiB) to
    a tempfile, and the chart's pods have a read-only root filesystem and (the control plane) no
    writable /tmp, so a spill failed and waitress reset the connection (registrations of 4,000 GPUs
    and more, issue 45). Memory is bounded instead: at most `max_body` per connection whose body is
    arriving (waitress reads a body whole before the app, and so the token, sees it: connection_limit
    clients sending at once hold connection_limit x max_body), and `max_unread` plus one answer per
    connection whose answers are not read. A response is built whole in memory by our apps before waitress
    sees it, so buffering it in memory costs at most one more copy."""

    def __init__(self, app: WSGIApp, host: str, port: int, name: str, *, threads: int = 4, timeout: float = 10.0,
                 read_timeout: float | None = None, max_body: int = 1 << 20, max_header: int = 64 << 10,
                 connection_limit: int = 1000, max_unread: int = 1 << 20, priority_paths: Iterable[str] = (),
                 read_chunk: int = 8192, body_hint: str = "") -> None:
        self.name = name
        try:
            # waitress refuses a body of max_request_body_size bytes or more and spills one of inbuf_overflow
            # bytes or more: both one past max_body, so that max_body itself is accepted, in memory.
            adj = Adjustments(
                host=host, port=port, threads=threads, channel_timeout=int(max(1, timeout)),
                cleanup_interval=SWEEP_SECONDS, max_request_body_size=max_body + 1,
                inbuf_overflow=max_body + 1, outbuf_overflow=NEVER_SPILL, outbuf_high_watermark=max_unread,
                max_request_header_size=max_header, connection_limit=connection_limit, expose_tracebacks=False,
                ident=name, asyncore_use_poll=True, recv_bytes=read_chunk, clear_untrusted_proxy_headers=True)
            dispatcher = _Dispatcher()
            dispatcher.priority = frozenset(priority_paths)
            # One TcpWSGIServer on the first address the host resolves to (what create_server builds for one).
            self._server: Any = _Server(app, {}, dispatcher=dispatcher, adj=adj, sockinfo=adj.listen[0])
            dispatcher.set_thread_count(threads)  # once listening: a failed start leaves no worker behind
        except OSError as e:
            raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        except ValueError as e:  # waitress refuses an address it cannot resolve
            raise ListenError(f"cannot listen on {host}:{port}: {e}") from None
        self._server.channel_class = _channel_class(max_body, body_hint)
        self._server.read_timeout = timeout if read_timeout is None else read_timeout
        self._server.name = name
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
