"""`make mutate`: mutation testing of the core mechanisms with mutmut (issue 49).

mutmut changes one thing at a time in the code (a `<` to `<=`, a constant, a call's argument dropped, a
`return x` to `return None`) and runs the unit tests that reach the changed function; a change no test
notices is a survivor: a behaviour the tests do not pin down. The scope is the five core mechanism packages
(agent/gpu_agent/mechanisms/{registration,queues,leadership,domain,inventory}), or one of them or one file
with --module; the tests are the unit test files that import the packages in scope (agent/tests/unit), less
EXCLUDED_TESTS below. Before any test runs, mypy (as `make lint` runs it) reads every mutant: one it rejects
could never land, and counts as caught without a test.

mutmut names a mutant by its module's dotted path from the folder it runs in, so it runs in a folder of its
own, .mutate/ (ignored by git), where gpu_agent and tests link to agent/'s (and charts to charts/), with a
pyproject.toml written for it (its [tool.mutmut] settings and the project's pytest and mypy settings); it
copies them into .mutate/mutants/ and runs pytest there. Each run starts afresh (the folder's earlier results
are dropped: a result mutmut kept would not see a test added since) unless --retest, which runs again only
the last run's survivors, against every test that reaches them now (mapped afresh).

At the end: a table per file (mutants, killed by a test, caught by mypy, survived, timeout, justified, score)
and the survivors, each as file:line, function, the line before and after, and the name `mutmut show NAME`
takes (run in .mutate/). A survivor is justified by an entry in agent/tests/mutation-survivors.toml (file,
function, was, optionally now, why); the run exits 1 while any survivor is neither killed nor justified.
--report prints the last run's verdict again, --stubs adds an entry to fill in for each unjustified survivor,
--count only counts the mutants per file without running a test (for an estimate of a run's time).

    python scripts/mutate.py [--module leadership | agent/gpu_agent/mechanisms/leadership/elector.py]
                             [--jobs 1] [--retest | --count | --report] [--stubs]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "agent"
WORK = REPO / ".mutate"
SURVIVORS = AGENT / "tests" / "mutation-survivors.toml"
PACKAGES = ("registration", "queues", "leadership", "domain", "inventory")
# Unit test files that import a package in scope but are left out of the mutation run, and why. mutmut runs
# the tests that reach a mutated function once per mutant, so a test must be quick and give the same answer
# every time.
EXCLUDED_TESTS = {
    "test_sim.py": "the simulation's 500 seeds take a minute or more (make sim and make test-unit run it)",
    "test_parsers_fuzz.py": "hypothesis draws new examples on each run, so a mutant's verdict could change "
                            "from run to run (make fuzz and make test-unit run it)",
}
# mutmut's exit codes of a mutant's test run, as its status words say them (mutmut.stats.status_by_exit_code)
KILLED = {"killed"}
TYPED = {"caught by type check"}  # mypy (as `make lint` runs it) rejects the mutant: it could never land
TIMEOUT = {"timeout", "segfault"}  # the tests never finished: stopped at the time limit, or killed by a signal
SURVIVED = {"survived", "no tests"}  # "no tests": no selected test reaches the function


@dataclass(frozen=True)
class Mutant:
    name: str  # mutmut's, e.g. gpu_agent.mechanisms.leadership.elector.xǁLeaderElectorǁ_keep__mutmut_3
    file: str  # from the repository root: agent/gpu_agent/mechanisms/leadership/elector.py
    function: str  # LeaderElector._keep, or a module-level function's name
    line: int
    was: str  # the changed line(s), stripped, one per line
    now: str
    status: str  # one of mutmut's status words


@dataclass(frozen=True)
class Justified:
    file: str
    function: str
    was: str
    now: str | None  # None: every mutant of the line(s) `was` in `function`
    why: str

    def matches(self, m: Mutant) -> bool:
        return (self.file, self.function, self.was) == (m.file, m.function, m.was) and self.now in (None, m.now)


# --- the scope ---------------------------------------------------------------------------------------------

def scope(module: str | None) -> tuple[list[str], list[str]]:
    """(the packages in scope, mutmut's only_mutate globs relative to agent/) for --module: a package
    name or a path of a package or file, from the repository root, agent/ or the mechanisms folder."""
    if not module:
        return list(PACKAGES), [f"gpu_agent/mechanisms/{p}/*.py" for p in PACKAGES]
    rel = module.strip("/")
    for prefix in ("agent/", "gpu_agent/", "mechanisms/"):
        rel = rel.removeprefix(prefix)
    package = rel.split("/")[0]
    path = AGENT / "gpu_agent" / "mechanisms" / rel
    if package not in PACKAGES or not path.exists():
        sys.exit(f"mutate: {module!r} is not one of the packages {', '.join(PACKAGES)} nor a file in one")
    glob = f"gpu_agent/mechanisms/{rel}" if path.is_file() else f"gpu_agent/mechanisms/{rel}/*.py"
    return [package], [glob]


def tests_for(packages: list[str]) -> list[str]:
    """The unit test files (relative to agent/) that import a package in scope, less EXCLUDED_TESTS."""
    found = []
    for path in sorted((AGENT / "tests" / "unit").glob("test_*.py")):
        text = path.read_text()
        if path.name in EXCLUDED_TESTS:
            continue
        if any(re.search(rf"gpu_agent\.mechanisms\.{p}\b|from gpu_agent\.mechanisms import .*\b{p}\b", text)
               for p in packages):
            found.append(str(path.relative_to(AGENT)))
    return found


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def prepare(only_mutate: list[str], tests: list[str], fresh: bool) -> None:
    """.mutate/: gpu_agent and tests linked to agent/'s, and the pyproject.toml mutmut and pytest read there."""
    WORK.mkdir(exist_ok=True)
    # charts: a test reads the chart's CRDs three folders up from itself (tests/unit/ in mutants/)
    for name, target in (("gpu_agent", "agent/gpu_agent"), ("tests", "agent/tests"), ("charts", "charts")):
        link = WORK / name
        if not link.is_symlink():
            link.symlink_to(Path("..") / target)
    if fresh:
        shutil.rmtree(WORK / "mutants", ignore_errors=True)
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
    pytest_ini = tool["pytest"]["ini_options"]
    # mypy as `make lint` runs it, over the files mutated (it follows their imports): a mutant it rejects
    # could never pass the test command, so mutmut counts it caught ("caught by type check") without a test.
    mypy = {k: v for k, v in tool["mypy"].items() if k not in ("files", "mypy_path", "exclude", "overrides")}
    mypy["warn_unused_ignores"] = False  # mutmut's trampolines carry `# type: ignore` whether needed or not
    # each copy of an __init__ declares its attributes' types again: no-redef on every copy, mutated or not
    mypy["disable_error_code"] = ["no-redef"]
    mypy_overrides = "".join(f"\n[[tool.mypy.overrides]]\n{toml_table(o)}" for o in tool["mypy"].get("overrides", []))
    (WORK / "pyproject.toml").write_text(f"""\
# Written by scripts/mutate.py for each run; edit that instead.
[tool.mutmut]
source_paths = ["gpu_agent"]
only_mutate = {toml_list(only_mutate)}
pytest_add_cli_args_test_selection = {toml_list(tests)}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:xdist"]
# Each mutant's tests run in a process forked from one that has only collected them: the tests start
# threads and event loops, which a fork of the process that ran them would inherit half-done.
process_isolation = "forkserver"
# The folder is regenerated on each run; mutmut's git checks would look at the whole repository.
use_git_change_detection = false
type_check_command = {toml_list([sys.executable, "-m", "mypy", "--output", "json"])}
# A mutant's tests may take 5 times what they took unmutated (plus 1 s) before it counts as a timeout (mutmut's
# default, 15, held a hung registration mutant 4 minutes): the tests run on injected clocks, so one that takes
# longer is stuck (a loop that never lets the clock move), not slow.
timeout_multiplier = 5.0

[tool.pytest.ini_options]
pythonpath = ["."]
addopts = {json.dumps(pytest_ini.get("addopts", ""))}
markers = {toml_list(pytest_ini.get("markers", []))}

[tool.mypy]
{toml_table(mypy)}
files = {toml_list(mutated_files(only_mutate))}
{mypy_overrides}""")


def toml_table(table: dict[str, object]) -> str:
    """key = value lines for the strings, booleans and lists of strings of a pyproject table."""
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())


def mutated_files(only_mutate: list[str]) -> list[str]:
    return sorted(str(p.relative_to(AGENT)) for g in only_mutate for p in AGENT.glob(g))


# --- mutmut's results --------------------------------------------------------------------------------------

def function_name(mutant_name: str) -> str:
    """gpu_agent.x.y.xǁClassǁmethod__mutmut_3 -> Class.method; gpu_agent.x.y.x_func__mutmut_3 -> func"""
    mangled = mutant_name.partition("__mutmut_")[0].rpartition(".")[2]
    if mangled.startswith("xǁ"):
        _, cls, method = mangled.split("ǁ")
        return f"{cls}.{method}"
    return mangled.removeprefix("x_")


def changed_lines(diff: str) -> tuple[str, str, int]:
    """(was, now, at) of a unified diff of one function: its removed and its added lines, each stripped, and
    the line of the first removed one in the function's text (1: its first line)."""
    lines = diff.splitlines()
    was = [line[1:].strip() for line in lines if line.startswith("-") and not line.startswith("---")]
    now = [line[1:].strip() for line in lines if line.startswith("+") and not line.startswith("+++")]
    at = 0
    for line in lines:
        if hunk := re.match(r"@@ -(\d+)", line):
            at = int(hunk.group(1))
        elif line.startswith(" "):
            at += 1
        elif line.startswith("-") and not line.startswith("---"):
            break
    return "\n".join(was), "\n".join(now), at


def line_of(source: str, function: str, was: str, at: int) -> int:
    """The line in `source` of the first changed line: line `at` of `function`'s text as mutmut prints it (from
    the comments right above it, or its decorators, or its def), or else the first line in it that reads the same."""
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None = None
    for part in function.split("."):
        node = next((n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                     and n.name == part), None)
        if node is None:
            return 0
        body = node.body
    assert node is not None
    lines = source.splitlines()
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    while first > 1 and lines[first - 2].strip().startswith("#"):
        first -= 1
    wanted = was.split("\n")[0]
    guess = first + at - 1
    if 0 < guess <= len(lines) and lines[guess - 1].strip() == wanted:
        return guess
    end = node.end_lineno or node.lineno
    return next((n for n in range(node.lineno, end + 1) if lines[n - 1].strip() == wanted), node.lineno)


def read_results() -> list[Mutant]:
    """Every mutant of the last run in .mutate/mutants, with its status (mutmut's modules, run in .mutate/)."""
    os.chdir(WORK)
    from mutmut.configuration import reset_config
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    reset_config()  # the pyproject.toml of this run, not one read before it
    mutants = []
    for path in sorted(walk_mutatable_files()):
        data = SourceFileMutationData(path=path)
        data.load()
        source = Path(path).read_text()
        for name, code in sorted(data.exit_code_by_key.items(), key=lambda kv: mutant_order(kv[0])):
            function = function_name(name)
            was, now, at = changed_lines(get_diff_for_mutant(name, path=path))
            mutants.append(Mutant(name, f"agent/{path}", function, line_of(source, function, was, at), was, now,
                                  status_by_exit_code[code]))
    return mutants


def mutant_order(name: str) -> tuple[str, int]:
    stem, _, number = name.rpartition("__mutmut_")
    return stem, int(number)


def read_justified(path: Path = SURVIVORS) -> list[Justified]:
    entries = tomllib.loads(path.read_text()).get("survivor", []) if path.exists() else []
    out = []
    for e in entries:
        missing = {"file", "function", "was", "why"} - e.keys()
        if missing or not e["why"].strip():
            sys.exit(f"mutate: {path.relative_to(REPO)}: an entry lacks {sorted(missing) or ['a why']}: {e}")
        now = e["now"].strip() if "now" in e else None
        out.append(Justified(e["file"], e["function"], e["was"].strip(), now, " ".join(e["why"].split())))
    return out


# --- the report --------------------------------------------------------------------------------------------

def report(mutants: list[Mutant], justified: list[Justified], stubs: bool = False) -> tuple[str, int]:
    """The table and the survivor list, and the exit code: 1 while a survivor is not justified, or a
    mutant was left unchecked (an interrupted run) or ended oddly ("suspicious"). `stubs`: each unjustified
    survivor also as an entry for the survivors file, its `why` left to write."""
    rows: dict[str, list[Mutant]] = {}
    for m in mutants:
        rows.setdefault(m.file, []).append(m)
    head = (f"{'file':<36} {'mutants':>7} {'killed':>6} {'mypy':>5} {'survived':>8} {'timeout':>7} {'justified':>9} "
            f"{'score':>6}")
    out = ["", head, "-" * len(head)]
    totals = [0] * 6
    unjustified: list[Mutant] = []
    other: list[Mutant] = []
    used: set[Justified] = set()
    for file, ms in rows.items():
        survivors = [m for m in ms if m.status in SURVIVED]
        just = 0
        for m in survivors:
            hit = next((j for j in justified if j.matches(m)), None)
            if hit:
                used.add(hit)
                just += 1
            else:
                unjustified.append(m)
        other += [m for m in ms if m.status not in KILLED | TYPED | TIMEOUT | SURVIVED]
        counts = [len(ms), sum(m.status in KILLED for m in ms), sum(m.status in TYPED for m in ms), len(survivors),
                  sum(m.status in TIMEOUT for m in ms), just]
        totals = [t + c for t, c in zip(totals, counts, strict=True)]
        out.append(row(file.removeprefix("agent/gpu_agent/mechanisms/"), counts))
    out += ["-" * len(head), row("all", totals),
            "killed: by a test; mypy: rejected by mypy --strict as `make lint` runs it; timeout: the tests never ended",
            "score: (killed + mypy + timeout) / (mutants - justified)"]
    if unjustified:
        out += ["", f"{len(unjustified)} survivor(s) neither killed nor justified in "
                    f"{SURVIVORS.relative_to(REPO)} (`mutmut show NAME` in .mutate/ shows one as a diff):"]
        for m in unjustified:
            out += [f"  {m.file}:{m.line}  {m.function}  [{m.status}]  {m.name}",
                    *(f"      - {line}" for line in m.was.split("\n")),
                    *(f"      + {line}" for line in m.now.split("\n"))]
    if other:
        out += ["", f"{len(other)} mutant(s) neither killed nor survived (rerun them):"]
        out += [f"  {m.file}:{m.line}  {m.function}  [{m.status}]  {m.name}" for m in other]
    stale = [j for j in justified if j not in used and j.file in rows]
    if stale:
        out += ["", f"{len(stale)} justified entr(ies) matched no survivor of this run (a test kills the mutant now, "
                    "or the code changed): drop or mend them:"]
        out += [f"  {j.file}  {j.function}: {j.was!r}" + (f" -> {j.now!r}" if j.now is not None else "")
                for j in stale]
    if stubs and unjustified:
        out += ["", f"# entries for {SURVIVORS.relative_to(REPO)}, each `why` to write:"]
        for m in unjustified:
            out += ["", "[[survivor]]", f"file = {json.dumps(m.file)}", f"function = {json.dumps(m.function)}",
                    f"was = {toml_string(m.was)}", f"now = {toml_string(m.now)}", 'why = ""']
    return "\n".join(out), 1 if unjustified or other else 0


def toml_string(text: str) -> str:
    return f"\"\"\"\n{text}\"\"\"" if "\n" in text else json.dumps(text)


def row(name: str, counts: list[int]) -> str:
    total, killed, typed, survived, timeout, just = counts
    denominator = total - just
    score = f"{100 * (killed + typed + timeout) / denominator:.1f}%" if denominator else "-"
    return f"{name:<36} {total:>7} {killed:>6} {typed:>5} {survived:>8} {timeout:>7} {just:>9} {score:>6}"


# --- main --------------------------------------------------------------------------------------------------

def count(only_mutate: list[str]) -> int:
    """Mutants per file, generated as mutmut generates them, without running a test."""
    os.chdir(WORK)
    from mutmut.configuration import config
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.file_utils import walk_mutatable_files

    assert config().only_mutate == only_mutate
    per_package: dict[str, int] = {}
    for path in sorted(walk_mutatable_files()):
        n = len(mutate_file_contents(str(path), Path(path).read_text()).mutant_names)
        package = str(path).split("/")[2]
        per_package[package] = per_package.get(package, 0) + n
        print(f"{str(path).removeprefix('gpu_agent/mechanisms/'):<40} {n:>6}")
    for package, n in per_package.items():
        print(f"{package + '/ (all)':<40} {n:>6}")
    print(f"{'all':<40} {sum(per_package.values()):>6}")
    return 0


# A test's wall-time limit under mutmut (agent/tests/conftest.py reads it; 30 s otherwise). mutmut bounds each
# mutant's run itself (5 times its tests' time, plus 1 s); the limit would only fail its stats and clean runs,
# which run every test traced, at the lowest priority, beside whatever else the host runs.
TEST_TIMEOUT_UNDER_MUTMUT = "600"


def test_env() -> dict[str, str]:
    return {**os.environ, "GPU_AGENT_TEST_TIMEOUT": TEST_TIMEOUT_UNDER_MUTMUT}


def explain_failed_run(tests: list[str]) -> None:
    """mutmut runs its clean and forced-fail runs in a forked child and prints only "Failed to run clean test":
    the child's pytest output goes to the child's copy of the buffer mutmut would print. Run the same tests as
    its clean run does (unmutated, in .mutate/mutants) and show how they end."""
    mutants = WORK / "mutants"
    if not mutants.is_dir():
        return
    command = [sys.executable, "-m", "pytest", "--rootdir=.", "--tb=native", "-x", "-q", "-p", "no:randomly",
               *tests, "-p", "no:cacheprovider", "-p", "no:xdist"]
    print(f"mutate: mutmut shows no output of its clean run; the same tests, unmutated, in {mutants}:\n"
          f"  MUTANT_UNDER_TEST= {' '.join(command[1:])}", file=sys.stderr)
    clean = subprocess.run(command, cwd=mutants, env={**test_env(), "MUTANT_UNDER_TEST": ""},
                           capture_output=True, text=True)
    lines = [line for line in (clean.stdout + clean.stderr).splitlines()
             if not line.startswith(("WARNING ", "INFO ", "DEBUG "))]  # the captured log lines of a failed test
    print("\n".join(lines[-40:]) + f"\nmutate: they exited {clean.returncode}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default=os.environ.get("MODULE") or None,
                        help="one package (leadership) or file (agent/gpu_agent/mechanisms/leadership/elector.py)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MUTATE_JOBS") or 1))
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--retest", action="store_true", help="run the last run's survivors again, and only them")
    what.add_argument("--count", action="store_true", help="count the mutants per file; run no test")
    what.add_argument("--report", action="store_true", help="the last run's table and survivors again; run nothing")
    parser.add_argument("--stubs", action="store_true", help="print each unjustified survivor as an entry for "
                        f"{SURVIVORS.relative_to(REPO)}")
    args = parser.parse_args()

    packages, only_mutate = scope(args.module)
    tests = tests_for(packages)
    if args.report:
        text, code = report(read_results(), read_justified(), stubs=args.stubs)
        print(text)
        return code
    retest = []
    if args.retest:
        if not (WORK / "mutants").is_dir():
            sys.exit("mutate: --retest: no earlier run in .mutate/mutants")
        retest = [m.name for m in read_results() if m.status not in KILLED | TYPED | TIMEOUT]
        os.chdir(REPO)
        if not retest:
            print("mutate: the last run left no survivor to run again")
    prepare(only_mutate, tests, fresh=not args.retest and not args.count)
    if args.retest:
        # mutmut maps tests to the functions they reach once, and afterwards only maps tests it has not seen:
        # a test changed since would keep its old map. Mapped afresh, the survivors meet every test that reaches them.
        (WORK / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    if args.count:
        return count(only_mutate)

    print(f"mutate: {', '.join(only_mutate)} against {len(tests)} test files: {' '.join(tests)}")
    print(f"mutate: left out: {'; '.join(f'{k}: {v}' for k, v in EXCLUDED_TESTS.items())}")
    started = time.monotonic()
    mutmut = Path(sys.executable).parent / "mutmut"
    if not args.retest or retest:
        run = subprocess.run([str(mutmut), "run", "--max-children", str(args.jobs), *retest], cwd=WORK,
                             env=test_env())
        if run.returncode != 0:
            print(f"mutate: mutmut run exited {run.returncode}", file=sys.stderr)
            explain_failed_run(tests)
            return run.returncode
    took = time.monotonic() - started
    mutants = read_results()
    text, code = report(mutants, read_justified(), stubs=args.stubs)
    print(text)
    ran = len(retest) if args.retest else len(mutants)
    print(f"\nmutate: {ran} mutants run in {took:.0f} s ({took / max(ran, 1):.1f} s a mutant, with mutmut's "
          f"stats and clean runs) on {args.jobs} worker(s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
