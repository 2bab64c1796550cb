"""Benchmark (printed, not asserted): how fast work moves through the queue (issue 25).

Part 1, the control plane alone on loopback: a control plane process (its SQLite database on disk, WAL,
fsync on every commit, as deployed), ITEMS items enqueued, then 1, 4 and 16 consumer threads, each with
its own HTTP session, lease and ack until the queue is empty: lease+ack per second, with one item per
lease call (what every client did before maxItems) and with several (maxItems; skipped against a
control plane without it). The database starts with DONE items already done, as they pile up in a real
one (and those of each run stay), so a lease query that scans them shows. Each figure is the median of
REPEAT runs (the machine is noisy). Run it with PYTHONPATH at an older tree for the figures before.

Part 2, the cluster (`BENCH_CLUSTER=1`, what `make bench-queue` runs): see e2e/bench_work_queue.py.

    make bench-queue     (or: PYTHONPATH=agent python agent/bench/bench_queue.py)
    BENCH_CP_ONLY=1      part 1 only (no cluster needed)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.integration.harness import Rig

from gpu_agent.foundations.control_plane_client import ControlPlaneClient
from gpu_agent.foundations.gpus import GPU, Inventory

ITEMS = int(os.environ.get("BENCH_ITEMS", "480"))
CONSUMERS = (1, 4, 16)
BATCH = int(os.environ.get("BENCH_BATCH", "16"))  # maxItems of a batched consumer: a 16-GPU node's slots
DONE = int(os.environ.get("BENCH_DONE", "20000"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))


def backlog(db: Path) -> None:
    """DONE items already done, written before the control plane starts (its own Store makes the schema)."""
    from gpu_agent.roles.control_plane.store import Store

    store = Store(db)
    with store._lock:
        store._db.execute("BEGIN")
        store._db.executemany("INSERT INTO items (idempotency_key, payload, state, deliveries, created_at, acked_at) "
                              "VALUES (?, '{}', 'done', 1, 0, 0)", ((f"old-{n}",) for n in range(DONE)))
        store._db.execute("COMMIT")
    store.close()


def consume(url: str, credential: object, fence: object, batch: int, start: threading.Barrier) -> int:
    client = ControlPlaneClient(url, timeout=30)
    done = 0
    start.wait()
    while True:
        if batch == 1:
            item = client.lease(credential, 60, 0, fence)  # type: ignore[arg-type]
            items = [item] if item is not None else []
        else:
            items = client.lease_many(credential, 60, 0, fence, batch)  # type: ignore[arg-type]
        if not items:
            client.close()
            return done
        for item in items:
            client.ack(credential, item)  # type: ignore[arg-type]
            done += 1


def control_plane_alone() -> list[tuple[int, int, float]]:
    """(consumers, items per lease call, median lease+ack per second) for each setting."""
    rates: dict[tuple[int, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(Path(tmp))
        backlog(Path(tmp) / "cp.sqlite")
        try:
            admin = rig.start_control_plane()
            credential = admin.register(rig.registration_token, "bench", 1,
                                        Inventory((GPU("GPU-00000000-0000-0000-0000-000000000001", "fake", 1 << 30),))
                                        ).credential.token
            fence = admin.start_term(credential, "bench")
            batches = (1, BATCH) if hasattr(admin, "lease_many") else (1,)
            run = 0
            for consumers, batch in [(c, b) for _ in range(REPEAT) for c in CONSUMERS for b in batches]:
                run += 1
                with ThreadPoolExecutor(8) as pool:  # enqueued before the clock starts
                    list(pool.map(lambda n, r=run: admin.enqueue(rig.admin_token, f"r{r}-{n}", {"command": ["true"]}),
                                  range(ITEMS)))
                start = threading.Barrier(consumers + 1)
                with ThreadPoolExecutor(consumers) as pool:
                    futures = [pool.submit(consume, rig.cp_url, credential, fence, batch, start)
                               for _ in range(consumers)]
                    start.wait()
                    began = time.monotonic()
                    moved = sum(f.result() for f in futures)
                    took = time.monotonic() - began
                assert moved == ITEMS, (moved, ITEMS)  # every item exactly once, or the figure means nothing
                rates.setdefault((consumers, batch), []).append(moved / took)
        finally:
            rig.stop()
    return [(c, b, statistics.median(r)) for (c, b), r in sorted(rates.items())]


def print_control_plane(rows: list[tuple[int, int, float]]) -> None:
    print(f"\ncontrol plane alone on loopback ({ITEMS} items per run, {DONE} done before, SQLite WAL, fsync per "
          f"commit; median of {REPEAT})")
    print(f"  {'consumers':>9}  {'items/call':>10}  {'lease+ack/s':>11}")
    for consumers, batch, rate in rows:
        print(f"  {consumers:>9}  {batch:>10}  {rate:>11.0f}")


def main() -> int:
    print_control_plane(control_plane_alone())
    if os.environ.get("BENCH_CP_ONLY") == "1":
        return 0
    from e2e.bench_work_queue import main as on_the_cluster  # the cluster part: e2e's helpers and clients

    return on_the_cluster()


if __name__ == "__main__":
    sys.exit(main())
