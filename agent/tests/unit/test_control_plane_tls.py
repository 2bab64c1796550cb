"""The control plane's clients over TLS (issue 48): each call verified against an explicit CA file (controlPlaneCaFile)
or the default trusted CAs, a certificate not verified told as such (naming the setting, never a token), the CA
file read again at each new connection; and the one rule all the clients start by (check_transport): plain HTTP
only to a loopback host, or where controlPlaneAllowInsecure says so, with a warning. Against an HTTPS server of the
test's own (tests/tls_server.py) with throwaway CAs."""

from __future__ import annotations

import json

import pytest
import trustme

from gpu_agent import cli
from gpu_agent.foundations.config import ConfigError
from gpu_agent.foundations.control_plane_client import (
    ControlPlaneClient,
    TlsFailed,
    Unavailable,
    check_transport,
)
from gpu_agent.foundations.secrets import Secret
from tests.loopback_kubeconfig import LoopbackApiServer, QuietHandler
from tests.tls_server import TlsServer, write_ca

TOKEN = "tls-test-token-6c1f0e2d9b"


class ControlPlane:
    """What these tests ask of a control plane: its /healthz, the queue's list and counts, an enqueue. The list
    names the last item enqueued, done."""

    def __init__(self) -> None:
        self.enqueued: list[dict] = []

    def __call__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, object]:
        if method == "POST":
            self.enqueued.append(json.loads(body))
            return 201, {"id": 7, "created": True}
        if path == "/healthz":
            return 200, {"status": "ok"}
        if path == "/v1/status":
            return 200, {"items": {"queued": 0, "done": 1}}
        key = self.enqueued[-1]["idempotencyKey"] if self.enqueued else "a"
        return 200, {"items": [{"id": 7, "idempotencyKey": key, "state": "done", "deliveries": 1, "createdAt": 1.0}]}


@pytest.fixture(autouse=True)
def default_trust_is_requests_own(monkeypatch):
    """The default trusted CAs the same on every machine: requests' certifi bundle, not one a CI runner names."""
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def other_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server(ca):
    s = TlsServer(ca, ControlPlane())
    yield s
    s.close()


# --- the client ---------------------------------------------------------------------------------------------------

def test_a_call_verified_against_the_ca_file_is_answered_and_carries_its_token(server, ca, tmp_path):
    client = ControlPlaneClient(server.url, timeout=5, ca_file=write_ca(ca, tmp_path / "ca.pem"))
    assert client.status(Secret(TOKEN)) == {"items": {"queued": 0, "done": 1}}
    [(method, path, headers)] = server.requests
    assert (method, path, headers["Authorization"]) == ("GET", "/v1/status", f"Bearer {TOKEN}")


def test_a_certificate_not_verified_fails_naming_the_ca_setting_never_the_token_and_is_retried(server, other_ca, tmp_path):
    for client, trusted in ((ControlPlaneClient(server.url, timeout=5), "the default trusted CAs"),
                            (ControlPlaneClient(server.url, timeout=5, ca_file=write_ca(other_ca, tmp_path / "ca.pem")),
                             f"controlPlaneCaFile {tmp_path / 'ca.pem'}")):
        with pytest.raises(TlsFailed) as e:
            client.status(Secret(TOKEN))
        message = str(e.value)
        assert message.startswith(f"GET /v1/status: TLS: the control plane's certificate is not verified against "
                                  f"{trusted} (unable to get local issuer certificate); "), message
        assert "controlPlaneCaFile to the PEM bundle" in message or "point controlPlaneCaFile at" in message
        assert TOKEN not in message
        # Unavailable's kind of failure, retried with backoff; its own reason in the failure metrics
        assert isinstance(e.value, Unavailable) and e.value.recoverable and e.value.kind == "tls"
    assert server.requests == []  # refused at the handshake: no request (and no token) was sent


def test_requests_ca_bundle_in_the_environment_does_not_override_the_ca_file(server, ca, other_ca, tmp_path,
                                                                                monkeypatch):
    """requests lets REQUESTS_CA_BUNDLE replace verify=True and a session's verify, not a path given with the request:
    the CA file named is the one verified against, whatever the environment says."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", write_ca(other_ca, tmp_path / "other.pem"))
    client = ControlPlaneClient(server.url, timeout=5, ca_file=write_ca(ca, tmp_path / "ca.pem"))
    assert client.status(Secret(TOKEN))["items"]["done"] == 1
    # Without one, the default trusted CAs are requests' own, which that variable names.
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    assert ControlPlaneClient(server.url, timeout=5).status(Secret(TOKEN))["items"]["done"] == 1


def test_a_ca_file_replaced_in_place_is_verified_against_from_the_next_call_on(server, ca, other_ca, tmp_path):
    """A CA rotated as a mounted ConfigMap is (the file swapped whole): the same client, built once, verifies the
    next connection against the new file, first refusing the new certificate while the file still holds the old CA."""
    client = ControlPlaneClient(server.url, timeout=5, ca_file=write_ca(ca, tmp_path / "ca.pem"))
    assert client.status(Secret(TOKEN))
    server.use(other_ca)  # the control plane restarted with a certificate of the new CA
    with pytest.raises(TlsFailed, match="not verified against controlPlaneCaFile"):
        client.status(Secret(TOKEN))
    write_ca(other_ca, tmp_path / "ca.pem")
    assert client.status(Secret(TOKEN))["items"]["done"] == 1


def test_a_ca_file_gone_after_the_start_fails_the_call_naming_it_and_its_return_recovers(server, ca, tmp_path):
    path = write_ca(ca, tmp_path / "ca.pem")
    client = ControlPlaneClient(server.url, timeout=5, ca_file=path)
    (tmp_path / "ca.pem").unlink()
    with pytest.raises(TlsFailed) as e:
        client.status(Secret(TOKEN))
    assert str(e.value) == (f"GET /v1/status: controlPlaneCaFile {path} is not there; point controlPlaneCaFile at "
                            "the PEM bundle of the CA that signed the control plane's certificate")
    write_ca(ca, tmp_path / "ca.pem")
    assert client.status(Secret(TOKEN))


# --- the rule every client starts by ------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:8700", "http://127.8.9.10:1", "http://[::1]:8700",
                                 "http://localhost:8700", "http://LocalHost", "https://10.0.0.1:8700",
                                 "https://cp.example.com"])
def test_https_and_plain_http_to_a_loopback_host_are_accepted_without_a_word(url):
    assert check_transport(url) == ""


@pytest.mark.parametrize("url,shown", [
    ("http://10.0.0.1:8700", "http://10.0.0.1:8700"),
    ("http://gpu-agent-control-plane.ns.svc:8700", "http://gpu-agent-control-plane.ns.svc:8700"),
    ("http://localhost.example.com", "http://localhost.example.com"),  # a name that merely starts like it
    ("http://127.0.0.1.nip.io:80", "http://127.0.0.1.nip.io:80"),
    ("http://admin:pa55word@10.0.0.1:8700/", "http://10.0.0.1:8700"),  # a password in the URL is not repeated
])
def test_plain_http_beyond_loopback_is_refused_naming_the_url_setting_and_the_fix_unless_allowed(url, shown):
    with pytest.raises(ConfigError) as e:
        check_transport(url)
    assert str(e.value) == (
        f"controlPlaneUrl {shown} is plain HTTP to a host beyond this machine: the registration token and credentials "
        "would cross the network in clear; use its https:// URL (with controlPlaneCaFile naming the CA that signed "
        "its certificate), or set controlPlaneAllowInsecure=true (--control-plane-allow-insecure=true) to accept that")
    assert check_transport(url, allow_insecure=True) == (
        f"controlPlaneUrl {shown} is plain HTTP to a host beyond this machine and controlPlaneAllowInsecure is true: "
        "the registration token and credentials cross the network in clear")


def test_a_ca_file_that_is_no_ca_bundle_is_refused_at_the_start_naming_the_setting(ca, tmp_path):
    (tmp_path / "notes.txt").write_text("not a certificate")
    for path, reason in ((tmp_path / "absent.pem", "No such file or directory"),
                         (tmp_path / "notes.txt", "NO_CERTIFICATE_OR_CRL_FOUND")):
        with pytest.raises(ConfigError) as e:
            check_transport("https://cp.example.com", str(path))
        assert str(e.value) == (f"controlPlaneCaFile {path} cannot be used as a CA bundle ({reason}); point it at the "
                                "PEM file of the CA that signed the control plane's certificate")
    assert check_transport("https://cp.example.com", write_ca(ca, tmp_path / "ca.pem")) == ""


# --- the commands ---------------------------------------------------------------------------------------------------

def no_gpus(tmp_path) -> list[str]:
    """Flags under which a cluster agent that did start would leave at once by itself (exit 3: no GPUs at start)."""
    from gpu_agent.foundations import fake_state
    from gpu_agent.foundations.gpus import Inventory

    fake_state.write_atomic(tmp_path / "gpus.json", fake_state.render(Inventory(), node="n"))
    return ["--fake-gpu-state-file", str(tmp_path / "gpus.json"), "--listen-address", "127.0.0.1:0",
            "--executor-journal", str(tmp_path / "journal.sqlite")]


def test_the_cluster_agent_refuses_plain_http_beyond_loopback_before_it_starts(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("GPU_AGENT_CONTROL_PLANE_TOKEN", TOKEN)
    assert cli.main(["cluster-agent", *no_gpus(tmp_path), "--control-plane-url", "http://10.0.0.1:8700"]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines()[-1].startswith(
        "gpu-agent cluster-agent: error: controlPlaneUrl http://10.0.0.1:8700 is plain HTTP to a host beyond this "
        "machine"), err
    assert "controlPlaneAllowInsecure=true" in err and TOKEN not in err


def test_queue_list_verifies_the_control_plane_with_its_ca_file_flag(server, ca, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("GPU_AGENT_ADMIN_TOKEN", TOKEN)
    argv = ["queue", "list", "--control-plane-url", server.url]
    assert cli.main([*argv, "--control-plane-ca-file", write_ca(ca, tmp_path / "ca.pem")]) == 0
    assert capfd.readouterr().out.splitlines()[-1] == "counts: queued 0, done 1"
    assert [(m, p, h["Authorization"]) for m, p, h in server.requests] == [
        ("GET", "/v1/queue/items", f"Bearer {TOKEN}"), ("GET", "/v1/status", f"Bearer {TOKEN}")]
    assert cli.main(argv) == 1  # the default trusted CAs do not know the test's CA
    err = capfd.readouterr().err
    assert "TLS: the control plane's certificate is not verified against the default trusted CAs" in err
    assert "set controlPlaneCaFile to the PEM bundle" in err


def test_queue_refuses_plain_http_beyond_loopback_and_with_consent_warns_at_verbosity_0(tmp_path, capfd, monkeypatch):
    made: list[tuple[str, str]] = []

    class Recording(ControlPlaneClient):
        def __init__(self, url: str, timeout: float = 10.0, ca_file: str = "") -> None:
            made.append((url, ca_file))
            super().__init__(url, timeout, ca_file=ca_file)

        def list_items(self, admin_token):
            return []

        def status(self, token):
            return {"items": {}}

    monkeypatch.setattr(cli, "ControlPlaneClient", Recording)
    monkeypatch.setenv("GPU_AGENT_ADMIN_TOKEN", TOKEN)
    argv = ["queue", "list", "--control-plane-url", "http://10.0.0.1:8700"]
    assert cli.main(argv) == 2
    assert "gpu-agent queue: error: controlPlaneUrl http://10.0.0.1:8700 is plain HTTP" in capfd.readouterr().err
    assert made == []
    assert cli.main([*argv, "--control-plane-allow-insecure", "true", "-v", "0"]) == 0
    [warning] = capfd.readouterr().err.strip().splitlines()
    assert warning.startswith("W") and warning.endswith(
        "controlPlaneUrl http://10.0.0.1:8700 is plain HTTP to a host beyond this machine and controlPlaneAllowInsecure"
        " is true: the registration token and credentials cross the network in clear")
    assert made == [("http://10.0.0.1:8700", "")]


class Agent:
    """A Ready cluster agent's /livez and /healthz, on loopback HTTP (what chart-test asks beside the control plane)."""

    def __init__(self) -> None:
        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                ready = {"status": "ready", "components": {"gpus": {"ready": True, "reason": "2 GPUs available"}}}
                self.send_json(json.dumps(ready if self.path == "/healthz" else {"status": "live"}).encode())

        self.server = LoopbackApiServer()
        self.server.serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.httpd.server_address[1]}"


@pytest.fixture
def agent():
    a = Agent()
    yield a
    a.server.close()


def test_chart_test_verifies_the_control_planes_healthz_and_the_work_items_calls_with_its_ca_file(
        server, ca, agent, tmp_path, capfd):
    token = tmp_path / "adminToken"
    token.write_text(TOKEN)
    argv = ["chart-test", "--namespace=ns", "--fullname=t-gpu-agent", f"--control-plane-url={server.url}",
            f"--cluster-agent-url={agent.url}", f"--admin-token-file={token}", "--timeout=20", "--request-timeout=2"]
    assert cli.main([*argv, f"--control-plane-ca-file={write_ca(ca, tmp_path / 'ca.pem')}"]) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[0] == f"ok   control plane: {server.url}/healthz answered 200"
    assert out[-2].startswith("ok   work item: ") and out[-1] == "chart-test: all 4 checks passed"
    assert [(m, p) for m, p, _ in server.requests] == [("GET", "/healthz"), ("POST", "/v1/queue/items"),
                                                       ("GET", "/v1/queue/items")]

    assert cli.main(argv) == 1  # without it: the default trusted CAs, which do not know the test's CA
    out = capfd.readouterr().out.splitlines()
    assert out[0] == (f"FAIL control plane: {server.url}/healthz: TLS: the control plane's certificate is not verified "
                      "against the default trusted CAs (unable to get local issuer certificate); fix: set "
                      "controlPlaneCaFile to the PEM bundle of the CA that signed it (--control-plane-ca-file)")
    [work] = [line for line in out if "work item" in line and line.startswith("FAIL")]
    assert "POST /v1/queue/items: TLS: the control plane's certificate is not verified" in work
    assert "controlPlaneCaFile" in work and TOKEN not in "\n".join(out)


def test_chart_test_refuses_plain_http_beyond_loopback(capfd):
    assert cli.main(["chart-test", "--control-plane-url=http://10.0.0.1:8700"]) == 2
    assert capfd.readouterr().err.startswith(
        "gpu-agent chart-test: error: controlPlaneUrl http://10.0.0.1:8700 is plain HTTP to a host beyond this machine")
