"""Domain formation benchmark (printed, not asserted): N simulated node agents, each with its
own client and node name, write their entries into one GPUDomain on a real API server.

    make bench-domain            (brings the CI cluster up if needed; BENCH_SIZES=50,144,256)

First R is measured: one writer alone in a tight read-update loop. Then for each N and each
strategy, N threads are released at once and each runs the node agent's own writer until
its entry is in (aggregate: its member applied, and the one aggregator's write holding all N); the table gives the time to a Ready domain, t / (N / R), calls per
writer, and the 409 and 429 answers, and checks that no entry was lost and indices are
unique. The simulator (domain_sim.py), calibrated with the measured R, follows.

Then many domains at once (BENCH_MANY=64x18, BENCH_MANY_RUNS=5 runs; BENCH_MANY= skips it): M domains
of n members each, formed together (the cluster agent's EveryDomainAggregator folding them all, in a
process of its own), against a floor measured in the same run: the same M x n member applies from as
many threads and clients with nobody folding, just before and just after (their mean is the run's
floor). Each writer's connection is open before the release on both sides (BENCH_WARM=0: not). Each side of each run has a namespace of its own, deleted and waited for before the next. A watch of the domains,
independent of the aggregator, counts their status writes and sees when each turns Ready (its
readiness latency: its last member's apply -> Ready seen). The median ratio of the runs ends the
table, because one run on a 2-core machine is noise. And the size of
the largest status objects (144 nodes with 4 GPU UUIDs, in one clique and in 8 cliques of 18)
against a quarter of etcd's 1.5 MiB request limit.
"""

from __future__ import annotations

import collections
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

from e2e.cluster import CI_KUBECONFIG
from gpu_agent.foundations.kube import REQUEST_TIMEOUT, api_client
from gpu_agent.mechanisms.domain.aggregate import (
    FOLDER_CONNECTIONS,
    Aggregator,
    EveryDomainAggregator,
    MemberWriter,
    fold,
)
from gpu_agent.mechanisms.domain.entries import Entry
from gpu_agent.mechanisms.domain.writer import GROUP, PLURAL, STRATEGIES, VERSION, DomainWriter
from gpu_agent_hooks.cli import apply_crds

KUBECONFIG = str(CI_KUBECONFIG)  # KUBECONFIG_PATH, else the CI cluster's (e2e/cluster.py chooses where that lives)
REPO = Path(__file__).resolve().parents[2]
# Each invocation, and each run of the many-domains case, in a namespace of its own, deleted (and waited
# for) before the next: a run never meets the last one's terminating namespace, nor its garbage collection.
NAMESPACE = f"bench-domain-{random.Random().getrandbits(24):06x}"
# In the many-domains case each writer's TLS connection is opened (one GET) before the timed release, on both sides,
# as a node agent that has been running holds one. BENCH_WARM=0 opens them inside the timed window instead: 1,152
# handshakes in the same second stalled the API server for seconds in 6 of 15 runs (either side), and the median of
# five then said more about those stalls than about the folder (see docs/domains.md).
WARM = os.environ.get("BENCH_WARM", "1") != "0"


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


def create_namespace(api: client.ApiClient, name: str) -> None:
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)),
                                           _request_timeout=REQUEST_TIMEOUT)


def delete_namespace(api: client.ApiClient, name: str, timeout: float = 180.0) -> float:
    """Delete the namespace and wait until it is gone (its objects' deletion is no next run's load);
    returns the seconds it took."""
    core = client.CoreV1Api(api)
    started = time.monotonic()
    try:
        core.delete_namespace(name, _request_timeout=REQUEST_TIMEOUT)
    except client.ApiException as e:
        if e.status != 404:
            raise
    while time.monotonic() - started < timeout:
        try:
            core.read_namespace(name, _request_timeout=REQUEST_TIMEOUT)
        except client.ApiException as e:
            if e.status == 404:
                return time.monotonic() - started
            raise
        time.sleep(0.5)
    raise TimeoutError(f"namespace {name} still exists {timeout:.0f} s after its deletion")


def fold_process(namespace: str, names: list[str], n: int, results: multiprocessing.Queue) -> None:
    """The cluster agent's side of the many-domains run: fold every domain; report when all are formed
    (CLOCK_MONOTONIC is one clock for every process of the machine)."""
    folding = EveryDomainAggregator(api_client(KUBECONFIG, connections=FOLDER_CONNECTIONS), namespace, interval=float(os.environ.get("BENCH_FOLD_INTERVAL", "0.1")))
    if os.environ.get("BENCH_FOLD_MAX_INTERVAL"):
        folding.MAX_INTERVAL = float(os.environ["BENCH_FOLD_MAX_INTERVAL"])
    threading.Thread(target=folding.run, daemon=True).start()
    deadline = time.monotonic() + 60
    def initialized() -> bool:  # every domain's aggregator listening, and its first status written
        aggregators = [folding.aggregators.get(name) for name in names]
        return all(a is not None and a.writes for a in aggregators)
    while not initialized() and time.monotonic() < deadline:
        time.sleep(0.05)
    # Where a domain's readiness latency goes: when the folder saw its last member, when its write holding
    # every member returned.
    saw_all: dict[str, float] = {}
    wrote_all: dict[str, float] = {}
    cpu_before = time.process_time()  # this process's CPU: the folder's cost (with the 5 ms poll below)
    results.put("ready")

    def formed() -> int:  # polled every 5 ms
        for name in names:
            a = folding.aggregators.get(name)
            if a is not None and len(a.members) == n:
                saw_all.setdefault(name, time.monotonic())
            if a is not None and len((((a.writer.cached or {}).get("status") or {}).get("nodes")) or []) == n:
                wrote_all.setdefault(name, time.monotonic())
        return len(wrote_all)
    while formed() < len(names) and time.monotonic() < deadline + 600:
        time.sleep(0.005)
    formed_at = time.monotonic()
    cpu = time.process_time() - cpu_before
    time.sleep(1.0)  # writes still due (none should be) are counted too
    reasons: collections.Counter[str] = collections.Counter()
    for a in folding.aggregators.values():
        reasons.update(a.write_reasons)
    results.put(("formed", formed_at, dict(reasons), saw_all, wrote_all, cpu))
    folding.stop()


def watch_process(namespace: str, m: int, results: multiprocessing.Queue) -> None:
    """What a reader of the GPUDomains sees, independent of the aggregator's own counts, in a process of
    its own (the writers' threads would delay what it sees): each domain's status writes (its MODIFIED
    events, when seen) and when it was first seen Ready. Reports once every domain is Ready, and one
    second more of writes."""
    from kubernetes import watch

    api = new_client()
    custom = client.CustomObjectsApi(api)
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _request_timeout=REQUEST_TIMEOUT)
    modified: list[tuple[str, float]] = []
    ready_at: dict[str, float] = {}
    w = watch.Watch()
    results.put("watching")
    all_ready = float("inf")
    deadline = time.monotonic() + 660
    while time.monotonic() < min(deadline, all_ready + 1.0):
        for event in w.stream(custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                              resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=1,
                              _request_timeout=(5, 30)):
            seen = time.monotonic()
            obj = event["object"]
            name = obj["metadata"]["name"]
            listed["metadata"]["resourceVersion"] = obj["metadata"]["resourceVersion"]
            if event["type"] == "MODIFIED":
                modified.append((name, seen))
            if (obj.get("status") or {}).get("status") == "Ready":
                ready_at.setdefault(name, seen)
                if len(ready_at) == m and all_ready == float("inf"):
                    all_ready = seen
    w.stop()
    api.close()
    results.put((modified, ready_at))


SERVERS = ("kube-apiserver", "etcd", "kube-controller-manager")


def server_cpu() -> dict[str, float]:
    """CPU seconds the control plane's processes have used, where they run on this machine (the CI cluster);
    empty elsewhere. What each side of a run cost the API server and etcd, beside its time."""
    ticks = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        try:
            comm = (proc / "comm").read_text().strip()
            if comm in SERVERS:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                used[comm] = used.get(comm, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
    return used


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


def many_domains_run(m: int, n: int, run: int) -> dict[str, float]:
    """One run of M domains x n members formed at once, and the floor: the same member applies with no
    aggregator, in the same run, measured just before and just after (their mean is the floor, so a drift
    of the machine's speed within the run cancels), each in a namespace of its own."""
    admin = new_client()
    clients = []

    def client_for_domain() -> client.ApiClient:
        api = new_client()
        # one connection per thread of this domain (the client's pool manager exists already: set it there)
        api.rest_client.pool_manager.connection_pool_kw["maxsize"] = n
        clients.append(api)
        return api

    def apply_all(tag: str, fold_them: bool) -> dict[str, float]:
        namespace = f"{NAMESPACE}-{tag}-{run}"
        create_namespace(admin, namespace)
        custom = client.CustomObjectsApi(admin)
        names = [f"many-{d:03d}" for d in range(m)]
        for name in names:
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomain", "metadata": {"name": name},
                "spec": {"expectedNodes": n}}, _request_timeout=REQUEST_TIMEOUT)
        folding = watcher = None
        if fold_them:  # in a process of its own, as the cluster agent is: the writers' threads do not slow it
            seen: multiprocessing.Queue = multiprocessing.Queue()
            watcher = multiprocessing.Process(target=watch_process, args=(namespace, m, seen), daemon=True)
            watcher.start()
            assert seen.get(timeout=60) == "watching", "the watching process did not start"
            results: multiprocessing.Queue = multiprocessing.Queue()
            folding = multiprocessing.Process(target=fold_process, args=(namespace, names, n, results), daemon=True)
            folding.start()
            assert results.get(timeout=60) == "ready", "the folding process did not start"
        domain_clients = [client_for_domain() for _ in range(m)]
        writers = [(MemberWriter(domain_clients[d], namespace, names[d]),
                    Entry(f"node-{d:03d}-{i:02d}", "", (), True, f"rack-{d:03d}"))
                   for d in range(m) for i in range(n)]
        ok = [False] * len(writers)
        applied = [0.0] * len(writers)

        def write(k: int) -> None:
            ok[k] = writers[k][0].ensure(writers[k][1], deadline=time.monotonic() + 300)
            applied[k] = time.monotonic()

        if WARM:  # each writer's connection open before the release, as a running node agent's is (its watches)
            def warm(k: int) -> None:
                writer = writers[k][0]
                writer.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, writer.domain,
                                                           _request_timeout=REQUEST_TIMEOUT)
            run_together(warm, len(writers), 120)
        cpu_before = server_cpu()
        started = run_together(write, len(writers), 600)
        finished = max(applied)
        out: dict[str, float] = {"lost": float(len(ok) - sum(ok)), "dup": 0.0}
        if out["lost"]:
            errors = sum(w.stats.errors for w, _ in writers)
            print(f"  {tag}: {out['lost']:.0f} member applies gave up ({errors} errors)", flush=True)
        if folding is not None and watcher is not None:
            _, finished, reasons, saw_all, wrote_all, out["folder_cpu"] = results.get(timeout=600)
            out.update({f"why_{k}": float(v) for k, v in reasons.items()})
            folding.join(30)
            modified, ready_at = seen.get(timeout=660)
            watcher.join(30)
            latencies, folder_saw, folder_wrote = [], [], []
            for d, name in enumerate(names):
                obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                          _request_timeout=REQUEST_TIMEOUT)
                nodes = (obj.get("status") or {}).get("nodes") or []
                out["lost"] += n - len(nodes)
                for clique in {e.get("clique") for e in nodes}:
                    indices = [e["index"] for e in nodes if e.get("clique") == clique]
                    out["dup"] += len(indices) - len(set(indices))
                last_apply = max(applied[d * n:(d + 1) * n])
                if name in ready_at:
                    latencies.append(ready_at[name] - last_apply)
                if name in saw_all and name in wrote_all:
                    folder_saw.append(saw_all[name] - last_apply)
                    folder_wrote.append(wrote_all[name] - saw_all[name])
            # each domain's first status (NotReady, no member) is written before the release (see fold_process)
            out["initial_writes"] = float(sum(1 for _, when in modified if when < started))
            out["status_writes"] = float(sum(1 for _, when in modified if when >= started))
            out["never_ready"] = float(m - len(latencies))
            out["ready_p50"], out["ready_p99"] = percentile(latencies, 0.5), percentile(latencies, 0.99)
            out["saw_p50"], out["saw_p99"] = percentile(folder_saw, 0.5), percentile(folder_saw, 0.99)
            out["wrote_p50"], out["wrote_p99"] = percentile(folder_wrote, 0.5), percentile(folder_wrote, 0.99)
        out["t"] = finished - started
        cpu_after = server_cpu()  # the formed side: once every domain was formed (and 1 s of late writes)
        out["server_cpu"] = sum(cpu_after.get(k, 0.0) - cpu_before.get(k, 0.0) for k in SERVERS)
        out["apiserver_cpu"] = cpu_after.get("kube-apiserver", 0.0) - cpu_before.get("kube-apiserver", 0.0)
        for api in domain_clients:
            api.close()
        out["ns_gone_s"] = delete_namespace(admin, namespace)
        return out

    before = apply_all("floor-before", fold_them=False)
    formed = apply_all("formed", fold_them=True)
    after = apply_all("floor-after", fold_them=False)
    admin.close()
    floor = (before["t"] + after["t"]) / 2
    return {**{k: v for k, v in formed.items() if k.startswith(("why_", "saw_", "wrote_", "folder_"))},
            "initial_writes": formed["initial_writes"], "t": formed["t"], "floors": (before["t"], after["t"]),
            "floor": floor, "ratio": formed["t"] / floor, "status_writes": formed["status_writes"],
            "lost": formed["lost"] + before["lost"] + after["lost"], "dup": formed["dup"],
            "server_cpu": (before["server_cpu"], formed["server_cpu"], after["server_cpu"]),
            "apiserver_cpu": (before["apiserver_cpu"], formed["apiserver_cpu"], after["apiserver_cpu"]),
            "ready_p50": formed["ready_p50"], "ready_p99": formed["ready_p99"], "never_ready": formed["never_ready"]}


def many_domains(m: int, n: int, runs: int) -> list[str]:
    print(f"{'run':>3} {'t (s)':>7} {'floor (s): before, after, mean':>30} {'ratio':>6} {'status writes':>13} {'per domain':>10} "
          f"{'ready p50':>9} {'ready p99':>9} {'lost':>5} {'dup idx':>7}", flush=True)
    ratios = []
    for run in range(runs):
        r = many_domains_run(m, n, run)
        ratios.append(r["ratio"])
        never = f"   ({r['never_ready']:.0f} domains never seen Ready)" if r["never_ready"] else ""
        why = ", ".join(f"{r[k]:.0f} {k[4:]}" for k in sorted(r) if k.startswith("why_"))
        floors = f"{r['floors'][0]:.1f}, {r['floors'][1]:.1f}, {r['floor']:.2f}"
        print(f"{run + 1:>3} {r['t']:>7.1f} {floors:>30} {r['ratio']:>6.2f} "
              f"{r['status_writes']:>13.0f} {r['status_writes'] / m:>10.2f} {r['ready_p50']:>8.2f}s {r['ready_p99']:>8.2f}s "
              f"{r['lost']:>5.0f} {r['dup']:>7.0f}   (aggregator: {why}; {r['initial_writes']:.0f} first statuses before;"
              f" last apply -> folder saw it p50/p99 {r['saw_p50']:.2f}/{r['saw_p99']:.2f}s -> its write returned"
              f" {r['wrote_p50']:.2f}/{r['wrote_p99']:.2f}s; folder CPU {r['folder_cpu']:.1f}s;"
              f" API server + etcd + controller-manager CPU floor before/formed/after"
              f" {'/'.join(f'{c:.1f}' for c in r['server_cpu'])}s, of it the API server"
              f" {'/'.join(f'{c:.1f}' for c in r['apiserver_cpu'])}s)"
              f"{never}", flush=True)
    ordered = sorted(ratios)
    return [f"median ratio of {runs} runs: {ordered[len(ordered) // 2] if runs % 2 else sum(ordered[runs // 2 - 1:runs // 2 + 1]) / 2:.2f}"
            f" (t: the aggregator's write holding every member of every domain; floor: the same {m * n} member applies"
            f" unfolded; ready: a domain's last member applied -> seen Ready by a watch; status writes: MODIFIED events"
            f" of the domains, seen by that watch)"]


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
    if sizes:
        create_namespace(api, NAMESPACE)
        rate = measure_rate()
        print(f"R (one writer, read + update status, 5 s) = {rate:.1f}/s")
        print(f"{'N':>5} {'strategy':<11} {'t (s)':>8} {'t/(N/R)':>8} {'calls/w':>8} {'409s':>7} {'429s':>5} {'lost':>5} "
              f"{'unique':>7} {'domain':>9}")
        for n in sizes:
            for strategy in ("aggregate", *STRATEGIES):
                print(run(n, strategy, rate), flush=True)
        print()
        print(sim_table(rate))
        delete_namespace(api, NAMESPACE)
    many = os.environ.get("BENCH_MANY", "64x18")
    if many:
        m, n = (int(x) for x in many.split("x"))
        runs = int(os.environ.get("BENCH_MANY_RUNS", "5"))
        print(f"\nmany domains at once: {m} domains x {n} members, {runs} runs, each against the floor of the same "
              f"member applies unfolded, measured in the same run")
        for line in many_domains(m, n, runs):
            print(line, flush=True)
    print("\nstatus object size (what the aggregator writes):")
    for line in status_sizes():
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
