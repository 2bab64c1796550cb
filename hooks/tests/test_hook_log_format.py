"""`gpu-agent-hook --log-format text|json` (issue 50, part 2): json writes every line as gpu-agent's --log-format json
does (the agent's own formatter, gpu_agent.foundations.klog: one object a line on stderr, the same keys and types),
text is the plain `gpu-agent-hook: ...` line as before; the agent's secret redactor scrubs both, and a bad value is
refused naming the flag and the accepted values. The real command, in a process of its own, against a loopback
control plane that echoes the registration token in its error (the hook reads it from --token-file, as a Secret) and
a Kubernetes API that is not there (each cleanup step fails and says so)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
from tests.loopback_kubeconfig import loopback_kubeconfig
from tests.unit.test_log_format import LINE_SCHEMA

from gpu_agent.foundations import klog

TOKEN = "hook-registration-token-7c21e9d04b"
PACKAGES = [str(Path(__file__).resolve().parents[2] / d) for d in ("agent", "hooks")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def control_plane():
    """A control plane that refuses the deregistration quoting the Authorization header's token in its error."""

    class Echo(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            token = self.headers.get("Authorization", "").removeprefix("Bearer ")
            body = json.dumps({"error": f"unknown token {token}"}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def hook(tmp_path: Path, url: str, before: tuple[str, ...] = (), after: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`gpu-agent-hook [before] cleanup ... [after]` in a process of its own; the Kubernetes API's port is closed."""
    (tmp_path / "registrationToken").write_text(TOKEN)
    argv = [*before, "--kubeconfig", loopback_kubeconfig(free_port(), tmp_path), "cleanup", "--namespace", "ns",
            "--release", "ga", "--cluster-id", "c1", "--control-plane-url", url, "--token-file",
            str(tmp_path / "registrationToken"), "--timeout", "20", *after]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*PACKAGES, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "gpu_agent_hooks", *argv], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.parametrize("where", ["before the hook", "after the hook"])
def test_json_every_line_is_the_agents_json_line_and_the_token_is_redacted(tmp_path, control_plane, where):
    flags = ("--log-format", "json")
    r = hook(tmp_path, control_plane, **{"before" if where == "before the hook" else "after": flags})
    assert r.returncode == 0, r.stderr[-2000:]  # best effort, as the cleanup always is
    assert r.stdout == ""  # every line is a log line, on stderr
    docs = [json.loads(line) for line in r.stderr.splitlines()]  # each line: not one plain line left
    for doc in docs:
        jsonschema.validate(doc, LINE_SCHEMA)
        assert list(doc) == list(klog.JSON_KEYS)
        assert doc["logger"] == "gpu_agent.gpu_agent_hooks" and doc["caller"].startswith("cli.py:")
    said = {doc["msg"].split(":")[0]: doc for doc in docs}
    assert sorted(said) == ["cleanup GPUDomain entries", "cleanup GPUDomain members", "cleanup deregister",
                            "cleanup work claim templates", "cleanup work pods"]
    deregister = said["cleanup deregister"]
    assert deregister["msg"] == ("cleanup deregister: failed: RuntimeError: POST /v1/deregister: 401 unknown token "
                                 "<redacted>")
    assert deregister["level"] == "warning" and said["cleanup GPUDomain members"]["level"] == "info"
    assert TOKEN not in r.stderr


def test_text_is_the_plain_line_as_before_and_redacted_alike(tmp_path, control_plane):
    for r in (hook(tmp_path, control_plane), hook(tmp_path, control_plane, before=("--log-format", "text"))):
        assert r.returncode == 0 and r.stderr == "", r.stderr
        lines = r.stdout.splitlines()
        assert all(line.startswith("gpu-agent-hook: cleanup ") for line in lines) and len(lines) == 5, lines
        assert ("gpu-agent-hook: cleanup deregister: failed: RuntimeError: POST /v1/deregister: 401 unknown token "
                "<redacted>") in lines
        assert TOKEN not in r.stdout


def test_a_refusal_is_one_json_error_line(monkeypatch, tmp_path, capsys):
    """The skew check's refusal, in the process under test (the Kubernetes API stood in for): an error line."""
    from gpu_agent_hooks import cli

    monkeypatch.setattr(cli, "_json_log", None)  # put back afterwards: the other tests call say() in text
    root = logging.getLogger(klog.ROOT)  # klog.setup's, put back as it was
    for name in ("handlers", "level", "propagate"):
        monkeypatch.setattr(root, name, list(root.handlers) if name == "handlers" else getattr(root, name))
    monkeypatch.setattr(cli, "api_client", lambda *args, **kwargs: None)

    def refuse(*args):
        raise cli.SkewError("a downgrade across a stored version is refused")

    monkeypatch.setattr(cli, "skew_check", refuse)
    assert cli.main(["skew-check", "--namespace", "ns", "--deployment", "d", "--to-version", "0.1.0", "--crds",
                     str(tmp_path), "--log-format", "json"]) == 1
    out, err = capsys.readouterr()
    (doc,) = [json.loads(line) for line in err.splitlines()]
    jsonschema.validate(doc, LINE_SCHEMA)
    assert (doc["level"], doc["msg"]) == ("error", "refused: a downgrade across a stored version is refused")
    assert out == ""


@pytest.mark.parametrize("argv", [["--log-format", "xml", "cleanup"], ["skew-check", "--log-format=JSON"]])
def test_a_bad_value_is_refused_naming_the_flag_and_the_accepted_values(argv):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*PACKAGES, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "gpu_agent_hooks", *argv], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert "error: argument --log-format: invalid choice:" in r.stderr and "(choose from 'text', 'json')" in r.stderr
    assert "Traceback" not in r.stderr
