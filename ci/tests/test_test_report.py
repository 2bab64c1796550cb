"""scripts/test_report.py, the closing report of `make test`: stage times with the steps the ci/ scripts time, the
parts built or found cached, the slowest tests, and the two ways a run that passed every stage still fails: a
skipped test, and a run over its budget. The inputs are written here as test.sh and the stages leave them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _load():
    path = Path(__file__).resolve().parents[2] / "scripts" / "test_report.py"
    spec = importlib.util.spec_from_file_location("test_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


report = _load().report


def junit(*cases: str) -> str:
    return f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>'


def run_folder(tmp_path: Path, skipped: bool = False) -> Path:
    (tmp_path / "junit").mkdir(parents=True)
    (tmp_path / "stages.tsv").write_text("unit\t80\t0\ne2e\t1500\t0\n")
    (tmp_path / "e2e.log").write_text("12:00:01 ci: kubernetes v1.36.2 built in 431s: kube-apiserver\n"
                                      "12:00:02 ci: coredns v1.12.4 cached\n"
                                      "12:00:03 ci: timing: cluster-up (3 node(s)) 460s\n"
                                      "12:30:00 ci: timing: e2e serial phase 700s cpu 23%\n")
    skip = '<skipped type="pytest.skip" message="kstatus not built: run bash ci/scripts/build-kstatus.sh"/>'
    (tmp_path / "junit" / "unit.xml").write_text(junit(
        '<testcase classname="agent.tests.unit.test_a" name="test_quick" time="0.2"/>',
        f'<testcase classname="agent.tests.unit.test_gitops" name="test_kstatus" time="0.0">{skip if skipped else ""}'
        '</testcase>'))
    (tmp_path / "junit" / "e2e-serial-phase.xml").write_text(junit(
        '<testcase classname="e2e.test_releases" name="test_downgrade" time="171.5"/>',
        '<testcase classname="e2e.test_nodes" name="test_drain" time="99.0"><failure message="x"/></testcase>'))
    return tmp_path


def test_the_tables_show_each_stage_with_its_steps_the_parts_and_the_slowest_tests_first(tmp_path):
    text, failures = report(run_folder(tmp_path), elapsed=1600, budget_minutes=80, allow_skips=False)
    assert failures == []
    lines = text.splitlines()
    e2e = next(i for i, line in enumerate(lines) if line.startswith("e2e "))
    assert "1500s" in lines[e2e] and "1 passed, 1 failed, 0 skipped" in lines[e2e]
    assert lines[e2e + 1].split()[:4] == ["cluster-up", "(3", "node(s))", "460s"]
    assert lines[e2e + 2].split() == ["e2e", "serial", "phase", "700s", "11.7", "23%"]  # the step's cpu busy
    assert any(line.startswith("whole run") and "1600s" in line for line in lines)
    assert any("kubernetes v1.36.2" in line and "built (cold)" in line and "431s" in line for line in lines)
    assert any("coredns v1.12.4" in line and "cached (warm)" in line for line in lines)
    slowest = [line for line in lines if "::" in line]
    assert slowest[0].startswith("e2e.test_releases::test_downgrade") and "171.5" in slowest[0]
    assert "== no test skipped (4 test results read)" in text


def test_a_skipped_test_fails_the_run_naming_it_unless_skips_are_allowed(tmp_path):
    folder = run_folder(tmp_path, skipped=True)
    text, failures = report(folder, elapsed=1600, budget_minutes=80, allow_skips=False)
    assert "test_kstatus" in text and "kstatus not built" in text and len(failures) == 1 and "1 test(s) skipped" in failures[0]
    assert report(folder, elapsed=1600, budget_minutes=80, allow_skips=True)[1] == []


def test_a_run_over_its_budget_fails_with_the_tables(tmp_path):
    text, failures = report(run_folder(tmp_path), elapsed=80 * 60 + 1, budget_minutes=80, allow_skips=False)
    assert failures == ["the run took 80.0 min, over its budget of 80 min (TEST_BUDGET_MINUTES): CI stops a run at "
                        "90 min; see the tables above for where the time went"]
    assert "where the time went" in text
    assert report(run_folder(tmp_path / "x"), elapsed=80 * 60, budget_minutes=80, allow_skips=False)[1] == []


def test_a_stage_run_beside_another_says_so_and_an_old_three_column_ledger_still_reads(tmp_path):
    folder = run_folder(tmp_path)
    with (folder / "stages.tsv").open("a") as ledger:  # as scripts/stage.sh appends it with STAGE_BESIDE=e2e
        ledger.write("kind\t241\t0\te2e\n")
    (folder / "kind.log").write_text("12:40:00 ci: timing: e2e suite (kind) 164s cpu 32%\n")
    lines = report(folder, elapsed=1600, budget_minutes=80, allow_skips=False)[0].splitlines()
    kind = next(i for i, line in enumerate(lines) if line.startswith("kind "))
    assert "241s" in lines[kind] and "ok, beside e2e" in lines[kind]
    assert lines[kind + 1].split()[:5] == ["e2e", "suite", "(kind)", "164s", "2.7"]
    e2e = next(line for line in lines if line.startswith("e2e "))
    assert "beside" not in e2e
