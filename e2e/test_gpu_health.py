"""GPU health on a real cluster (issue 27): a fault injected as a real GPU breaks, and what each
consumer makes of it. `fake-gpu fault` marks a GPU of the node's layout; the fake device plugin
reports it Unhealthy and kubelet lowers allocatable; the cluster agent registers only the healthy
GPUs, is NotReady with a reason naming where they went when none is healthy, and pauses its queues;
the node agent's GPUDomainMember turns NotReady and says why; a clear brings everything back within
2 s, nothing restarted; a work Pod leased while a GPU is faulted is given healthy GPUs only.

Evidence comes from outside the agents: allocatable from the API server, the registered count from
the control plane's own record (sampled beside it, streamed to the test as it changes), /healthz
through the API server's proxy, the member object, and the work Pod's own view of its devices.
Samplers record in threads; the tests assert, including how many samples each took.

The cluster agent here acts on a loss at once (`clusterAgent.gpuLossDebounce=0`), so the figures
are those of health itself. The loss window (test_readiness.py: a kubelet restart absorbed, a real
loss acted on after it) applies to a health loss as to a disappearance: with the chart's default
for the cluster source (5 s) every fault -> registered and fault -> NotReady figure here grows by it.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import pytest
from kubernetes import client
from kubernetes.stream import stream

from e2e.helpers import Sampler, drops, exec_api, pod_log, wait_until
from e2e.release import CONTROL_PLANE_PRELUDE, NODE_SCOPE, Release

DOMAIN = "health"
GOAL = 2.0  # seconds from a fault (or its clear) to allocatable and the registered count following
CYCLES = 10  # faults the latency figures are taken over
MAX_REREGISTRATION = 1.0  # seconds NotReady a GPU change may cost: one registration round trip (loopback, in-cluster)


class Faults:
    """`fake-gpu fault --node N` as the command does it (fake_gpu.cluster), called in this process so
    that a fault's moment is known to the millisecond: each call returns the monotonic time taken
    just before its ConfigMap write (a latency from it is an upper bound)."""

    def __init__(self, fake_gpus) -> None:
        from fake_gpu.cluster import ClusterLayout
        from fake_gpu.layout import classify

        self.layout = ClusterLayout(fake_gpus.namespace, fake_gpus.kubeconfig, "fg")
        self.classify = classify
        self.node = fake_gpus.node

    def fault(self, gpu: int, **error) -> float:
        fault, why = self.classify(**error)
        assert fault is not None, f"{error} breaks nothing ({why}): use the command for those"
        started = time.monotonic()
        self.layout.fault(self.node, gpu, fault)
        return started

    def clear(self, gpu: int | None = None) -> float:
        started = time.monotonic()
        self.layout.fault(self.node, gpu, None)
        return started


# Polls the control plane's own record of this cluster's registration beside it (loopback, every
# 50 ms) and prints the registered GPU count and generation on every change and once a second, with
# how many polls it has made: the test reads the lines as they come and times them on its own clock.
REGISTERED = """
import time
end, polls, last, said = time.monotonic() + SECONDS, 0, None, 0.0
while time.monotonic() < end:
    regs = c.status(t)["registrations"]
    now = (regs[0]["gpuCount"], regs[0]["generation"]) if regs else (0, -1)
    polls += 1
    if now != last or time.monotonic() - said >= 1:
        print("count", polls, *now, flush=True)
        last, said = now, time.monotonic()
    time.sleep(0.05)
print("done", polls, flush=True)
"""


class RegisteredCount:
    """The registered GPU count as the control plane records it: (arrival time, (count, generation))
    per line; a registration of the same count again shows as a new generation."""

    def __init__(self, release: Release, seconds: float) -> None:
        self.release, self.seconds = release, seconds
        self.samples: list[tuple[float, tuple[int, int]]] = []
        self.polls = 0
        self.errors = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        code = CONTROL_PLANE_PRELUDE + REGISTERED.replace("SECONDS", str(self.seconds))
        resp = stream(exec_api(self.release.api).connect_get_namespaced_pod_exec, self.release.control_plane_pod(),
                      self.release.namespace, command=["python3", "-u", "-c", code], stderr=True, stdin=False,
                      stdout=True, tty=False, _preload_content=False)
        pending = ""
        try:
            while resp.is_open() and not self._stop.is_set():
                resp.update(timeout=0.1)
                if resp.peek_stdout():
                    pending += resp.read_stdout()
                    now = time.monotonic()
                    while "\n" in pending:
                        line, pending = pending.split("\n", 1)
                        words = line.split()
                        if len(words) >= 2 and words[0] in ("count", "done"):
                            self.polls = int(words[1])
                        if len(words) == 4 and words[0] == "count":
                            self.samples.append((now, (int(words[2]), int(words[3]))))
                if resp.peek_stderr():
                    self.errors += resp.read_stderr()
        finally:
            resp.close()

    def latest(self) -> tuple[int, int]:
        """(count, generation) last seen; (0, -1) before anything is registered."""
        return self.samples[-1][1] if self.samples else (0, -1)

    def registered(self, count: int) -> Callable[[tuple[int, int]], bool]:
        """A sample test: `count` GPUs registered at a generation newer than the latest seen now."""
        generation = self.latest()[1]
        return lambda seen: seen[0] == count and seen[1] > generation

    def __enter__(self) -> RegisteredCount:
        self._thread.start()
        wait_until(lambda: self.samples or self.errors, 30, "the control plane's registration sampler to start")
        assert not self.errors, self.errors[-600:]
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def first(samples, after: float, good) -> float | None:
    """When the first sample at or after `after` satisfied `good`, or None."""
    return next((t for t, v in samples if t >= after and good(v)), None)


def within(samples, after: float, good, timeout: float, what: str) -> float:
    """Seconds from `after` to the first sample satisfying `good`, polled until `timeout` after it."""
    wait_until(lambda: first(samples, after, good) is not None, timeout + max(0.0, after - time.monotonic()), what,
               interval=0.05)
    return first(samples, after, good) - after


def spread(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds):.2f} s, worst {max(seconds):.2f} s"


def restarts(core, namespace: str, selector: str) -> dict[str, int]:
    return {f"{p.metadata.name}/{c.name}": c.restart_count for p in core.list_namespaced_pod(namespace, label_selector=selector).items
            for c in p.status.container_statuses or []}


@pytest.fixture
def health_release(api, core, apps, kubeconfig, namespace, fake_gpus):
    """4 fake GPUs on this process's node, and a release with a control plane, a domain of that node and a cluster
    agent that acts at once. Side by side the release is scoped to the worker's node (NODE_SCOPE, filled in place); in a
    process of its own the cluster agent counts every node's GPUs, so the other nodes are set to none."""
    if not NODE_SCOPE:
        for node in core.list_node().items:
            if node.metadata.name != fake_gpus.node and fake_gpus.allocatable(node.metadata.name):
                fake_gpus.set(0, node=node.metadata.name)
    fake_gpus.set(4)
    faults = Faults(fake_gpus)
    faults.clear()  # whatever a failed run left
    r = Release(api, core, apps, kubeconfig, namespace, name=f"gh{uuid.uuid4().hex[:5]}")
    try:
        r.install("--set", "gracefulNoGPU=true", "--set", f"domain.name={DOMAIN}", "--set", "domain.expectedNodes=1",
                  "--set", "clusterAgent.gpuLossDebounce=0")
        wait_until(r.all_running, 90, "every release pod Running")
        last: list = [None]  # the agent's last /healthz, named if the wait times out (the kind stage saw one once)

        def active():
            last[0] = r.healthz()[1]
            return (last[0] or {}).get("active")
        try:
            wait_until(active, 60, "the cluster agent Ready and active on 4 GPUs")
        except AssertionError as e:
            raise AssertionError(f"{e}; its last /healthz: {last[0]}") from e
        yield r, faults
    finally:
        try:
            faults.clear()
        finally:
            r.uninstall_if_installed()
            fake_gpus.set(0)


@pytest.mark.fast
def test_an_xid_79_takes_one_gpu_out_of_allocatable_and_registration_within_2s_and_an_xid_13_changes_nothing(
        health_release, fake_gpus):
    r, faults = health_release
    with Sampler(fake_gpus.allocatable, 0.05) as allocatable, Sampler(lambda: r.healthz()[0], 0.1) as health, \
            RegisteredCount(r, seconds=40) as registered:
        started = time.monotonic()
        wait_until(lambda: registered.latest()[0] == 4, 20, "the control plane to record 4 registered GPUs")

        # An application Xid, through the command as a user gives it: nothing changes.
        cmd = fake_gpus.command("fault", "--node", fake_gpus.node, "--gpu", "2", "--xid", "13")
        assert cmd.returncode == 0 and "unchanged" in cmd.stdout, cmd.stdout + cmd.stderr
        quiet = time.monotonic()
        wait_until(lambda: len([t for t, _ in allocatable.samples if t > quiet]) >= 40, 10,
                   "2 s of allocatable samples after the Xid 13")
        assert {v for t, v in allocatable.samples if t > quiet} == {4}
        assert {v for t, v in health.samples if t > quiet} == {200}
        assert registered.latest()[0] == 4 and not [v for t, v in registered.samples if t > quiet and v[0] != 4]

        # Xid 79 on GPU 1: fallen off the bus.
        three = registered.registered(3)
        broke = faults.fault(1, xid=79)
        to_allocatable = within(allocatable.samples, broke, lambda v: v == 3, 10, "allocatable 3 after the Xid 79")
        to_registered = within(registered.samples, broke, three, 10, "3 registered after the Xid 79")
        code, body = r.healthz()
        assert code == 200, body  # three healthy GPUs still take work
        gpus = body["components"]["gpus"]
        assert gpus["reason"].startswith("3 of 4 GPUs healthy; not healthy:") and f"node {fake_gpus.node}" in gpus["reason"]
        assert [g["health"] for g in gpus["details"]["gpus"]].count("Unhealthy") == 1

        four = registered.registered(4)
        cleared = faults.clear(1)
        back_allocatable = within(allocatable.samples, cleared, lambda v: v == 4, 10, "allocatable 4 after the clear")
        back_registered = within(registered.samples, cleared, four, 10, "4 registered after the clear")
        elapsed = time.monotonic() - started
    # A GPU change (a health change is one) is NotReady until the new generation is registered (the one gate:
    # mechanisms/registration/manager.py), a round trip to the control plane; one GPU of four broken must not
    # take the agent out for longer than that.
    first_ready = next(t for t, v in health.samples if v == 200)
    out = drops([(t, v) for t, v in health.samples if t >= first_ready], lambda v: v == 200, until=health.samples[-1][0])
    assert max(out, default=0.0) <= MAX_REREGISTRATION, f"NotReady for {max(out):.2f} s with three healthy GPUs: {out}"
    assert len(allocatable.samples) >= elapsed / 0.05 * 0.3, "the allocatable sampler fell behind"
    assert registered.polls >= elapsed / 0.05 * 0.3, f"the control plane was polled only {registered.polls} times"
    print(f"\nXid 79 -> allocatable 3 in {to_allocatable:.2f} s, -> 3 registered in {to_registered:.2f} s; clear -> "
          f"allocatable 4 in {back_allocatable:.2f} s, -> 4 registered in {back_registered:.2f} s; Xid 13: nothing "
          f"changed over {len([t for t, _ in allocatable.samples if t > quiet])} allocatable samples; control plane "
          f"polled {registered.polls} times")
    assert max(to_allocatable, to_registered, back_allocatable, back_registered) <= GOAL


def member_of(api, r: Release, node: str):
    """A reader of the node's member of the release's domain (its spec; {} while it is not there)."""
    custom = client.CustomObjectsApi(api)

    def member() -> dict:
        try:
            return custom.get_namespaced_custom_object("gpu-agent.io", "v1beta1", r.namespace, "gpudomainmembers",
                                                       f"{DOMAIN}.{node}")["spec"]
        except client.ApiException:
            return {}
    return member


@pytest.mark.serial(reason="measures a 2 s goal of /healthz through the API server's proxy: beside another worker's "
                           "installs (CI, 2026-12-06) the first 200 after the clear was sampled 6.0 s late")
def test_all_gpus_faulted_is_notready_with_the_reason_and_a_clear_is_ready_within_2s_with_nothing_restarted(
        health_release, fake_gpus, api, core):
    r, faults = health_release
    node = fake_gpus.node
    plugin = fake_gpus.plugin_pod()
    plugin_restarts = {c.name: c.restart_count for c in plugin.status.container_statuses}
    member = member_of(api, r, node)

    wait_until(lambda: member().get("ready") is True and member().get("healthyGPUs") == 4, 30, "the member Ready on 4")
    with Sampler(lambda: r.healthz()[0], 0.1) as health, Sampler(fake_gpus.allocatable, 0.05) as allocatable, \
            RegisteredCount(r, seconds=120) as registered:
        # Every GPU broken, each its own way.
        broke = faults.fault(0, xid=79)
        faults.fault(1, xid=48)
        faults.fault(2, ecc="double")
        faults.fault(3, lost=True)
        not_ready = within(health.samples, broke, lambda v: v == 503, 10, "/healthz 503 with every GPU faulted")
        # The first 503 can come while the later faults are still on their way (a registration of the new GPU
        # generation holds Ready back too): the state asserted below is the one with all four seen.
        _, body = wait_until(lambda: (lambda got: got if (got[1] or {}).get("components", {}).get("gpus", {}).get(
            "reason", "").startswith("no healthy GPU:") else None)(r.healthz()), 10, "all four faults seen")
        components = body["components"]
        assert components["gpus"]["reason"].startswith("no healthy GPU: 4 GPUs Unhealthy (node " + node), components["gpus"]
        assert "4 nvidia.com/gpu in capacity, 0 allocatable" in components["gpus"]["reason"]
        assert components["registration"]["reason"].startswith("no healthy GPU:"), components["registration"]
        assert not components["queues"]["ready"] and components["queues"]["reason"].startswith("paused"), components["queues"]
        assert not body["active"]
        metrics = r.metrics()
        assert "gpu_agent_queue_paused 1.0" in metrics and "gpu_agent_gpus 0.0" in metrics
        spec = wait_until(lambda: (lambda m: m if m.get("ready") is False else None)(member()), 10,
                          "the member NotReady")
        assert spec["healthyGPUs"] == 0 and spec["message"].startswith("no healthy GPU:"), spec
        assert "Xid 79" in spec["message"] and "Xid 48" in spec["message"] and "Lost" in spec["message"], spec
        assert len(spec["gpuUUIDs"]) == 4, "the member still lists the node's GPUs"

        four = registered.registered(4)
        cleared = faults.clear()
        ready_again = within(health.samples, cleared, lambda v: v == 200, 10, "/healthz 200 after the clear")
        back_registered = within(registered.samples, cleared, four, 10, "4 registered after the clear")
        wait_until(lambda: member().get("ready") is True and member().get("healthyGPUs") == 4, 10, "the member Ready")
        assert "message" not in member()
        print(f"\nevery GPU faulted -> /healthz 503 in {not_ready:.2f} s; clear -> 200 in {ready_again:.2f} s, "
              f"-> 4 registered in {back_registered:.2f} s")
        assert ready_again <= GOAL and back_registered <= GOAL

        # A work item leased while GPU 2 is faulted: its Pod gets the three healthy GPUs, never GPU 2.
        three = registered.registered(3)
        broke = faults.fault(2, xid=48)
        within(registered.samples, broke, three, 10, "3 registered with GPU 2 faulted")
        within(allocatable.samples, broke, lambda v: v == 3, 10, "allocatable 3 with GPU 2 faulted")
        pod_devices = work_pod_devices(r, core)
        four = registered.registered(4)
        cleared = faults.clear()
        within(registered.samples, cleared, four, 10, "4 registered again")
        latencies_from = time.monotonic()

        # The latencies over CYCLES faults of every GPU, and their clears.
        to_zero, to_not_ready, recovery = [], [], []
        for _ in range(CYCLES):
            broke = faults.fault(0, xid=79)
            for gpu in (1, 2, 3):
                faults.fault(gpu, xid=48)
            to_zero.append(within(allocatable.samples, broke, lambda v: v == 0, 10, "allocatable 0"))
            to_not_ready.append(within(health.samples, broke, lambda v: v == 503, 10, "/healthz 503"))
            cleared = faults.clear()
            recovery.append(within(health.samples, cleared, lambda v: v == 200, 10, "/healthz 200"))
            within(allocatable.samples, cleared, lambda v: v == 4, 10, "allocatable 4")
        samples = len([t for t, _ in health.samples if t >= latencies_from])
        elapsed = time.monotonic() - latencies_from
    visible, state = pod_devices
    healthy = {g["uuid"] for g in state["gpus"] if g.get("health", "Healthy") == "Healthy"}
    faulted = {g["uuid"] for g in state["gpus"]} - healthy
    assert len(faulted) == 1 and len(visible) == 3 and set(visible) == healthy, (visible, state)
    print(f"work Pod leased with GPU 2 faulted: given {len(visible)} GPUs, all healthy, not {sorted(faulted)[0]}")
    print(f"over {CYCLES} faults of every GPU: fault -> allocatable 0: {spread(to_zero)}; fault -> /healthz 503: "
          f"{spread(to_not_ready)}; clear -> /healthz 200: {spread(recovery)} ({samples} /healthz samples)")
    assert samples >= elapsed / 0.1 * 0.5, f"the /healthz sampler fell behind: {samples} samples in {elapsed:.1f} s"
    assert max(recovery) <= GOAL
    for component in ("cluster-agent", "control-plane", "node-agent"):
        counts = restarts(core, r.namespace, f"app.kubernetes.io/instance={r.name},app.kubernetes.io/component={component}")
        assert counts and set(counts.values()) == {0}, (component, counts)
    after = {c.name: c.restart_count for c in core.read_namespaced_pod(plugin.metadata.name, fake_gpus.namespace)
             .status.container_statuses}
    assert after == plugin_restarts, "the fake device plugin restarted"


EVENT_GOAL = 5.0  # seconds from a fault (or its clear) to its Event on the Node
EVENTS_CONTROLLER = "gpu-agent.io/node-agent"


def test_gpu_health_changes_are_events_on_the_node_naming_the_xid_and_the_recovery(health_release, fake_gpus, api):
    """nodeAgent.gpuHealthEvents (the default): what `kubectl events -n default --for node/NAME` shows a platform team.
    Xid 79 on GPU 1 (fallen off the bus: the fake, as NVML, makes the GPU Lost) is a Warning GPULost naming the Xid,
    Xid 48 on GPU 2 a Warning GPUUnhealthy naming it and its class; the clear is a Normal GPUHealthy for each, saying
    what it was. Read through events.k8s.io in namespace default (where a Node's Events go), each within EVENT_GOAL
    of its cause. Events of the node from earlier releases (the same faults, the same notes) are told apart by name:
    this release's node agent records each anew."""
    r, faults = health_release
    node = fake_gpus.node
    events = client.EventsV1Api(api)
    member = member_of(api, r, node)

    def about_node() -> list[dict]:
        # As JSON: the kubelet's own Events of the node (core/v1, no eventTime) fail the client's EventsV1Event model.
        listed = json.loads(events.list_namespaced_event("default", field_selector=f"regarding.name={node}",
                                                         _request_timeout=10, _preload_content=False).data)
        return [e for e in listed["items"] if e.get("reportingController") == EVENTS_CONTROLLER
                and e["regarding"].get("kind") == "Node"]

    # The node agent has read the node's 4 GPUs healthy (its member says so) before anything breaks.
    wait_until(lambda: member().get("ready") is True and member().get("healthyGPUs") == 4, 30, "the member Ready on 4")
    before = {e["metadata"]["name"] for e in about_node()}

    def new(type_: str, reason: str, *words: str):
        return next((e for e in about_node() if e["metadata"]["name"] not in before
                     and (e.get("type"), e.get("reason")) == (type_, reason)
                     and all(w in (e.get("note") or "") for w in words)), None)

    def seen(started: float, type_: str, reason: str, *words: str):
        event = wait_until(lambda: new(type_, reason, *words), 30, f"a {type_} {reason} Event on node {node} "
                           f"saying {' ... '.join(words)}", interval=0.1)
        return event, time.monotonic() - started

    lost_at = faults.fault(1, xid=79)
    unhealthy_at = faults.fault(2, xid=48)
    lost, to_lost = seen(lost_at, "Warning", "GPULost", "GPU 1 (GPU-", "Lost: Xid 79 (GPU has fallen off the bus)")
    unhealthy, to_unhealthy = seen(unhealthy_at, "Warning", "GPUUnhealthy", "GPU 2 (GPU-",
                                   "Unhealthy: Xid 48 (double-bit ECC error) [critical Xid]")
    for e in (lost, unhealthy):
        assert e["metadata"]["namespace"] == "default" and e["regarding"]["name"] == node, e
        assert e["regarding"].get("apiVersion") == "v1" and e.get("reportingInstance") == node, e
        assert e.get("action") == "CheckGPUHealth", e
    # The faults hold over many reads of the node's state file (the member follows them meanwhile).
    wait_until(lambda: member().get("healthyGPUs") == 2, 10, "the member on 2 healthy GPUs")
    cleared = faults.clear()
    back_1, to_back_1 = seen(cleared, "Normal", "GPUHealthy", "GPU 1 (GPU-", "was Lost: Xid 79")
    back_2, to_back_2 = seen(cleared, "Normal", "GPUHealthy", "GPU 2 (GPU-", "was Unhealthy: Xid 48")
    # A fault that holds is one occurrence, not one per read: no Event of these four turned into a series.
    notes = {e.get("note") for e in (lost, unhealthy, back_1, back_2)}
    mine = [e for e in about_node() if e["metadata"]["name"] not in before and e.get("note") in notes]
    assert len(mine) >= 4 and not [e for e in mine if e.get("series")], [(e.get("reason"), e.get("series")) for e in mine]
    print(f"\nXid 79 -> Warning GPULost on node {node} in {to_lost:.2f} s, Xid 48 -> Warning GPUUnhealthy in "
          f"{to_unhealthy:.2f} s; clear -> Normal GPUHealthy in {to_back_1:.2f} s and {to_back_2:.2f} s")
    for e in (lost, unhealthy, back_1, back_2):
        print(f"  {e.get('type')} {e.get('reason')}: {e.get('note')}")
    assert max(to_lost, to_unhealthy, to_back_1, to_back_2) <= EVENT_GOAL


WORK = ["sh", "-c", 'fake-gpu smi -L; echo STATE-BEGIN; cat "$FAKE_GPU_STATE_FILE"; echo; echo STATE-END; sleep 5']


def work_pod_devices(r: Release, core) -> tuple[list[str], dict]:
    """Enqueue one item asking for 3 GPUs; (the UUIDs its Pod was given, the node's fake state file as
    the Pod saw it at its start: which GPUs were faulted)."""
    from gpu_agent.mechanisms.queues.pod_executor import pod_name

    key = f"health-{uuid.uuid4().hex[:6]}"
    r.control_plane(f"c.enqueue(t, {key!r}, {{'gpus': 3, 'command': {WORK!r}}})\n")

    text = wait_until(lambda: (lambda t: t if "STATE-END" in t else "")(pod_log(core, r.namespace, pod_name(key))), 60, "the work Pod to print its GPUs")
    visible = [line.split("UUID: ")[1].rstrip(")") for line in text.splitlines() if "UUID: GPU-" in line]
    state = json.loads(text.split("STATE-BEGIN", 1)[1].split("STATE-END", 1)[0])
    return visible, state
