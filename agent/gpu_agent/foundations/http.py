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

And TLS, which waitress does not do and will not (its maintainers' advice: a proxy in front, which would be one more
container beside the control plane, and one more hop for its slow clients). A listener given a certificate serves
HTTPS itself: the TLS session runs over memory buffers between waitress's socket and its parser (`_TLSChannel`),
so that each of the above holds over TLS too, the handshake counting as the request arriving. The certificate and key
are reloaded from their files when they change (`TLSFiles`, `_Certificates`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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


# How often, at most, a TLS listener looks (a stat of each file) whether its certificate or key file changed.
RELOAD_CHECK_SECONDS = 1.0
# How long, and for how many bytes, at most, a TLS connection whose request was refused while it was still arriving
# (413) reads and drops the rest before it closes (see _TLSChannel.linger).
LINGER_SECONDS = 5.0
LINGER_BYTES = 64 << 20
# What a socket error that ends the connection looks like (waitress's list: wasyncore._DISCONNECTED).
_DISCONNECTED = frozenset({errno.ECONNRESET, errno.ENOTCONN, errno.ESHUTDOWN, errno.ECONNABORTED, errno.EPIPE,
                           errno.EBADF})


class ListenError(Exception):
    """The listener cannot start (its address cannot be used, its certificate cannot be loaded); the message names
    the address and the reason."""


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
        # The client may still be sending what was refused (the 413 goes out once the headers announce the body).
        channel: Any = self.channel  # a _TLSChannel lingers; a plain channel ignores the mark
        channel.linger = True
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
        if self._nothing_to_read():
            return
        super().handle_read()

    def _nothing_to_read(self) -> bool:
        # The loop reads a connection its poll found readable; at the cap the listener may have read it first in the
        # same turn (_Server._read_pending). Nothing to read then is not an error (waitress closes the connection on
        # any error of its read, EAGAIN included).
        try:
            self.socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            pass  # the read meets it and closes the connection
        return False

    def progress_since(self) -> float:
        """When this connection last moved towards an answer: its request began arriving, else its last activity."""
        return self.arriving_since or self.last_activity

    def unsent(self) -> int:
        """Bytes of answers not yet taken by the socket."""
        return int(self.total_outbufs_len)

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


class _TLSChannel(_Channel):
    """A connection served over TLS: the socket stays waitress's plain non-blocking socket, and the TLS session runs
    over memory buffers (as asyncio's sslproto does), so that waitress above reads and writes plaintext and keeps its
    framing, timeouts and limits. `recv` feeds what the socket brings to the session and returns the plaintext it
    yields (none while the handshake is under way); `send` encrypts waitress's plaintext and keeps the ciphertext the
    socket did not take (`_ciphertext`), taking no more plaintext until it is sent. The handshake counts as the
    request arriving: one not done within the read deadline is closed like a request that did not arrive.

    waitress sends from its worker threads too (an answer written as the app returns it) while the loop reads: every
    call into the session holds `_tls_lock`, which is never held while waitress's `outbuf_lock` is taken (the
    workers take them in the other order).

    `linger`: the answer refused a request still arriving (a body over the limit). An HTTP client sends its whole body
    before it reads the answer; closed at once, its next write fails (over TLS an SSL EOF, which clients do not take
    for the early answer a broken pipe is) and it never reads the 413. So, once the answer is out, such a connection
    reads and drops what arrives until the client closes, for at most LINGER_SECONDS and LINGER_BYTES (nginx's
    lingering close)."""

    linger = False
    lingering_since = 0.0
    _lingered = 0

    def __init__(self, server: Any, sock: socket.socket, addr: Any, adj: Adjustments, map: Any = None) -> None:
        self._tls_lock = threading.Lock()
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = server.certificates.context().wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._ciphertext = bytearray()
        self._handshaken = self._first_read_done = self._broken = False
        # A graceful close (an answer sent with Connection: close) waits for its ciphertext to be sent: _graceful
        # while waitress may close that way, _close_when_sent once it has asked.
        self._graceful = self._close_when_sent = False
        super().__init__(server, sock, addr, adj, map)
        self.arriving_since = self.creation_time

    # ---- reading ----

    def readable(self) -> bool:
        return True if self.lingering_since else bool(super().readable())

    def handle_read(self) -> None:
        # waitress takes an empty read for the client's disconnect; here it can also be a read that brought only
        # handshake records. recv closes the connection itself when the client has gone.
        if self._nothing_to_read():
            return
        if self.lingering_since:
            self._drop_what_arrives()
            return
        try:
            data = self.recv(self.adj.recv_bytes)
        except OSError:
            self.handle_close()
            return
        if data:
            self.received(data)

    def recv(self, buffer_size: int) -> bytes:
        try:
            raw = self.socket.recv(buffer_size)
        except (BlockingIOError, InterruptedError):
            return b""
        except OSError as e:
            if e.errno not in _DISCONNECTED:
                raise
            raw = b""
        if not raw:
            self.handle_close()
            return b""
        self.last_activity = time.time()
        if not self._first_read_done:
            self._first_read_done = True
            if raw[:1].isupper():  # a plain-HTTP request line, where a TLS record would start with 22 (handshake)
                self._answer_plain_http()
                return b""
        failure: ssl.SSLError | None = None
        with self._tls_lock:
            self._incoming.write(raw)
            was_handshaken = self._handshaken
            try:
                plaintext = self._read_plaintext(buffer_size)
            except ssl.SSLZeroReturnError:  # the client's close_notify: the end of what it sends, as its FIN is
                plaintext, self._broken = b"", True
            except ssl.SSLError as e:
                plaintext, failure = b"", e
            self._take_ciphertext()
            broken = self._flush_ciphertext() or self._broken
        if failure is not None:
            self.server.closed_tls += 1
            log.v(2, "%s: closed the connection from %s: TLS failed (%s)", self.server.name, self.addr,
                  failure.reason or type(failure).__name__)
        if failure is not None or broken:
            self.handle_close()
            return b""
        if self._handshaken and not was_handshaken:
            self.arriving_since = 0.0  # the request's own deadline starts at its first byte (received)
        return plaintext

    def _drop_what_arrives(self) -> None:
        try:
            raw = self.socket.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            raw = b""
        self._lingered += len(raw)
        if not raw or self._lingered > LINGER_BYTES:
            self.handle_close()
        else:
            self.last_activity = time.time()

    def _read_plaintext(self, limit: int) -> bytes:
        """The handshake's next step, then every byte of plaintext the session can decrypt from what it holds (left
        there, it would wait for the socket to bring more); called with _tls_lock held."""
        if not self._handshaken:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self._handshaken = True
        chunks = []
        while True:
            try:
                chunk = self._tls.read(limit)
            except ssl.SSLWantReadError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def _answer_plain_http(self) -> None:
        """An HTTP request on the HTTPS port is answered as nginx answers it: 400, saying so, and closed."""
        body = json.dumps({"error": "this port serves HTTPS: use an https:// URL"}).encode()
        head = (f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        try:
            self.socket.send(head + body)  # a fresh socket's buffer takes it whole
        except OSError:
            pass
        self.server.closed_tls += 1
        log.v(2, "%s: answered a plain-HTTP request from %s with 400", self.server.name, self.addr)
        self.handle_close()

    # ---- writing ----

    def send(self, data: bytes, do_close: bool = True) -> int:
        with self._tls_lock:
            broken = self._flush_ciphertext()
            if self._ciphertext and not broken:
                return 0  # the socket is full: waitress keeps its plaintext until the ciphertext before it is sent
            if not broken:
                try:
                    view, written = memoryview(data), 0
                    while written < len(view):
                        written += self._tls.write(view[written:])
                except ssl.SSLError:  # the session has ended (the client's close_notify)
                    self._broken = broken = True
                else:
                    self._take_ciphertext()
                    broken = self._flush_ciphertext()
        if broken:
            if do_close:
                self.handle_close()
            return 0
        return len(data)

    def writable(self) -> bool:
        return bool(self._ciphertext) or bool(super().writable())

    def handle_write(self) -> None:
        with self._tls_lock:
            broken = self._flush_ciphertext()
            pending = bool(self._ciphertext)
        if broken or self.will_close or (self._close_when_sent and not pending and not self.lingering_since):
            # The sweep's closes (idle, read deadline, lingering done), errors, and a graceful close once its
            # ciphertext is out.
            self.handle_close()
            return
        if pending or self._close_when_sent:
            return  # waitress's plaintext goes after the ciphertext already made of its earlier plaintext
        self._graceful = True
        try:
            super().handle_write()
        finally:
            self._graceful = False

    def handle_close(self) -> None:
        if self._graceful and self.connected and not self._broken:
            # waitress's close after an answer with Connection: close: a close now would cut off the answer's end.
            # The client is told the session ends (close_notify) and the connection closes once that is sent
            # (handle_write), or by the sweep once it has taken nothing for the idle timeout.
            with self._tls_lock:
                try:
                    self._tls.unwrap()
                except ssl.SSLError:  # SSLWantReadError: the client's close_notify is not waited for
                    pass
                self._take_ciphertext()
                broken = self._flush_ciphertext()
                pending = bool(self._ciphertext)
            if self.linger and not broken:
                # Read and drop until the client closes (handle_read), the ciphertext sent meanwhile (handle_write).
                self.will_close, self.close_when_flushed, self._close_when_sent = False, False, True
                self.lingering_since = time.time()
                return
            if pending and not broken:
                self.will_close, self.close_when_flushed, self._close_when_sent = False, True, True
                return
        super().handle_close()

    def unsent(self) -> int:
        return int(self.total_outbufs_len) + len(self._ciphertext)

    def _take_ciphertext(self) -> None:
        """What the session wrote (records of the handshake, of answers, alerts) queued for the socket; _tls_lock held."""
        if self._outgoing.pending:
            self._ciphertext += self._outgoing.read()

    def _flush_ciphertext(self) -> bool:
        """Send what the socket takes of the queued ciphertext; True when the connection is broken (the queue is then
        dropped). Called with _tls_lock held."""
        while self._ciphertext and not self._broken:
            try:
                if self.socket is None:  # closed meanwhile (by the loop, while a worker writes)
                    raise ConnectionResetError(errno.EBADF, "closed")
                sent = self.socket.send(self._ciphertext)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                self._broken = True
            else:
                del self._ciphertext[:sent]
                self.last_activity = time.time()
        if self._broken:
            self._ciphertext.clear()
        return self._broken


def _channel_class(max_body: int, hint: str, tls: bool) -> type[HTTPChannel]:
    """A channel whose error task knows this listener's body limit (waitress builds channels and
    tasks itself, so the limit travels as class attributes)."""
    task = type("_JSONErrorTask", (_JSONErrorTask,), {"max_body": max_body, "hint": hint})
    return type("_Channel", (_TLSChannel if tls else _Channel,), {"error_task_class": task})


@dataclass(frozen=True)
class TLSFiles:
    """The PEM files a listener serves HTTPS with: the certificate (its chain after it) and its private key. The
    listener reloads them when they change (a Kubernetes Secret volume's update, cert-manager's renewal)."""

    cert_file: str
    key_file: str


def _no_password() -> bytes:
    # An encrypted key is refused instead of OpenSSL asking for its password on the terminal.
    raise ValueError("it is encrypted; the listener needs it unencrypted")


def _load_context(files: TLSFiles) -> ssl.SSLContext:
    """A server context for the files; ValueError naming the file at fault and why (never what it holds)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # A client-started renegotiation (TLS 1.2) costs the server a handshake per request: a known DoS.
    context.options |= ssl.OP_NO_RENEGOTIATION
    context.set_alpn_protocols(["http/1.1"])  # so that an HTTP/2 client does not expect HTTP/2 of this server
    try:
        context.load_cert_chain(files.cert_file, files.key_file, password=_no_password)
    except (OSError, ValueError) as e:
        raise ValueError(_why_unusable(files, e)) from None
    return context


def _why_unusable(files: TLSFiles, error: Exception) -> str:
    """Which of the two files OpenSSL refused, and why: it does not say itself. The certificate file is read on its
    own first; if that works, the fault is the key's."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=files.cert_file)
    except OSError as e:
        return f"certificate file {files.cert_file}: {_describe(e, 'no PEM certificate')}"
    if isinstance(error, ssl.SSLError) and error.reason == "KEY_VALUES_MISMATCH":
        return f"key file {files.key_file}: the key does not match the certificate in {files.cert_file}"
    return f"key file {files.key_file}: {_describe(error, 'no PEM private key')}"


def _describe(error: Exception, unusable: str) -> str:
    if isinstance(error, ssl.SSLError):
        return f"{unusable} in it ({error.reason or 'unreadable'})"
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return str(error)


def _files_signature(files: TLSFiles) -> tuple[object, ...]:
    """What changes when either file does. stat follows links: a Secret volume swaps its files through a `..data`
    symlink, so a path's own link never changes but the file it leads to does."""
    out: list[object] = []
    for path in (files.cert_file, files.key_file):
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError as e:
            out.append(e.errno)
    return tuple(out)


class _Certificates:
    """The context new connections get: built from `files` at start (ValueError if they are unusable), rebuilt when
    they change (looked at, at most every RELOAD_CHECK_SECONDS, when a connection arrives). New files that cannot be
    loaded (half written during an update, a key for another certificate) leave the last good context in use, with
    one warning per change; connections keep the context they began with."""

    def __init__(self, files: TLSFiles, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.files, self.name, self._clock = files, name, clock
        self._seen = _files_signature(files)
        self._context = _load_context(files)
        self._checked_at = clock()

    def context(self) -> ssl.SSLContext:
        now = self._clock()
        if now - self._checked_at < RELOAD_CHECK_SECONDS:
            return self._context
        self._checked_at = now
        seen = _files_signature(self.files)
        if seen != self._seen:
            self._seen = seen
            try:
                self._context = _load_context(self.files)
            except ValueError as e:
                log.warning("%s: keeping the certificate loaded before, since the changed files cannot be loaded: %s; "
                            "they are loaded once they change again", self.name, e)
            else:
                log.info("%s: loaded the changed certificate %s and key %s for new connections", self.name,
                         self.files.cert_file, self.files.key_file)
        return self._context


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
    certificates: _Certificates | None = None  # serving HTTPS
    closed_slow = closed_evicted = closed_unread = closed_tls = 0
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
            if 0.0 < getattr(channel, "lingering_since", 0.0) < now - LINGER_SECONDS:
                channel.will_close = True  # closed by its next write turn (handle_write), or below
            if channel.will_close and channel.unsent():  # idle, its answer unread: see _shut_with_reset
                _shut_with_reset(channel)
        closed = self.closed_slow or self.closed_evicted or self.closed_unread or self.closed_tls
        if now - self._reported_at >= REPORT_SECONDS and closed:
            tls = (f", {self.closed_tls} whose TLS failed (a plain-HTTP client, a client that does not trust the "
                   "certificate)") if self.certificates is not None else ""
            log.warning("%s: closed %d connection(s) whose request did not arrive within %gs, %d to make room at the "
                        "cap of %d connections, %d that left more than %d bytes of answers unread%s (since the last "
                        "report)", self.name, self.closed_slow, self.read_timeout, self.closed_evicted,
                        self.adj.connection_limit, self.closed_unread, self.adj.outbuf_high_watermark, tls)
            self.closed_slow = self.closed_evicted = self.closed_unread = self.closed_tls = 0
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
    sees it, so buffering it in memory costs at most one more copy.

    With `tls` the listener serves HTTPS (TLS 1.2 or newer) with that certificate and key, reloaded when the files
    change (see _Certificates), every limit above unchanged: the TLS handshake counts as the request arriving
    (`read_timeout` from the connection's accept), a connection whose handshake fails is closed (a plain-HTTP
    request is answered 400 first), and an answer's unsent ciphertext counts as its unread answer."""

    def __init__(self, app: WSGIApp, host: str, port: int, name: str, *, threads: int = 4, timeout: float = 10.0,
                 read_timeout: float | None = None, max_body: int = 1 << 20, max_header: int = 64 << 10,
                 connection_limit: int = 1000, max_unread: int = 1 << 20, priority_paths: Iterable[str] = (),
                 read_chunk: int = 8192, body_hint: str = "", tls: TLSFiles | None = None) -> None:
        self.name = name
        try:
            # Before the socket is bound: unusable files leave nothing listening.
            certificates = _Certificates(tls, name) if tls is not None else None
        except ValueError as e:
            raise ListenError(f"cannot serve HTTPS on {host}:{port}: {e}") from None
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
        self._server.channel_class = _channel_class(max_body, body_hint, tls=certificates is not None)
        self._server.certificates = certificates
        self._server.read_timeout = timeout if read_timeout is None else read_timeout
        self._server.name = name
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def address(self) -> str:
        return f"{self._server.effective_host}:{self._server.effective_port}"

    @property
    def tls(self) -> bool:
        return self._server.certificates is not None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}"

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
