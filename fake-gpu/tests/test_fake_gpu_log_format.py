"""`fake-gpu --log-format text|json` (issue 50, part 2): json writes every log line (the daemon's, an error) as
gpu-agent's --log-format json does (the agent's own formatter, gpu_agent.foundations.klog: one object a line on
stderr, the same keys and types); text is each line as before; the agent's secret redactor scrubs both; a bad value
is refused naming the flag and the accepted values. The real command, in a process of its own where it can be."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from tests.loopback_kubeconfig import loopback_kubeconfig
from tests.unit.test_log_format import LINE_SCHEMA

from fake_gpu import cli
from gpu_agent.foundations import klog
from gpu_agent.foundations.secrets import REDACTOR

PACKAGES = [str(Path(__file__).resolve().parents[2] / d) for d in ("agent", "fake-gpu")]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([*PACKAGES, os.environ.get("PYTHONPATH", "")])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def json_lines(text: str) -> list[dict]:
    docs = [json.loads(line) for line in text.splitlines()]  # each line: not one plain line left
    for doc in docs:
        jsonschema.validate(doc, LINE_SCHEMA)
        assert list(doc) == list(klog.JSON_KEYS)
    return docs


def test_the_daemon_logs_json_from_its_first_line(tmp_path):
    """The DaemonSet's command against an API server that is not there: it says where it watches, then warns as it
    retries reading its Node, every line JSON; SIGTERM stops it as always."""
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    err = tmp_path / "stderr"
    env = {**ENV, "KUBECONFIG": loopback_kubeconfig(free_port(), tmp_path)}
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "fake_gpu", "--log-format", "json", "--state-file",
                                 str(tmp_path / "fake-gpus.json"), "daemon", "--node-name", "n1", "--plugin-dir",
                                 str(plugin_dir)], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        try:
            deadline = time.monotonic() + 30
            while "real_gpu_guard" not in err.read_text() and proc.poll() is None:
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == ""
    docs = json_lines(err.read_text())
    assert (docs[0]["level"], docs[0]["logger"]) == ("info", "gpu_agent.fake_gpu.daemon")
    assert docs[0]["msg"] == "fake-gpu daemon for node n1: layout ConfigMap gpu-agent/gpu-agent-fake-gpu-layout"
    guard = [d for d in docs if d["logger"] == "gpu_agent.fake_gpu.real_gpu_guard"]
    assert guard and guard[0]["level"] == "warning" and guard[0]["msg"].startswith("reading the Node for node n1 failed")


@pytest.mark.parametrize("where", ["before the command", "after the command"])
def test_an_error_is_one_json_line_and_the_output_stays_as_it_was(tmp_path, where):
    state = tmp_path / "absent.json"
    flags = ["--log-format", "json"]
    argv = [*flags, "status", "--state-file", str(state)] if where == "before the command" else \
        ["status", "--state-file", str(state), *flags]
    r = subprocess.run([sys.executable, "-m", "fake_gpu", *argv], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 2 and r.stdout == ""
    (doc,) = json_lines(r.stderr)
    assert (doc["level"], doc["logger"]) == ("error", "gpu_agent.fake_gpu.cli")
    assert doc["msg"].startswith(f"fake GPU state file {state} does not exist")
    # A command's output is not a log line: status's JSON on stdout, as in text.
    assert subprocess.run([sys.executable, "-m", "fake_gpu", "--state-file", str(state), "set", "--count", "1"],
                          capture_output=True, timeout=60, env=ENV).returncode == 0
    r = subprocess.run([sys.executable, "-m", "fake_gpu", *argv], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 0 and r.stderr == "" and json.loads(r.stdout)["count"] == 1


@pytest.fixture
def logging_put_back(monkeypatch):
    """klog.setup's changes to the gpu_agent loggers, undone after the test."""
    root = logging.getLogger(klog.ROOT)
    for name in ("handlers", "level", "propagate"):
        monkeypatch.setattr(root, name, list(root.handlers) if name == "handlers" else getattr(root, name))


@pytest.mark.parametrize("log_format", klog.FORMATS)
def test_a_secret_in_a_logged_line_is_redacted_in_both_formats(tmp_path, capsys, logging_put_back, log_format):
    """A secret the process holds (registered with the agent's redactor, as every Secret is) in an error line."""
    secret = "fake-gpu-secret-0a9b8c7d6e5f"
    REDACTOR.register(secret)
    state = tmp_path / secret / "fake-gpus.json"
    assert cli.main(["--log-format", log_format, "--state-file", str(state), "status"]) == 2
    out, err = capsys.readouterr()
    assert secret not in err and out == ""
    if log_format == "json":
        (doc,) = json_lines(err)
        assert doc["msg"].startswith(f"fake GPU state file {tmp_path}/<redacted>/fake-gpus.json does not exist")
    else:
        assert err.startswith(f"fake-gpu: error: fake GPU state file {tmp_path}/<redacted>/fake-gpus.json does not exist")


@pytest.mark.parametrize("argv", [["--log-format", "xml", "status"], ["daemon", "--node-name", "n1", "--log-format=JSON"]])
def test_a_bad_value_is_refused_naming_the_flag_and_the_accepted_values(argv):
    r = subprocess.run([sys.executable, "-m", "fake_gpu", *argv], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 2 and r.stdout == ""
    assert "error: argument --log-format: invalid choice:" in r.stderr and "(choose from 'text', 'json')" in r.stderr
    assert "Traceback" not in r.stderr
