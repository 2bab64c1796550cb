"""The cleanup hook's deregistration over TLS (issue 48): --control-plane-ca-file reaches the client, which verifies
the control plane against it; a certificate not verified fails that step naming the setting; plain HTTP beyond
loopback is refused (that step only: the rest of the cleanup still runs) unless --control-plane-allow-insecure=true,
which is said. Against an HTTPS server of the test's own (agent/tests/tls_server.py)."""

import pytest
import trustme
from tests.tls_server import TlsServer, write_ca

from gpu_agent_hooks import cli

TOKEN = "hook-registration-token-4be1a7"


class NoObjects:
    """The Kubernetes API of a release with nothing left to clean: every list is empty."""

    def list_namespaced_pod(self, *args, **kwargs):
        return cli.client.V1PodList(items=[])

    def list_namespaced_custom_object(self, *args, **kwargs):
        return {"items": []}


@pytest.fixture
def hook(monkeypatch, tmp_path):
    """Runs `gpu-agent-hook cleanup` with the given flags against an empty release; its token file holds TOKEN. The
    default trusted CAs are requests' own (certifi's), not a bundle the machine's environment names."""
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    monkeypatch.setattr(cli, "api_client", lambda *args, **kwargs: None)
    monkeypatch.setattr(cli.client, "CoreV1Api", lambda api: NoObjects())
    monkeypatch.setattr(cli.client, "CustomObjectsApi", lambda api: NoObjects())
    (tmp_path / "registrationToken").write_text(TOKEN)

    def run(*flags: str) -> int:
        return cli.main(["cleanup", "--namespace", "ns", "--release", "ga", "--cluster-id", "c1", "--token-file",
                         str(tmp_path / "registrationToken"), "--timeout", "20", *flags])
    return run


@pytest.fixture
def server():
    ca = trustme.CA()
    s = TlsServer(ca, lambda method, path, headers, body: (200, {}))
    s.ca = ca
    yield s
    s.close()


def test_the_deregistration_is_verified_against_the_ca_file_flag(hook, server, tmp_path, capsys):
    assert hook("--control-plane-url", server.url, "--control-plane-ca-file", write_ca(server.ca, tmp_path / "ca.pem")) == 0
    out = capsys.readouterr().out
    assert "cleanup deregister: ok" in out, out
    [(method, path, headers)] = server.requests
    assert (method, path, headers["Authorization"]) == ("POST", "/v1/deregister", f"Bearer {TOKEN}")


def test_without_the_ca_file_the_deregistration_fails_naming_the_setting_and_the_rest_runs(hook, server, capsys):
    assert hook("--control-plane-url", server.url) == 0  # best effort, as every step of the cleanup
    out = capsys.readouterr().out
    assert ("cleanup deregister: failed: RuntimeError: POST /v1/deregister: TLS: the control plane's certificate is "
            "not verified against the default trusted CAs") in out, out
    assert "controlPlaneCaFile" in out and TOKEN not in out
    assert "cleanup work pods: ok" in out and server.requests == []


def test_plain_http_beyond_loopback_is_refused_unless_allowed_and_then_said(hook, monkeypatch, capsys):
    made = []

    class Recording:
        def __init__(self, url, timeout, ca_file=""):
            made.append((url, ca_file))

        def deregister(self, token, cluster_id):
            pass

    monkeypatch.setattr(cli, "ControlPlaneClient", Recording)
    assert hook("--control-plane-url", "http://10.0.0.1:8700") == 0
    out = capsys.readouterr().out
    assert ("gpu-agent-hook: cleanup deregister: refused: controlPlaneUrl http://10.0.0.1:8700 is plain HTTP to a host "
            "beyond this machine") in out, out
    assert "cleanup deregister:" not in out.replace("cleanup deregister: refused", "")  # the step did not run
    assert "cleanup work pods: ok" in out and made == []

    assert hook("--control-plane-url", "http://10.0.0.1:8700", "--control-plane-allow-insecure", "true") == 0
    out = capsys.readouterr().out
    assert ("gpu-agent-hook: warning: controlPlaneUrl http://10.0.0.1:8700 is plain HTTP to a host beyond this "
            "machine and controlPlaneAllowInsecure is true: the registration token and credentials cross the network "
            "in clear") in out
    assert "cleanup deregister: ok" in out and made == [("http://10.0.0.1:8700", "")]
