"""Domain formation benchmark (printed, not asserted): N simulated node agents, each with its
own client and node name, write their entries into one GPUDomain on a real API server.

    make bench-domain            (brings the CI cluster up if needed; BENCH_SIZES=50,144,256)

First R is measured: one writer alone in a tight read-update loop. Then for each N and each
strategy, N threads are released at once and each runs the node agent's own writer until
its entry is in (aggregate: its member applied, and the one aggregator's write holding all N); the table gives the time to a Ready domain, t / (N / R), calls per
writer, and the 409 and 429 answers, and checks that no entry was lost and indices are
unique. The simulator (domain_sim.py), calibrated with the measured R, follows.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from kubernetes import client, config

from bench.domain_sim import table as sim_table
from gpu_agent.mechanisms.domain.aggregate import Aggregator, MemberWriter
from gpu_agent.mechanisms.domain.entries import Entry
from gpu_agent.mechanisms.domain.writer import GROUP, PLURAL, STRATEGIES, VERSION, DomainWriter
from gpu_agent_hooks.cli import apply_crds

KUBECONFIG = os.environ.get("KUBECONFIG_PATH", "/var/lib/gpu-agent-ci/admin.kubeconfig")
NAMESPACE = "bench-domain"
REPO = Path(__file__).resolve().parents[2]


def new_client() -> client.ApiClient:
    return config.new_client_from_config(KUBECONFIG)


def make_domain(custom: client.CustomObjectsApi, name: str, expected: int) -> None:
    try:
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
        time.sleep(0.5)
    except client.ApiException:
        pass
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomain", "metadata": {"name": name},
        "spec": {"expectedNodes": expected}})


def measure_rate(seconds: float = 5.0) -> float:
    api = new_client()
    custom = client.CustomObjectsApi(api)
    make_domain(custom, "bench-rate", 1)
    done, flip, deadline = 0, False, time.monotonic() + seconds
    while time.monotonic() < deadline:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "bench-rate")
        flip = not flip
        obj["status"] = {"nodes": [{"name": "solo", "index": 0, "status": "Ready" if flip else "NotReady"}]}
        custom.replace_namespaced_custom_object_status(GROUP, VERSION, NAMESPACE, PLURAL, "bench-rate", obj)
        done += 1
    return done / seconds


def run(n: int, strategy: str, rate: float) -> str:
    name = f"bench-{strategy}-{n}"
    custom = client.CustomObjectsApi(new_client())
    make_domain(custom, name, n)
    aggregator = None
    if strategy == "aggregate":
        writers: list = [MemberWriter(new_client(), NAMESPACE, name) for _ in range(n)]
        aggregator = Aggregator(new_client(), NAMESPACE, name)
        threading.Thread(target=aggregator.run, daemon=True).start()
    else:
        writers = [DomainWriter(new_client(), NAMESPACE, name, strategy, rate, random.Random(i)) for i in range(n)]
    barrier = threading.Barrier(n + 1)
    finished = [0.0] * n
    ok = [False] * n

    def writer_thread(i: int) -> None:
        barrier.wait()
        ok[i] = writers[i].ensure(Entry(f"node-{i:04d}", f"10.1.{i // 250}.{i % 250}", (), True),
                                  deadline=time.monotonic() + float(os.environ.get("BENCH_DEADLINE", "180")))
        finished[i] = time.monotonic()

    threads = [threading.Thread(target=writer_thread, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.monotonic()
    for t in threads:
        t.join(660)
    if aggregator is not None:
        # the domain is formed when the aggregator's write holds every member
        def complete() -> bool:
            cached = aggregator.writer.cached or {}
            return len(((cached.get("status") or {}).get("nodes")) or []) == n
        while not complete() and time.monotonic() - started < 600:
            time.sleep(0.005)
        finished.append(time.monotonic())
        aggregator.stop()
    elapsed = max(finished) - started
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    nodes = (obj.get("status") or {}).get("nodes") or []
    indices = [e["index"] for e in nodes]
    present = {e["name"] for e in nodes}
    # lost: a writer was told its entry was in, and it is not; gave up: a writer hit the deadline
    lost = sum(1 for i in range(n) if ok[i] and f"node-{i:04d}" not in present)
    gave_up = n - sum(ok)
    unique = len(indices) == len(set(indices))
    calls = sum(w.stats.calls for w in writers) / n
    conflicts = sum(w.stats.conflicts for w in writers)
    throttled = sum(w.stats.throttled for w in writers)
    ready = (obj.get("status") or {}).get("status")
    for w in writers:
        w.api.close()
    note = f" (+{aggregator.writes} aggregator writes)" if aggregator is not None else ""
    return (f"{n:>5} {strategy:<11} {elapsed:>8.1f} {elapsed / (n / rate):>8.2f} {calls:>8.1f} {conflicts:>7} {throttled:>5} "
            f"{lost:>5} {'yes' if unique else 'NO':>7} {ready:>9}{note}{f' ({gave_up} writers gave up at the deadline)' if gave_up else ''}")


def main() -> int:
    sizes = [int(x) for x in os.environ.get("BENCH_SIZES", "50,144,256").split(",")]
    api = new_client()
    apply_crds(api, REPO / "charts" / "gpu-agent" / "crds")
    try:
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    except client.ApiException as e:
        if e.status != 409:
            raise
    rate = measure_rate()
    print(f"R (one writer, read + update status, 5 s) = {rate:.1f}/s")
    print(f"{'N':>5} {'strategy':<11} {'t (s)':>8} {'t/(N/R)':>8} {'calls/w':>8} {'409s':>7} {'429s':>5} {'lost':>5} "
          f"{'unique':>7} {'domain':>9}")
    for n in sizes:
        for strategy in ("aggregate", *STRATEGIES):
            print(run(n, strategy, rate), flush=True)
    print()
    print(sim_table(rate))
    client.CoreV1Api(api).delete_namespace(NAMESPACE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
