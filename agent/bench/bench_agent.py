"""Benchmark (printed, not asserted): GPU arrival -> Ready and removal -> NotReady latency,
agent RSS and idle CPU, with the agent's default poll intervals.

    make bench        (or: PYTHONPATH=agent python agent/bench/bench_agent.py)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.integration.harness import Rig

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "10"))
IDLE_SECONDS = float(os.environ.get("BENCH_IDLE_SECONDS", "20"))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(Path(tmp))
        rig.start_control_plane()
        rig.set_gpus(0)
        agent = rig.start_agent(*sys.argv[1:], verbosity=0, fast_polls=False)  # the defaults: honest figures
        arrive, leave = [], []
        for _ in range(ROUNDS):
            t0 = time.monotonic()
            rig.set_gpus(4)
            rig.wait_health(200, 10)
            arrive.append(time.monotonic() - t0)
            t0 = time.monotonic()
            rig.set_gpus(0)
            rig.wait_health(503, 10)
            leave.append(time.monotonic() - t0)
        rig.set_gpus(4)
        rig.wait_health(200, 10)
        time.sleep(2)  # measured idle window starts after start-up work has settled
        c0, w0 = cpu_seconds(agent.pid), time.monotonic()
        time.sleep(IDLE_SECONDS)
        idle_cpu = (cpu_seconds(agent.pid) - c0) / (time.monotonic() - w0) * 100
        rss = rss_mib(agent.pid)
        rig.stop()
    print(f"gpu-agent cluster agent benchmark ({ROUNDS} rounds, default poll 0.5 s; fake-gpu command time included)")
    print(f"{'measure':<34}{'median':>10}{'worst':>10}{'goal':>10}")
    print(f"{'GPU arrival -> /healthz 200 (s)':<34}{statistics.median(arrive):>10.3f}{max(arrive):>10.3f}{'<= 2':>10}")
    print(f"{'GPU removal -> /healthz 503 (s)':<34}{statistics.median(leave):>10.3f}{max(leave):>10.3f}{'<= 2':>10}")
    print(f"{'RSS, Ready and idle (MiB)':<34}{rss:>10.1f}{'':>10}{'<= 60':>10}")
    print(f"{f'idle CPU over {IDLE_SECONDS:.0f} s (% of a core)':<34}{idle_cpu:>10.2f}{'':>10}{'<= 0.5':>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
