"""A gpu-agent release on the cluster, driven through the real helm binary, with probes through
the API server (so they work on any cluster the suite reaches through its kubeconfig)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import yaml
from kubernetes import client, watch

from e2e.artifacts import dump, failing_test
from e2e.cluster import CI_CLUSTER_DIR, host_paths, tool
from e2e.helpers import drops, exec_python, pod_http_get, wait_until
from gpu_agent.mechanisms.queues.pod_executor import never_started

CHART = Path(__file__).resolve().parent.parent / "charts" / "gpu-agent"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
BASE = ["--set", "image.tag=dev", "--set", "controlPlane.enabled=true"]
CA = "app.kubernetes.io/component=cluster-agent"
# What Python run in the control plane's pod starts with: a client `c` and the admin token `t`; `url` and `ca`, what it
# calls, over HTTPS verified against the pod's own CA where the control plane serves it (the chart's default), else (the
# last stable chart, or controlPlane.tls.enabled=false) plain HTTP on loopback.
CONTROL_PLANE_PRELUDE = ("import os\n"
                         "from gpu_agent.foundations.control_plane_client import ControlPlaneClient\n"
                         "from gpu_agent.foundations.secrets import Secret\n"
                         "ca = '/var/run/secrets/gpu-agent-tls/ca.crt'\n"
                         "ca = ca if os.path.exists(ca) else None\n"
                         "url = ('https' if ca else 'http') + '://127.0.0.1:8700'\n"
                         "c = ControlPlaneClient(url, ca_file=ca) if ca else ControlPlaneClient(url)\n"
                         "t = Secret(open('/var/run/secrets/gpu-agent/adminToken').read().strip())\n")
WAIT = ["--wait", "--timeout", "3m"]
# Where this process's releases may look for GPUs: empty alone; beside other workers, the node it owns
# (e2e/conftest.py fake_gpus), so that each release counts, uses and serves that node's GPUs only.
NODE_SCOPE: list[str] = []


def scope_to(node: str) -> list[str]:
    """The values that keep a release on one node: its cluster agent counts that node's GPUs and places work Pods
    there, and its node agents run there alone."""
    return ["--set", f"clusterAgent.gpuNodeSelector.kubernetes\\.io/hostname={node}",
            "--set", f"nodeAgent.nodeSelector.kubernetes\\.io/hostname={node}"]


def scope_to_label(key: str, value: str) -> list[str]:
    """The values that keep a release on the nodes labelled key=value (a lane's: e2e/conftest.py lane_of)."""
    escaped = key.replace(".", "\\.")
    return ["--set", f"clusterAgent.gpuNodeSelector.{escaped}={value}", "--set", f"nodeAgent.nodeSelector.{escaped}={value}"]


def without_gpu_node_selector(args: list[str]) -> list[str]:
    """`args` for the last stable chart, whose closed schema has no clusterAgent.gpuNodeSelector: that value dropped
    (its cluster agent counts every node's GPUs), the node agents' nodeSelector kept."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--set" and i + 1 < len(args) and args[i + 1].startswith("clusterAgent.gpuNodeSelector"):
            continue
        if i > 0 and args[i - 1] == "--set" and arg.startswith("clusterAgent.gpuNodeSelector"):
            continue
        out.append(arg)
    return out


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=300)
    if check and r.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed: {r.stderr}")
    return r


class Release:
    """A gpu-agent release on the fake GPUs, with probes through the API server."""

    def __init__(self, api, core, apps, kubeconfig, namespace, name="ga"):
        self.api, self.core, self.apps, self.namespace, self.name = api, core, apps, namespace, name
        self.kubeconfig = str(kubeconfig)
        self.fullname = f"{name}-gpu-agent" if "gpu-agent" not in name else name

    def args(self, *extra):
        return ["--kubeconfig", self.kubeconfig, "-n", self.namespace, self.name, str(CHART), *BASE,
                "--set", "image.pullPolicy=Never", "--set", "nodeAgent.gpuSource=fake",
                "--set", f"nodeAgent.fakeGpuStateDir={host_paths()['stateDir']}", "--set", "logVerbosity=2", *NODE_SCOPE,
                *extra]

    def install(self, *extra):
        return helm("install", *self.args(*extra), "--timeout", "120s")

    def upgrade(self, *extra):
        return helm("upgrade", *self.args(*extra), "--timeout", "120s")

    def uninstall(self):
        return helm("uninstall", "--kubeconfig", self.kubeconfig, "-n", self.namespace, self.name, "--wait", "--timeout", "120s")

    def uninstall_if_installed(self):
        """Uninstall, unless it is not installed. Called from a test's `finally` while its failure is on the way out,
        it first keeps what the release's pods said (the namespace's dump after the test would find them gone)."""
        if sys.exc_info()[0] is not None and failing_test():
            folder = dump(self.core, self.namespace, failing_test(), into=f"before-uninstall-{self.name}")
            print(f"\nwhat release {self.name} said before its uninstall is in {folder}")
        if helm("status", "--kubeconfig", self.kubeconfig, "-n", self.namespace, self.name, check=False).returncode == 0:
            self.uninstall()

    def all_running(self, at_least: int = 3) -> bool:
        pods = self.pods(f"app.kubernetes.io/instance={self.name}")
        return len(pods) >= at_least and all(p.status.phase == "Running" and p.metadata.deletion_timestamp is None
                                             for p in pods)

    def pods(self, selector):
        return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items

    def agent_pod(self):
        pods = [p for p in self.pods(CA) if p.metadata.deletion_timestamp is None and p.status.phase == "Running"]
        return pods[0].metadata.name if len(pods) == 1 else None

    def healthz(self):
        """(status, body) of the agent's own /healthz; (0, None) until the agent itself answers
        (the API server's proxy says 503 too while a pod is not serving yet)."""
        pod = self.agent_pod()
        if pod is None:
            return 0, None
        code, body = pod_http_get(self.core, self.namespace, pod, 8080, "healthz")
        return (code, body) if isinstance(body, dict) and "components" in body else (0, None)

    def metrics(self) -> str:
        pod = self.agent_pod()
        code, body = pod_http_get(self.core, self.namespace, pod, 8080, "metrics") if pod else (0, "")
        return body if code == 200 and isinstance(body, str) else ""

    def control_plane_pod(self) -> str:
        """The control plane's pod, once one is Ready."""
        def ready_pod():
            pods = [p for p in self.pods("app.kubernetes.io/component=control-plane")
                    if p.metadata.deletion_timestamp is None and all(c.ready for c in p.status.container_statuses or [])
                    and p.status.container_statuses]
            return pods[0].metadata.name if pods else None

        return wait_until(ready_pod, 60, "the control plane Ready")

    def control_plane(self, code: str) -> str:
        """Run Python in the control plane's pod with a client `c` and the admin token `t`; raises
        if it fails (the output would otherwise be taken for an answer)."""
        out = exec_python(self.api, self.namespace, self.control_plane_pod(), CONTROL_PLANE_PRELUDE + code)
        if "Traceback (most recent call last)" in out:
            raise AssertionError(f"control plane call failed: {out[-600:]}")
        return out

    def tokens(self):
        secret = self.core.read_namespaced_secret(f"{self.fullname}-control-plane-tokens", self.namespace)
        return [base64.b64decode(v).decode() for v in secret.data.values()]


LEADERSHIP = ("gpu-agent.io/leader", "gpu-agent.io/lease-uid", "gpu-agent.io/lease-transitions")


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at one moment (intervals that only touch do not overlap; a single
    moment inside another interval does)."""
    intervals = [(start, max(end, start + 1e-9)) for start, end in intervals]
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


class WorkPods:
    """Every work Pod the namespace ever had, by name, with each distinct UID: an item run twice
    shows as a second UID under its (deterministic) name. Read from the API server's watch, not
    from anything the agent records.

    A watch that breaks is relisted at once (the list shows every pod that exists then). Only a
    pod created and deleted inside the gap could be missed, and a work Pod lives for seconds (its
    container starts, works, exits; the agent deletes it after the ack), so the tests require
    every gap to be shorter than MAX_GAP. `gaps` records (seconds, why) for each."""

    MAX_GAP = 1.0

    def __init__(self, core, namespace):
        self.core, self.namespace, self.uids, self.events, self.gaps = core, namespace, {}, 0, []
        self.created: dict[str, tuple[float, tuple[str, ...]]] = {}  # uid -> (first seen, leadership token)
        self.ran: dict[str, set[str]] = {}  # name -> UIDs seen with a container that ran
        # uid -> [first seen Running, first seen after that no longer Running (ended, or being deleted)]
        self.running: dict[str, list[float | None]] = {}
        self._lock, self._stopped, self._watch = threading.Lock(), threading.Event(), None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        selector, rv, broken_at, why = "gpu-agent.io/work-item=true", None, None, ""
        while not self._stopped.is_set():
            try:
                if rv is None:
                    listed = self.core.list_namespaced_pod(self.namespace, label_selector=selector)
                    for pod in listed.items:
                        self._record(pod)
                    rv = listed.metadata.resource_version
                    if broken_at is not None:
                        self.gaps.append((time.monotonic() - broken_at, why))
                        broken_at = None
                self._watch = watch.Watch()
                for event in self._watch.stream(self.core.list_namespaced_pod, self.namespace, label_selector=selector,
                                                resource_version=rv, timeout_seconds=120):
                    self._record(event["object"])
                    rv = event["object"].metadata.resource_version
            except Exception as e:  # noqa: BLE001 - recorded as a gap; the tests bound it
                if self._stopped.is_set():
                    return
                if broken_at is None:
                    broken_at, why = time.monotonic(), f"{type(e).__name__} {getattr(e, 'status', '') or ''} {str(e)[:120]}"
                rv = None
                self._stopped.wait(0.1)

    def _record(self, pod):
        with self._lock:
            self.events += 1
            self.uids.setdefault(pod.metadata.name, set()).add(pod.metadata.uid)
            if not never_started(pod):  # a container ran: the item's work happened (once per UID)
                self.ran.setdefault(pod.metadata.name, set()).add(pod.metadata.uid)
            now, uid = time.monotonic(), pod.metadata.uid
            if pod.status.phase == "Running" and pod.metadata.deletion_timestamp is None:
                self.running.setdefault(uid, [now, None])
            elif uid in self.running and self.running[uid][1] is None:
                self.running[uid][1] = now
            if pod.metadata.uid not in self.created:  # first sight of this Pod: when, and under whose leadership
                notes = pod.metadata.annotations or {}
                self.created[pod.metadata.uid] = (time.monotonic(), tuple(notes.get(k, "") for k in LEADERSHIP))

    def leaderships(self) -> dict[tuple[str, ...], tuple[float, float]]:
        """Each leadership's token (leader, Lease uid, transitions: the annotations the Pod carries) and
        the interval in which Pods created under it were first seen."""
        out: dict[tuple[str, ...], tuple[float, float]] = {}
        with self._lock:
            for seen, token in self.created.values():
                first, last = out.get(token, (seen, seen))
                out[token] = (min(first, seen), max(last, seen))
        return out

    def stop(self):
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def complete(self) -> bool:
        """True when no gap in the watch could have hidden a work Pod."""
        return all(seconds < self.MAX_GAP for seconds, _ in self.gaps)

    def most_running(self) -> int:
        """The most work Pods the watch saw Running at one moment (a Pod still Running counts to now)."""
        with self._lock:
            now = time.monotonic()
            return most_at_once([(start or now, end or now) for start, end in self.running.values()])

    def executions(self) -> dict[str, int]:
        with self._lock:
            return {name: len(uids) for name, uids in self.uids.items()}

    def runs(self) -> dict[str, int]:
        """Per name, how many of its Pods ran (a container started): what "executed twice" means. A Pod
        that never ran (unschedulable, refused by the kubelet, deleted first) is an attempt, not a run."""
        with self._lock:
            return {name: len(uids) for name, uids in self.ran.items()}


def enqueue(release: Release, keys: list[str], seconds: int = 1, gpus: int = 1) -> None:
    payload = {"gpus": gpus, "command": ["sh", "-c", f"sleep {seconds}; fake-gpu smi -L"]}
    release.control_plane("".join(f"c.enqueue(t, {k!r}, {payload!r})\n" for k in keys))


def items(release: Release) -> dict[str, str]:
    out = release.control_plane("import json; print(json.dumps(c.list_items(t)))")
    return {i["idempotencyKey"]: i["state"] for i in json.loads(out.strip().splitlines()[-1])}


def longest_not_ready(samples) -> float:
    """The longest run of /healthz answers other than 200 (one still open counts to the last sample)."""
    return max(drops(samples, lambda code: code == 200, until=samples[-1][0] if samples else None), default=0.0)


def persistent_control_plane(core, namespace: str, release: Release) -> str:
    """A hostPath PersistentVolume bound ahead to the chart's claim, so that the control plane's
    queue survives its pod being replaced by the upgrade (the CI cluster has no provisioner)."""
    path = str(CI_CLUSTER_DIR / "pv" / namespace)
    os.makedirs(path, exist_ok=True)
    os.chown(path, 65532, 65532)
    core.create_persistent_volume(client.V1PersistentVolume(
        metadata=client.V1ObjectMeta(name=f"pv-{namespace}"),
        spec=client.V1PersistentVolumeSpec(
            capacity={"storage": "1Gi"}, access_modes=["ReadWriteOnce"], persistent_volume_reclaim_policy="Retain",
            host_path=client.V1HostPathVolumeSource(path=path, type="Directory"),
            claim_ref=client.V1ObjectReference(namespace=namespace, name=f"{release.fullname}-control-plane"))))
    return path


def remove_volume(core, namespace: str, path: str) -> None:
    try:
        core.delete_persistent_volume(f"pv-{namespace}")
    except client.ApiException:
        pass
    shutil.rmtree(path, ignore_errors=True)


class Active:
    """Which cluster agents are active (`active` in their own /healthz; a 0.1.x agent has none, and
    its 200 meant leasing), all probed at once so that one sample is one moment.

    Each probe is bounded (2 s), but a sample waits for its probes only SAMPLE_WAIT: a pod that hangs
    (one shutting down) must not hold up the next samples, or the moment a new leader turns active
    goes unseen for as long. Every probe that found its pod active, late or not, lands in `seen`
    as (started, ended, pod); `history` keeps (sample started, pods found active in time)."""

    PROBE_TIMEOUT = 2.0
    SAMPLE_WAIT = 0.4

    def __init__(self, release: Release) -> None:
        self.release = release
        self.pool = ThreadPoolExecutor(32)
        self.seen: list[tuple[float, float, str]] = []
        self.history: list[tuple[float, list[str]]] = []

    def _one(self, pod: str) -> bool:
        started = time.monotonic()
        on = self._probe(pod)
        if on:
            self.seen.append((started, time.monotonic(), pod))
        return on

    def _probe(self, pod: str) -> bool:
        try:
            code, body = pod_http_get(self.release.core, self.release.namespace, pod, 8080, "healthz",
                                      timeout=self.PROBE_TIMEOUT)
        except Exception:  # noqa: BLE001 - no answer in time: not seen active
            return False
        if not isinstance(body, dict) or "components" not in body:
            return False  # not serving (yet, or any more)
        return bool(body["active"]) if "active" in body else code == 200

    def __call__(self) -> list[str]:
        started = time.monotonic()
        pods = [p.metadata.name for p in self.release.pods(CA)  # a terminating leader may still be active
                if p.status.phase == "Running"]
        probes = {pod: self.pool.submit(self._one, pod) for pod in pods}
        deadline = time.monotonic() + self.SAMPLE_WAIT
        active = []
        for pod, probe in probes.items():
            try:
                if probe.result(timeout=max(0.0, deadline - time.monotonic())):
                    active.append(pod)
            except FutureTimeout:
                pass  # answers later: in `seen`, not in this sample
        self.history.append((started, active))
        return active


def leaderless(active: Active, start: float, end: float) -> float:
    """An upper bound of the longest time without an active agent in [start, end]."""
    return longest_leaderless(active, start, end)[0]


def longest_leaderless(active: Active, start: float, end: float) -> tuple[float, list[str]]:
    """(the bound, the probes around it as text for a failure message). Each probe that found an agent
    active saw it so at some moment within its own span. Taken in the order they ended, the bound
    for the gap before probe b is b's end minus the latest start among the probes that ended before
    it: every one of those saw its active moment before the gap began, so none started later."""
    probes = sorted(active.seen, key=lambda p: p[1])
    latest_start, gaps = None, []
    for s, e, _ in probes:
        if latest_start is not None and e >= start and latest_start <= end:
            gaps.append((e - latest_start, latest_start, e))
        latest_start = s if latest_start is None else max(latest_start, s)
    if not gaps:
        return end - start, []
    gap, s1, e2 = max(gaps)
    around = [f"{pod} active within [{s - s1:+.2f}, {e - s1:+.2f}] s" for s, e, pod in probes if s1 - 1 <= s <= e2 + 1]
    return gap, around[:40]


def lost_and_doubled(release: Release, pods: WorkPods, keys: list[str], timeout: float = 240) -> tuple[list[str], dict]:
    """Waits for every item to be done and a work Pod seen for each, stops the watch, and returns the
    items no Pod ran (lost) and the Pods with more than one UID (an item run twice)."""
    from gpu_agent.mechanisms.queues.pod_executor import pod_name

    # Each look is a Python process in the control plane's pod: once a second, so that looking does not take
    # the CPU the items run on.
    wait_until(lambda: (lambda s: len(s) == len(keys) and set(s.values()) == {"done"})(items(release)), timeout,
               "every item done", interval=1.0)
    wait_until(lambda: set(pods.executions()) >= {pod_name(k) for k in keys}, 30, "a work pod seen for every item")
    pods.stop()
    executions = pods.executions()
    return [k for k in keys if pod_name(k) not in executions], {n: c for n, c in executions.items() if c > 1}


def operation(release: Release, active: Active, keys: list[str], command: list[str]) -> dict:
    """Enqueue `keys` (running while the operation goes on), run it, wait for one active agent."""
    enqueue(release, keys, seconds=2)
    started = time.monotonic()
    r = helm(*command, check=False)
    done = time.monotonic()
    assert r.returncode == 0, f"helm {command[0]} failed after {done - started:.1f}s: {r.stderr[-1500:]}"
    wait_until(lambda: len(active()) == 1, 90, "one active cluster agent after the operation")
    return {"took": done - started, "window": (started, time.monotonic())}
