"""Large inventories (issue 45): bodies and responses kept in memory, limits named, the whole count kept.

Real HTTP on loopback against the listener and the control plane in this process, with Python's
temporary folder gone (as in the chart's pod) wherever a spill to a temporary file would show.
"""

from __future__ import annotations

import json
import logging
import platform
import socket
import sqlite3
import tempfile

import pytest
import requests

from gpu_agent.foundations import http, malloc
from gpu_agent.foundations.control_plane_client import MAX_REGISTERED_GPUS, ControlPlaneClient, TooLarge
from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.foundations.secrets import Secret
from gpu_agent.roles.control_plane import api
from gpu_agent.roles.control_plane.server import ControlPlane, ControlPlaneServer, ServerSettings
from gpu_agent.roles.control_plane.store import Store

REG = Secret("registration-token-large-0123")
ADMIN = Secret("admin-token-large-0123")


@pytest.fixture
def no_temp_dir(monkeypatch):
    """tempfile cannot make a file in this process, as in the chart's control plane pod."""
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/no-temp-dir")
    with pytest.raises(OSError):
        tempfile.TemporaryFile()


def echo(environ, start_response):
    """Answers with the body's length, then as many bytes as the query string asks for."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    got = len(environ["wsgi.input"].read(length))
    size = int(environ.get("QUERY_STRING") or 0)
    return http.json_response(start_response, 200, None, body=json.dumps({"got": got}).encode().ljust(size))


@pytest.fixture
def listener():
    started = []

    def make(max_body, hint=""):
        server = http.Listener(echo, "127.0.0.1", 0, "test", timeout=5.0, max_body=max_body, body_hint=hint)
        server.start()
        started.append(server)
        return server
    yield make
    for s in started:
        s.stop()


def test_a_body_past_waitress_spill_point_and_a_large_response_stay_in_memory(listener, no_temp_dir, caplog):
    server = listener(4 << 20)
    body = b"x" * (3 << 20)  # waitress spilled a body of 512 KiB or more to a temporary file
    with caplog.at_level(logging.WARNING, logger="waitress"), requests.Session() as session:
        # and a response of 1 MiB or more: its spill failed after the bytes were queued, so the first answer arrived
        # and the connection was reset under the second
        for _ in range(2):
            r = session.post(server.url + "/?" + str(2 << 20), data=body, timeout=10)
            assert r.status_code == 200, r.text[:200]
            assert json.loads(r.content) == {"got": 3 << 20} and len(r.content) == 2 << 20
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_body_of_the_limit_is_read_and_one_byte_more_is_413_naming_size_limit_and_hint(listener):
    server = listener(100_000, hint="send fewer GPUs")
    assert requests.post(server.url, data=b"x" * 100_000, timeout=5).json() == {"got": 100_000}
    r = requests.post(server.url, data=b"x" * 100_001, timeout=5)
    assert r.status_code == 413 and r.headers["Content-Type"] == "application/json"
    assert r.json() == {"error": "the request body of 100001 bytes is over this server's limit of 100000 bytes; "
                                 "send fewer GPUs"}


def test_a_chunked_body_over_the_limit_is_413_naming_the_limit(listener):
    server = listener(1000)
    host, port = server.address.split(":")
    chunk = b"x" * 800
    request = (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2 + b"0\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(request)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), received[:200]
    assert "is over this server's limit of 1000 bytes" in json.loads(body)["error"]


# ---- the control plane ---------------------------------------------------------------------------

@pytest.fixture
def cp(tmp_path):
    server = ControlPlaneServer(ControlPlane(Store(tmp_path / "cp.sqlite"), ServerSettings(REG, ADMIN, 60.0, 30.0, 60.0)),
                                "127.0.0.1", 0)
    server.start()
    yield server, ControlPlaneClient(server.url, timeout=10)
    server.stop()


def gpus(n, start=0):
    return Inventory(tuple(GPU(f"GPU-{i:08x}-0000-4000-8000-000000000000", "NVIDIA H100 80GB HBM3", 85520809984, index=i)
                           for i in range(start, start + n)))


def status_of(client, cluster):
    return next(r for r in client.status(ADMIN)["registrations"] if r["clusterId"] == cluster)


def test_the_agents_limit_is_the_apis_and_the_document_says_what_413_and_422_mean():
    assert api.MAX_GPUS == MAX_REGISTERED_GPUS == 16384
    doc = api.document()
    schema = doc["components"]["schemas"]["RegisterRequest"]["properties"]
    assert schema["gpus"]["maxItems"] == 16384
    assert schema["gpuCount"]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": api.MAX_CLUSTER_GPUS}
    responses = doc["paths"]["/v1/register"]["post"]["responses"]
    assert str(api.MAX_BODY) in responses["413"]["description"] and "maxItems" in responses["422"]["description"]


def test_a_truncated_registration_keeps_the_whole_count_and_a_small_one_reads_as_before(cp, no_temp_dir):
    _, client = cp
    client.register(REG, "big", 1, gpus(100), gpu_count=20_000)
    client.register(REG, "small", 1, gpus(4), gpu_count=4)
    client.register(REG, "low", 1, gpus(4), gpu_count=None)
    assert (status_of(client, "big")["gpuCount"], status_of(client, "big")["gpusListed"]) == (20_000, 100)
    assert (status_of(client, "small")["gpuCount"], status_of(client, "small")["gpusListed"]) == (4, 4)
    assert status_of(client, "low")["gpuCount"] == 4
    client.register(REG, "big", 2, gpus(8))  # a later registration that lists every GPU drops the old count
    assert (status_of(client, "big")["gpuCount"], status_of(client, "big")["gpusListed"]) == (8, 8)


def test_a_count_below_the_list_counts_the_list_rather_than_being_refused(cp):
    server, client = cp
    body = {"clusterId": "c", "generation": 1, "gpus": gpus(3).to_json(), "gpuCount": 1}
    r = requests.post(server.url + "/v1/register", json=body, headers={"Authorization": f"Bearer {REG.reveal()}"}, timeout=5)
    assert r.status_code == 200, r.text
    assert status_of(client, "c")["gpuCount"] == 3


def test_the_client_sends_gpu_count_only_when_it_lists_fewer():
    sent = []

    class Recording(requests.Session):
        def request(self, method, url, **kwargs):
            sent.append(json.loads(kwargs["data"]))
            answer = requests.Response()
            answer.status_code = 200
            answer._content = b'{"registrationId": "r", "reregisterAfterSeconds": 60, ' \
                              b'"credential": {"token": "t", "expiresInSeconds": 60, "expiresAt": 1}}'
            return answer

    client = ControlPlaneClient("http://cp.invalid", session=Recording())
    client.register(REG, "c", 1, gpus(2), gpu_count=2)
    client.register(REG, "c", 1, gpus(2), gpu_count=5)
    assert "gpuCount" not in sent[0] and sent[1]["gpuCount"] == 5


def test_a_list_over_the_limit_is_a_too_large_naming_the_field_the_limit_and_the_fix(cp, monkeypatch):
    _, client = cp
    with pytest.raises(TooLarge) as refused:
        client.register(REG, "c", 1, gpus(MAX_REGISTERED_GPUS + 1))
    message = str(refused.value)
    assert refused.value.status == 422 and refused.value.kind == "too-large"
    assert message.startswith("POST /v1/register: refused for its size, 16385 GPUs listed: 422 field 'gpus': 16385 items, "
                              "more than the 16384 one request may hold; list the first 16384 GPUs"), message


def test_a_body_over_the_control_planes_limit_is_a_too_large_naming_both_sizes(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "MAX_BODY", 64 << 10)  # read when the server is built: a control plane with a smaller limit
    server = ControlPlaneServer(ControlPlane(Store(tmp_path / "cp.sqlite"), ServerSettings(REG, ADMIN, 60.0, 30.0, 60.0)),
                                "127.0.0.1", 0)
    server.start()
    try:
        with pytest.raises(TooLarge) as refused:
            ControlPlaneClient(server.url, timeout=10).register(REG, "c", 1, gpus(1000))
    finally:
        server.stop()
    message = str(refused.value)
    sent = len(json.dumps({"clusterId": "c", "generation": 1, "gpus": gpus(1000).to_json()}))
    assert refused.value.status == 413
    assert message.startswith(f"POST /v1/register: refused for its size, 1000 GPUs listed: 413 the request body of {sent} "
                              f"bytes is over this server's limit of {64 << 10} bytes; a registration fits whole"), message
    assert message.endswith(f"(this request: {sent} bytes)")


def test_the_store_keeps_sqlite_temporary_files_in_memory_and_an_old_database_gains_the_count(tmp_path):
    db = sqlite3.connect(tmp_path / "cp.sqlite")
    db.executescript("""CREATE TABLE registrations (cluster_id TEXT PRIMARY KEY, registration_id TEXT NOT NULL,
        generation INTEGER NOT NULL, gpus TEXT NOT NULL, registered_at REAL NOT NULL, count INTEGER NOT NULL DEFAULT 1);
        INSERT INTO registrations VALUES ('old', 'reg-1', 3, '[{"uuid": "GPU-1"}, {"uuid": "GPU-2"}]', 1.0, 1);""")
    db.commit()
    db.close()
    store = Store(tmp_path / "cp.sqlite")
    try:
        assert store._db.execute("PRAGMA temp_store").fetchone() == (2,)  # 2: MEMORY
        (reg,) = store.status()["registrations"]
        assert (reg["clusterId"], reg["gpuCount"], reg["gpusListed"]) == ("old", 2, 2)
    finally:
        store.close()


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_malloc_arenas_are_limited_on_glibc_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert malloc.limit_arenas(1) is True
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert malloc.limit_arenas(1) is False


def test_a_database_this_release_wrote_still_takes_a_registration_from_0_1_0_after_a_downgrade(tmp_path):
    """0.1.0 (the last stable release) inserts a registration by position, six values. The whole count lives in a
    table of its own, so a downgraded control plane registers on this release's database; its registration, a new
    id, is reported by its list's length, never by a count kept for an earlier one."""
    import sqlite3

    from gpu_agent.roles.control_plane.store import Store

    path = tmp_path / "cp.db"
    store = Store(path)
    store.register("c1", 1, [{"uuid": f"GPU-{i}"} for i in range(3)], gpu_count=20000)
    assert store.status()["registrations"][0]["gpuCount"] == 20000
    db = sqlite3.connect(path)  # what 0.1.0's Store.register runs (git show 1468469:.../store.py)
    db.execute("""INSERT INTO registrations VALUES (?, ?, ?, ?, ?, 1)
        ON CONFLICT(cluster_id) DO UPDATE SET registration_id=excluded.registration_id,
        generation=excluded.generation, gpus=excluded.gpus, registered_at=excluded.registered_at,
        count=registrations.count + 1""", ("c1", "reg-from-0.1.0", 2, '[{"uuid": "GPU-0"}, {"uuid": "GPU-1"}]', 1.0))
    db.commit()
    db.close()
    [reg] = Store(path).status()["registrations"]
    assert (reg["registrationId"], reg["gpuCount"], reg["gpusListed"]) == ("reg-from-0.1.0", 2, 2), reg
