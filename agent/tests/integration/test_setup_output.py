"""A fresh `make setup` shows progress and prints no warnings (scripts/setup.sh, run as make runs it)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_fresh_setup_prints_steps_and_no_warnings(tmp_path):
    venv = tmp_path / "venv"
    out = subprocess.run(["bash", str(REPO / "scripts/setup.sh")], env={**os.environ, "VENV": str(venv)},
                         capture_output=True, text=True, timeout=600)
    lines = (out.stdout + out.stderr).splitlines()
    assert out.returncode == 0, "\n".join(lines[-40:])
    assert (venv / "bin/gpu-agent").exists() and (venv / "bin/fake-gpu").exists()
    assert lines and all(line.startswith("setup: ") for line in lines), "\n".join(lines)
    noisy = [line for line in lines if re.search(r"warn|deprecat|error", line, re.I)]
    assert not noisy, "\n".join(noisy)
    assert any(re.match(r"setup: done in \d+ s", line) for line in lines)
    # Progress: one line per package collected, numbered (the first install is the slow one).
    assert len([line for line in lines if re.match(r"setup:   \[\d+\] ", line)]) >= 20
