"""Domain formation benchmark (printed, not asserted): N simulated node agents, each with its
own client and node name, write their entries into one GPUDomain on a real API server.

    make bench-domain            (brings the CI cluster up if needed; BENCH_SIZES=50,144,256)

First R is measured: one writer alone in a tight read-update loop. Then for each N and each
strategy, N threads are released at once and each runs the node agent's own writer until
its entry is in (aggregate: its member applied, and the one aggregator's write holding all N); the table gives the time to a Ready domain, t / (N / R), calls per
writer, and the 409 and 429 answers, and checks that no entry was lost and indices are
unique. The simulator (domain_sim.py), calibrated with the measured R, follows.

Then many domains at once (BENCH_MANY=64x18): M domains of n members each, formed together (the
cluster agent's EveryDomainAggregator folding them all), against a floor measured in the same run:
the same M x n member applies from as many threads and clients with nobody folding. And the size of
the largest status objects (144 nodes with 4 GPU UUIDs, in one clique and in 8 cliques of 18)
against a quarter of etcd's 1.5 MiB request limit.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.domain_sim import table as sim_table
from kubernetes import client, config

from gpu_agent.foundations.kube import REQUEST_TIMEOUT
from gpu_agent.mechanisms.domain.aggregate import Aggregator, EveryDomainAggregator, MemberWriter, fold
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
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, _request_timeout=REQUEST_TIMEOUT)
        time.sleep(0.5)
    except client.ApiException:
        pass
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomain", "metadata": {"name": name},
        "spec": {"expectedNodes": expected}}, _request_timeout=REQUEST_TIMEOUT)


def measure_rate(seconds: float = 5.0) -> float:
    api = new_client()
    custom = client.CustomObjectsApi(api)
    make_domain(custom, "bench-rate", 1)
    done, flip, deadline = 0, False, time.monotonic() + seconds
    while time.monotonic() < deadline:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "bench-rate", _request_timeout=REQUEST_TIMEOUT)
        flip = not flip
        obj["status"] = {"nodes": [{"name": "solo", "index": 0, "status": "Ready" if flip else "NotReady"}]}
        custom.replace_namespaced_custom_object_status(GROUP, VERSION, NAMESPACE, PLURAL, "bench-rate", obj, _request_timeout=REQUEST_TIMEOUT)
        done += 1
    return done / seconds


def run_together(target: Callable[[int], None], count: int, timeout: float) -> float:
    """`count` threads running target(i), released at once by a barrier; returns when they were
    released, after all have finished (or `timeout` passed)."""
    barrier = threading.Barrier(count + 1)

    def released(i: int) -> None:
        barrier.wait()
        target(i)

    threads = [threading.Thread(target=released, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.monotonic()
    for t in threads:
        t.join(timeout)
    return started


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
    finished = [0.0] * n
    ok = [False] * n

    def writer_thread(i: int) -> None:
        ok[i] = writers[i].ensure(Entry(f"node-{i:04d}", f"10.1.{i // 250}.{i % 250}", (), True),
                                  deadline=time.monotonic() + float(os.environ.get("BENCH_DEADLINE", "180")))
        finished[i] = time.monotonic()

    started = run_together(writer_thread, n, 660)
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
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, _request_timeout=REQUEST_TIMEOUT)
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


def fold_process(names: list[str], n: int, results: multiprocessing.Queue) -> None:
    """The cluster agent's side of the many-domains run: fold every domain; report when all are formed
    (CLOCK_MONOTONIC is one clock for every process of the machine)."""
    folding = EveryDomainAggregator(new_client(), NAMESPACE, interval=float(os.environ.get("BENCH_FOLD_INTERVAL", "0.1")))
    threading.Thread(target=folding.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while not set(names) <= set(folding.aggregators) and time.monotonic() < deadline:
        time.sleep(0.05)  # every domain's aggregator listening before the writers start
    results.put("ready")

    def formed() -> int:
        aggregators = [folding.aggregators.get(name) for name in names]
        return sum(1 for a in aggregators
                   if a is not None and len((((a.writer.cached or {}).get("status") or {}).get("nodes")) or []) == n)
    while formed() < len(names) and time.monotonic() < deadline + 600:
        time.sleep(0.005)
    results.put(("formed", time.monotonic(), sum(a.writes for a in folding.aggregators.values())))
    folding.stop()


def many_domains(m: int, n: int) -> list[str]:
    """M domains x n members at once, then the floor: the same member applies with no aggregator."""
    clients = []

    def client_for_domain() -> client.ApiClient:
        api = new_client()
        # one connection per thread of this domain (the client's pool manager exists already: set it there)
        api.rest_client.pool_manager.connection_pool_kw["maxsize"] = n
        clients.append(api)
        return api

    status_writes = [0]

    def apply_all(tag: str, fold_them: bool) -> tuple[float, int, int]:
        custom = client.CustomObjectsApi(new_client())
        names = [f"many-{tag}-{d:03d}" for d in range(m)]
        for name in names:
            make_domain(custom, name, n)
        folding = None
        if fold_them:  # in a process of its own, as the cluster agent is: the writers' threads do not slow it
            results: multiprocessing.Queue = multiprocessing.Queue()
            folding = multiprocessing.Process(target=fold_process, args=(names, n, results), daemon=True)
            folding.start()
            assert results.get(timeout=60) == "ready", "the folding process did not start"
        domain_clients = [client_for_domain() for _ in range(m)]
        writers = [(MemberWriter(domain_clients[d], NAMESPACE, names[d]), Entry(f"node-{d:03d}-{i:02d}", "", (), True,
                                                                              f"rack-{d:03d}"))
                   for d in range(m) for i in range(n)]
        ok = [False] * len(writers)

        def write(k: int) -> None:
            ok[k] = writers[k][0].ensure(writers[k][1], deadline=time.monotonic() + 300)

        started = run_together(write, len(writers), 600)
        finished = time.monotonic()
        if folding is not None:
            _, finished, status_writes[0] = results.get(timeout=600)
            folding.join(30)
        elapsed = finished - started
        lost = bad_indices = 0
        if folding is not None:
            for name in names:
                obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, _request_timeout=REQUEST_TIMEOUT)
                nodes = (obj.get("status") or {}).get("nodes") or []
                lost += n - len(nodes)
                for clique in {e.get("clique") for e in nodes}:
                    indices = [e["index"] for e in nodes if e.get("clique") == clique]
                    bad_indices += len(indices) - len(set(indices))
        gave_up = len(ok) - sum(ok)
        if gave_up:
            errors = sum(w.stats.errors for w, _ in writers)
            print(f"  {tag}: {gave_up} member applies gave up ({errors} errors)", flush=True)
        return elapsed, lost + gave_up, bad_indices

    # formed first: the floor's domains must not exist while the cluster agent's folder watches them all
    formed, lost, bad = apply_all("formed", fold_them=True)
    floor, floor_lost, _ = apply_all("floor", fold_them=False)
    for api in clients:
        api.close()
    return [f"{'M x n':>8} {'members':>8} {'t (s)':>7} {'floor (s)':>9} {'ratio':>6} {'writes':>7} {'lost':>5} {'dup idx':>7}",
            f"{f'{m} x {n}':>8} {m * n:>8} {formed:>7.1f} {floor:>9.1f} {formed / floor:>6.2f} {m * n + status_writes[0]:>7} "
            f"{lost + floor_lost:>5} {bad:>7}   (writes: {m * n} member applies + {status_writes[0]} status writes)"]


def status_sizes() -> list[str]:
    """Bytes of the GPUDomain as the aggregator writes it, at the largest sizes we plan for."""
    limit = 1.5 * 2**20
    rows = []
    for label, cliques, per in (("144 nodes, one clique", 1, 144), ("8 cliques of 18", 8, 18)):
        members = {f"node-{c:02d}-{i:03d}": {"ready": True, "ip": f"10.{c}.{i // 250}.{i % 250}", "clique":
                   f"6f9619ff-8b86-d011-b42d-00c04fc964ff.{c}",
                   "gpuUUIDs": [f"GPU-{c:02d}{i:06d}-0000-0000-0000-00000000000{g}" for g in range(4)]}
                   for c in range(cliques) for i in range(per)}
        obj = fold({"apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomain",
                    "metadata": {"name": "big", "namespace": NAMESPACE}, "spec": {"expectedNodes": 144}}, members)
        size = len(json.dumps(obj, separators=(",", ":")))
        rows.append(f"{label}: {size / 1024:.1f} KiB = {size / limit:.1%} of etcd's 1.5 MiB request limit (goal < 25%)")
    return rows


def main() -> int:
    sizes = [int(x) for x in os.environ.get("BENCH_SIZES", "50,144,256").split(",") if x]  # "": many domains only
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
    m, n = (int(x) for x in os.environ.get("BENCH_MANY", "64x18").split("x"))
    print(f"\nmany domains at once: {m} domains x {n} members, against the floor of the same member applies unfolded")
    for line in many_domains(m, n):
        print(line, flush=True)
    print("\nstatus object size (what the aggregator writes):")
    for line in status_sizes():
        print(line)
    client.CoreV1Api(api).delete_namespace(NAMESPACE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
