"""Slow clients cannot starve a listener (issue 48, part 5), over real sockets on loopback.

What a slow client did before: a request trickled a byte at a time held its connection for ever
(waitress's timeout is an idle timeout); at the connection cap waitress stopped accepting, so the
probes waited in the backlog; a client that never read its answers held a worker; and 16 long-polls
from one credential took every worker of the control plane, /healthz included.

A sampler thread probes every 0.1 s and records; the tests assert on what it recorded. Waiting is a
poll to a deadline.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests

from gpu_agent.foundations import http
from gpu_agent.foundations.clock import SystemClock
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.roles import endpoints
from gpu_agent.roles.control_plane import api
from gpu_agent.roles.control_plane.server import ControlPlane, ControlPlaneServer, ServerSettings
from gpu_agent.roles.control_plane.store import Store
from gpu_agent.roles.endpoints import EndpointServer
from tests.slow_clients import BOUND, Sampler, SlowClients, peer_closed, wait_until

REG = Secret("registration-token-slow-0123")
ADMIN = Secret("admin-token-slow-0123")


@pytest.fixture
def agent_endpoints():
    server = EndpointServer("127.0.0.1", 0, HealthRegistry(SystemClock(), ["gpus"]), AgentMetrics(), timeout=2.0)
    server.start()
    yield server
    server.stop()


def test_livez_answers_throughout_200_slow_connections_and_every_one_is_closed_within_the_timeout(agent_endpoints):
    timeout = 2.0
    sampler = Sampler(f"http://{agent_endpoints.address}/livez")
    sampler.start()
    slow = SlowClients(agent_endpoints.address, 200)
    try:
        # Past the cap of 64, the stalest make room for the newest at once; the rest go at their timeout.
        over = 200 - endpoints.CONNECTION_LIMIT
        wait_until(lambda: len(slow.closed_at) >= over, timeout, f"{over} connections closed at the cap")
        wait_until(slow.all_closed, timeout + http.SWEEP_SECONDS + 3, "every slow connection closed by the server")
        time.sleep(0.3)  # a few samples with the listener quiet again
    finally:
        samples = sampler.stop()
        slow.close()
    at_cap = sorted(slow.closed_at.values())[over - 1]
    print("\n" + sampler.report("/livez under 200 slow connections") +
          f"; {over} closed at the cap within {at_cap:.2f} s, the last after {slow.last_closed():.2f} s")
    assert at_cap < timeout - 0.5, f"the connections over the cap were closed only after {at_cap:.2f} s (timeout {timeout} s)"
    assert len(samples) >= 15, f"the sampler took only {len(samples)} samples"
    late = [(round(d, 3), c) for d, c in samples if c != 200 or d > BOUND]
    assert not late, f"{len(late)} of {len(samples)} probes failed or took over {BOUND}s: {late[:5]}"
    kinds = {kind: slow.last_closed(kind) for kind in SlowClients.KINDS}
    assert max(kinds.values()) <= timeout + http.SWEEP_SECONDS + 1.0, f"closed after (s), by kind: {kinds}"


def test_a_trickled_request_is_closed_at_the_read_timeout_though_it_is_never_idle(agent_endpoints):
    host, port = agent_endpoints.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        started = time.monotonic()
        s.sendall(b"GET /livez HTTP/1.1\r\n")
        s.settimeout(0.3)
        closed = None
        while time.monotonic() - started < 6:  # three idle timeouts: an idle timeout alone never closes it
            try:
                s.send(b"X")
                if s.recv(1024) == b"":
                    closed = time.monotonic() - started
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = time.monotonic() - started
                break
    assert closed is not None, "a request trickled a byte every 0.3 s kept its connection for 6 s"
    assert 2.0 <= closed <= 2.0 + http.SWEEP_SECONDS + 0.5, closed


def test_at_the_cap_a_new_connection_is_served_and_the_stalest_slow_one_makes_room():
    listener = http.Listener(lambda env, sr: http.json_response(sr, 200, {"ok": True}), "127.0.0.1", 0, "capped",
                             timeout=30.0, connection_limit=8)
    listener.start()
    host, port = listener.address.split(":")
    held = []
    try:
        for _ in range(8):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished: each holds a slot for the 30 s timeout
            held.append(s)
        time.sleep(http.NEWCOMER_SECONDS + 0.1)  # old enough to be closed first
        started = time.monotonic()
        assert requests.get(listener.url + "/", timeout=BOUND).status_code == 200
        took = time.monotonic() - started
        held[0].settimeout(2)
        with pytest.raises(ConnectionResetError):  # closed with a reset: given up, not finished
            held[0].recv(1024)
        held[1].settimeout(0.2)
        with pytest.raises(TimeoutError):
            held[1].recv(1024)  # the others still open: one made room, not all
    finally:
        for s in held:
            s.close()
        listener.stop()
    assert took < BOUND / 2, took


def test_a_probe_sent_during_a_burst_of_new_connections_is_answered_not_closed_to_make_room():
    """At the cap, a burst of new connections: everything is younger than FRESH_SECONDS, and the probe's request is
    in (its answer takes a while). The burst's silent connections make room, oldest first; the probe, being
    answered, is closed last of all (CI once saw a probe reset 2 ms after it connected, in the 200-connection
    flood)."""
    def slowly(environ, start_response):
        time.sleep(0.5)  # the probe's answer is on its way while the burst arrives
        return http.json_response(start_response, 200, {"ok": True})

    listener = http.Listener(slowly, "127.0.0.1", 0, "burst", timeout=30.0, connection_limit=8)
    listener.start()
    host, port = listener.address.split(":")
    held = []
    try:
        held += [socket.create_connection((host, int(port)), timeout=5) for _ in range(7)]  # silent, and fresh
        probe = socket.create_connection((host, int(port)), timeout=5)
        probe.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        held += [socket.create_connection((host, int(port)), timeout=5) for _ in range(12)]  # the burst: 12 over
        answer = probe.recv(1024)
        probe.close()
    finally:
        for s in held:
            s.close()
        listener.stop()
    assert answer.startswith(b"HTTP/1.1 200"), answer


def big_answers(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/big":
        return http.json_response(start_response, 200, None, body=b"x" * (256 << 10), content_type="text/plain")
    return http.json_response(start_response, 200, {"path": path})


def test_a_client_that_never_reads_its_answers_is_closed_and_holds_no_worker():
    # One worker, answers of 256 KiB: a client that pipelines 64 requests and never reads left 16 MiB
    # to drain, and waitress's worker waited for it for as long as the client stayed.
    listener = http.Listener(big_answers, "127.0.0.1", 0, "unread", threads=1, timeout=30.0, max_unread=512 << 10)
    listener.start()
    host, port = listener.address.split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        s.connect((host, int(port)))
        s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 64)
        started = time.monotonic()
        r = requests.get(listener.url + "/small", timeout=5)
        took = time.monotonic() - started
        assert r.status_code == 200 and took < BOUND, took
        wait_until(lambda: peer_closed(s), 5, "the server to close the connection that does not read")
    finally:
        s.close()
        listener.stop()


def test_a_connection_that_times_out_with_its_answer_unread_is_closed():
    # An 8 MiB answer to a client that reads nothing stays in the server's buffers past what the kernel takes.
    # waitress marks the connection closed at its idle timeout but closes it only once its socket is writable,
    # which it never is again: it stayed open for as long as the client liked.
    def app(environ, start_response):
        return http.json_response(start_response, 200, None, body=b"x" * (8 << 20), content_type="text/plain")

    listener = http.Listener(app, "127.0.0.1", 0, "stuck", timeout=1.0, max_unread=16 << 20)
    listener.start()
    host, port = listener.address.split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        s.connect((host, int(port)))
        started = time.monotonic()
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: peer_closed(s), 1.0 + http.SWEEP_SECONDS + 2, "the server to close the idle connection")
        assert time.monotonic() - started >= 1.0
    finally:
        s.close()
        listener.stop()


def test_a_probe_is_served_before_the_requests_queued_ahead_of_it():
    gate, calls = threading.Event(), []

    def app(environ, start_response):
        calls.append(environ["PATH_INFO"])
        if environ["PATH_INFO"].startswith("/slow"):
            gate.wait(10)
        return http.json_response(start_response, 200, {})

    listener = http.Listener(app, "127.0.0.1", 0, "priority", threads=1, timeout=30.0, priority_paths=("/livez",))
    listener.start()
    host, port = listener.address.split(":")
    socks = []
    try:
        for i in range(4):  # the first holds the only worker; three more queue behind it
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(f"GET /slow{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            socks.append(s)
            if i == 0:
                wait_until(lambda: calls == ["/slow0"], 5, "the first request to take the worker")
        wait_until(lambda: len(listener._server.task_dispatcher.queue) == 3, 5, "three requests queued")
        probe = threading.Thread(target=lambda: requests.get(listener.url + "/livez", timeout=10), daemon=True)
        probe.start()
        wait_until(lambda: len(listener._server.task_dispatcher.queue) == 4, 5, "the probe queued")
        gate.set()
        probe.join(10)
        wait_until(lambda: len(calls) == 5, 5, "every request answered")
    finally:
        gate.set()
        for s in socks:
            s.close()
        listener.stop()
    assert calls[1] == "/livez", calls


# ---- the control plane: long-polls cannot take /healthz's workers -----------------------------------------


@pytest.fixture
def cp(tmp_path):
    server = ControlPlaneServer(ControlPlane(Store(tmp_path / "cp.sqlite"), ServerSettings(REG, ADMIN, 600.0, 30.0, 60.0, 20.0)),
                                "127.0.0.1", 0)
    server.start()
    yield server
    server.stop()


def register(cp: ControlPlaneServer, cluster: str) -> str:
    r = requests.post(cp.url + "/v1/register", json={"clusterId": cluster, "generation": 1, "gpus": []},
                      headers={"Authorization": "Bearer " + REG.reveal()}, timeout=5)
    return str(r.json()["credential"]["token"])


def long_polls(cp: ControlPlaneServer, credentials: list[str],
               wait: float = 20.0) -> tuple[list[threading.Thread], list[tuple[int, float, str]]]:
    """One long-polled lease call (waitSeconds `wait`, on an empty queue) per credential named, each on its thread."""
    answers: list[tuple[int, float, str]] = []

    def call(token: str) -> None:
        started = time.monotonic()
        r = requests.post(cp.url + "/v1/queue/lease", json={"waitSeconds": wait},
                          headers={"Authorization": "Bearer " + token}, timeout=30)
        answers.append((r.status_code, time.monotonic() - started, r.headers.get("Retry-After", "")))

    threads = [threading.Thread(target=call, args=(t,), daemon=True) for t in credentials]
    for t in threads:
        t.start()
    return threads, answers


@pytest.mark.parametrize("credentials", [1, 16], ids=["one credential", "16 credentials"])
def test_healthz_answers_within_100ms_while_16_long_polls_are_held(cp, credentials):
    tokens = [register(cp, f"c{i}") for i in range(credentials)]
    threads, answers = long_polls(cp, [tokens[i % credentials] for i in range(16)])
    held = api.MAX_LONG_POLLS_PER_CREDENTIAL if credentials == 1 else api.MAX_LONG_POLLS
    wait_until(lambda: len(answers) == 16 - held, 5, f"{16 - held} calls over the bound answered")
    sampler = Sampler(cp.url + "/healthz")
    sampler.start()
    time.sleep(2.0)  # 20 samples while the long-polls are held
    samples = sampler.stop()
    assert sum(t.is_alive() for t in threads) == held == cp.cp.long_polls.waiting
    print("\n" + sampler.report(f"/healthz with 16 long-polls from {credentials} credential(s), {held} held"))
    assert len(samples) >= 15, len(samples)
    slow = [(round(d * 1000, 1), c) for d, c in samples if c != 200 or d >= 0.1]
    assert not slow, f"{len(slow)} of {len(samples)} /healthz calls failed or took 100 ms or more: {slow[:5]}"
    assert all(code == 429 and took < 1 and retry == "1" for code, took, retry in answers), answers
    cp.cp.store.release_waiters()  # the held calls end (empty) at once
    for t in threads:
        t.join(10)
    assert sorted(code for code, _, _ in answers) == [204] * held + [429] * (16 - held)


def test_a_long_poll_that_ended_makes_room_for_the_next(cp):
    token = register(cp, "c")
    for _ in range(3):  # each round as many as the bound, held until their wait ends: none refused
        started = time.monotonic()
        threads, answers = long_polls(cp, [token] * api.MAX_LONG_POLLS_PER_CREDENTIAL, wait=0.3)
        for t in threads:
            t.join(10)
        assert [code for code, _, _ in answers] == [204] * api.MAX_LONG_POLLS_PER_CREDENTIAL, answers
        assert time.monotonic() - started >= 0.3
    assert cp.cp.long_polls.waiting == 0
    # A plain lease (no wait) is never counted: with the bound taken, one still answers.
    threads, _ = long_polls(cp, [token] * api.MAX_LONG_POLLS_PER_CREDENTIAL)
    wait_until(lambda: cp.cp.long_polls.waiting == api.MAX_LONG_POLLS_PER_CREDENTIAL, 5, "the long-polls held")
    r = requests.post(cp.url + "/v1/queue/lease", json={}, headers={"Authorization": "Bearer " + token}, timeout=5)
    assert r.status_code == 204
    cp.cp.store.release_waiters()
    for t in threads:
        t.join(10)
