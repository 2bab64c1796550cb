"""HTTPS from the listener itself (issue 48, part 1): TLS over waitress's socket, every limit of the plain listener kept,
the certificate reloaded from its files. Real sockets on loopback, certificates from a test CA (trustme); waiting is a
poll to a deadline."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import trustme

from gpu_agent.foundations import http
from tests.slow_clients import BOUND, peer_closed, wait_until

BIG = bytes(range(256)) * (32 << 10)  # 8 MiB, more than the socket buffers on both sides take


def answers(environ: dict[str, Any], start_response: http.StartResponse) -> list[bytes]:
    path = environ["PATH_INFO"]
    if path == "/big":
        return http.json_response(start_response, 200, None, body=BIG, content_type="application/octet-stream")
    if path == "/two-pieces":  # waitress writes each piece of an app's answer on its own
        start_response("200 OK", [("Content-Length", str(2 * len(BIG))), ("Content-Type", "application/octet-stream")])
        return [BIG, BIG[::-1]]
    if path == "/pieces":  # written by the worker piece by piece while the loop sends what it encrypted before
        start_response("200 OK", [("Content-Length", str(len(BIG))), ("Content-Type", "application/octet-stream")])
        return [BIG[i:i + (16 << 10)] for i in range(0, len(BIG), 16 << 10)]
    return http.json_response(start_response, 200, {"path": path})


@dataclass
class Certificate:
    ca: trustme.CA
    leaf: trustme.LeafCert

    @property
    def der(self) -> bytes:
        return ssl.PEM_cert_to_DER_cert(self.leaf.cert_chain_pems[0].bytes().decode())

    def write(self, folder: Path) -> http.TLSFiles:
        folder.mkdir(parents=True, exist_ok=True)
        self.leaf.cert_chain_pems[0].write_to_path(str(folder / "tls.crt"))
        self.leaf.private_key_pem.write_to_path(str(folder / "tls.key"))
        return http.TLSFiles(str(folder / "tls.crt"), str(folder / "tls.key"))


def issue() -> Certificate:
    ca = trustme.CA()
    return Certificate(ca, ca.issue_cert("127.0.0.1"))


@pytest.fixture
def first() -> Certificate:
    return issue()


@pytest.fixture
def ca_file(tmp_path: Path, first: Certificate) -> str:
    first.ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return str(tmp_path / "ca.pem")


@pytest.fixture
def listener(tmp_path: Path, first: Certificate) -> Iterator[http.Listener]:
    served = http.Listener(answers, "127.0.0.1", 0, "tls", timeout=30.0, max_unread=16 << 20,
                           tls=first.write(tmp_path / "v1"))
    served.start()
    yield served
    served.stop()


@pytest.fixture
def logged() -> Iterator[list[logging.LogRecord]]:
    """Every record of ours and waitress's (a handler on their loggers: `klog.setup`, run by other tests of this
    process, stops them propagating to pytest's)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("gpu_agent", "waitress")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


def tls_connect(listener: http.Listener, *cas: Certificate | str, rcvbuf: int = 0) -> ssl.SSLSocket:
    context = ssl.create_default_context()
    for ca in cas:
        if isinstance(ca, str):
            context.load_verify_locations(cafile=ca)
        else:
            context.load_verify_locations(cadata=ca.ca.cert_pem.bytes().decode())
    host, port = listener.address.split(":")
    raw = socket.socket()
    if rcvbuf:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.settimeout(10)
    raw.connect((host, int(port)))
    return context.wrap_socket(raw, server_hostname=host)


def read_answer(stream: Any) -> tuple[int, dict[str, str], bytes]:
    status = stream.readline()
    headers = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status.split()[1]), headers, stream.read(int(headers["content-length"]))


def get(path: str, close: bool = False) -> bytes:
    headers = "Host: x\r\n" + ("Connection: close\r\n" if close else "")
    return f"GET {path} HTTP/1.1\r\n{headers}\r\n".encode()


def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.exc_info or r.levelno >= logging.ERROR]


# ---- serving ----------------------------------------------------------------------------------------------------


def test_a_get_over_https_is_answered_verified_against_the_ca(listener, ca_file, logged):
    assert listener.url.startswith("https://127.0.0.1:")
    r = requests.get(listener.url + "/hello", verify=ca_file, timeout=5)
    assert (r.status_code, r.json()) == (200, {"path": "/hello"})
    assert not tracebacks(logged)


def test_plain_http_untrusted_and_garbage_clients_are_closed_quietly_and_reported(listener, ca_file, logged,
                                                                                 monkeypatch):
    monkeypatch.setattr(http, "REPORT_SECONDS", 3600.0)
    monkeypatch.setattr(listener._server, "_reported_at", time.time())  # no report until all three are closed
    r = requests.get(listener.url.replace("https://", "http://") + "/hello", timeout=5)
    assert r.status_code == 400 and "serves HTTPS" in r.json()["error"], r.text
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(listener.url + "/hello", timeout=5)  # the system's CAs: the test CA's certificate is untrusted
    host, port = listener.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\x00\x10" + bytes(16))  # a TLS record header and no ClientHello in it
        wait_until(lambda: peer_closed(s), 5, "the server to close the connection that sent garbage")
    wait_until(lambda: listener._server.closed_tls == 3, 5, "the three connections counted")
    listener._server._reported_at = 0.0  # the next sweep reports them
    line = wait_until(lambda: [r.getMessage() for r in logged if "whose TLS failed" in r.getMessage()],
                      http.SWEEP_SECONDS + 3, "the listener's report of what it closed")
    assert "3 whose TLS failed" in line[0], line
    assert not tracebacks(logged), tracebacks(logged)
    assert requests.get(listener.url + "/after", verify=ca_file, timeout=5).status_code == 200


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "Connection: close"])
def test_an_answer_of_several_mib_arrives_whole(listener, ca_file, close):
    with requests.Session() as session:
        r = session.get(listener.url + "/big", verify=ca_file, timeout=10,
                        headers={"Connection": "close"} if close else {})
        assert r.status_code == 200 and len(r.content) == len(BIG) and r.content == BIG
        again = session.get(listener.url + "/small", verify=ca_file, timeout=5)
        assert again.json() == {"path": "/small"}


def in_one_piece(listener: http.Listener) -> None:
    """waitress hands the socket what is left of an answer in pieces of the socket's send buffer size (read at accept);
    here, all of it at once, more than the socket takes."""
    base = listener._server.channel_class

    class OnePiece(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.sendbuf_len = 4 * len(BIG)

    listener._server.channel_class = OnePiece


def test_an_answer_whose_ciphertext_the_socket_did_not_take_is_sent_whole_before_the_close(listener, first):
    """waitress closes a Connection: close connection as soon as it has handed the socket the answer's last byte: the
    ciphertext of it that the socket did not take must still go out first. Whether any is left depends on how fast the
    client reads; here it is most of 8 MiB: the worker thread hands over the first piece of the answer (its ciphertext
    fills the socket) and keeps the second, which the loop hands over whole once the first is sent, to a client whose
    receive buffer is small."""
    in_one_piece(listener)
    with tls_connect(listener, first, rcvbuf=64 << 10) as s:
        s.sendall(get("/two-pieces", close=True))
        received = s.makefile("rb").read()  # to the end: the server's close
    assert received.startswith(b"HTTP/1.1 200 OK"), received[:100]
    assert len(received) - received.index(b"\r\n\r\n") - 4 == 2 * len(BIG), len(received)
    assert received.endswith(b"\r\n\r\n" + BIG + BIG[::-1])


def test_ciphertext_left_after_the_last_byte_of_a_kept_alive_answer_is_sent(listener, first):
    """The worker hands the socket all of the answer at once and keeps nothing: what the socket did not take is the
    listener's alone to send, with no answer waiting in waitress to wake the loop for it."""
    in_one_piece(listener)
    with tls_connect(listener, first, rcvbuf=64 << 10) as s:
        s.settimeout(5)
        stream = s.makefile("rb")
        s.sendall(get("/big"))
        code, _, body = read_answer(stream)
        assert code == 200 and body == BIG
        s.sendall(get("/next"))
        assert read_answer(stream)[2] == b'{"path": "/next"}'


def test_an_answer_written_piece_by_piece_while_the_loop_sends_arrives_whole(listener, first):
    # The worker encrypts and sends each piece while the loop thread sends what is left of the one before: thousands of
    # turns in which both use the one TLS session and its queue of ciphertext (without the lock between them, most runs
    # of this test fail).
    with tls_connect(listener, first, rcvbuf=128 << 10) as s:
        s.settimeout(10)
        stream = s.makefile("rb")
        for _ in range(16):
            s.sendall(get("/pieces"))
            code, _, body = read_answer(stream)
            assert code == 200 and body == BIG


def test_a_closing_connection_whose_client_never_reads_is_closed_at_the_idle_timeout(tmp_path, first):
    listener = http.Listener(answers, "127.0.0.1", 0, "unread", timeout=1.0, max_unread=16 << 20,
                             tls=first.write(tmp_path / "v1"))
    listener.start()
    in_one_piece(listener)
    try:
        with tls_connect(listener, first, rcvbuf=64 << 10) as s:
            s.sendall(get("/big", close=True))
            started = time.monotonic()
            wait_until(lambda: peer_closed(s), 1.0 + http.SWEEP_SECONDS + 2, "the server to close the connection")
            assert time.monotonic() - started >= 0.9
    finally:
        listener.stop()


def test_keep_alive_and_pipelined_requests_share_one_connection(listener, first):
    with tls_connect(listener, first) as s:
        s.settimeout(5)
        stream = s.makefile("rb")
        s.sendall(get("/one") + get("/two") + get("/three"))  # pipelined: one write, answered in order
        assert [read_answer(stream)[2] for _ in range(3)] == [b'{"path": "/one"}', b'{"path": "/two"}',
                                                             b'{"path": "/three"}']
        # Requests of 14 KiB in one TLS record, more than one read of the socket (8 KiB) brings: the plaintext the
        # session decrypts past what one read returns would be in no socket to wake the loop.
        paths = [f"/p{i}-{'x' * 200}" for i in range(60)]
        s.sendall(b"".join(get(path) for path in paths))
        assert [read_answer(stream)[2] for _ in paths] == [f'{{"path": "{path}"}}'.encode() for path in paths]
        for path in ("/four", "/five"):  # keep-alive: one after the other
            s.sendall(get(path))
            assert read_answer(stream)[2] == f'{{"path": "{path}"}}'.encode()
        s.sendall(get("/big") + get("/six"))
        code, _, body = read_answer(stream)
        assert code == 200 and body == BIG
        assert read_answer(stream)[2] == b'{"path": "/six"}'
        assert len(listener._server.active_channels) == 1


# ---- the certificate reloaded -------------------------------------------------------------------------------------


def swap(folder: Path, certificate: Certificate, version: str) -> None:
    """As the kubelet updates a Secret volume: the files in a new folder, then the `..data` link swapped to it."""
    certificate.write(folder / version)
    swap_to(folder, version)


def swap_to(folder: Path, version: str) -> None:
    os.symlink(version, folder / "..data_tmp")
    os.replace(folder / "..data_tmp", folder / "..data")


def test_new_connections_get_the_changed_certificate_and_open_ones_keep_theirs(tmp_path, first, logged, monkeypatch):
    monkeypatch.setattr(http, "RELOAD_CHECK_SECONDS", 0.0)
    secret = tmp_path / "secret"
    swap(secret, first, "v1")
    for name in ("tls.crt", "tls.key"):
        os.symlink(f"..data/{name}", secret / name)
    listener = http.Listener(answers, "127.0.0.1", 0, "reload", timeout=30.0,
                             tls=http.TLSFiles(str(secret / "tls.crt"), str(secret / "tls.key")))
    listener.start()
    second, third = issue(), issue()
    try:
        old = tls_connect(listener, first, second, third)
        old_stream = old.makefile("rb")
        old.sendall(get("/before"))
        assert read_answer(old_stream)[0] == 200

        swap(secret, second, "v2")
        with tls_connect(listener, first, second, third) as s:
            assert s.getpeercert(binary_form=True) == second.der
        old.sendall(get("/still"))  # the connection made before keeps its session
        assert read_answer(old_stream)[2] == b'{"path": "/still"}'
        assert old.getpeercert(binary_form=True) == first.der
        old.close()

        # A key for another certificate, then a certificate cut short: the last good one stays, one warning each.
        mismatched = secret / "v3"
        third.write(mismatched)
        second.leaf.private_key_pem.write_to_path(str(mismatched / "tls.key"))
        swap_to(secret, "v3")
        for _ in range(2):
            with tls_connect(listener, first, second, third) as s:
                assert s.getpeercert(binary_form=True) == second.der
        half = secret / "v4"
        third.write(half)
        (half / "tls.crt").write_bytes((half / "tls.crt").read_bytes()[:200])
        swap_to(secret, "v4")
        for _ in range(2):
            with tls_connect(listener, first, second, third) as s:
                assert s.getpeercert(binary_form=True) == second.der
        warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
        assert len(warnings) == 2, warnings
        assert f"key file {secret / 'tls.key'}: the key does not match the certificate" in warnings[0], warnings[0]
        assert f"certificate file {secret / 'tls.crt'}: no PEM certificate" in warnings[1], warnings[1]
        key_text = third.leaf.private_key_pem.bytes().decode().splitlines()[1]
        assert not any(key_text in r.getMessage() for r in logged)

        swap(secret, third, "v5")  # whole again
        with tls_connect(listener, first, second, third) as s:
            assert s.getpeercert(binary_form=True) == third.der
    finally:
        listener.stop()


def test_the_files_are_looked_at_at_most_once_a_second(tmp_path, first):
    now = [100.0]
    files = first.write(tmp_path / "v1")
    certificates = http._Certificates(files, "clocked", clock=lambda: now[0])
    before = certificates.context()
    issue().write(tmp_path / "v1")
    now[0] += http.RELOAD_CHECK_SECONDS - 0.01
    assert certificates.context() is before
    now[0] += 0.02
    assert certificates.context() is not before


@pytest.mark.parametrize("cert,key,says", [
    ("tls.crt", "missing.key", "key file {d}/missing.key: No such file or directory"),
    ("tls.key", "tls.key", "certificate file {d}/tls.key: no PEM certificate in it"),
    ("tls.crt", "tls.crt", "key file {d}/tls.crt: no PEM private key in it"),
])
def test_a_listener_whose_files_cannot_be_loaded_does_not_start(tmp_path, first, cert, key, says):
    first.write(tmp_path)
    with pytest.raises(http.ListenError) as e:
        http.Listener(answers, "127.0.0.1", 0, "bad", tls=http.TLSFiles(str(tmp_path / cert), str(tmp_path / key)))
    assert str(e.value).startswith("cannot serve HTTPS on 127.0.0.1:0: " + says.format(d=tmp_path)), str(e.value)
    assert "PRIVATE KEY" not in str(e.value)


# ---- slow clients -------------------------------------------------------------------------------------------------


def test_a_handshake_not_done_within_the_read_timeout_is_closed_and_a_done_one_is_not(tmp_path, first):
    listener = http.Listener(answers, "127.0.0.1", 0, "handshake", timeout=30.0, read_timeout=0.5,
                             tls=first.write(tmp_path / "v1"))
    listener.start()
    host, port = listener.address.split(":")
    try:
        # Before the silent one, so the first to go if the deadline held it too: its handshake done, no request sent.
        done = tls_connect(listener, first)
        wait_until(lambda: [c.arriving_since for c in listener._server.active_channels.values()] == [0.0], 5,
                   "the server to finish its side of the handshake")
        with socket.create_connection((host, int(port)), timeout=5) as silent:
            started = time.monotonic()
            wait_until(lambda: peer_closed(silent), 0.5 + http.SWEEP_SECONDS + 1.5, "the silent connection closed")
            assert time.monotonic() - started >= 0.4
        assert not peer_closed(done)
        done.sendall(get("/one"))
        assert read_answer(done.makefile("rb"))[2] == b'{"path": "/one"}'
        done.close()
    finally:
        listener.stop()


def test_at_the_cap_of_tls_connections_a_probe_is_answered_and_the_stalest_makes_room(tmp_path, first, ca_file,
                                                                                       monkeypatch):
    monkeypatch.setattr(http, "NEWCOMER_SECONDS", 0.0)  # every connection held is old enough to be closed
    listener = http.Listener(answers, "127.0.0.1", 0, "capped", timeout=30.0, connection_limit=8,
                             tls=first.write(tmp_path / "v1"))
    listener.start()
    host, port = listener.address.split(":")
    held: list[socket.socket] = []
    try:
        for _ in range(4):  # handshake done, a request begun and never finished
            s = tls_connect(listener, first)
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        for _ in range(4):  # no handshake at all
            held.append(socket.create_connection((host, int(port)), timeout=5))
        wait_until(lambda: len(listener._server.active_channels) == 8, 5, "8 connections held")
        started = time.monotonic()
        assert requests.get(listener.url + "/livez", verify=ca_file, timeout=BOUND).status_code == 200
        assert time.monotonic() - started < BOUND / 2
        wait_until(lambda: peer_closed(held[0]), 2, "the stalest connection closed")
        assert [peer_closed(s) for s in held[1:]] == [False] * 7  # one made room, not all
    finally:
        for s in held:
            s.close()
        listener.stop()


@pytest.mark.parametrize("body_mib", [1, 8])
def test_a_body_over_the_limit_gets_its_413_over_https_while_the_client_is_still_sending(tmp_path, first, ca_file,
                                                                                         body_mib):
    """The 413 goes out when the headers announce too large a body, while the client is still sending it. Closed at
    once, the client's next write fails (an SSL EOF, which HTTP clients do not take for the early answer a broken pipe
    is) and it never reads the 413: the agent's registration over the limit saw an SSL error, not TooLarge. The
    listener reads and drops the rest of the body before it closes, as nginx's lingering close does."""
    served = http.Listener(answers, "127.0.0.1", 0, "tls", timeout=30.0, max_body=1 << 10, tls=first.write(tmp_path / "v1"))
    served.start()
    try:
        r = requests.post(f"{served.url}/register", data=b"x" * (body_mib << 20), verify=ca_file, timeout=BOUND,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        assert "over this server's limit of 1024 bytes" in r.json()["error"]
    finally:
        served.stop()


def test_a_refused_body_is_read_and_dropped_for_at_most_the_linger_bound_then_closed(tmp_path, first, monkeypatch):
    """A client that announced a body over the limit, sent some of it and then neither sends nor closes is not held
    for the idle timeout (30 s here): the lingering close ends at LINGER_SECONDS. The 413 was sent before."""
    monkeypatch.setattr(http, "LINGER_SECONDS", 0.5)
    served = http.Listener(answers, "127.0.0.1", 0, "tls", timeout=30.0, max_body=1 << 10, tls=first.write(tmp_path / "v1"))
    served.start()
    try:
        with tls_connect(served, first) as s:
            s.sendall(b"POST /register HTTP/1.1\r\nHost: x\r\nContent-Length: 10485760\r\n\r\n" + b"x" * (256 << 10))
            started = time.monotonic()
            status, _, body = read_answer(s.makefile("rb"))
            assert status == 413 and b"limit of 1024 bytes" in body
            wait_until(lambda: peer_closed(s), 0.5 + http.SWEEP_SECONDS + 2, "the server to end its lingering close")
            assert time.monotonic() - started >= 0.4  # it lingered, and did not close the moment the answer was out
    finally:
        served.stop()
