"""A cluster of several nodes (`make cluster-up NODES=3`): one pod per node, traffic between
nodes, fake GPUs per node, and a GPUDomain that loses a node and gets it back.

Marked `multinode`: they run in the one stage of `make e2e` with the rest of the suite (a 3-node CI
cluster); on a cluster with fewer nodes they skip, saying so. The node faults (stop,
partition) exist on the CI cluster only (ci/scripts/node.sh), as do the host's firewall counters.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
import uuid

import pytest
from kubernetes import client

from e2e.cluster import node_fault, provider, tool
from e2e.fake_gpu_release import fake_gpu_nodes
from e2e.helpers import Sampler, apply, domain_status, exec_python, wait_until
from e2e.release import CA, WAIT, Active, Release, WorkPods, enqueue, items, leaderless, lost_and_doubled
from gpu_agent.mechanisms.queues.pod_executor import pod_name

pytestmark = [pytest.mark.multinode, pytest.mark.serial(reason="sets GPUs on every node, stops, partitions, drains or deletes nodes")]

PROBE = """
import json, socket, time, urllib.request
out = {}
for url in URLS:
    # a new Service reaches a node's kube-proxy a moment after its pods are Ready: retry to a deadline
    deadline = time.monotonic() + 30
    while True:
        try:
            out[url] = urllib.request.urlopen(url, timeout=5).read().decode()
            break
        except Exception as e:
            out[url] = "error: %s" % e
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
try:
    out["dns"] = socket.gethostbyname("kubernetes.default.svc.cluster.local")
except Exception as e:
    out["dns"] = "error: %s" % e
try:
    socket.create_connection(("192.0.2.1", 80), timeout=2)  # TEST-NET-1: must never leave the machine
    out["outside"] = "connected"
except Exception as e:
    out["outside"] = "error: %s" % e
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def nodes(core) -> list[str]:
    names = sorted(n.metadata.name for n in core.list_node().items)
    if len(names) < 3:
        pytest.skip(f"needs 3 nodes, the cluster has {len(names)}: make cluster-up NODES=3 (the CI cluster)")
    return names


def fence_drops() -> int:
    """Packets the CI host's fence dropped so far (its last rule), read from the host's firewall."""
    out = subprocess.run(["iptables", "-t", "mangle", "-L", "GPUCI-FENCE", "-v", "-x", "-n"], check=True,
                         capture_output=True, text=True).stdout
    return int(next(line for line in out.splitlines() if " DROP " in f" {line} ").split()[0])


def test_a_daemonset_runs_one_pod_per_node_and_pods_reach_each_other_by_ip_service_and_dns(api, core, namespace, nodes):
    apply(api, namespace, "named-web-daemonset.yaml.j2", name="web")

    def ready_pods():
        pods = core.list_namespaced_pod(namespace, label_selector="app=web").items
        ok = [p for p in pods if any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))]
        return ok if len(ok) == len(nodes) else None

    pods = wait_until(ready_pods, 90, f"{len(nodes)} web pods Ready")
    assert sorted(p.spec.node_name for p in pods) == nodes, "one pod on every node"
    by_ip = {p.status.pod_ip: p.metadata.name for p in pods}
    service = f"http://web.{namespace}.svc.cluster.local/name"
    urls = [f"http://{ip}:8000/name" for ip in by_ip] + [service]
    rows = []
    for pod in pods:
        before = fence_drops() if provider() == "ci" else 0
        answers = json.loads(exec_python(api, namespace, pod.metadata.name, f"URLS = {urls!r}\n{PROBE}").strip())
        for ip, name in by_ip.items():
            assert answers[f"http://{ip}:8000/name"] == name, (pod.spec.node_name, ip, answers)
        assert answers[service] in by_ip.values(), (pod.spec.node_name, answers)
        assert answers["dns"] == "10.96.0.1" or answers["dns"].count(".") == 3, (pod.spec.node_name, answers)
        assert answers["outside"].startswith("error"), (pod.spec.node_name, answers)
        dropped = fence_drops() - before if provider() == "ci" else None
        if dropped is not None:
            assert dropped >= 1, f"{pod.spec.node_name}: the host's fence dropped nothing of the pod's outside attempt"
        rows.append(f"{pod.spec.node_name}: {len(by_ip)} pods by IP, the Service, DNS {answers['dns']}, outside refused"
                    + (f" ({dropped} packet(s) dropped by the fence)" if dropped is not None else ""))
    print("\n" + "\n".join(rows))


def test_fake_gpus_per_node_allocatable_follows_on_each_within_2s(fake_gpus, nodes):
    counts = {node: count for node, count in zip(nodes, itertools.cycle((1, 2, 4)))}  # every node a count
    times = {node: fake_gpus.set(count, timeout=2, node=node) for node, count in counts.items()}
    assert {node: fake_gpus.allocatable(node) for node in nodes} == counts, "each node keeps its own count"
    times[nodes[1]] = fake_gpus.set(3, timeout=2, node=nodes[1])
    assert {node: fake_gpus.allocatable(node) for node in nodes} == {**counts, nodes[1]: 3}, "only that node changed"
    print("\nallocatable followed in " + ", ".join(f"{n} {t:.2f} s" for n, t in times.items()))
    for node in nodes:
        fake_gpus.set(0, node=node)


def node_ready(core, node: str) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in core.read_node(node).status.conditions or [])


@pytest.mark.disruptive
def test_node_agents_form_a_domain_across_nodes_and_a_stopped_or_partitioned_node_turns_notready_and_back(
        api, core, apps, kubeconfig, namespace, fake_gpus, nodes):
    """Real DaemonSet pods on three nodes form one GPUDomain; a worker stopped (node-stop: its kubelet,
    containerd and pods killed) or cut off (node-partition) turns its member and the domain NotReady
    within the heartbeat TTL + 1 s, and both come back when the node does."""
    if provider() != "ci":
        pytest.skip("node faults need the CI cluster (ci/scripts/node.sh)")
    for node in nodes:
        fake_gpus.set(1, node=node)
    first, worker = nodes[0], nodes[-1]
    release = Release(api, core, apps, kubeconfig, namespace, name=f"nodes{uuid.uuid4().hex[:5]}")
    pin = f"kubernetes\\.io/hostname={first}"  # the cluster agent and control plane stay on the node that lives
    release.install("--set", "domain.name=gpus", "--set", f"domain.expectedNodes={len(nodes)}",
                    "--set", "domain.heartbeatInterval=1", "--set", "domain.heartbeatTTL=3",
                    "--set", f"clusterAgent.nodeSelector.{pin}", "--set", f"controlPlane.nodeSelector.{pin}")
    custom = client.CustomObjectsApi(api)

    def status():
        return domain_status(custom, namespace, "gpus")

    def member(node):
        return next((m for m in status().get("nodes", []) if m["name"] == node), {})

    faulted = None
    try:
        wait_until(lambda: status().get("status") == "Ready" and len(status().get("nodes", [])) == len(nodes), 120,
                   f"the GPUDomain Ready with {len(nodes)} members")
        indices = {m["name"]: m["index"] for m in status()["nodes"]}
        assert sorted(indices) == nodes and sorted(indices.values()) == list(range(len(nodes))), indices
        rows = []
        for fault, undo in (("stop", "start"), ("partition", "heal")):
            node_fault(fault, worker)
            faulted, started = undo, time.monotonic()
            wait_until(lambda: member(worker).get("status") == "NotReady" and status().get("status") == "NotReady",
                       3 + 1 + 2, f"{worker}'s member and the domain NotReady after node-{fault}")  # TTL 3 s + 1 s + a poll
            member_gone = time.monotonic() - started
            wait_until(lambda: not node_ready(core, worker), 60, f"{worker} NotReady at the API server")
            node_gone = time.monotonic() - started
            node_fault(undo, worker)
            faulted, started = None, time.monotonic()
            wait_until(lambda: member(worker).get("status") == "Ready" and status().get("status") == "Ready", 120,
                       f"{worker}'s member and the domain Ready after node-{undo}")
            back = time.monotonic() - started
            assert member(worker)["index"] == indices[worker], "the node keeps its index"
            rows.append(f"node-{fault} {worker}: member and domain NotReady after {member_gone:.1f} s, node NotReady after "
                        f"{node_gone:.1f} s; node-{undo}: Ready again after {back:.1f} s")
        print("\n" + "\n".join(rows))
    finally:
        if faulted:
            node_fault(faulted, worker)
        wait_until(lambda: node_ready(core, worker), 120, f"{worker} Ready again (for the tests after this one)")
        release.uninstall_if_installed()
        for node in nodes:
            fake_gpus.set(0, node=node)


def test_a_gpudomain_a_user_creates_with_a_node_selector_is_joined_by_exactly_the_matching_nodes(
        api, core, apps, kubeconfig, namespace, fake_gpus, nodes):
    """domain.joinMatching: the chart's node agents join a GPUDomain created after install whose
    nodeSelector matches their node's labels, and only those; a node relabelled out of it leaves."""
    for node in nodes:
        fake_gpus.set(1, node=node)
    label, value = "gpu-agent.io/e2e-rack", uuid.uuid4().hex[:8]
    members = nodes[1:]
    release = Release(api, core, apps, kubeconfig, namespace, name=f"sel{uuid.uuid4().hex[:5]}")
    custom = client.CustomObjectsApi(api)

    def names():
        try:
            obj = custom.get_namespaced_custom_object("gpu-agent.io", "v1beta1", namespace, "gpudomains", "rack")
        except client.ApiException:
            return None
        return sorted(n["name"] for n in (obj.get("status") or {}).get("nodes") or [])

    try:
        for node in members:
            core.patch_node(node, {"metadata": {"labels": {label: value}}})
        release.install("--set", "domain.joinMatching=true")
        custom.create_namespaced_custom_object("gpu-agent.io", "v1beta1", namespace, "gpudomains", {
            "apiVersion": "gpu-agent.io/v1beta1", "kind": "GPUDomain", "metadata": {"name": "rack"},
            "spec": {"expectedNodes": len(members), "nodeSelector": {label: value}}})
        started = time.monotonic()
        wait_until(lambda: names() == members, 90, f"the user's GPUDomain joined by {members} only")
        joined = time.monotonic() - started
        core.patch_node(members[-1], {"metadata": {"labels": {label: "elsewhere"}}})
        started = time.monotonic()
        wait_until(lambda: names() == members[:-1], 60, f"{members[-1]} relabelled out of the domain, gone from it")
        print(f"\nuser GPUDomain with nodeSelector: joined by {members} in {joined:.1f} s; "
              f"{members[-1]} left {time.monotonic() - started:.1f} s after its label changed")
    finally:
        for node in members:
            core.patch_node(node, {"metadata": {"labels": {label: None}}})
        release.uninstall_if_installed()
        for node in nodes:
            fake_gpus.set(0, node=node)


def hand_overs(active: Active) -> list[str]:
    """The active agents in the order they led, from every probe that found one active (repeats collapsed)."""
    order: list[str] = []
    for _, _, pod in sorted(active.seen, key=lambda p: p[1]):
        if not order or order[-1] != pod:
            order.append(pod)
    return order


@pytest.mark.disruptive
def test_kubectl_drain_of_the_leaders_node_hands_over_once_and_the_budget_evicts_one_agent_at_a_time(
        api, core, apps, kubeconfig, namespace, fake_gpus, nodes):
    """clusterAgent.replicas=2 with the chart's defaults otherwise: the soft anti-affinity puts the
    agents on two workers and the PodDisruptionBudget allows one eviction. Draining the leader's node
    hands over once with work running, nothing lost or doubled. The drained node's agent comes back
    beside the other, so draining that node next evicts two agents: the budget makes the second wait
    until the first's replacement is Ready, so some agent is Ready throughout."""
    first, workers = nodes[0], nodes[1:3]  # the two workers the pool label below lets the two agents on
    fake_gpus.set(4, node=first)  # work Pods ask for a GPU: they run on the node nobody drains
    pool = ("gpu-agent.io/e2e-pool", uuid.uuid4().hex[:8])
    release = Release(api, core, apps, kubeconfig, namespace, name=f"drain{uuid.uuid4().hex[:5]}")
    kubectl = [tool("kubectl"), "--kubeconfig", str(kubeconfig)]
    drained: list[str] = []

    def drain(node: str) -> float:
        drained.append(node)
        started = time.monotonic()
        r = subprocess.run([*kubectl, "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=180s"],
                           capture_output=True, text=True, timeout=200)
        assert r.returncode == 0, r.stderr[-2000:]
        return time.monotonic() - started

    def ready_agents() -> int:
        return sum(1 for p in release.pods(CA) if p.metadata.deletion_timestamp is None
                   and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or []))

    def where() -> dict[str, str]:
        return {p.metadata.name: p.spec.node_name for p in release.pods(CA) if p.metadata.deletion_timestamp is None}

    try:
        for node in workers:
            core.patch_node(node, {"metadata": {"labels": {pool[0]: pool[1]}}})
        pin = f"kubernetes\\.io/hostname={first}"
        release.install("--set", "clusterAgent.replicas=2", "--set-string", f"clusterAgent.nodeSelector.{pool[0].replace('.', chr(92) + '.')}={pool[1]}",
                        "--set", f"controlPlane.nodeSelector.{pin}", *WAIT)
        placed = where()
        assert sorted(placed.values()) == workers, f"the soft anti-affinity should spread the agents: {placed}"
        shown = subprocess.run([*kubectl, "-n", namespace, "get", "deploy,ds,pdb", "-o", "wide"], capture_output=True,
                               text=True, timeout=30).stdout
        print("\n" + shown)
        pdb = client.PolicyV1Api(api).read_namespaced_pod_disruption_budget(f"{release.fullname}-cluster-agent", namespace)
        assert pdb.spec.max_unavailable == 1 and pdb.spec.unhealthy_pod_eviction_policy == "AlwaysAllow"
        wait_until(lambda: pdb_allowed(api, namespace, release) == 1, 30, "the budget allows one disruption")

        active = Active(release)
        wait_until(lambda: len(active()) == 1, 60, "one active cluster agent")
        leader_node = placed[active()[0]]
        pods = WorkPods(core, namespace)
        keys = [f"drain-{i}" for i in range(8)]
        with Sampler(active, 0.25), Sampler(ready_agents, 0.25) as readiness:
            enqueue(release, keys[:4], seconds=2)
            started = time.monotonic()
            took = drain(leader_node)
            wait_until(lambda: len(active()) == 1 and ready_agents() == 2, 90, "a leader and a Ready standby again")
            first_gap = leaderless(active, started, time.monotonic())
            order = hand_overs(active)
            other = next(n for n in workers if n != leader_node)
            assert sorted(where().values()) == [other, other], where()  # the replacement could only go there
            subprocess.run([*kubectl, "uncordon", leader_node], check=True, capture_output=True, timeout=30)
            enqueue(release, keys[4:], seconds=2)
            started_both = time.monotonic()
            took_both = drain(other)
            wait_until(lambda: len(active()) == 1 and ready_agents() == 2, 90, "a leader and a Ready standby again")
            second_gap = leaderless(active, started_both, time.monotonic())
        lost, doubled = lost_and_doubled(release, pods, keys)
        ready_counts = [v for _, v in readiness.samples if isinstance(v, int)]
        during_both = [v for t, v in readiness.samples if isinstance(v, int) and t >= started_both]
        print(f"drain of the leader's node {leader_node}: {took:.1f} s, led in turn by {len(order)} agents, "
              f"longest without an active agent {first_gap:.2f} s")
        print(f"drain of {other} holding both agents: {took_both:.1f} s, fewest Ready agents meanwhile "
              f"{min(during_both, default=-1)}, longest without an active agent {second_gap:.2f} s")
        print(f"{len(ready_counts)} readiness samples, {len(active.history)} activity samples; {len(keys)} items, "
              f"{len(lost)} lost, {len(doubled)} doubled")
        assert len(ready_counts) >= 30 and len(during_both) >= 10, (len(ready_counts), len(during_both))
        assert len(order) == 2, f"one hand-over expected while draining the leader's node: {order}"
        assert min(during_both) >= 1, "the budget let both agents go at once"
        assert pods.complete(), pods.gaps
        assert not lost and not doubled, (lost, doubled)
    finally:
        for node in drained:
            subprocess.run([*kubectl, "uncordon", node], capture_output=True, timeout=30)
        for node in workers:
            core.patch_node(node, {"metadata": {"labels": {pool[0]: None}}})
        release.uninstall_if_installed()
        fake_gpus.set(0, node=first)


def pdb_allowed(api, namespace: str, release: Release) -> int:
    pdb = client.PolicyV1Api(api).read_namespaced_pod_disruption_budget(f"{release.fullname}-cluster-agent", namespace)
    return (pdb.status.disruptions_allowed if pdb.status else None) or 0


def node_uid(core, node: str) -> str | None:
    try:
        return core.read_node(node).metadata.uid
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def first_times(conditions: dict, timeout: float, what: str, since: float) -> dict[str, float]:
    """Poll each condition (name -> predicate) to one deadline; the seconds from `since` at which each first held."""
    seen: dict[str, float] = {}

    def every_one_seen() -> bool:
        for name, condition in conditions.items():
            if name not in seen and condition():
                seen[name] = time.monotonic() - since
        return len(seen) == len(conditions)

    try:
        wait_until(every_one_seen, timeout, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; held so far: {seen or 'none'}") from None
    return seen


@pytest.mark.disruptive
def test_two_workers_one_deleted_one_force_lost_at_once_each_with_a_member_and_a_running_work_pod_leave_the_domain_and_come_back(
        api, core, apps, kubeconfig, namespace, fake_gpus, nodes):
    """The bats failover group's whole-node cases, both at once on two workers. Each carries the chart's node
    agent, its domain member and a work item's running Pod (each item asks for 2 GPUs: only the two workers have 2).
    `deleted`: its Node object is deleted from the API while it runs (`kubectl delete node`); `force-lost`: its
    processes are killed (node-stop) and its Node deleted. Each member leaves the domain (force-lost: NotReady within
    the heartbeat TTL + 1 s first), the domain's indices stay unique in every sample and it never loses more than the
    two members, each item is done with its Pod run once (the API server's watch), and each node comes back
    (node-start re-registers it) with its member; new items run there. One after another they took 129 and 138 s
    (CI, 2026-12-07); at once their waits (the pod GC's 40 s quarantine of an orphaned Pod, the node coming back)
    overlap."""
    if provider() != "ci":
        pytest.skip("losing a whole node needs the CI cluster (ci/scripts/node.sh)")
    first = nodes[0]
    losses = {nodes[-2]: "deleted", nodes[-1]: "force-lost"}
    victims = list(losses)
    for node in nodes:
        fake_gpus.set(2 if node in losses else 1, node=node)
    release = Release(api, core, apps, kubeconfig, namespace, name=f"lost{uuid.uuid4().hex[:5]}")
    pin = f"kubernetes\\.io/hostname={first}"  # the cluster agent and control plane stay on a node that lives
    custom = client.CustomObjectsApi(api)
    kubectl = [tool("kubectl"), "--kubeconfig", str(kubeconfig)]
    ttl = 3

    def status():
        return domain_status(custom, namespace, "gpus")

    def member(node):
        return next((m for m in status().get("nodes", []) if m["name"] == node), {})

    def gone_from(read: dict, node: str) -> bool:  # a status read ({} when the read failed) without the node
        return bool(read) and all(m["name"] != node for m in read.get("nodes", []))

    def work(key: str, seconds: int) -> str:
        enqueue(release, [key], seconds=seconds, gpus=2)
        return pod_name(key)

    def running_on(name: str) -> str | None:
        """The victim the Pod runs on, once its container runs."""
        try:
            pod = core.read_namespaced_pod(name, namespace)
        except client.ApiException:
            return None
        running = any(c.state.running for c in pod.status.container_statuses or [])
        return pod.spec.node_name if running and pod.spec.node_name in losses else None

    def back_in_service(victim: str) -> bool:
        """The node Ready at the API server, labelled by its fake-gpu pod, its GPUs allocatable again."""
        return node_uid(core, victim) is not None and node_ready(core, victim) and \
            victim in {n.metadata.name for n in fake_gpu_nodes(core, "fg")} and fake_gpus.allocatable(victim) == 2

    old_uids = {victim: node_uid(core, victim) for victim in victims}
    lost = set()
    try:
        release.install("--set", "domain.name=gpus", "--set", f"domain.expectedNodes={len(nodes)}",
                        "--set", "domain.heartbeatInterval=1", "--set", f"domain.heartbeatTTL={ttl}",
                        "--set", f"clusterAgent.nodeSelector.{pin}", "--set", f"controlPlane.nodeSelector.{pin}")
        wait_until(lambda: status().get("status") == "Ready" and len(status().get("nodes", [])) == len(nodes), 120,
                   f"the GPUDomain Ready with {len(nodes)} members")
        pods = WorkPods(core, namespace)
        keys = [f"on-lost-node-{i}" for i in range(len(victims))]
        for key in keys:
            work(key, 600)
        placed = wait_until(lambda: (lambda on: on if len(set(on.values()) - {None}) == len(victims) else None)(
            {pod_name(key): running_on(pod_name(key)) for key in keys}), 90, f"a work Pod running on each of {victims}")
        key_on = {node: key for key in keys for name, node in placed.items() if name == pod_name(key)}

        def indices():  # a failed read is recorded by the Sampler as an error, not as an empty domain
            obj = custom.get_namespaced_custom_object("gpu-agent.io", "v1beta1", namespace, "gpudomains", "gpus")
            return [m.get("index") for m in (obj.get("status") or {}).get("nodes") or []]

        with Sampler(indices, 0.25) as sampled:
            started = time.monotonic()
            lost.update(victims)
            for victim, loss in losses.items():
                if loss == "force-lost":
                    node_fault("stop", victim)
            for victim in victims:
                r = subprocess.run([*kubectl, "delete", "node", victim, "--wait=false"], capture_output=True, text=True,
                                   timeout=60)
                assert r.returncode == 0, r.stderr
            figures = {victim: {} for victim in victims}
            forced = [v for v, loss in losses.items() if loss == "force-lost"]
            for victim, took in first_times(
                    {v: (lambda v=v: member(v).get("status") in ("NotReady", None) and status().get("status") == "NotReady")
                     for v in forced}, ttl + 1 + 2, "the force-lost members and the domain NotReady", started).items():
                figures[victim]["member NotReady"] = took
            for victim, took in first_times({v: (lambda v=v: gone_from(status(), v)) for v in victims}, 150,
                                            f"{victims}' members gone from the domain", started).items():
                figures[victim]["member removed"] = took
            assert len(status().get("nodes", [])) == len(nodes) - len(victims) and status().get("status") == "NotReady"
            for victim, took in first_times({v: (lambda v=v: items(release).get(key_on[v]) == "done") for v in victims},
                                            120, "the interrupted items done (a run each, not lost)", started).items():
                figures[victim]["item done"] = took

            # Back: a deleted node's kubelet does not register again by itself; it boots (node-start) and does.
            for victim, loss in losses.items():
                if loss == "deleted":
                    node_fault("stop", victim)
            restarted = time.monotonic()
            for victim in victims:
                node_fault("start", victim)
            for victim, took in first_times({v: (lambda v=v: back_in_service(v)) for v in victims}, 180,
                                            f"{victims} registered again, labelled and their GPUs allocatable",
                                            restarted).items():
                figures[victim]["node back"] = took
            lost.clear()
            for victim, took in first_times({v: (lambda v=v: member(v).get("status") == "Ready") for v in victims}, 120,
                                            f"{victims}' members back", restarted).items():
                figures[victim]["member back"] = took
            wait_until(lambda: status().get("status") == "Ready" and len(status().get("nodes", [])) == len(nodes), 60,
                       "the domain Ready with every member")
            sampled_for = time.monotonic() - started
        for victim in victims:
            assert node_uid(core, victim) != old_uids[victim], f"{victim} registered as a new object"
        fresh = [work(f"after-the-nodes-came-back-{i}", 1) for i in range(len(victims))]
        wait_until(lambda: all(items(release).get(f"after-the-nodes-came-back-{i}") == "done" for i in range(len(victims))),
                   120, "new items done on the nodes that came back")
        pods.stop()
        runs, executions = pods.runs(), pods.executions()
        samples = [v for _, v in sampled.samples if isinstance(v, list)]
        for victim, loss in losses.items():
            print(f"worker {victim} {loss}: " + ", ".join(f"{k} after {v:.1f} s" for k, v in figures[victim].items()))
        print(f"{len(samples)} samples of the domain's indices over {sampled_for:.1f} s, fewest members "
              f"{min(map(len, samples), default=-1)}; work Pods run: {runs}")
        # The sampler's own health: at least 60% of the polls its window allowed, and never fewer than 10.
        assert len(samples) >= max(10, 0.6 * sampled_for / 0.25), (len(samples), f"over {sampled_for:.1f} s")
        assert min(map(len, samples)) >= len(nodes) - len(victims), \
            f"the domain lost more than the two members: {min(map(len, samples))}"
        duplicated = [s for s in samples if len(s) != len(set(s))]
        assert not duplicated, f"a sample of the domain held one index twice: {duplicated[:3]}"
        assert pods.complete(), pods.gaps
        for name in [pod_name(key) for key in keys] + fresh:
            assert runs.get(name) == 1 and executions.get(name) == 1, (name, runs, executions)
        for victim in forced:
            assert figures[victim]["member NotReady"] <= ttl + 1 + 1, figures
    finally:
        for victim in victims:
            if victim in lost or not back_in_service(victim):
                node_fault("stop", victim)
                node_fault("start", victim)
        for victim in victims:
            wait_until(lambda v=victim: back_in_service(v), 180, f"{victim} back in service (for the tests after this one)")
        release.uninstall_if_installed()
        for node in nodes:
            fake_gpus.set(0, node=node)

