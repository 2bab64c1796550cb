"""The README's first five minutes, followed line by line as written.

`gpu-agent local` runs exactly as `make run` starts it, in a fresh folder; the README's
second-terminal block is read from README.md and each command is run as printed there, in the
same folder. Every line of that block must have a claim here, so a README edit that adds a
command without a check fails this test. The agent's own log is the evidence only for the
lines the README promises it prints; readiness is checked over HTTP, the queue through the
control plane.
"""

from __future__ import annotations

import itertools
import re
import shlex
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.integration.harness import Process, Rig, wait_until

REPO = Path(__file__).resolve().parents[3]
AGENT = "http://127.0.0.1:8080"


def readme_block() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    start = text.index("With `make run` going")
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block, "README: no sh block after 'With `make run` going'"
    lines = []
    for raw in block.group(1).splitlines():
        command, _, comment = raw.partition("#")
        if command.strip():
            lines.append((command.strip(), comment.strip()))
    return lines


def make_run_command() -> list[str]:
    """What `make run` runs, read from the Makefile (ARGS empty)."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^run: setup\n\t(.+)$", makefile, re.M)
    assert recipe, "Makefile: no 'run: setup' recipe"
    return shlex.split(recipe.group(1).replace("$(BIN)", ".venv/bin").replace("$(ARGS)", ""))


class Sampler:
    """Records (time, /livez status, /healthz status) every 100 ms; the test asserts on them."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), Rig._get(AGENT + "/livez"), Rig._get(AGENT + "/healthz")))
            self._stop.wait(0.1)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def healthz() -> int:
    return Rig._get(AGENT + "/healthz")


def test_readme_second_terminal_block_as_written(tmp_path):
    for port in (8080, 8700):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} is in use; the README walkthrough needs it as `make run` does")
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    argv = make_run_command()
    agent = Process("make-run", argv, tmp_path / "make-run.log", cwd=tmp_path)  # argv[0] is relative to cwd
    lines = readme_block()
    claims_checked = []
    try:
        wait_until(lambda: agent.grep("gpu-agent local is up"), 20, "the start-up banner")
        banner = "\n".join(agent.lines())
        for promised in ("fake-gpu set --count 4", "fake-gpu set --count 0", "gpu-agent queue list",
                         "gpu-agent queue add demo-9", ".run/admin-token", AGENT):
            assert promised in banner, f"the banner does not print {promised!r}"

        def run(command: str) -> str:
            out = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, f"README line {command!r} exited {out.returncode}: {out.stderr}"
            return out.stdout

        with Sampler() as sampler:
            for command, comment in lines:
                if command.startswith("curl") and command.endswith("/healthz"):
                    out = run(command)
                    assert "503" in comment and "no GPUs available in cluster" in out
                    assert healthz() == 503
                elif command.endswith("fake-gpu set --count 4"):
                    run(command)
                    wait_until(lambda: healthz() == 200, 2, "/healthz 200 after the GPUs arrive")
                    wait_until(lambda: len(agent.grep(r"work item demo-\d done")) == 5, 10, "the 5 demo items done")
                elif command.endswith("gpu-agent queue list"):
                    out = run(command)
                    rows = [r.split() for r in out.splitlines() if re.match(r"\s*\d+\s+demo-", r)]
                    assert sorted(r[1] for r in rows) == [f"demo-{n}" for n in range(5)], out
                    assert all(r[2] == "done" and r[3] == "1" for r in rows), out
                elif command.endswith("gpu-agent queue add demo-9"):
                    assert "demo-9 queued" in run(command)
                    wait_until(lambda: agent.grep(r"work item demo-9 done \(\d+\.\d s\)"), 10, "demo-9 done in the log")
                elif command.endswith("fake-gpu set --count 0"):
                    run(command)
                    wait_until(lambda: healthz() == 503, 2, "/healthz 503 after the last GPU leaves")
                elif command.startswith("curl") and command.endswith("/livez"):
                    assert '"live"' in run(command)
                elif "fake-gpu cycle" in command:
                    before = len(sampler.samples)
                    run(command)
                    cycle = [h for _, _, h in sampler.samples[before:]]
                    flips = sum(1 for a, b in itertools.pairwise(cycle) if a != b)
                    assert flips >= 5, f"readiness did not follow the cycle: {flips} changes in {len(cycle)} samples"
                else:
                    pytest.fail(f"README line {command!r} has no claim checked here: add one")
                claims_checked.append(command)
        assert len(sampler.samples) >= 50, f"sampler took only {len(sampler.samples)} samples"
        assert all(live == 200 for _, live, _ in sampler.samples), "/livez was not 200 throughout"
        assert len(claims_checked) == len(lines) >= 7
        # -v 0 shows the state changes a person watches for, and no per-poll noise.
        log = agent.lines()
        assert any("effective configuration" in line for line in log)
        assert any(re.search(r"\]   controlPlaneToken: <redacted>$", line) for line in log)
        assert not any("V6" in line or "control plane: POST" in line for line in log)
    finally:
        agent.stop()
