"""ci/tools/cpu_sampler.py, beside `make test`, and its table in scripts/test_report.py: each sample groups the CI
cluster's daemons by process name and the nodes' pods by cgroup, under the e2e phase then running; the report turns
the differences into each phase's busy share per group, a counter that went down (a node's cgroup removed) adding
nothing. The /proc and cgroup trees are written here as the kernel lays them out."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sampler = _load("cpu_sampler", REPO / "ci" / "tools" / "cpu_sampler.py")
test_report = _load("test_report_for_cpu", REPO / "scripts" / "test_report.py")
TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int, comm: str, utime: int, stime: int) -> str:
    # fields after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    return f"{pid} ({comm}) S 1 1 1 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0 5 0 0\n"


@pytest.fixture
def host(tmp_path):
    proc, cpuacct = tmp_path / "proc", tmp_path / "cpuacct"
    (proc / "self").mkdir(parents=True)
    (proc / "stat").write_text(f"cpu  {3 * TICK} 0 {TICK} {10 * TICK} {TICK} 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
    for pid, comm, ut, st in ((11, "kube-apiserver", 2 * TICK, TICK), (12, "kubelet", TICK, 0), (13, "kubelet", TICK, 0),
                              (14, "containerd-shim", TICK, 0), (15, "python3", 50 * TICK, 0),
                              (16, "a (tricky) name", 9 * TICK, 0)):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "stat").write_text(proc_stat(pid, comm, ut, st))
    (proc / "17").mkdir()  # gone between the listing and the read: no stat
    for folder, ns in (("kubepods", 2_000_000_000), ("gpuci-w1", 1_500_000_000), ("libpod_parent", 4_000_000_000),
                       ("blkio-like", 7_000_000_000)):
        (cpuacct / folder).mkdir(parents=True)
        (cpuacct / folder / "cpuacct.usage").write_text(f"{ns}\n")
    (cpuacct / "cpuacct.usage").write_text("99000000000\n")  # the root: everything, not a group
    return proc, cpuacct


def test_a_sample_groups_daemons_by_name_and_pods_by_cgroup_under_the_phase_then_running(host, tmp_path):
    proc, cpuacct = host
    phases = tmp_path / "e2e-phases"
    phases.write_text("serial\ngrouped\n")
    row = sampler.sample(proc, cpuacct, phases, 1000.0)
    assert row == {"t": 1000.0, "phase": "grouped", "busy": 4.0,  # user + system: idle and iowait left out
                   "groups": {"apiserver": 3.0, "ci-pods": 3.5, "containerd": 1.0, "kind-nodes": 4.0, "kubelets": 2.0}}
    assert sampler.sample(proc, cpuacct, tmp_path / "none", 1.0)["phase"] == ""
    assert sampler.sample(proc, tmp_path / "no-cgroup-v1", None, 1.0)["groups"] == {
        "apiserver": 3.0, "containerd": 1.0, "kubelets": 2.0}


def test_the_report_gives_each_phase_its_busy_share_per_group_and_a_removed_cgroup_adds_nothing():
    def s(t, phase, busy, **groups):
        return {"t": t, "phase": phase, "busy": busy, "groups": groups}

    samples = [s(0, "", 0, apiserver=0, ci_pods=0),
               s(10, "serial", 10, apiserver=2, ci_pods=6),   # before the serial phase: 10 s, 10 busy
               s(20, "serial", 15, apiserver=3, ci_pods=8),   # serial: 10 s, 5 busy: apiserver 1, pods 2, rest 2
               s(30, "ended", 35, apiserver=13, ci_pods=0)]   # serial again: 20 busy, apiserver 10, pods' counter reset
    rows = test_report.cpu_rows(samples, cores=2)
    assert rows == [("before the serial phase", "10s", "50%", "10", "ci_pods 60%, apiserver 20%, rest 20%"),
                    ("serial", "20s", "62%", "25", "apiserver 44%, ci_pods 8%, rest 48%")]


def test_the_report_shows_the_table_when_the_run_left_samples_and_skips_lines_it_cannot_read(tmp_path):
    (tmp_path / "junit").mkdir()
    (tmp_path / "stages.tsv").write_text("unit\t80\t0\n")
    lines = [json.dumps({"t": 0, "phase": "", "busy": 0, "groups": {"etcd": 0}}), "not json", '{"t": "x"}',
             json.dumps({"t": 30, "phase": "parallel", "busy": 45, "groups": {"etcd": 9}})]
    (tmp_path / "cpu.jsonl").write_text("\n".join(lines) + "\n")
    text, failures = test_report.report(tmp_path, 100, 80, False)
    assert "== where the CPU went" in text and "etcd 20%, rest 80%" in text and not failures
    (tmp_path / "cpu.jsonl").unlink()
    assert "where the CPU went" not in test_report.report(tmp_path, 100, 80, False)[0]


def test_it_stops_by_itself_once_its_parent_is_gone(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    r = subprocess.run([sys.executable, str(REPO / "ci" / "tools" / "cpu_sampler.py"), str(tmp_path / "out.jsonl"),
                        "--interval", "0.05", "--parent", str(dead.pid)], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0 and not (tmp_path / "out.jsonl").exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])  # then a zombie until waited
    r = subprocess.run([sys.executable, str(REPO / "ci" / "tools" / "cpu_sampler.py"), str(tmp_path / "out.jsonl"),
                        "--interval", "0.1", "--parent", str(alive.pid)], capture_output=True, text=True, timeout=20)
    alive.wait()
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert r.returncode == 0 and rows and all({"t", "phase", "busy", "groups"} <= set(row) for row in rows)
