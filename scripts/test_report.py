"""The closing report of `make test` (scripts/test.sh): where the time went, what was skipped, and the budget.

Reads what the run left in its output folder: stages.tsv (one line a stage: name, seconds, exit code, and the stage
it ran beside, if any), each stage's log (the `ci: timing: WHAT Ns` lines and the `ci: PART built in Ns` /
`ci: PART cached` lines that ci/scripts print) and the JUnit XML of every pytest run (junit/*.xml), and cpu.jsonl where ci/tools/cpu_sampler.py ran beside the run
(where each e2e phase's CPU went). Prints those tables and exits 1 when a
test was skipped (unless --allow-skips) or the run took longer than --budget-minutes; 0 otherwise. A stage
that failed is test.sh's to report: this only adds the reasons above.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

TIMING = re.compile(r" ci: timing: (?P<what>.+?) (?P<seconds>\d+)s(?: cpu (?P<cpu>\d+)%)?$")
BUILT = re.compile(r" ci: (?P<part>.+?) built in (?P<seconds>\d+)s")
CACHED = re.compile(r" ci: (?P<part>.+?) (?:binaries )?cached\b")


@dataclass(frozen=True)
class Case:
    stage: str
    name: str
    seconds: float
    outcome: str  # passed | failed | skipped
    reason: str = ""


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: int
    rc: int
    beside: str = ""  # the stage it ran beside (its time overlaps that one's), or ""


def stages(out: Path) -> list[Stage]:
    """The ledger scripts/stage.sh writes: name, seconds, exit code and, for a stage run beside another, its name."""
    ledger = out / "stages.tsv"
    rows = []
    for line in ledger.read_text().splitlines() if ledger.exists() else []:
        name, seconds, rc, *beside = line.split("\t")
        rows.append(Stage(name, int(seconds), int(rc), beside[0] if beside else ""))
    return rows


def log_lines(out: Path, stage: str) -> list[str]:
    log = out / f"{stage}.log"
    return log.read_text(errors="replace").splitlines() if log.exists() else []


def cases(out: Path) -> list[Case]:
    found = []
    for xml in sorted((out / "junit").glob("*.xml")):
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError as e:
            print(f"test report: {xml} is not JUnit XML ({e}); its tests are not counted", file=sys.stderr)
            continue
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            outcome, reason = "passed", ""
            for child in case:
                if child.tag == "skipped":
                    outcome, reason = "skipped", child.get("message", "")
                elif child.tag in ("failure", "error"):
                    outcome = "failed"
            found.append(Case(xml.stem, name, float(case.get("time") or 0), outcome, reason))
    return found


def table(title: str, header: tuple[str, ...], rows: list[tuple[object, ...]]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [f"== {title}"]
    for i, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


PHASE_NAMES = {"": "before the serial phase", "ended": "after the e2e stage"}


def cpu_rows(samples: list[dict], cores: int) -> list[tuple[object, ...]]:
    """One row per phase (in the order first seen): wall seconds, how busy the host's cores were, and each group's
    share of the busy CPU seconds (ci/tools/cpu_sampler.py). A group's counter that went down (a node's cgroup removed
    at cluster-down) adds nothing for that interval; what the groups leave of busy is "rest"."""
    per: dict[str, dict[str, float]] = {}
    for before, after in itertools.pairwise(samples):
        acc = per.setdefault(before.get("phase", ""), {"wall": 0.0, "busy": 0.0})
        acc["wall"] += after["t"] - before["t"]
        acc["busy"] += max(0.0, after["busy"] - before["busy"])
        for group, seconds in after.get("groups", {}).items():
            acc[group] = acc.get(group, 0.0) + max(0.0, seconds - before.get("groups", {}).get(group, seconds))
    rows: list[tuple[object, ...]] = []
    for name, acc in per.items():
        wall, busy = acc.pop("wall"), acc.pop("busy")
        if wall <= 0:
            continue
        groups = sorted(acc.items(), key=lambda kv: -kv[1])
        rest = max(0.0, busy - sum(v for _, v in groups))
        shares = ", ".join(f"{g} {v / busy:.0%}" for g, v in [*groups, ("rest", rest)] if busy and v / busy >= 0.01)
        rows.append((PHASE_NAMES.get(name, name), f"{wall:.0f}s", f"{busy / (wall * cores):.0%}", f"{busy:.0f}", shares))
    return rows


def cpu_table(out: Path) -> str | None:
    """The CPU table, or None without samples; a line it cannot read is left out (the sampler never fails a run)."""
    path = out / "cpu.jsonl"
    if not path.exists():
        return None
    samples = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            samples.append({"t": float(row["t"]), "busy": float(row["busy"]), "phase": str(row.get("phase", "")),
                            "groups": {str(k): float(v) for k, v in row.get("groups", {}).items()}})
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    rows = cpu_rows(samples, os.cpu_count() or 1)
    if not rows:
        return None
    return table("where the CPU went (ci/tools/cpu_sampler.py, every 10 s; rest: the tests, helm, the kernel)",
                 ("phase", "wall", "cpu busy", "cpu seconds", "share of the busy seconds"), rows)


def report(out: Path, elapsed: int, budget_minutes: float, allow_skips: bool) -> tuple[str, list[str]]:
    """(the report's text, the reasons the run fails)."""
    parts: list[str] = []
    failures: list[str] = []
    ran = stages(out)
    logs = {stage.name: log_lines(out, stage.name) for stage in ran}  # each stage's log read once, for both tables
    all_cases = cases(out)
    rows: list[tuple[object, ...]] = []
    for stage in ran:
        name, seconds, rc, beside = stage.name, stage.seconds, stage.rc, stage.beside
        of_stage = [c for c in all_cases if c.stage == name or c.stage.startswith(name + "-")]
        counts = (f"{sum(c.outcome == 'passed' for c in of_stage)} passed, {sum(c.outcome == 'failed' for c in of_stage)} "
                  f"failed, {sum(c.outcome == 'skipped' for c in of_stage)} skipped") if of_stage else ""
        result = ("ok" if rc == 0 else f"FAILED ({rc})") + (f", beside {beside}" if beside else "")
        rows.append((name, f"{seconds}s", f"{seconds / 60:.1f}", "", result, counts))
        for line in logs[name]:
            if m := TIMING.search(line):
                cpu = f"{m['cpu']}%" if m["cpu"] else ""
                rows.append((f"  {m['what']}", f"{m['seconds']}s", f"{int(m['seconds']) / 60:.1f}", cpu, "", ""))
    rows.append(("whole run", f"{elapsed}s", f"{elapsed / 60:.1f}", "", f"budget {budget_minutes:g} min", ""))
    # cpu busy: the host's every core, where a step measured it; near 100% the step waits on the CPU, not the cluster
    parts.append(table("where the time went (stages, and the steps inside them)", ("stage", "seconds", "minutes",
                                                                                   "cpu busy", "result", "tests"), rows))

    built: dict[str, tuple[str, str]] = {}
    for lines in logs.values():
        for line in lines:
            if m := BUILT.search(line):
                built[m["part"]] = ("built (cold)", f"{m['seconds']}s")
            elif (m := CACHED.search(line)) and m["part"] not in built:
                built[m["part"]] = ("cached (warm)", "-")
    if built:
        parts.append(table("parts ci/ builds: built this run or found in the cache", ("part", "this run", "seconds"),
                           [(p, how, s) for p, (how, s) in built.items()]))

    if (cpu := cpu_table(out)) is not None:
        parts.append(cpu)

    slowest = sorted(all_cases, key=lambda c: -c.seconds)[:15]
    if slowest:
        parts.append(table("the slowest 15 tests (setup + call + teardown)", ("test", "stage", "seconds"),
                           [(c.name, c.stage, f"{c.seconds:.1f}") for c in slowest]))

    skipped = [c for c in all_cases if c.outcome == "skipped"]
    if skipped:
        parts.append(table(f"{len(skipped)} skipped test(s)", ("test", "stage", "reason"),
                           [(c.name, c.stage, c.reason[:160]) for c in skipped]))
        if not allow_skips:
            failures.append(f"{len(skipped)} test(s) skipped (listed above): every test must run on this machine "
                            "(TEST_ALLOW_SKIPS=1 lets a run on a partial machine through)")
    else:
        parts.append(f"== no test skipped ({len(all_cases)} test results read)")
    if elapsed > budget_minutes * 60:
        failures.append(f"the run took {elapsed / 60:.1f} min, over its budget of {budget_minutes:g} min "
                        "(TEST_BUDGET_MINUTES): CI stops a run at 90 min; see the tables above for where the time went")
    return "\n\n".join(parts), failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the run's output folder (scripts/test.sh's TEST_OUT)")
    p.add_argument("--elapsed", type=int, required=True, help="seconds the whole run took")
    p.add_argument("--budget-minutes", type=float, default=80.0)
    p.add_argument("--allow-skips", action="store_true")
    args = p.parse_args(argv)
    text, failures = report(args.out, args.elapsed, args.budget_minutes, args.allow_skips)
    print("\n" + text + "\n", flush=True)
    for f in failures:
        print(f"test: FAILED: {f}", flush=True)
    if not failures:
        print(f"test: report: the whole run took {args.elapsed / 60:.1f} min, within its {args.budget_minutes:g}-minute "
              "budget", flush=True)

    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
