"""Broken files and bad start-up settings, against the real processes (issue 13's defects).

A fake GPU state file that cannot be read means 0 GPUs (NotReady, queues paused), logged once
per change of the error, and `fake-gpu set` can always overwrite it. Every start-up failure is
one line naming the setting or resource, with exit code 2.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import wait_until

BAD_STATE_FILES = {
    "not UTF-8": b"\xff\xfe\x00garbage",
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "100,000 GPUs": None,  # built below: 100,000 well-formed entries (about 15 MB)
}


def hundred_thousand_gpus() -> bytes:
    entry = ('{"uuid": "GPU-%08x-0000-4000-8000-000000000000", "name": "NVIDIA H100", "memoryTotalBytes": 85520809984, '
             '"migMode": false}')
    return ('{"apiVersion": "fake-gpu.gpu-agent.io/v1", "kind": "FakeGPUState", "gpus": ['
            + ", ".join(entry % i for i in range(100_000)) + "]}").encode()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("name", BAD_STATE_FILES)
def test_an_unreadable_state_file_means_no_gpus_logged_once_and_fake_gpu_set_repairs_it(rig, name):
    rig.start_control_plane()
    rig.set_gpus(4)
    agent = rig.start_agent()
    rig.wait_health(200, 10)
    rss_ready = rss_mib(agent.pid)
    data = BAD_STATE_FILES[name] or hundred_thousand_gpus()
    tmp = rig.fake_file.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, rig.fake_file)
    rig.wait_health(503, 5)
    _code, health = rig.healthz()
    assert not health["components"]["gpus"]["ready"] and health["components"]["gpus"]["details"]["count"] == 0
    assert health["components"]["queues"]["reason"].startswith("paused")
    # Many polls later (0.1 s apart), one log line for the error, and no traceback.
    polls_before = len(agent.lines())
    wait_until(lambda: len(agent.grep("cannot be read")) >= 1, 5, "the error logged")
    time.sleep(2.0)  # 20 polls of the same broken file: none may log again
    assert len(agent.grep("cannot be read")) == 1, agent.grep("cannot be read")
    assert not agent.grep("Traceback")
    assert len(agent.lines()) - polls_before < 10
    assert rss_mib(agent.pid) - rss_ready < 10, "reading the bad file kept memory"
    # The documented fix works on whatever is there.
    for args in (["status"], ["set", "--count", "4"]):
        r = rig.fake_gpu(*args)
        assert "Traceback" not in r.stderr
    assert rig.fake_gpu("status").returncode == 0
    rig.wait_health(200, 10)


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpu_agent", *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def test_start_up_failures_are_one_line_naming_the_setting_with_exit_2(tmp_path):
    tokens = {"GPU_AGENT_REGISTRATION_TOKEN": "r" * 20, "GPU_AGENT_ADMIN_TOKEN": "a" * 20}
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    (tmp_path / "bad.yaml").write_bytes(b"\xff\xfe verbosity: 1")
    (tmp_path / "deep.yaml").write_bytes(b"[" * 50_000)
    cases = {
        "address in use": (["cluster-agent", "--listen-address", f"127.0.0.1:{port}"], {}, f"127.0.0.1:{port}"),
        "unbindable address": (["control-plane", "--listen-address", "192.0.2.1:8700", "--database",
                                str(tmp_path / "cp.sqlite")], tokens, "192.0.2.1:8700"),
        "unwritable database": (["control-plane", "--database", "/proc/nope/cp.sqlite"], tokens, "--database"),
        "unwritable journal": (["cluster-agent", "--executor-journal", "/proc/nope/j.sqlite",
                                "--listen-address", "127.0.0.1:0"], {}, "--executor-journal"),
        "unwritable state dir": (["local", "--state-dir", "/proc/nope", "--listen-address", "127.0.0.1:0"], {}, "--state-dir"),
        "non-UTF-8 config": (["cluster-agent", "--config", str(tmp_path / "bad.yaml")], {}, "not UTF-8"),
        "absurdly nested config": (["cluster-agent", "--config", str(tmp_path / "deep.yaml")], {}, "deep.yaml"),
        "verbosity out of range": (["local", "-v", "9"], {}, "set it with -v or GPU_AGENT_VERBOSITY"),
    }
    try:
        for name, (args, env, named) in cases.items():
            r = run_cli(*args, env=env, cwd=tmp_path)
            assert r.returncode == 2, (name, r.returncode, r.stderr[-500:])
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and "error:" in lines[0] and named in lines[0], (name, r.stderr[-500:])
            assert "Traceback" not in r.stderr
    finally:
        busy.close()


def test_state_dir_holds_every_file_it_promises(tmp_path):
    state = tmp_path / "elsewhere"
    proc = subprocess.Popen([sys.executable, "-m", "gpu_agent", "local", "--state-dir", str(state),
                             "--listen-address", "127.0.0.1:0", "--control-plane-listen", "127.0.0.1:0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        expected = {"registration-token", "admin-token", "control-plane.sqlite", "executions.sqlite", "fake-gpus.json"}
        wait_until(lambda: expected <= {p.name for p in state.glob("*")}, 20, f"{expected} in the state folder")
        assert not (tmp_path / ".run").exists(), "files went to .run despite --state-dir"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    assert f"--state-file {state / 'fake-gpus.json'}" in out  # the banner's commands work as printed


def fake_gpu(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fake_gpu", *args], capture_output=True, text=True, timeout=30, cwd=cwd)


@pytest.mark.parametrize("args,named", [
    (["set", "--count", "2", "--state-file", "/proc/nope/x.json"], "--state-file"),
    (["cycle", "--interval", "nan"], "--interval"),
    (["set", "--count", "1", "--max", "-1"], "--max"),
    (["cycle", "--to", "-1"], "--to"),
    (["cycle", "--from", "99"], "--from"),
])
def test_fake_gpu_refuses_bad_flags_naming_them(tmp_path, args, named):
    r = fake_gpu(*args, cwd=tmp_path)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_fake_gpu_error_suggests_a_command_its_parser_accepts(tmp_path):
    bad = tmp_path / "state.json"
    bad.write_bytes(b"\xff")
    r = fake_gpu("status", "--state-file", str(bad), cwd=tmp_path)
    assert r.returncode == 2
    suggested = r.stderr.split("`")[1]  # "... rewrite it with `fake-gpu set --count N --state-file PATH`"
    assert suggested.startswith("fake-gpu set")
    argv = suggested.split()[1:]
    argv[argv.index("N")] = "2"
    fixed = fake_gpu(*argv, cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert fake_gpu("status", "--state-file", str(bad), cwd=tmp_path).returncode == 0
