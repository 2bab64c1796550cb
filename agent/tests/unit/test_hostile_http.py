"""Hostile and broken HTTP against the control plane and the agent's endpoints, over real sockets.

Each test is a defect once found by hand (issue 13); the evidence is what a client receives on
the wire and what the server logged, never the server's own bookkeeping.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import threading
import time

import pytest
import requests

from gpu_agent.foundations import klog
from gpu_agent.foundations.clock import SystemClock
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.roles.control_plane import api
from gpu_agent.roles.control_plane.server import ControlPlane, ControlPlaneServer, ServerSettings
from gpu_agent.roles.control_plane.store import Store
from gpu_agent.roles.endpoints import EndpointServer

REG = Secret("registration-token-hostile-0123")
ADMIN = Secret("admin-token-hostile-0123")


@pytest.fixture
def logs():
    stream = io.StringIO()
    klog.setup(6, stream)
    yield stream
    klog.setup(0)


@pytest.fixture
def cp(tmp_path, logs):
    server = ControlPlaneServer(ControlPlane(Store(tmp_path / "cp.sqlite"), ServerSettings(REG, ADMIN, 60.0, 30.0, 60.0, 0.2)),
                                "127.0.0.1", 0, timeout=2.0)
    server.start()
    yield server
    server.stop()


def raw(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes as they are; return everything the server sends until it closes or goes quiet."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except TimeoutError:
            pass
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def post(cp, path, body: bytes, token: Secret | None, content_type="application/json"):
    headers = {"Content-Type": content_type} if content_type else {}
    if token is not None:
        headers["Authorization"] = "Bearer " + token.reveal()
    return requests.post(cp.url + path, data=body, headers=headers, timeout=10)


HOSTILE_BODIES = {
    "not UTF-8": b'{"clusterId": "\xff\xfe"}',
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "5,000-digit number": b'{"generation": ' + b"9" * 5000 + b"}",
    "NaN": b'{"clusterId": "c", "generation": NaN, "gpus": []}',
}


@pytest.mark.parametrize("name", HOSTILE_BODIES)
def test_hostile_bodies_without_a_token_get_401_and_are_never_parsed(cp, logs, name):
    r = post(cp, "/v1/register", HOSTILE_BODIES[name], None)
    assert r.status_code == 401 and r.headers["Content-Type"] == "application/json"
    assert "Traceback" not in logs.getvalue()


@pytest.mark.parametrize("name", HOSTILE_BODIES)
def test_hostile_bodies_with_a_token_get_400_naming_the_problem(cp, logs, name):
    r = post(cp, "/v1/register", HOSTILE_BODIES[name], REG)
    assert r.status_code == 400, r.text
    assert "error" in r.json()
    assert "Traceback" not in logs.getvalue()


@pytest.mark.parametrize("field,value", [("generation", 10**30), ("generation", -1), ("clusterId", ""),
                                         ("clusterId", "evil\nI1130 forged log line"), ("gpus", [{"uuid": "GPU-1"}])])
def test_out_of_range_fields_get_422_naming_the_field(cp, field, value):
    body = {"clusterId": "c", "generation": 1, "gpus": [], field: value}
    r = post(cp, "/v1/register", json.dumps(body).encode(), REG)
    assert r.status_code == 422 and field in r.json()["error"], r.text


def test_a_huge_item_id_is_404_not_500(cp):
    r = post(cp, "/v1/queue/items/" + "9" * 19 + "/ack", b'{"leaseId": "x"}', None)
    assert r.status_code == 401  # the token first
    cred = requests.post(cp.url + "/v1/register", json={"clusterId": "c", "generation": 1, "gpus": []},
                         headers={"Authorization": "Bearer " + REG.reveal()}, timeout=5).json()["credential"]["token"]
    r = post(cp, "/v1/queue/items/" + "9" * 19 + "/ack", b'{"leaseId": "x"}', Secret(cred))
    assert r.status_code == 404
    r = post(cp, "/v1/queue/items/" + "9" * 40 + "/ack", b'{"leaseId": "x"}', Secret(cred))
    assert r.status_code == 404


def test_lease_seconds_nan_or_infinite_is_refused(cp):
    cred = requests.post(cp.url + "/v1/register", json={"clusterId": "c", "generation": 1, "gpus": []},
                         headers={"Authorization": "Bearer " + REG.reveal()}, timeout=5).json()["credential"]["token"]
    for body in (b'{"leaseSeconds": NaN}', b'{"leaseSeconds": Infinity}', b'{"leaseSeconds": 1e999}', b'{"leaseSeconds": 0}'):
        r = post(cp, "/v1/queue/lease", body, Secret(cred))
        assert r.status_code in (400, 422), (body, r.status_code)


def test_a_body_over_the_limit_gets_413_and_the_rest_is_never_read_as_a_request(cp):
    padding = b"x" * (api.MAX_BODY + 1024)
    hidden = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    request = (b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Authorization: Bearer " + REG.reveal().encode() + b"\r\n"
               b"Content-Length: " + str(len(padding)).encode() + b"\r\n\r\n" + padding + hidden)
    host, port = cp.url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            s.sendall(request)  # the server may answer and close before it has all of it
        except (ConnectionResetError, BrokenPipeError):
            pass
        try:
            while chunk := s.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    assert status_of(received) == 413, received[:200]
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"Content-Type: application/json" in head and "error" in json.loads(body), received[:300]
    assert received.count(b"HTTP/1.1 ") == 1, "the request hidden after the padding was answered"


def test_an_inventory_of_4000_gpus_registers(cp):
    gpus = [{"uuid": f"GPU-{i:08d}-0000-0000-0000-000000000000", "name": "NVIDIA H100 80GB HBM3",
             "memoryTotalBytes": 85520809984, "migMode": False, "index": i} for i in range(4000)]
    r = post(cp, "/v1/register", json.dumps({"clusterId": "big", "generation": 1, "gpus": gpus}).encode(), REG)
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("length", [b"abc", b"-1", b"99999999999999999999999"])
def test_bad_content_length_is_answered_not_dropped_or_hung(cp, logs, length):
    request = (b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + length + b"\r\n\r\n{}")
    started = time.monotonic()
    response = raw(cp.url, request, timeout=5)
    assert 400 <= status_of(response) < 500, response[:200]
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"application/json" in head and "error" in json.loads(body.split(b"HTTP/1.1")[0]), response[:300]
    assert time.monotonic() - started < 4
    assert "Traceback" not in logs.getvalue()


@pytest.mark.parametrize("method", ["TRACE", "PUT", "HEAD", "OPTIONS", "PATCH"])
def test_other_methods_get_405_with_allow_and_a_json_body(cp, method):
    r = requests.request(method, cp.url + "/v1/register", timeout=5)
    assert r.status_code == 405
    assert r.headers["Allow"] == "POST"
    if method != "HEAD":
        assert "error" in r.json()


def test_unknown_paths_get_404_json(cp):
    r = requests.get(cp.url + "/nope", timeout=5)
    assert r.status_code == 404 and "error" in r.json()


def test_chunked_bodies_are_read(cp):
    body = json.dumps({"clusterId": "chunky", "generation": 3, "gpus": []}).encode()
    chunked = b"".join(f"{len(body[i:i + 10]):x}\r\n".encode() + body[i:i + 10] + b"\r\n" for i in range(0, len(body), 10))
    request = (b"POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Authorization: Bearer " + REG.reveal().encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
               + chunked + b"0\r\n\r\n")
    response = raw(cp.url, request)
    assert status_of(response) == 200 and b"registrationId" in response


def test_a_cluster_id_with_a_newline_cannot_forge_a_log_line(logs):
    klog.get_logger("test").info("cluster %s registered", "evil\nI1130 00:00:00.000000 1 forged.py:1] forged")
    lines = logs.getvalue().splitlines()
    assert len(lines) == 1 and "\\n" in lines[0]


def test_slow_clients_do_not_delay_livez_and_are_closed_after_the_timeout():
    health = HealthRegistry(SystemClock(), ["gpus"])
    server = EndpointServer("127.0.0.1", 0, health, AgentMetrics(), timeout=2.0)
    server.start()
    url = f"http://{server.address}"
    host, port = server.address.split(":")
    slow = []
    try:
        for _ in range(100):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")  # never finished
            slow.append(s)
        worst = 0.0
        for _ in range(10):
            started = time.monotonic()
            assert requests.get(url + "/livez", timeout=2).status_code == 200
            worst = max(worst, time.monotonic() - started)
        print(f"\n/livez with 100 half-sent requests open: worst of 10 in {worst * 1000:.1f} ms")
        assert worst < 0.1
        closed = []

        def wait_closed(s: socket.socket) -> None:
            try:
                closed.append(s.recv(1) == b"")
            except OSError:
                closed.append(True)

        threads = [threading.Thread(target=wait_closed, args=(s,)) for s in slow]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert closed.count(True) == 100, f"{closed.count(True)} of 100 slow connections closed by the server"
    finally:
        for s in slow:
            s.close()
        server.stop()


def test_waitress_warnings_go_through_the_klog_handler(logs):
    logging.getLogger("waitress").warning("a waitress warning")
    assert "a waitress warning" in logs.getvalue() and logs.getvalue().startswith("W")
