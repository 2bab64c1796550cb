"""The exit codes `gpu-agent --help` and docs/cli.md document (cli.EXIT_CODES) are the ones the command exits with:
the table is printed by every command's --help and written in docs/cli.md, and each code is made by a real process.
Code 3 (no GPUs at start, gracefulNoGPU off) is made by test_config's
test_the_process_exits_3_when_it_starts_with_no_gpus_and_graceful_no_gpu_off_its_last_line_saying_why."""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_agent import cli

REPO = Path(__file__).resolve().parents[3]


def gpu_agent(*argv, cwd, env=None, **kw):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
    return subprocess.Popen([sys.executable, "-m", "gpu_agent", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env={**environ, **(env or {})}, **kw)


def run(*argv, cwd, env=None, timeout=60):
    p = gpu_agent(*argv, cwd=cwd, env=env)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def flat(text):
    return " ".join(text.split())


def test_every_documented_code_is_in_the_top_level_help_and_the_cli_doc():
    text = flat(cli.build_parser().format_help())
    assert "Exit codes:" in text
    for code, meaning in cli.EXIT_CODES.items():
        assert f" {code} {flat(meaning)}" in text, code
    doc = (REPO / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", doc, re.M))
    assert {int(code): meaning for code, meaning in rows.items()} == cli.EXIT_CODES


def _parsers(parser, path=()):
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_each_commands_help_lists_the_codes_it_can_exit_with():
    parsers = dict(_parsers(cli.build_parser()))
    assert set(parsers) - {""} == set(cli.COMMAND_EXIT_CODES)
    for path, codes in cli.COMMAND_EXIT_CODES.items():
        assert 0 in codes and 2 in codes and set(codes) <= set(cli.EXIT_CODES), path
        table = flat(parsers[path].format_help().split("Exit codes:")[1])
        for code in cli.EXIT_CODES:
            assert (f" {code} {flat(cli.EXIT_CODES[code])}" in f" {table}") == (code in codes), (path, code)


def test_0_for_version_help_and_a_serving_role_stopped_by_sigterm(tmp_path):
    assert run("version", cwd=tmp_path)[0] == 0
    assert run("queue", "list", "--help", cwd=tmp_path)[0] == 0
    p = gpu_agent("control-plane", "--listen-address", "127.0.0.1:0", "--database", str(tmp_path / "cp.sqlite"),
                  cwd=tmp_path, env={"GPU_AGENT_REGISTRATION_TOKEN": "registration-token-0123456789",
                                     "GPU_AGENT_ADMIN_TOKEN": "admin-token-0123456789"})
    try:
        deadline = time.monotonic() + 30
        line = ""
        while "serving HTTP on" not in line:
            assert time.monotonic() < deadline and p.poll() is None, "the control plane never said it listens"
            line = p.stderr.readline()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0, p.stderr.read()
    finally:
        p.kill()
        p.communicate()


def test_1_when_the_control_plane_cannot_be_reached(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the command runs: connection refused
    code, out, err = run("queue", "list", "--control-plane-url", f"http://127.0.0.1:{port}", cwd=tmp_path,
                         env={"GPU_AGENT_ADMIN_TOKEN": "admin-token-0123456789"})
    assert code == 1 and out == "", err
    assert err.startswith("gpu-agent queue list: error: ") and "admin-token-0123456789" not in err


@pytest.mark.parametrize("argv,says", [
    (["no-such-command"], "invalid choice: 'no-such-command'"),
    (["queue", "list", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["queue", "list", "-o", "xml"], "invalid choice: 'xml' (choose from 'json', 'yaml', 'wide')"),
    (["completion", "fish"], "invalid choice: 'fish'"),
    (["queue", "list"], "adminTokenFile: .run/admin-token cannot be read (No such file or directory)"),
    (["queue", "list", "--admin-token-file", ""], "no admin token: set GPU_AGENT_ADMIN_TOKEN or --admin-token-file"),
    (["inventory", "--gpu-source", "magic"], "gpuSource"),
])
def test_2_for_a_usage_error_or_a_bad_setting_naming_it(tmp_path, argv, says):
    code, out, err = run(*argv, cwd=tmp_path)
    assert code == 2 and out == "", err
    assert says in err


def test_2_when_the_listen_address_is_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        code, _, err = run("control-plane", "--listen-address", address, "--database", str(tmp_path / "cp.sqlite"),
                           cwd=tmp_path, env={"GPU_AGENT_REGISTRATION_TOKEN": "registration-token-0123456789",
                                              "GPU_AGENT_ADMIN_TOKEN": "admin-token-0123456789"})
    assert code == 2, err
    assert err.startswith("gpu-agent control-plane: error: ") and address in err


# The command as a terminal starts it: SIGINT neither blocked nor ignored. A child inherits both from whoever starts
# it, and the unit stage's runs saw it ignore SIGINT (2 of 2 CI runs under 2 xdist workers, never alone): some
# library an earlier test in that worker loaded left SIGINT blocked or ignored in the thread that starts the child.
UNBLOCKED = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
             "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def interruptible_gpu_agent(*argv, cwd, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
    return subprocess.Popen([sys.executable, "-c", UNBLOCKED, "-m", "gpu_agent", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env={**environ, **(env or {})})


def signal_mask(pid):
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as e:
        return str(e)
    return " ".join(ln.replace("\t", "") for ln in lines if ln.startswith(("SigBlk", "SigIgn", "SigCgt")))


def test_130_when_a_one_shot_command_is_interrupted(tmp_path):
    """Ctrl-C while `queue list` waits on a control plane that takes its request and never answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(30)
        p = interruptible_gpu_agent("queue", "list", "--control-plane-url", f"http://127.0.0.1:{silent.getsockname()[1]}",
                                    cwd=tmp_path, env={"GPU_AGENT_ADMIN_TOKEN": "admin-token-0123456789"})
        try:
            conn, _ = silent.accept()
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:  # the whole request is in: the command waits for the answer
                    request += conn.recv(4096)
                mask = signal_mask(p.pid)
                p.send_signal(signal.SIGINT)
                assert p.wait(timeout=30) == 130, f"{p.stderr.read()}\nthe command's signal state: {mask}"
        finally:
            p.kill()
            p.communicate()
