"""Where a `make test` run's CPU goes, sampled beside it: one JSON line every INTERVAL seconds in OUT.

Each line holds cumulative CPU seconds since boot: the host's every core busy (/proc/stat), each group of processes
below, and the e2e phase then running (the last line of --phase-file, which ci/scripts/e2e.sh appends each phase's name
to; "" before the first). scripts/test_report.py turns the differences between lines into a table per phase.

Groups: the CI cluster's daemons by process name (kube-apiserver, etcd, the controller manager and scheduler, the
kubelets, containerd and its shims, kube-proxy, the NetworkPolicy enforcer, the OCI registry), read from each live
process's /proc/PID/stat; the pods of the CI cluster's nodes and the kind nodes, read from cgroup v1's cpuacct, whose
counter for a parent keeps what its removed children used (a pod deleted between two samples still counts). What the
groups leave of `busy` is the rest: the test processes, helm and kubectl, the compilers, the kernel. A process that
starts and ends between two samples counts only there.

It stops when --parent (scripts/test.sh) is gone, or on SIGTERM; it never fails the run: a sample it cannot take is
skipped.

    python3 ci/tools/cpu_sampler.py OUT [--interval 10] [--phase-file F] [--parent PID]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

# process name (comm, at most 15 characters) -> group
DAEMONS = {
    "kube-apiserver": "apiserver",
    "etcd": "etcd",
    "kube-controller": "controller-manager+scheduler",
    "kube-scheduler": "controller-manager+scheduler",
    "kubelet": "kubelets",
    "containerd": "containerd",
    "containerd-shim": "containerd",
    "kube-proxy": "kube-proxy",
    "kube-network-po": "networkpolicy",
    "docker-registry": "registry",
}
# cgroup v1 cpuacct folders -> group: the first node's pods, each other node's (its cgroup root), the kind nodes
CGROUPS = {"kubepods": "ci-pods", "gpuci-": "ci-pods", "libpod_parent": "kind-nodes"}


def busy_seconds(proc: Path) -> float:
    fields = [int(v) for v in (proc / "stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def daemon_seconds(proc: Path) -> dict[str, float]:
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        group = DAEMONS.get(name)
        if group is None:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[group] = out.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def cgroup_seconds(cpuacct: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        entries = list(cpuacct.iterdir())
    except OSError:  # no cgroup v1 cpuacct here
        return out
    for entry in entries:
        group = next((g for prefix, g in CGROUPS.items() if entry.name.startswith(prefix)), None)
        if group is None or not entry.is_dir():
            continue
        try:
            out[group] = out.get(group, 0.0) + int((entry / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            continue
    return out


def phase(phase_file: Path | None) -> str:
    if phase_file is None:
        return ""
    try:
        lines = phase_file.read_text().split()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def sample(proc: Path, cpuacct: Path, phase_file: Path | None, now: float) -> dict:
    groups = daemon_seconds(proc)
    for group, seconds in cgroup_seconds(cpuacct).items():
        groups[group] = groups.get(group, 0.0) + seconds
    return {"t": round(now, 2), "phase": phase(phase_file), "busy": round(busy_seconds(proc), 2),
            "groups": {k: round(v, 2) for k, v in sorted(groups.items())}}


def alive(pid: int | None) -> bool:
    """Whether the parent still runs: a process that exited but was not yet waited for (a zombie) has not."""
    if pid is None:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--phase-file", type=Path)
    p.add_argument("--parent", type=int, help="stop once this process is gone")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    proc, cpuacct = Path("/proc"), Path("/sys/fs/cgroup/cpuacct")
    while alive(args.parent):
        try:
            row = sample(proc, cpuacct, args.phase_file, time.time())
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        except (OSError, ValueError) as e:  # a sample missed is a gap in the table, never a failed run
            print(f"cpu_sampler: a sample skipped: {e}", file=sys.stderr)
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
