"""Idle footprint of each worker node of the CI cluster: the resident memory and CPU of its own
daemons (kubelet, containerd, kube-proxy and the namespace holder), sampled over a window.

    python3 ci/tools/node_footprint.py [--seconds 30]

A benchmark: it measures and prints; the goal (250 MiB and 3 % of a core per extra node) is
printed beside it, not asserted. Pods the node runs are not counted: they are the workload."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: e2e/cluster.py chooses CLUSTER_DIR
from e2e.cluster import CI_CLUSTER_DIR

PIDS = CI_CLUSTER_DIR / "pids"
DAEMONS = ("holder", "containerd", "kubelet", "kube-proxy")
TICKS = os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    workers = sorted({p.name.split("-", 1)[0] for p in PIDS.glob("w*-holder.pid")})
    if not workers:
        raise SystemExit("no worker nodes: make cluster-up NODES=3")
    pids = {w: {d: int((PIDS / f"{w}-{d}.pid").read_text()) for d in DAEMONS if (PIDS / f"{w}-{d}.pid").exists()}
            for w in workers}
    before = {w: {d: cpu_seconds(p) for d, p in ds.items()} for w, ds in pids.items()}
    started = time.monotonic()
    time.sleep(args.seconds)
    elapsed = time.monotonic() - started
    print(f"idle footprint per worker node over {elapsed:.0f} s (goal: <= 250 MiB, <= 3 % of a core)")
    print(f"{'node':6} {'RSS MiB':>8} {'CPU %':>6}   " + "  ".join(f"{d} (MiB, %)" for d in DAEMONS))
    for w, ds in pids.items():
        rss = {d: rss_mib(p) for d, p in ds.items()}
        cpu = {d: 100 * (cpu_seconds(p) - before[w][d]) / elapsed for d, p in ds.items()}
        print(f"{w:6} {sum(rss.values()):8.0f} {sum(cpu.values()):6.2f}   "
              + "  ".join(f"{d} ({rss[d]:.0f}, {cpu[d]:.2f})" for d in ds))


if __name__ == "__main__":
    main()
