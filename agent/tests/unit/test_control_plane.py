"""The reference control plane over real HTTP on loopback, with its client."""

import threading
import time

import pytest
import requests

from gpu_agent.foundations.control_plane_client import ControlPlaneClient, ControlPlaneError, Fence
from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.foundations.secrets import Secret
from gpu_agent.roles.control_plane.server import ControlPlane, ControlPlaneServer, ServerSettings
from gpu_agent.roles.control_plane.store import Store

REG = Secret("registration-token-0123456789")
ADMIN = Secret("admin-token-0123456789")
INV = Inventory((GPU("GPU-00000000-0000-0000-0000-000000000001", "fake", 1 << 30),))


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


def start(db, clock, ttl=60.0, faults=False):
    server = ControlPlaneServer(ControlPlane(Store(db, clock), ServerSettings(REG, ADMIN, ttl, 30.0, 60.0,
                                                                                fault_injection=faults)), "127.0.0.1", 0)
    server.start()
    return server


@pytest.fixture
def cp(tmp_path, clock):
    server = start(tmp_path / "cp.sqlite", clock)
    yield server, ControlPlaneClient(server.url, timeout=5)
    server.stop()


@pytest.fixture
def cp_faults(tmp_path, clock):
    """A control plane with fault injection on (a test facility, off by default)."""
    server = start(tmp_path / "cp.sqlite", clock, faults=True)
    yield server, ControlPlaneClient(server.url, timeout=5)
    server.stop()


def test_register_lease_ack(cp):
    _server, client = cp
    reg = client.register(REG, "c1", 1, INV)
    assert reg.credential.expires_in == 60
    for k in ("a", "b"):
        client.enqueue(ADMIN, k, {"k": k})
    assert client.enqueue(ADMIN, "a", {"k": "again"}) == 1  # idempotent on the key
    cred = reg.credential.token
    first = client.lease(cred, 10)
    second = client.lease(cred, 10)
    assert (first.idempotency_key, second.idempotency_key) == ("a", "b")
    assert client.lease(cred, 10) is None
    client.ack(cred, first)
    client.ack(cred, second)
    assert client.status(ADMIN)["items"] == {"queued": 0, "leased": 0, "done": 2, "failed": 0}


def test_an_items_state_is_told_to_a_credential_and_an_unknown_item_is_404(cp):
    _server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    client.enqueue(ADMIN, "a", {})
    assert client.item_state(cred, 1) == "queued"
    item = client.lease(cred, 10)
    assert client.item_state(cred, 1) == "leased"
    client.ack(cred, item)
    assert client.item_state(cred, 1) == "done"
    for missing in (2, 2**63 + 5):
        with pytest.raises(ControlPlaneError) as e:
            client.item_state(cred, missing)
        assert e.value.kind == "rejected" and e.value.status == 404


def test_expired_lease_is_delivered_again_and_a_stale_ack_is_refused(cp, clock):
    _server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    client.enqueue(ADMIN, "a", {})
    first = client.lease(cred, 5)
    assert client.lease(cred, 5) is None
    clock.now += 6
    again = client.lease(cred, 5)
    assert again.item_id == first.item_id and again.deliveries == 2 and again.lease_id != first.lease_id
    with pytest.raises(ControlPlaneError) as e:
        client.ack(cred, first)
    assert e.value.kind == "rejected" and e.value.status == 409
    client.ack(cred, again)


def test_a_renewed_lease_keeps_a_long_item_from_being_delivered_again_and_an_expired_one_is_not_revived(cp, clock):
    _, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    client.enqueue(ADMIN, "long", {})
    item = client.lease(cred, 5)
    for _ in range(4):  # 16 s of work: more than three 5 s leases
        clock.now += 4
        client.renew_lease(cred, item, 5)
        assert client.lease(cred, 5) is None
    client.ack(cred, item)
    assert [(i["idempotencyKey"], i["state"], i["deliveries"]) for i in client.list_items(ADMIN)] == [("long", "done", 1)]
    client.enqueue(ADMIN, "late", {})
    late = client.lease(cred, 5)
    clock.now += 6
    with pytest.raises(ControlPlaneError) as e:
        client.renew_lease(cred, late, 5)
    assert e.value.kind == "rejected" and e.value.status == 409
    assert client.lease(cred, 5).item_id == late.item_id  # delivered again, as an expired lease must be


@pytest.mark.parametrize("seconds,status,says", [
    ("NaN", 400, "NaN is not JSON"), ("Infinity", 400, "Infinity is not JSON"), ("0", 422, "'leaseSeconds'"),
    ("-1", 422, "'leaseSeconds'"), ("1e9", 422, "'leaseSeconds'"), ('"10"', 422, "'leaseSeconds'")])
def test_a_lease_length_that_is_not_a_finite_bounded_number_is_refused_naming_it(cp, seconds, status, says):
    server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    client.enqueue(ADMIN, "a", {})
    item = client.lease(cred, 5)
    for path, body in (("/v1/queue/lease", f'{{"leaseSeconds": {seconds}}}'),
                       (f"/v1/queue/items/{item.item_id}/renew", f'{{"leaseId": "{item.lease_id}", "leaseSeconds": {seconds}}}')):
        r = requests.post(server.url + path, data=body, timeout=5,
                          headers={"Authorization": "Bearer " + cred.reveal(), "Content-Type": "application/json"})
        assert r.status_code == status and says in r.json()["error"], (path, r.status_code, r.text)
    client.renew_lease(cred, item, 5)  # the lease itself is untouched by the refusals
    client.ack(cred, item)


def test_release_makes_an_item_available_at_once(cp):
    _, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    client.enqueue(ADMIN, "a", {})
    item = client.lease(cred, 30)
    client.release(cred, item)
    assert client.lease(cred, 30).item_id == item.item_id


def test_every_endpoint_but_health_needs_the_right_token(cp):
    server, client = cp
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
    for method, path in [("GET", "/openapi.json"), ("POST", "/v1/register"), ("POST", "/v1/credentials/renew"),
                         ("POST", "/v1/queue/items"), ("POST", "/v1/queue/lease"), ("POST", "/v1/queue/items/1/ack"),
                         ("GET", "/v1/status"), ("POST", "/admin/faults"), ("GET", "/v1/queue/items/1")]:
        assert requests.request(method, server.url + path, json={}, timeout=5).status_code == 401, path
    with pytest.raises(ControlPlaneError) as e:
        client.enqueue(REG, "x", {})  # the registration token is not an admin token
    assert e.value.kind == "unauthorized"
    doc = requests.get(server.url + "/openapi.json", headers={"Authorization": "Bearer " + ADMIN.reveal()}, timeout=5).json()
    assert doc["openapi"].startswith("3.") and "/v1/queue/lease" in doc["paths"]


def test_credentials_expire_and_a_renewed_one_keeps_working_for_the_overlap_beside_its_successor(tmp_path, clock):
    """No window of 401s at a renewal: calls under way with the old token land, and an agent whose
    renewal answer was lost renews again with it; credentialOverlap (60 s by default) later it is refused."""
    server = start(tmp_path / "cp.sqlite", clock, ttl=600.0)
    client = ControlPlaneClient(server.url, timeout=5)
    try:
        cred = client.register(REG, "c1", 1, INV).credential.token
        fresh = client.renew(cred)
        client.lease(cred, 5)
        again = client.renew(cred)  # the first answer was lost
        clock.now += 59
        client.lease(cred, 5)
        clock.now += 1.5
        with pytest.raises(ControlPlaneError) as e:
            client.lease(cred, 5)
        assert e.value.kind == "unauthorized" and e.value.status == 401 and "expired" in str(e.value)
        client.lease(again.token, 5)
        clock.now += 600
        with pytest.raises(ControlPlaneError) as e:
            client.renew(fresh.token)
        assert e.value.kind == "unauthorized" and "expired" in str(e.value)
    finally:
        server.stop()


def test_bad_requests_name_the_field(cp):
    server, _ = cp
    auth = {"Authorization": "Bearer " + REG.reveal()}
    r = requests.post(server.url + "/v1/register", json={"clusterId": "c", "gpus": []}, headers=auth, timeout=5)
    assert r.status_code == 422 and "'generation'" in r.json()["error"] and "Field required" in r.json()["error"]
    json_type = {**auth, "Content-Type": "application/json"}
    r = requests.post(server.url + "/v1/register", data=b"{nope", headers=json_type, timeout=5)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = requests.post(server.url + "/v1/register", data=b"{}", headers=auth, timeout=5)
    assert r.status_code == 415 and "application/json" in r.json()["error"]


@pytest.mark.parametrize("fault,kind", [
    ({"mode": "status", "status": 503}, "unavailable"),
    ({"mode": "status", "status": 599, "retryAfterSeconds": 1}, "unavailable"),
    ({"mode": "drop"}, "unavailable"),
    ({"mode": "malformed"}, "protocol"),
])
def test_faults_fail_the_next_calls_then_stop(cp_faults, fault, kind):
    _, client = cp_faults
    client.set_fault(ADMIN, count=2, path="/v1/register", **fault)
    for _ in range(2):
        with pytest.raises(ControlPlaneError) as e:
            client.register(REG, "c1", 1, INV)
        assert e.value.kind == kind
        assert REG.reveal() not in str(e.value)
    client.register(REG, "c1", 1, INV)


def test_delay_fault_makes_the_client_time_out(cp_faults):
    server, _ = cp_faults
    client = ControlPlaneClient(server.url, timeout=0.3)
    client.set_fault(ADMIN, mode="delay", delaySeconds=1, path="/v1/register")
    with pytest.raises(ControlPlaneError, match="timed out"):
        client.register(REG, "c1", 1, INV)


class StubResponse:
    """What requests' Session.request returns, for answers the control plane itself never gives."""

    def __init__(self, status_code, reason, content):
        self.status_code, self.reason, self.content = status_code, reason, content

    def json(self):
        import json

        return json.loads(self.content)


def test_a_429_from_the_control_plane_is_unavailable_and_retried(cp, monkeypatch):
    """A throttled call is retried like an outage. Fault injection answers 5xx only, so the 429 is stubbed."""
    _, client = cp
    monkeypatch.setattr(client._session, "request", lambda *a, **k: StubResponse(429, "Too Many Requests",
                                                                                  b'{"error": "slow down"}'))
    with pytest.raises(ControlPlaneError) as e:
        client.register(REG, "c1", 1, INV)
    assert e.value.kind == "unavailable" and e.value.recoverable and e.value.status == 429
    assert "slow down" in str(e.value)


def _admin(method, server, path, headers=None, **kw):
    return requests.request(method, server.url + path, headers={"Authorization": "Bearer " + ADMIN.reveal(),
                                                                **(headers or {})}, timeout=5, **kw)


def test_without_the_setting_fault_injection_is_refused_naming_it_and_nothing_is_armed(cp):
    server, client = cp
    for method, body in (("POST", {"mode": "status", "status": 503, "path": "/v1/status"}), ("DELETE", None)):
        r = _admin(method, server, "/admin/faults", json=body)
        assert r.status_code == 404, (method, r.text)
        error = r.json()["error"]
        assert "fault injection is off" in error and "--fault-injection=true" in error, error
        assert "controlPlane.faultInjection=true" in error, error
    r = _admin("POST", server, "/admin/faults", data=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status_code == 404, r.text  # the body is not even read
    assert client.status(ADMIN)["items"]["queued"] == 0  # answered normally: no fault was armed
    assert requests.post(server.url + "/admin/faults", json={"mode": "drop"}, timeout=5).status_code == 401
    doc = _admin("GET", server, "/openapi.json").json()
    for method in ("post", "delete"):
        assert "404" in doc["paths"]["/admin/faults"][method]["responses"], method


def test_an_armed_fault_never_answers_a_call_its_token_refuses(cp_faults):
    server, client = cp_faults
    client.set_fault(ADMIN, mode="status", status=503, count=1, path="/v1/status")
    r = requests.get(server.url + "/v1/status", timeout=5)
    assert r.status_code == 401, r.text  # no token: refused first
    r = requests.get(server.url + "/v1/status", headers={"Authorization": "Bearer nope-not-a-token"}, timeout=5)
    assert r.status_code == 401, r.text
    r = requests.get(server.url + "/v1/status", headers={"Authorization": "Bearer " + REG.reveal()}, timeout=5)
    assert r.status_code == 403, r.text  # a token of the wrong kind
    assert _admin("GET", server, "/v1/status").status_code == 503  # the fault was still armed: refusals do not use it
    assert _admin("GET", server, "/v1/status").status_code == 200


def test_a_delay_fault_does_not_hold_back_a_refusal(cp_faults):
    server, client = cp_faults
    client.set_fault(ADMIN, mode="delay", delaySeconds=5, path="/v1/register")
    r = requests.post(server.url + "/v1/register", json={}, timeout=2)
    assert r.status_code == 401


@pytest.mark.parametrize("status,accepted", [(399, False), (400, False), (429, False), (499, False), (500, True),
                                             (503, True), (599, True), (600, False), (1000, False)])
def test_a_fault_status_is_a_server_error(cp_faults, status, accepted):
    server, client = cp_faults
    r = _admin("POST", server, "/admin/faults", json={"mode": "status", "status": status, "path": "/v1/status"})
    if accepted:
        assert r.status_code == 200, r.text
        assert _admin("GET", server, "/v1/status").status_code == status
    else:
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert "'status'" in error and "500 to 599" in error, error
        assert client.status(ADMIN)["items"]["queued"] == 0  # nothing armed


@pytest.mark.parametrize("argv,environ,on", [
    ([], {}, False),
    (["--fault-injection=true"], {}, True),
    ([], {"GPU_AGENT_FAULT_INJECTION": "true"}, True),
    (["--fault-injection=false"], {"GPU_AGENT_FAULT_INJECTION": "true"}, False),  # the flag wins
])
def test_fault_injection_is_a_setting_of_the_control_plane_off_by_default(tmp_path, argv, environ, on):
    import argparse

    from gpu_agent.foundations.config import add_arguments, load
    from gpu_agent.roles import local
    from gpu_agent.roles.control_plane import main

    parser = argparse.ArgumentParser()
    add_arguments(parser, main.SETTINGS)
    args = parser.parse_args(["--database", str(tmp_path / "cp.sqlite"), "--listen-address", "127.0.0.1:0", *argv])
    tokens = {"GPU_AGENT_REGISTRATION_TOKEN": REG.reveal(), "GPU_AGENT_ADMIN_TOKEN": ADMIN.reveal()}
    cfg = load(main.SETTINGS, args, {**tokens, **environ}, as_=main.ControlPlaneConfig)
    server = main.build_server(cfg, cfg.listenAddress)
    server.start()
    try:
        assert server.cp.settings.fault_injection is on
        r = _admin("DELETE", server, "/admin/faults")
        assert r.status_code == (200 if on else 404), r.text
    finally:
        server.stop()
    # `gpu-agent local` (make run) has the setting too, off unless asked for
    assert next(s for s in local.SETTINGS if s.name == "faultInjection").default is False


def _control_plane_config(tmp_path, argv, environ=None):
    import argparse

    from gpu_agent.foundations.config import add_arguments, load
    from gpu_agent.roles.control_plane import main

    parser = argparse.ArgumentParser()
    add_arguments(parser, main.SETTINGS)
    args = parser.parse_args(["--database", str(tmp_path / "cp.sqlite"), "--listen-address", "127.0.0.1:0", *argv])
    tokens = {"GPU_AGENT_REGISTRATION_TOKEN": REG.reveal(), "GPU_AGENT_ADMIN_TOKEN": ADMIN.reveal()}
    return load(main.SETTINGS, args, {**tokens, **(environ or {})}, as_=main.ControlPlaneConfig)


def test_the_control_plane_serves_https_with_a_certificate_and_key_and_plain_http_without(tmp_path):
    import trustme

    from gpu_agent.roles import local
    from gpu_agent.roles.control_plane import main

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    plain = _control_plane_config(tmp_path, [])
    secure = _control_plane_config(tmp_path, ["--tls-cert-file", str(tmp_path / "tls.crt")],
                                   {"GPU_AGENT_TLS_KEY_FILE": str(tmp_path / "tls.key")})
    for cfg, scheme in ((plain, "http"), (secure, "https")):
        tls = main.tls_files(cfg)
        server = main.build_server(cfg, cfg.listenAddress, tls)
        server.start()
        try:
            assert server.url.startswith(f"{scheme}://127.0.0.1:")
            assert main.serving(server, tls).startswith(f"serving {scheme.upper()} on {server.url}")
            r = requests.get(server.url + "/healthz", verify=str(tmp_path / "ca.pem"), timeout=5)
            assert r.status_code == 200, r.text
        finally:
            server.stop()
    # `gpu-agent local` (make run) serves plain HTTP on loopback: it has no such settings
    assert not [s.name for s in local.SETTINGS if s.name.startswith("tls")]


@pytest.mark.parametrize("given,missing,flag,env", [
    ("tlsCertFile", "tlsKeyFile", "--tls-key-file", "GPU_AGENT_TLS_KEY_FILE"),
    ("tlsKeyFile", "tlsCertFile", "--tls-cert-file", "GPU_AGENT_TLS_CERT_FILE"),
])
def test_a_certificate_without_its_key_or_a_key_without_its_certificate_is_refused_naming_the_missing_one(
        tmp_path, given, missing, flag, env):
    from gpu_agent.foundations.config import ConfigError
    from gpu_agent.roles.control_plane import main

    (tmp_path / "file.pem").write_text("")
    given_flag = "--tls-cert-file" if given == "tlsCertFile" else "--tls-key-file"
    cfg = _control_plane_config(tmp_path, [given_flag, str(tmp_path / "file.pem")])
    with pytest.raises(ConfigError) as e:
        main.tls_files(cfg)
    assert str(e.value) == (f"{given} is set but {missing} is not: HTTPS needs both the certificate and its key; set "
                            f"{flag} (or {env}), or unset {given} to serve plain HTTP")


def test_the_document_bounds_the_fault_status_to_server_errors(cp):
    server, _ = cp
    schema = _admin("GET", server, "/openapi.json").json()["components"]["schemas"]["FaultRequest"]
    status = schema["properties"]["status"]
    assert (status["type"], status["minimum"], status["maximum"], status["default"]) == ("integer", 500, 599, 503)


def test_malformed_response_error_names_the_field_and_not_the_body(cp, monkeypatch):
    _, client = cp
    monkeypatch.setattr(client._session, "request", lambda *a, **k: StubResponse(
        200, "OK", b'{"registrationId": "r", "credential": {"token": "leaky-secret-token-value"}}'))
    with pytest.raises(ControlPlaneError) as e:
        client.register(REG, "c1", 1, INV)
    assert e.value.kind == "protocol" and "expiresInSeconds" in str(e.value)
    assert "leaky-secret" not in str(e.value)


def test_queue_and_credentials_survive_a_restart(tmp_path, clock):
    server = start(tmp_path / "cp.sqlite", clock)
    client = ControlPlaneClient(server.url)
    cred = client.register(REG, "c1", 1, INV).credential.token
    for k in range(3):
        client.enqueue(ADMIN, f"k{k}", {})
    client.ack(cred, client.lease(cred, 30))
    server.stop()
    server = start(tmp_path / "cp.sqlite", clock)
    client = ControlPlaneClient(server.url)
    try:
        assert client.status(ADMIN)["items"] == {"queued": 2, "leased": 0, "done": 1, "failed": 0}
        assert client.lease(cred, 30).idempotency_key == "k1"  # the old credential is still valid
    finally:
        server.stop()


def test_tokens_are_stored_hashed(tmp_path, clock):
    server = start(tmp_path / "cp.sqlite", clock)
    token = ControlPlaneClient(server.url).register(REG, "c1", 1, INV).credential.token.reveal()
    server.stop()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert token.encode() not in raw


def test_long_poll_lease_returns_as_soon_as_an_item_is_enqueued(cp):
    import threading
    import time

    server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    timer = threading.Timer(0.3, lambda: ControlPlaneClient(server.url).enqueue(ADMIN, "late", {}))
    timer.start()
    started = time.monotonic()
    item = client.lease(cred, 10, wait_seconds=5)
    took = time.monotonic() - started
    assert item is not None and item.idempotency_key == "late"
    assert 0.25 <= took < 2.0
    started = time.monotonic()
    assert client.lease(cred, 10, wait_seconds=0.4) is None
    assert time.monotonic() - started >= 0.35


def test_a_new_term_hands_back_older_leases_and_fences_every_call_of_the_older_term(cp):
    _server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    for k in ("a", "b"):
        client.enqueue(ADMIN, k, {})
    old = client.start_term(cred, "agent-old")
    running = client.lease(cred, 30, fence=old)
    assert running.idempotency_key == "a"
    new = client.start_term(cred, "agent-new")
    assert new.term > old.term
    # The item the old term held is queued again at once (not after its 30 s lease), for the new term.
    adopted = client.lease(cred, 30, fence=new)
    assert adopted.idempotency_key == "a" and adopted.deliveries == 2
    for call in (lambda: client.ack(cred, running), lambda: client.renew_lease(cred, running, 30),
                 lambda: client.release(cred, running), lambda: client.lease(cred, 30, fence=old),
                 lambda: client.lease(cred, 30), lambda: client.lease(cred, 30, fence=Fence("forger", new.term + 5))):
        with pytest.raises(ControlPlaneError) as refused:
            call()
        assert refused.value.kind == "fenced" and f"term {new.term}" in str(refused.value)
    client.ack(cred, adopted)
    assert client.status(ADMIN)["items"] == {"queued": 1, "leased": 0, "done": 1, "failed": 0}
    assert client.status(ADMIN)["term"] == {"term": new.term, "holder": "agent-new"}
    log = client.deliveries(ADMIN)
    assert [(d["itemId"], d["holder"], d["term"]) for d in log] == [(1, "agent-old", old.term), (1, "agent-new", new.term)]


def test_a_database_written_before_terms_existed_gains_them_and_keeps_its_items(tmp_path, clock):
    import sqlite3
    db = tmp_path / "old.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript("""CREATE TABLE items (id INTEGER PRIMARY KEY AUTOINCREMENT, idempotency_key TEXT NOT NULL UNIQUE,
        payload TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'queued', lease_id TEXT, lease_expires_at REAL,
        deliveries INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, acked_at REAL);
        INSERT INTO items (idempotency_key, payload, state, lease_id, lease_expires_at, deliveries, created_at)
        VALUES ('leased-by-0.1', '{}', 'leased', 'x', 9999999999, 1, 1);""")
    conn.commit()
    conn.close()
    store = Store(db, clock)
    term, handed_back = store.start_term("agent")
    assert handed_back == 1  # a lease taken by a 0.1 agent (no term) is handed back too
    assert store.lease(30, "agent", term)["idempotencyKey"] == "leased-by-0.1"
    store.close()


def test_term_fields_are_validated_naming_the_field(cp):
    server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    for path, body, field in (("/v1/queue/terms", "{}", "holder"), ("/v1/queue/terms", '{"holder": ""}', "holder"),
                              ("/v1/queue/lease", '{"term": 0}', "term"), ("/v1/queue/lease", '{"term": "1"}', "term"),
                              ("/v1/queue/items/1/ack", '{"leaseId": "x", "term": -1}', "term")):
        r = requests.post(server.url + path, data=body, timeout=5,
                          headers={"Authorization": "Bearer " + cred.reveal(), "Content-Type": "application/json"})
        assert r.status_code == 422 and field in r.json()["error"], (path, body, r.text)


# ---- poison items --------------------------------------------------------------------------------
def start_poisonable(db, clock, seed=7):
    import random

    store = Store(db, clock, rng=random.Random(seed), max_attempts=3, retry_base_seconds=2.0, retry_max_seconds=5.0)
    server = ControlPlaneServer(ControlPlane(store, ServerSettings(REG, ADMIN, 86400.0, 30.0, 60.0)), "127.0.0.1", 0)
    server.start()
    return server, store


def test_a_failing_item_is_held_back_so_the_items_behind_it_run_and_is_failed_after_its_last_attempt(tmp_path, clock):
    server, _store = start_poisonable(tmp_path / "cp.sqlite", clock)
    client = ControlPlaneClient(server.url, timeout=5)
    try:
        cred = client.register(REG, "c1", 1, INV).credential.token
        client.enqueue(ADMIN, "poison", {"gpus": 1, "command": ["false"]})
        client.enqueue(ADMIN, "good", {"gpus": 1})
        leased = []
        for attempt in range(1, 4):
            poison = client.lease(cred, 30)
            assert poison.idempotency_key == "poison" and poison.deliveries == attempt
            client.release(cred, poison, f"pod failed to start (attempt {attempt})")
            items = {i["idempotencyKey"]: i for i in client.list_items(ADMIN)}
            assert items["poison"]["failedAttempts"] == attempt
            assert items["poison"]["lastError"] == f"pod failed to start (attempt {attempt})"
            if attempt == 1:  # held back: the item behind it is leased, not the poison again
                good = client.lease(cred, 30)
                assert good.idempotency_key == "good"
                client.ack(cred, good)
                leased.append("good")
            if attempt < 3:
                assert client.lease(cred, 30) is None  # still backing off
                clock.now += 5.0  # the cap: every backoff is over
        assert items["poison"]["state"] == "failed" and leased == ["good"]
        clock.now += 3600
        assert client.lease(cred, 30) is None  # a failed item is never delivered again
        assert client.status(ADMIN)["items"] == {"queued": 0, "leased": 0, "done": 1, "failed": 1}
    finally:
        server.stop()


def test_backoff_doubles_from_its_base_to_its_cap_jittered_down_by_at_most_half(tmp_path, clock):
    import random

    store = Store(tmp_path / "cp.sqlite", clock, rng=random.Random(3), retry_base_seconds=1.0, retry_max_seconds=10.0)
    delays = [store.retry_delay(n) for n in range(1, 8)]
    ceilings = [1, 2, 4, 8, 10, 10, 10]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=False)), delays
    again = Store(tmp_path / "b.sqlite", clock, rng=random.Random(3), retry_base_seconds=1.0, retry_max_seconds=10.0)
    assert delays == [again.retry_delay(n) for n in range(1, 8)]  # the seed decides
    store.close()
    again.close()


def test_a_release_without_an_error_and_an_expired_lease_count_no_attempt(tmp_path, clock):
    server, _store = start_poisonable(tmp_path / "cp.sqlite", clock)
    client = ControlPlaneClient(server.url, timeout=5)
    try:
        cred = client.register(REG, "c1", 1, INV).credential.token
        client.enqueue(ADMIN, "a", {})
        for _ in range(5):
            client.release(cred, client.lease(cred, 30))  # a paused queue giving it back
        client.lease(cred, 30)
        clock.now += 31  # its consumer died: the lease expires
        item = client.lease(cred, 30)
        assert item.idempotency_key == "a" and item.deliveries == 7
        assert client.list_items(ADMIN)[0]["failedAttempts"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("payload,field", [
    ('{"gpus": "x"}', "payload.gpus"), ('{"gpus": -1}', "payload.gpus"), ('{"gpus": 1.5}', "payload.gpus"),
    ('{"gpus": 100000}', "payload.gpus"), ('{"gpus": true}', "payload.gpus"), ('{"command": "ls"}', "payload.command"),
    ('{"command": []}', "payload.command"), ('{"command": [1]}', "payload.command"), ('[]', "payload")])
def test_a_payload_no_executor_could_run_is_refused_at_enqueue_naming_the_field(cp, payload, field):
    server, client = cp
    r = requests.post(server.url + "/v1/queue/items", data=f'{{"idempotencyKey": "k", "payload": {payload}}}', timeout=5,
                      headers={"Authorization": "Bearer " + ADMIN.reveal(), "Content-Type": "application/json"})
    assert r.status_code == 422 and f"'{field}" in r.json()["error"].replace("', '", "."), r.text
    assert client.list_items(ADMIN) == []  # nothing queued


def test_a_valid_payload_is_kept_exactly_as_given(cp):
    _server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    payload = {"gpus": 2, "command": ["sh", "-c", "true"], "note": {"team": "a", "n": [1, 2.5, None]}}
    client.enqueue(ADMIN, "k", payload)
    client.enqueue(ADMIN, "defaults", {})
    assert client.lease(cred, 30).payload == payload
    assert client.lease(cred, 30).payload == {}


def test_each_kind_of_failure_is_its_own_type_and_only_the_unanswered_are_recoverable():
    from gpu_agent.foundations.control_plane_client import (
        Fenced,
        ProtocolError,
        Rejected,
        Unauthorized,
        Unavailable,
    )
    kinds = {cls: (cls.kind, cls.recoverable) for cls in (Unavailable, ProtocolError, Unauthorized, Fenced, Rejected)}
    assert kinds == {Unavailable: ("unavailable", True), ProtocolError: ("protocol", True),
                     Unauthorized: ("unauthorized", False), Fenced: ("fenced", False), Rejected: ("rejected", False)}
    assert all(issubclass(cls, ControlPlaneError) for cls in kinds)
    assert Rejected("GET /v1/queue/items/9: 404 no item 9", 404).status == 404


def test_a_release_and_a_state_are_answered_as_enums_and_a_value_outside_them_is_a_protocol_error(cp):
    from gpu_agent.foundations.control_plane_client import ItemState, ProtocolError, Released

    _, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    client.enqueue(ADMIN, "a", {})
    item = client.lease(cred, 30)
    assert client.item_state(cred, item.item_id) is ItemState.LEASED
    assert client.release(cred, item) is Released.RELEASED

    class OneAnswer(requests.Session):
        """A control plane that answers a state it does not have."""

        def request(self, method, url, **kwargs):
            answer = requests.Response()
            answer.status_code, answer._content = 200, b'{"id": 1, "state": "lost"}'
            return answer
    with pytest.raises(ProtocolError, match="field 'state' is not one of queued, leased, done, failed"):
        ControlPlaneClient("http://cp.invalid", session=OneAnswer()).item_state(cred, 1)


# ---- several items per lease call (issue 25) -----------------------------------------------------
def test_one_lease_call_takes_up_to_max_items_each_under_its_own_lease_and_an_old_body_gets_one(cp):
    server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    for k in "abcde":
        client.enqueue(ADMIN, k, {})
    fence = client.start_term(cred, "agent")
    batch = client.lease_many(cred, 30, 0, fence, 3)
    assert [i.idempotency_key for i in batch] == ["a", "b", "c"] and len({i.lease_id for i in batch}) == 3
    # A body without maxItems (a client of before it) gets the one item, with no `more` in the answer.
    r = requests.post(server.url + "/v1/queue/lease", json={"leaseSeconds": 30, "holder": "agent", "term": fence.term},
                      timeout=5, headers={"Authorization": "Bearer " + cred.reveal()})
    assert r.status_code == 200 and r.json()["idempotencyKey"] == "d" and "more" not in r.json(), r.text
    assert [i.idempotency_key for i in client.lease_many(cred, 30, 0, fence, 64)] == ["e"]  # what there is
    client.enqueue(ADMIN, "f", {})
    r = requests.post(server.url + "/v1/queue/lease", data=f'{{"maxItems": 2.0, "term": {fence.term}}}', timeout=5,
                      headers={"Authorization": "Bearer " + cred.reveal(), "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["idempotencyKey"] == "f", r.text  # JSON Schema's integer includes 2.0
    assert client.lease_many(cred, 30, 0, fence, 4) == []
    client.ack(cred, batch[1])  # each lease is its own: one acked, the others still leased
    assert client.status(ADMIN)["items"] == {"queued": 0, "leased": 5, "done": 1, "failed": 0}
    assert [d["itemId"] for d in client.deliveries(ADMIN)] == [1, 2, 3, 4, 5, 6]  # one delivery logged per item


@pytest.mark.parametrize("value", ["0", "65", '"2"', "1.5", "true"])
def test_max_items_out_of_range_is_refused_naming_the_field(cp, value):
    server, client = cp
    cred = client.register(REG, "c1", 1, INV).credential.token
    r = requests.post(server.url + "/v1/queue/lease", data=f'{{"maxItems": {value}}}', timeout=5,
                      headers={"Authorization": "Bearer " + cred.reveal(), "Content-Type": "application/json"})
    assert r.status_code == 422 and "'maxItems'" in r.json()["error"], r.text


def test_the_lease_query_reads_only_the_items_still_to_run(tmp_path, clock):
    """Done items pile up; the lease query must go by the partial index of queued and leased items, not scan them."""
    store = Store(tmp_path / "cp.sqlite", clock)
    from gpu_agent.roles.control_plane.store import LEASE_QUERY

    plan = store._db.execute("EXPLAIN QUERY PLAN " + LEASE_QUERY, (0, 0, 1)).fetchall()
    assert any("items_open" in row[-1] for row in plan), plan
    store.close()


def test_a_hung_call_holds_past_the_client_timeout_and_is_answered_once_the_faults_are_cleared(cp_faults):
    """A hang is not a delay: it ends when DELETE /admin/faults clears it, not after a time, and /healthz and the
    admin calls are answered meanwhile (the hung calls cannot take every worker)."""
    from gpu_agent.roles.control_plane import api
    server, client = cp_faults
    impatient = ControlPlaneClient(server.url, timeout=0.3)
    client.set_fault(ADMIN, mode="hang", count=api.MAX_HUNG_CALLS + 1, path="/v1/register")
    started = time.monotonic()
    for _ in range(api.MAX_HUNG_CALLS):
        with pytest.raises(ControlPlaneError, match="timed out"):
            impatient.register(REG, "c1", 1, INV)
    with pytest.raises(ControlPlaneError) as dropped:  # one more than may hang: dropped at once, not hung
        impatient.register(REG, "c1", 1, INV)
    assert dropped.value.kind == "unavailable" and "timed out" not in str(dropped.value)
    assert requests.get(server.url + "/healthz", timeout=2).status_code == 200  # a worker is still free
    assert _admin("DELETE", server, "/admin/faults").status_code == 200  # releases the hung ones
    late = []
    patient = threading.Thread(target=lambda: late.append(ControlPlaneClient(server.url, timeout=30).register(
        REG, "c1", 1, INV)), daemon=True)
    client.set_fault(ADMIN, mode="hang", count=1, path="/v1/register")
    patient.start()
    patient.join(1.0)
    assert patient.is_alive() and not late  # held well past the impatient client's timeout
    assert _admin("DELETE", server, "/admin/faults").status_code == 200
    patient.join(10)
    assert late and late[0].credential  # answered late, in full
    assert time.monotonic() - started < 20
    client.register(REG, "c1", 1, INV)  # cleared: nothing hangs any more
