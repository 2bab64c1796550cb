"""A discrete-event simulator of N node agents writing one GPUDomain, calibrated with R.

Model: one writer alone completes R read-write cycles a second (as measured), so each request
takes 1 / (2R): a share `SERVICE` of it is API-server work on one of `SLOTS` parallel workers
(2 cores), the rest is client and network time that does not queue. A write succeeds if the
object has not changed since the writer's read, else it is a 409 and the writer backs off
with its strategy's delays, then reads again. Conflicting writes cost the server as much as
successful ones, which is what makes contention expensive on a real API server. The defaults
are calibrated against the measured DRA figures at N = 144 and 256 (about 5x ideal, about
20 calls per writer), which they reproduce within 10 %; at N = 50 they are pessimistic (4x vs 1.9x).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from gpu_agent.mechanisms.domain.writer import make_backoff


@dataclass
class SimResult:
    seconds: float
    calls_per_writer: float
    conflicts: int


SLOTS = 2
SERVICE = 0.5


AGGREGATE_INTERVAL = 0.1


def simulate_aggregate(n: int, rate: float, slots: int = SLOTS, service: float = SERVICE) -> SimResult:
    """Every node applies its own member (one request each, no conflicts); one aggregator folds
    them with one status write per batch interval, starting when the first member lands."""
    per_request = 1.0 / (2 * rate)
    cost, latency = per_request * service, per_request * (1 - service)
    free = [0.0] * slots
    landed = []
    for _ in range(n):
        slot = min(range(slots), key=free.__getitem__)
        start = max(latency, free[slot])
        free[slot] = start + cost
        landed.append(free[slot])
    last = max(landed)
    t = min(landed)
    while True:  # the aggregator's batches: each takes the interval, then one write
        t += AGGREGATE_INTERVAL + latency + cost
        if t - latency - cost - AGGREGATE_INTERVAL >= last:
            return SimResult(t, 1.0, 0)


def simulate(n: int, rate: float, strategy: str, seed: int = 1, slots: int = SLOTS, service: float = SERVICE) -> SimResult:
    if strategy == "aggregate":
        return simulate_aggregate(n, rate, slots, service)
    rng = random.Random(seed)
    per_request = 1.0 / (2 * rate)
    cost, latency = per_request * service, per_request * (1 - service)
    free = [0.0] * slots
    version = 0
    events: list[tuple[float, int, str, int]] = []
    seq = 0
    read_version = [0] * n
    backoffs = [make_backoff(strategy, n, rate, random.Random(rng.random())) for _ in range(n)]
    calls = [0] * n
    conflicts = 0
    done = 0
    finished_at = 0.0

    def request(t: float, kind: str, w: int) -> None:
        nonlocal seq
        slot = min(range(slots), key=free.__getitem__)
        start = max(t + latency, free[slot])
        free[slot] = start + cost
        calls[w] += 1
        seq += 1
        heapq.heappush(events, (free[slot], seq, kind, w))

    for w in range(n):
        request(0.0, "read", w)
    while events:
        t, _, kind, w = heapq.heappop(events)
        if kind == "read":
            read_version[w] = version
            request(t, "write", w)
        elif kind == "write":
            if read_version[w] == version:
                version += 1
                done += 1
                finished_at = t
            else:
                conflicts += 1
                seq += 1
                heapq.heappush(events, (t + backoffs[w].next_delay(), seq, "retry", w))
        else:
            request(t, "read", w)
    assert done == n
    return SimResult(finished_at, sum(calls) / n, conflicts)


def table(rate: float, sizes: tuple[int, ...] = (50, 144, 256, 1000, 5000)) -> str:
    rows = [f"simulated, R = {rate:.1f}/s", f"{'N':>6} {'strategy':<11} {'t (s)':>9} {'t/(N/R)':>8} {'calls/w':>8} {'409s':>8}"]
    for n in sizes:
        for strategy in ("aggregate", "dra", "fulljitter"):
            r = simulate(n, rate, strategy)
            rows.append(f"{n:>6} {strategy:<11} {r.seconds:>9.1f} {r.seconds / (n / rate):>8.2f} "
                        f"{r.calls_per_writer:>8.1f} {r.conflicts:>8}")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    print(table(float(sys.argv[1]) if len(sys.argv) > 1 else 24.0))
