"""Benchmark (printed, not asserted), part 2 of `make bench-queue`: work items through the chart's cluster agent
against the floor the cluster itself sets (issue 25).

On the CI cluster, in a namespace of its own: charts/fake-gpu with 16 GPUs on one node, and charts/gpu-agent
installed as the e2e suite installs it (reference control plane, cluster GPU source, Pod executor, the
default queue.maxInFlight). Then BENCH_RUNS runs, each of two sides in turn:

- the floor: ITEMS one-GPU Pods that exit at once (`true`), created straight through the API by a plain
  client that keeps at most 16 of them in existence (16 threads, each: create, wait Succeeded, delete,
  wait gone), so the API server, scheduler and kubelet set the pace;
- the agent: the same ITEMS as work items (payload gpus 1, command `true`), enqueued at once in one
  exec beside the control plane; done when a watch has seen every item's Pod deleted.

Both sides are timed the same way, on this machine's clock: from the first create (the first enqueue)
to the last of their Pods gone. Enqueue -> Running uses the control plane's createdAt and the moment
the watch first saw the Pod with a container started; enqueue -> acked the control plane's createdAt
and ackedAt (the same clock, the node's). Pods per item counts the distinct Pod UIDs the watch saw
(independent of the agent). Pod GETs per item are the API server's own count (apiserver_request_total) over
the side's run, from every client: the floor's are the kubelet's alone (the floor watches), so the agent's
row less the floor's is what the agent reads. The agent's RSS and CPU are read from its container's /proc/1 at the
run's start and end, RSS also every 2 s in between (the peak is printed).

    python e2e/bench_work_queue.py     (PYTHONPATH=agent:.; KUBECONFIG_PATH, BENCH_RUNS=3, BENCH_ITEMS=300)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

from e2e.cluster import CI_KUBECONFIG, host_paths, tool
from e2e.helpers import api_server_requests, exec_in, wait_until
from e2e.release import WAIT, Release
from gpu_agent.foundations.kube import device_count
from gpu_agent.mechanisms.queues.pod_executor import pod_name

REPO = Path(__file__).resolve().parents[1]
ITEMS = int(os.environ.get("BENCH_ITEMS", "300"))
RUNS = int(os.environ.get("BENCH_RUNS", "3"))
GPUS = 16
GOAL = 0.8
SECURITY = {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


class PodTimes:
    """What a watch of one label selector sees, by Pod name, on this machine's clock: when each was first
    seen with a container started, Succeeded, and deleted; and every UID (Pods per name)."""

    def __init__(self, core: client.CoreV1Api, namespace: str, selector: str) -> None:
        self.core, self.namespace, self.selector = core, namespace, selector
        self.started: dict[str, float] = {}
        self.succeeded: dict[str, float] = {}
        self.gone: dict[str, float] = {}
        self.uids: dict[str, set[str]] = {}
        self.gaps = 0
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    listed = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
                    for pod in listed.items:
                        self._record("MODIFIED", pod)
                    rv = listed.metadata.resource_version
                self._watch = watch.Watch()
                for event in self._watch.stream(self.core.list_namespaced_pod, self.namespace,
                                                label_selector=self.selector, resource_version=rv, timeout_seconds=300):
                    self._record(event["type"], event["object"])
                    rv = event["object"].metadata.resource_version
            except Exception:  # noqa: BLE001 - relisted; counted (a Pod created and deleted in the gap is missed)
                if self._stop.is_set():
                    return
                self.gaps += 1
                rv = None
                self._stop.wait(0.1)

    def _record(self, kind: str, pod: Any) -> None:
        now, name = time.time(), pod.metadata.name
        with self.changed:
            self.uids.setdefault(name, set()).add(pod.metadata.uid)
            statuses = pod.status.container_statuses or []
            if any(s.state and (s.state.running or s.state.terminated) for s in statuses):
                self.started.setdefault(name, now)
            if pod.status.phase == "Succeeded":
                self.succeeded.setdefault(name, now)
            if kind == "DELETED":
                self.gone[name] = now
            self.changed.notify_all()

    def wait(self, what: dict[str, float], name: str, timeout: float) -> float:
        with self.changed:
            if not self.changed.wait_for(lambda: name in what, timeout):
                raise TimeoutError(f"{name}: not seen within {timeout:.0f} s")
            return what[name]

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def floor(core: client.CoreV1Api, namespace: str, image: str, run: int) -> dict[str, Any]:
    label = f"bench-queue-floor-{run}"
    times = PodTimes(core, namespace, f"bench-queue/floor={label}")
    created: dict[str, float] = {}

    def one(i: int) -> None:
        name = f"floor-{run}-{i}"
        created[name] = time.time()
        core.create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"bench-queue/floor": label}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5, "containers": [{
                "name": "work", "image": image, "imagePullPolicy": "IfNotPresent", "command": ["true"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}}, "securityContext": SECURITY}]}},
            _request_timeout=30)
        times.wait(times.succeeded, name, 300)
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0, _request_timeout=30)
        times.wait(times.gone, name, 120)

    began, gets = time.time(), api_server_requests(core.api_client, "GET", "pods")
    with ThreadPoolExecutor(GPUS) as pool:  # 16 threads, each one Pod at a time: at most 16 in existence
        list(pool.map(one, range(ITEMS)))
    took = max(times.gone.values()) - began
    gets = api_server_requests(core.api_client, "GET", "pods") - gets
    times.stop()
    return {"rate": ITEMS / took, "running": [times.started[n] - created[n] for n in created if n in times.started],
            "pods": sum(len(u) for u in times.uids.values()) / ITEMS, "gaps": times.gaps, "gets": gets / ITEMS}


def agent_process(release: Release) -> tuple[str, str]:
    pod = wait_until(release.agent_pod, 60, "one cluster agent pod")
    return pod, "cluster-agent"


def sample(release: Release, pod: str, container: str) -> tuple[float, float]:
    """(RSS MiB, CPU seconds) of the agent container's main process."""
    out = exec_in(release.api, release.namespace, pod, container, ["cat", "/proc/1/status", "/proc/1/stat"])
    rss = next(int(line.split()[1]) for line in out.splitlines() if line.startswith("VmRSS:")) / 1024
    fields = out.strip().splitlines()[-1].rsplit(")", 1)[1].split()
    return rss, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The API lists the newest 200 items only: the run's items are read from the control plane's database, beside it.
RECORDS = """
import json, sqlite3
db = sqlite3.connect("/var/lib/control-plane/control-plane.sqlite")
rows = db.execute("SELECT idempotency_key, state, created_at, acked_at FROM items WHERE idempotency_key LIKE ?", (PREFIX + "%",))
print(json.dumps([{"idempotencyKey": k, "state": s, "createdAt": c, **({"ackedAt": a} if a is not None else {})}
                  for k, s, c, a in rows]))
"""


def item_records(release: Release, prefix: str) -> dict[str, dict[str, Any]]:
    out = release.control_plane(RECORDS.replace("PREFIX", repr(prefix))).strip().splitlines()[-1]
    return {i["idempotencyKey"]: i for i in json.loads(out)}


def agent(release: Release, run: int) -> dict[str, Any]:
    keys = [f"bq-{run}-{i}" for i in range(ITEMS)]
    names = {pod_name(k): k for k in keys}
    times = PodTimes(release.core, release.namespace, "gpu-agent.io/work-item=true")
    pod, container = agent_process(release)
    rss_start, cpu_start = sample(release, pod, container)
    peak, stop = [rss_start], threading.Event()

    def rss_sampler() -> None:
        while not stop.wait(2.0):
            try:
                peak.append(sample(release, pod, container)[0])
            except Exception:  # noqa: BLE001 - a missed sample only; the peak is of those taken
                pass

    threading.Thread(target=rss_sampler, daemon=True).start()
    payload = {"gpus": 1, "command": ["true"]}
    began, gets = time.time(), api_server_requests(release.api, "GET", "pods")
    release.control_plane("".join(f"c.enqueue(t, {k!r}, {payload!r})\n" for k in keys))
    for name in names:
        times.wait(times.gone, name, 900)
    took = max(times.gone[n] for n in names) - began
    gets = api_server_requests(release.api, "GET", "pods") - gets
    stop.set()
    rss_end, cpu_end = sample(release, pod, container)
    times.stop()
    state = item_records(release, f"bq-{run}-")
    return {"rate": ITEMS / took,
            "running": [times.started[n] - state[k]["createdAt"] for n, k in names.items() if n in times.started],
            "acked": [state[k]["ackedAt"] - state[k]["createdAt"] for k in keys if "ackedAt" in state.get(k, {})],
            "pods": sum(len(times.uids.get(n, ())) for n in names) / ITEMS, "gaps": times.gaps,
            "not_done": sum(1 for k in keys if state.get(k, {}).get("state") != "done"),
            "rss": max([*peak, rss_end]), "cpu": (cpu_end - cpu_start) / took * 100, "gets": gets / ITEMS}


def main() -> int:
    kubeconfig = CI_KUBECONFIG
    api = config.new_client_from_config(str(kubeconfig))
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    # A second fake-gpu release would register a second device plugin with each kubelet.
    others = apps.list_daemon_set_for_all_namespaces(label_selector="app.kubernetes.io/name=fake-gpu").items
    if others:
        raise SystemExit(f"fake-gpu is already installed ({', '.join(f'{d.metadata.namespace}/{d.metadata.name}' for d in others)}):"
                         " this benchmark installs its own; uninstall that one first (is an e2e session running?)")
    ns = f"bench-queue-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    helm = [tool("helm"), "--kubeconfig", str(kubeconfig), "-n", ns]
    release = Release(api, core, apps, kubeconfig, ns, name="bq")
    rows: list[tuple[int, dict[str, Any], dict[str, Any]]] = []
    try:
        paths = host_paths()
        subprocess.run([*helm, "install", "fg", str(REPO / "charts" / "fake-gpu"), "--set", "image.tag=dev",
                        "--set", "image.repository=localhost/gpu-agent", "--set", "image.pullPolicy=Never",
                        *[a for k, v in paths.items() for a in ("--set", f"{k}={v}")], "--wait", "--timeout", "120s"],
                       check=True, capture_output=True, timeout=180)
        node = min(n.metadata.name for n in core.list_node().items)
        subprocess.run([sys.executable, "-m", "fake_gpu", "--kubeconfig", str(kubeconfig), "--namespace", ns, "set",
                        "--node", node, "--count", str(GPUS)], check=True, capture_output=True, timeout=60)
        wait_until(lambda: device_count(core.read_node(node).status.allocatable, "nvidia.com/gpu") == GPUS, 60,
                   f"{node}: {GPUS} allocatable GPUs")
        release.install(*WAIT)
        wait_until(lambda: (release.healthz()[1] or {}).get("active"), 90, "the cluster agent active")
        image = core.read_namespaced_pod(release.agent_pod(), ns).spec.containers[0].image
        for run in range(1, RUNS + 1):
            rows.append((run, floor(core, ns, image, run), agent(release, run)))
            print(f"run {run} done", flush=True)
    finally:
        release.uninstall_if_installed()
        subprocess.run([*helm, "uninstall", "fg", "--wait", "--timeout", "120s"], capture_output=True, timeout=180)
        core.delete_namespace(ns)
    print(f"\n{ITEMS} one-GPU items that exit at once, {GPUS} fake GPUs on one node, enqueued at once; floor: a plain "
          f"client keeping <= {GPUS} Pods in existence (create, wait Succeeded, delete)")
    print(f"{'run':>3} {'side':<6} {'items/s':>8} {'ratio':>6} {'enq->Running p50/p99 s':>23} {'enq->acked p50/p99 s':>21} "
          f"{'pods/item':>9} {'Pod GETs/item':>13} {'agent RSS MiB':>13} {'agent CPU %':>11}")
    ratios = []
    for run, f, a in rows:
        ratio = a["rate"] / f["rate"]
        ratios.append(ratio)
        print(f"{run:>3} {'floor':<6} {f['rate']:>8.2f} {'':>6} {pct(f['running'], .5):>11.2f}/{pct(f['running'], .99):<11.2f}"
              f" {'':>21} {f['pods']:>9.2f} {f['gets']:>13.1f}")
        print(f"{run:>3} {'agent':<6} {a['rate']:>8.2f} {ratio:>6.2f} {pct(a['running'], .5):>11.2f}/{pct(a['running'], .99):<11.2f}"
              f" {pct(a['acked'], .5):>10.2f}/{pct(a['acked'], .99):<10.2f} {a['pods']:>9.2f} {a['gets']:>13.1f} {a['rss']:>13.1f} "
              f"{a['cpu']:>11.1f}" + (f"  ({a['not_done']} not done!)" if a["not_done"] else "")
              + (f"  (watch gaps: {a['gaps']})" if a["gaps"] else ""))
    if ratios:
        median = statistics.median(ratios)
        print(f"\nthe agent moved work at {median:.2f}x the floor (median of {len(ratios)} runs; goal >= {GOAL}): "
              f"{'met' if median >= GOAL else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
