"""Real processes on loopback: the control plane, the cluster agent and the fake-gpu command.

Every process logs to a file under the test's folder; `LOGS` keeps every path so that a
session-wide check can grep them all for secrets. Waiting is always a poll to a deadline.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from gpu_agent.foundations.control_plane_client import ControlPlaneClient
from gpu_agent.foundations.secrets import Secret

# `python -c` this, then gpu_agent's arguments: gpu_agent with Python's temporary folder gone. tempfile falls back
# from $TMPDIR to /tmp, /var/tmp and the working folder, all writable here, so the folder is set past that search;
# the process refuses to start if a temporary file can still be made.
NO_TEMP_DIR = """
import runpy, tempfile
tempfile.tempdir = "/nonexistent/no-temp-dir"
try:
    tempfile.TemporaryFile().close()
except OSError:
    pass
else:
    raise SystemExit("a temporary file could still be made")
runpy.run_module("gpu_agent", run_name="__main__", alter_sys=True)
"""

LOGS: list[Path] = []
SECRETS: list[str] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


KLOG_TIME = re.compile(r"^[IWEF](\d{4} \d{2}:\d{2}:\d{2}\.\d{6})")


def klog_time(line: str) -> float:
    m = KLOG_TIME.match(line)
    assert m, line
    ts = datetime.strptime(f"{datetime.now().year}{m.group(1)}", "%Y%m%d %H:%M:%S.%f")
    return ts.timestamp()


class Process:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        LOGS.append(log)
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._file = open(log, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._file, stderr=subprocess.STDOUT, env=self._env, cwd=cwd)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def grep(self, pattern: str) -> list[str]:
        rx = re.compile(pattern)
        return [line for line in self.lines() if rx.search(line)]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.alive():
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
        finally:
            self._file.close()


class Rig:
    """One control plane, one agent, one fake GPU state file, all under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fake_file = root / "fake-gpus.json"
        self.registration_token = Secret(f"reg-{os.urandom(12).hex()}")
        self.admin_token = Secret(f"adm-{os.urandom(12).hex()}")
        SECRETS.extend([self.registration_token.reveal(), self.admin_token.reveal()])
        (root / "registration-token").write_text(self.registration_token.reveal())
        (root / "admin-token").write_text(self.admin_token.reveal())
        self.cp: Process | None = None
        self.agent: Process | None = None
        self.agents: list[Process] = []  # every agent started, so stop() leaves none running (a test may start two)
        self.cp_url = ""
        self.agent_url = ""
        self._agent_port = free_port()
        self._cp_port = free_port()
        self._starts = 0

    # processes -------------------------------------------------------------------------------
    def start_control_plane(self, *flags: str, faults: bool = False, no_temp_dir: bool = False,
                            token_folder: Path | None = None) -> ControlPlaneClient:
        """`faults`: with fault injection on (a test that arms faults through /admin/faults). `no_temp_dir`: the
        process cannot make a temporary file, as in the chart's pod (read-only root filesystem, no /tmp volume).
        `token_folder`: where it reads registrationToken and adminToken (default: the rig's own two files)."""
        reg_file, admin_file = ((token_folder / "registrationToken", token_folder / "adminToken") if token_folder
                                else (self.root / "registration-token", self.root / "admin-token"))
        if faults:
            flags = ("--fault-injection=true", *flags)
        self.cp_url = f"http://127.0.0.1:{self._cp_port}"
        start = [sys.executable, "-c", NO_TEMP_DIR] if no_temp_dir else [sys.executable, "-m", "gpu_agent"]
        self.cp = Process("control-plane", [*start, "control-plane", "-v", "2",
                                            "--listen-address", f"127.0.0.1:{self._cp_port}",
                                            "--database", str(self.root / "cp.sqlite"),
                                            "--registration-token-file", str(reg_file),
                                            "--admin-token-file", str(admin_file), *flags],
                          self.root / "control-plane.log")
        wait_until(lambda: self._get(self.cp_url + "/healthz") == 200, 15, "control plane /healthz")
        return ControlPlaneClient(self.cp_url, timeout=10)

    def start_agent(self, *flags: str, verbosity: int = 2, fast_polls: bool = True, graceful: bool = True,
                    token_file: Path | None = None) -> Process:
        """The cluster agent on this rig; `fast_polls` (tests) polls GPUs and the queue every 0.1 s
        instead of the defaults a benchmark must use. `graceful`: --graceful-no-gpu=true, since the rig's
        agents often start before their GPUs (the agent's default is to exit when it starts with none).
        `token_file`: the registration token it reads (default: the shared one)."""
        self._starts += 1
        self.agent_url = f"http://127.0.0.1:{self._agent_port}"
        self.agent = Process("cluster-agent", [sys.executable, "-m", "gpu_agent", "cluster-agent", "-v", str(verbosity),
                                               "--listen-address", f"127.0.0.1:{self._agent_port}",
                                               "--control-plane-url", self.cp_url,
                                               "--control-plane-token-file",
                                               str(token_file or self.root / "registration-token"),
                                               "--fake-gpu-state-file", str(self.fake_file),
                                               "--executor-journal", str(self.root / "executions.sqlite"),
                                               *(["--gpu-poll-interval", "0.1", "--queue-poll-interval", "0.1"]
                                                 if fast_polls else []),
                                               *(["--graceful-no-gpu", "true"] if graceful else []), *flags],
                             self.root / f"agent-{self._starts}.log")
        self.agents.append(self.agent)
        wait_until(lambda: self._get(self.agent_url + "/livez") == 200, 15, "agent /livez")
        return self.agent

    def stop(self) -> None:
        for p in (*reversed(self.agents), self.cp):
            if p is not None:
                p.stop()

    # probes ----------------------------------------------------------------------------------
    @staticmethod
    def _get(url: str) -> int:
        try:
            return requests.get(url, timeout=2).status_code
        except requests.RequestException:
            return 0

    def livez(self) -> int:
        return self._get(self.agent_url + "/livez")

    def healthz(self) -> tuple[int, dict[str, Any]]:
        r = requests.get(self.agent_url + "/healthz", timeout=2)
        return r.status_code, r.json()

    def metrics(self) -> str:
        return requests.get(self.agent_url + "/metrics", timeout=2).text

    def wait_health(self, code: int, timeout: float) -> float:
        """Poll /healthz until it answers `code`; returns the seconds it took."""
        started = time.monotonic()
        wait_until(lambda: self.healthz()[0] == code, timeout, f"/healthz {code}", interval=0.02)
        return time.monotonic() - started

    # fake GPUs, through the real command -----------------------------------------------------
    def fake_gpu(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fake_gpu", "--state-file", str(self.fake_file), *args],
                              capture_output=True, text=True, timeout=30)

    def set_gpus(self, count: int) -> None:
        r = self.fake_gpu("set", "--count", str(count))
        assert r.returncode == 0, r.stderr

    def executed_keys(self) -> list[str]:
        path = self.root / "executions.sqlite"
        if not path.exists():
            return []
        db = sqlite3.connect(str(path), timeout=5)
        try:
            return [r[0] for r in db.execute("SELECT idempotency_key FROM executions")]
        except sqlite3.OperationalError:
            return []
        finally:
            db.close()
