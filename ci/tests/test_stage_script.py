"""scripts/stage.sh, one stage of `make test`: its output in the stage's log, its time and exit code in the ledger,
and a stage run beside another (STAGE_BESIDE) kept off the console, marked in the ledger, its code still its own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

STAGE = Path(__file__).resolve().parents[2] / "scripts" / "stage.sh"


def run(out: Path, *cmd: str, beside: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TEST_OUT": str(out)}
    env.pop("STAGE_BESIDE", None)
    if beside:
        env["STAGE_BESIDE"] = beside
    return subprocess.run(["bash", str(STAGE), *cmd], env=env, capture_output=True, text=True, timeout=30)


def test_a_stage_shows_and_keeps_its_output_and_records_its_code(tmp_path):
    done = run(tmp_path, "lint", "bash", "-c", "echo checked; exit 3")
    assert done.returncode == 3
    assert "checked" in done.stdout and (tmp_path / "lint.log").read_text() == "checked\n"
    name, seconds, rc, beside = (tmp_path / "stages.tsv").read_text().rstrip("\n").split("\t")
    assert (name, rc, beside) == ("lint", "3", "") and int(seconds) >= 0


def test_a_stage_beside_another_writes_only_its_log_and_is_marked_in_the_ledger(tmp_path):
    assert run(tmp_path, "unit", "true").returncode == 0
    done = run(tmp_path, "kind", "bash", "-c", "echo from-kind; echo err >&2", beside="e2e")
    assert done.returncode == 0 and "from-kind" not in done.stdout + done.stderr.replace("stage kind", "")
    assert (tmp_path / "kind.log").read_text() == "from-kind\nerr\n"
    lines = [line.split("\t") for line in (tmp_path / "stages.tsv").read_text().splitlines()]
    assert [(n, rc, b) for n, _, rc, b in lines] == [("unit", "0", ""), ("kind", "0", "e2e")]


def test_without_an_output_folder_it_says_what_it_needs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TEST_OUT"}
    done = subprocess.run(["bash", str(STAGE), "x", "true"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "TEST_OUT" in done.stderr
