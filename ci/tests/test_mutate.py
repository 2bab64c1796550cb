"""scripts/mutate.py, `make mutate`: what it mutates and against which tests, where a survivor's change is in the
file, and the verdict: the table, the survivors a human has not justified (the run fails on them), the entries that
match nothing any more. mutmut itself is not run here: the mutants are written as its results read."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load():
    path = REPO / "scripts" / "mutate.py"
    spec = importlib.util.spec_from_file_location("mutate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


mutate = _load()
ELECTOR = "agent/gpu_agent/mechanisms/leadership/elector.py"


def test_the_scope_is_the_five_packages_or_one_of_them_or_one_file_however_the_path_is_written():
    packages, globs = mutate.scope(None)
    assert packages == ["registration", "queues", "leadership", "domain", "inventory"] and len(globs) == 5
    assert mutate.scope("leadership") == (["leadership"], ["gpu_agent/mechanisms/leadership/*.py"])
    for written in (ELECTOR, "gpu_agent/mechanisms/leadership/elector.py", "leadership/elector.py"):
        assert mutate.scope(written) == (["leadership"], ["gpu_agent/mechanisms/leadership/elector.py"])
    with pytest.raises(SystemExit, match="not one of the packages"):
        mutate.scope("dra")


def test_the_tests_are_the_unit_test_files_importing_the_package_less_the_slow_and_the_random_ones():
    tests = mutate.tests_for(["leadership"])
    assert "tests/unit/test_leader_election.py" in tests and "tests/unit/test_kube_lease.py" in tests
    assert "tests/unit/test_sim.py" not in tests  # it imports the elector too, but runs 500 seeds
    assert "tests/unit/test_parsers_fuzz.py" not in mutate.tests_for(["inventory"])


DIFF = """--- gpu_agent/mechanisms/leadership/elector.py
+++ gpu_agent/mechanisms/leadership/elector.py
@@ -13,5 +13,5 @@
             await self.on_stopped_leading(why)
     finally:
         if self.leading:
-            self.leading = False
+            self.leading = True
             await self._release()"""


def test_a_mutant_is_placed_on_its_own_line_where_the_same_text_is_on_two():
    was, now, at = mutate.changed_lines(DIFF)
    assert (was, now, at) == ("self.leading = False", "self.leading = True", 16)
    source = (REPO / ELECTOR).read_text()
    line = mutate.line_of(source, "LeaderElector.run", was, at)
    lines = source.splitlines()
    assert lines[line - 1].strip() == "self.leading = False" and lines[line - 2].strip() == "if self.leading:"


def mutant(n, status, was="log.info('x')", now="log.info('XXxXX')", function="f", file=ELECTOR):
    return mutate.Mutant(f"gpu_agent.m.x_{function}__mutmut_{n}", file, function, 10, was, now, status)


def test_the_verdict_fails_on_a_survivor_no_entry_justifies_and_not_on_the_ones_entries_do():
    line_entry = mutate.Justified(ELECTOR, "f", "log.info('x')", None, "log line only")
    one_entry = mutate.Justified(ELECTOR, "g", "a = 1", "a = 2", "equivalent")
    stale = mutate.Justified(ELECTOR, "h", "b = 1", None, "gone")
    mutants = [mutant(1, "killed"), mutant(2, "caught by type check"), mutant(3, "timeout"),
               mutant(4, "survived"), mutant(5, "survived", now="log.info(None)"),
               mutant(6, "survived", "a = 1", "a = 2", "g"), mutant(7, "survived", "a = 1", "a = 3", "g")]
    text, code = mutate.report(mutants, [line_entry, one_entry, stale])
    assert code == 1
    row = next(line for line in text.splitlines() if line.startswith("leadership/elector.py"))
    assert row.split() == ["leadership/elector.py", "7", "1", "1", "4", "1", "3", "75.0%"]
    assert "1 survivor(s) neither killed nor justified" in text and "x_g__mutmut_7" in text
    assert "matched no survivor" in text and "'b = 1'" in text
    text, code = mutate.report(mutants[:6], [line_entry, one_entry], stubs=True)
    assert code == 0 and "100.0%" in text and "[[survivor]]" not in text


def test_an_interrupted_run_fails_and_stubs_are_entries_to_fill_in():
    text, code = mutate.report([mutant(1, "not checked")], [])
    assert code == 1 and "neither killed nor survived" in text
    text, code = mutate.report([mutant(2, "no tests", "a = 1", "a = 2")], [], stubs=True)
    stub = tomllib.loads(text[text.index("[[survivor]]"):])["survivor"][0]
    assert code == 1 and stub == {"file": ELECTOR, "function": "f", "was": "a = 1", "now": "a = 2", "why": ""}


def test_every_justified_survivor_names_a_file_there_is_and_a_reason():
    for e in mutate.read_justified():
        assert (REPO / e.file).is_file() and e.why, e
