"""Domain formation on the real API server: many writers, kills and restarts, shutdown, NotReady and back."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client

from e2e.helpers import wait_until
from gpu_agent.foundations import fake_state
from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.mechanisms.domain.entries import Entry
from gpu_agent.mechanisms.domain.writer import GROUP, PLURAL, VERSION, DomainWriter
from gpu_agent_hooks.cli import apply_crds

CRDS = Path(__file__).resolve().parent.parent / "charts" / "gpu-agent" / "crds"


@pytest.fixture(scope="module")
def crd(api):
    apply_crds(api, CRDS)


def make_domain(api, namespace, name, expected):
    client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomain", "metadata": {"name": name},
        "spec": {"expectedNodes": expected}})


def get_domain(api, namespace, name):
    return client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


@pytest.mark.parametrize("mode", ["aggregate", "fulljitter"])
def test_50_writers_with_random_kills_and_restarts_converge_without_losing_an_entry(crd, api, kubeconfig, namespace, mode):
    from kubernetes import config

    from gpu_agent.mechanisms.domain.aggregate import Aggregator, MemberWriter

    make_domain(api, namespace, "d50", 50)
    aggregator = None
    if mode == "aggregate":
        aggregator = Aggregator(api, namespace, "d50")
        threading.Thread(target=aggregator.run, daemon=True).start()
    rng = random.Random(50)
    kills = {i: rng.choice(["none", "mid-retry", "after-write"]) for i in range(50)}
    restarts: list[str] = []
    converged: dict[int, bool] = {}  # threads record; the test asserts

    def new_writer(i):
        api_i = config.new_client_from_config(str(kubeconfig))
        if mode == "aggregate":
            return MemberWriter(api_i, namespace, "d50")
        return DomainWriter(api_i, namespace, "d50", mode, 25.0, random.Random(i))

    def agent(i):
        name = f"node-{i:02d}"
        entry = Entry(name, f"10.2.0.{i}", (f"GPU-{i:08d}-0000-0000-0000-000000000000",), True)
        w = new_writer(i)
        if kills[i] == "mid-retry":
            budget = iter(range(rng.randint(0, 2), -1, -1))
            if mode != "aggregate":  # a member is one call: a kill "mid-retry" is a kill before it
                w.ensure(entry, superseded=lambda: next(budget, 0) == 0)  # killed at a random point of its retry loop
        elif kills[i] == "after-write":
            w.ensure(entry)  # wrote its entry, then died
        if kills[i] != "none":
            time.sleep(rng.random() * 0.5)
            restarts.append(name)
            w = new_writer(1000 + i)  # a restarted agent: fresh client, empty cache
        converged[i] = w.ensure(entry, deadline=time.monotonic() + 120)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(50)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not [t for t in threads if t.is_alive()], "a writer thread never finished"
    assert sorted(i for i, ok in converged.items() if ok) == list(range(50)), f"writers that gave up: {converged}"
    wait_until(lambda: len(get_domain(api, namespace, "d50").get("status", {}).get("nodes") or []) == 50, 30,
               "all 50 entries in the domain")
    if aggregator is not None:
        aggregator.stop()
    obj = get_domain(api, namespace, "d50")
    nodes = obj["status"]["nodes"]
    print(f"\n{mode}: 50 writers, {len(restarts)} killed and restarted: converged in {time.monotonic() - started:.1f}s")
    assert sorted(n["name"] for n in nodes) == [f"node-{i:02d}" for i in range(50)]
    assert sorted(n["index"] for n in nodes) == list(range(50))
    assert obj["status"]["status"] == "Ready" and obj["status"]["readyNodes"] == 50
    planned = sorted(f"node-{i:02d}" for i, k in kills.items() if k != "none")
    assert sorted(restarts) == planned and len(planned) >= 10  # every planned kill happened (seeded plan)


class LocalNodeAgent:
    """A real node agent process against the cluster's API server, on fake GPUs."""

    def __init__(self, tmp: Path, kubeconfig, namespace, domain, node, strategy, gpus=1, clique=""):
        self.node, self.tmp = node, tmp
        self.state = tmp / f"{node}.json"
        fake_state.write_atomic(self.state, fake_state.render(Inventory(tuple(
            GPU(f"GPU-{abs(hash(node)) % 10**8:08d}-0000-0000-0000-00000000000{i}", "fake", 1 << 30, index=i)
            for i in range(gpus)), clique=clique), node))
        self.peers = tmp / f"{node}.peers"
        self.log = tmp / f"{node}.log"
        self.argv = [sys.executable, "-m", "gpu_agent", "node-agent", "-v", "3", "--listen-address", "127.0.0.1:0",
                     "--node-name", node, "--fake-gpu-state-file", str(self.state), "--domain-name", domain,
                     "--domain-namespace", namespace, "--kubeconfig", str(kubeconfig), "--peers-file", str(self.peers),
                     "--gpu-poll-interval", "0.2", "--domain-write-strategy", strategy]
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def entry_names(api, namespace, name):
    return {n["name"]: n["status"] for n in (get_domain(api, namespace, name).get("status") or {}).get("nodes") or []}


@pytest.fixture(params=["aggregate", "fulljitter"])
def strategy(request, api, namespace):
    """Each domain test runs with the default (aggregate: plus the aggregator the cluster agent
    runs, here on a thread) and with optimistic concurrency on the domain object."""
    aggregators = []

    def start(domain):
        if request.param == "aggregate":
            from gpu_agent.mechanisms.domain.aggregate import Aggregator

            agg = Aggregator(api, namespace, domain)
            threading.Thread(target=agg.run, daemon=True).start()
            aggregators.append(agg)
        return request.param

    yield start
    for agg in aggregators:
        agg.stop()


def test_shutdown_removes_the_entry_within_its_timeout(crd, api, kubeconfig, namespace, tmp_path, strategy):
    make_domain(api, namespace, "d1", 1)
    agent = LocalNodeAgent(tmp_path, kubeconfig, namespace, "d1", "solo", strategy("d1")).start()
    wait_until(lambda: entry_names(api, namespace, "d1").get("solo") == "Ready", 30, "the agent's entry, Ready")
    assert get_domain(api, namespace, "d1")["status"]["status"] == "Ready"
    started = time.monotonic()
    assert agent.stop() == 0
    wait_until(lambda: "solo" not in entry_names(api, namespace, "d1"), 10, "the entry to leave the domain")
    took = time.monotonic() - started
    assert took < 10.0
    assert "domain entry of solo removed" in agent.log.read_text()
    print(f"\nSIGTERM -> entry removed from the domain: {took:.2f}s")


def test_a_domain_with_one_node_gone_turns_not_ready_and_back(crd, api, kubeconfig, namespace, tmp_path, strategy):
    make_domain(api, namespace, "d2", 2)
    mode = strategy("d2")
    a = LocalNodeAgent(tmp_path, kubeconfig, namespace, "d2", "node-a", mode).start()
    b = LocalNodeAgent(tmp_path, kubeconfig, namespace, "d2", "node-b", mode).start()
    try:
        wait_until(lambda: get_domain(api, namespace, "d2").get("status", {}).get("status") == "Ready", 30, "domain Ready")
        wait_until(lambda: a.peers.exists() and len(a.peers.read_text().splitlines()) == 3, 10, "peers file with 2 nodes")
        b.stop()
        wait_until(lambda: get_domain(api, namespace, "d2")["status"]["status"] == "NotReady", 15, "domain NotReady")
        wait_until(lambda: len(a.peers.read_text().splitlines()) == 2, 10, "peers file with 1 node")
        b.start()
        wait_until(lambda: get_domain(api, namespace, "d2")["status"]["status"] == "Ready", 30, "domain Ready again")
        indices = sorted(n["index"] for n in get_domain(api, namespace, "d2")["status"]["nodes"])
        assert indices == [0, 1]
        assert "peer(s)" in a.log.read_text()
    finally:
        for agent in (a, b):
            if agent.proc.poll() is None:
                agent.stop()


def peers_of(agent: LocalNodeAgent) -> list[str]:
    """The node names in an agent's peers file (what a workload on that node would be handed)."""
    if not agent.peers.exists():
        return []
    return sorted(line.split()[1] for line in agent.peers.read_text().splitlines()[1:])


def test_two_racks_number_their_nodes_per_clique_and_a_node_moved_to_the_other_rack_follows(
        crd, api, kubeconfig, namespace, tmp_path):
    """Two fake racks (NVLink cliques) of three node agents each in one domain: indices run per clique,
    each node's peers file lists its own rack only; a node whose layout moves it to the other rack
    (`fake-gpu set --clique`) leaves the old rack's peers files and joins the new rack's."""
    from gpu_agent.mechanisms.domain.aggregate import Aggregator

    make_domain(api, namespace, "racks", 6)
    aggregator = Aggregator(api, namespace, "racks")
    threading.Thread(target=aggregator.run, daemon=True).start()
    racks = {"rack-a": ["a0", "a1", "a2"], "rack-b": ["b0", "b1", "b2"]}
    agents = {node: LocalNodeAgent(tmp_path, kubeconfig, namespace, "racks", node, "aggregate", clique=rack).start()
              for rack, nodes in racks.items() for node in nodes}
    try:
        def layout():
            status = get_domain(api, namespace, "racks").get("status") or {}
            return {n["name"]: (n.get("clique"), n["index"]) for n in status.get("nodes") or []}, status

        wait_until(lambda: layout()[1].get("status") == "Ready" and len(layout()[0]) == 6, 60, "6 members Ready")
        by_rack = {rack: sorted(index for c, index in layout()[0].values() if c == rack) for rack in racks}
        assert by_rack == {"rack-a": [0, 1, 2], "rack-b": [0, 1, 2]}, layout()[0]
        assert layout()[1]["cliques"] == [{"id": "rack-a", "nodes": 3, "readyNodes": 3},
                                          {"id": "rack-b", "nodes": 3, "readyNodes": 3}]
        for nodes in racks.values():
            for node in nodes:
                wait_until(lambda node=node, nodes=nodes: peers_of(agents[node]) == nodes, 15, f"{node}'s peers: its rack")
        started = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "fake_gpu", "--state-file", str(agents["a1"].state), "set", "--count", "1",
                            "--clique", "rack-b"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        wait_until(lambda: layout()[0].get("a1") == ("rack-b", 3), 30, "a1 in rack-b with the lowest free index there (3)")
        for node in ("a0", "a2"):
            wait_until(lambda node=node: peers_of(agents[node]) == ["a0", "a2"], 15, f"{node}'s peers without a1")
        for node in ("b0", "b1", "b2", "a1"):
            wait_until(lambda node=node: peers_of(agents[node]) == ["a1", "b0", "b1", "b2"], 15, f"{node}'s peers with a1")
        print(f"\na1 moved from rack-a to rack-b: every peers file right after {time.monotonic() - started:.1f} s; "
              f"indices {sorted(layout()[0].items())}")
    finally:
        aggregator.stop()
        for agent in agents.values():
            if agent.proc.poll() is None:
                agent.stop()
