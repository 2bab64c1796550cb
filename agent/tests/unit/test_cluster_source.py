"""The cluster source reads GPU health as kubelet reports it: capacity beyond allocatable on a Ready
node is GPUs its device plugin marked unhealthy (mechanisms/inventory/cluster.py). The evidence is
the inventory it builds from Node objects and what the monitor and its health entry make of it."""

from __future__ import annotations

import io
import uuid
from types import SimpleNamespace as NS  # noqa: N814 - short: it stands in for Node objects below

from gpu_agent.foundations import klog
from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.gpus import HEALTHY, UNHEALTHY
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.slices import MADE_UP_UUIDS
from gpu_agent.mechanisms.inventory.cluster import NodeGPUs, inventory_of, node_gpus
from gpu_agent.mechanisms.inventory.monitor import InventoryMonitor
from gpu_agent.mechanisms.inventory.source import Reading


def node(allocatable: str | None, capacity: str | None, ready: bool = True, cordoned: bool = False) -> NS:
    return NS(spec=NS(unschedulable=cordoned),
              status=NS(conditions=[NS(type="Ready", status="True" if ready else "False")],
                        allocatable={} if allocatable is None else {"nvidia.com/gpu": allocatable},
                        capacity={} if capacity is None else {"nvidia.com/gpu": capacity}))


def test_a_node_reads_allocatable_and_capacity_and_nothing_when_not_ready_or_cordoned():
    assert node_gpus(node("4", "4")) == NodeGPUs(4, 4)
    assert node_gpus(node("3", "4")) == NodeGPUs(3, 4)
    assert node_gpus(node("0", "4")) == NodeGPUs(0, 4)
    assert node_gpus(node("4", None)) == NodeGPUs(4, 4)  # no capacity read: never fewer than allocatable
    assert node_gpus(node("x", "4")) == NodeGPUs(0, 4)  # unreadable allocatable: none of them usable
    # quantities as the API server writes them: 5000 GPUs read "5k" (a 4-node cluster of 20000 counted none)
    assert node_gpus(node("5k", "5k")) == NodeGPUs(5000, 5000)
    assert node_gpus(node("1500", "2k")) == NodeGPUs(1500, 2000)
    assert node_gpus(node("500m", "1")) == NodeGPUs(0, 1)  # not a whole number of devices: none
    assert node_gpus(node("4", "4", ready=False)) == NodeGPUs(0, 0)
    assert node_gpus(node("4", "4", cordoned=True)) == NodeGPUs(0, 0)


def test_capacity_beyond_allocatable_is_listed_unhealthy_with_where_it_went():
    inv = inventory_of({"n1": NodeGPUs(3, 4), "n2": NodeGPUs(2, 2)})
    assert inv.count == 6 and len(inv.healthy) == 5
    (bad,) = inv.unhealthy
    assert bad.health == UNHEALTHY and bad.name == "nvidia.com/gpu 3 on n1"
    assert bad.health_reason == ("node n1: 4 nvidia.com/gpu in capacity, 3 allocatable "
                                 "(marked unhealthy by its device plugin, or the plugin is not registered)")
    assert all(g.health == HEALTHY and g.health_reason == "" for g in inv.healthy)
    # made-up UUIDs in NVML's form, the same for the same node and index; no memory is known (1 byte: some)
    assert inv.gpus[0].uuid == "GPU-" + str(uuid.uuid5(MADE_UP_UUIDS, "n1/0"))
    assert {g.memory_total_bytes for g in inv.gpus} == {1}


def test_the_uuids_stay_the_same_while_health_moves_so_a_fault_is_a_health_change_not_a_new_gpu():
    before, after = inventory_of({"n1": NodeGPUs(4, 4)}), inventory_of({"n1": NodeGPUs(3, 4)})
    assert before.uuids == after.uuids
    assert [g.is_healthy for g in after.gpus] == [True, True, True, False]


class TableSource:
    name = "cluster"

    def __init__(self, table: dict[str, NodeGPUs]) -> None:
        self.table = table

    def read(self) -> Reading:
        return Reading(inventory_of(self.table))

    def close(self) -> None:
        pass


async def test_every_gpu_unallocatable_is_not_ready_and_the_reason_names_each_node():
    clock = ManualClock()
    health = HealthRegistry(clock, ["gpus"])
    events = []

    async def changed(e):
        events.append(e)

    source = TableSource({"n1": NodeGPUs(4, 4), "n2": NodeGPUs(2, 2)})
    monitor = InventoryMonitor(source, clock=clock, health=health, poll_interval=0.5, on_change=changed)
    await monitor.poll_once()
    assert health.get("gpus").ready
    source.table = {"n1": NodeGPUs(0, 4), "n2": NodeGPUs(0, 2)}
    await monitor.poll_once()
    entry = health.get("gpus")
    assert not entry.ready and [len(e.inventory.healthy) for e in events] == [6, 0]
    assert entry.reason.startswith("no healthy GPU: 4 GPUs Unhealthy (node n1: 4 nvidia.com/gpu in capacity, "
                                   "0 allocatable (marked unhealthy by its device plugin")
    assert "… Unhealthy (node n2: 2 nvidia.com/gpu in capacity, 0 allocatable" in entry.reason



def listing_once(list_call, *, on_list, on_event, on_error, stop, **kwargs):
    """list_then_watch reduced to its list: what the source asks the API server for, answered once."""
    watch_args = {k: v for k, v in kwargs.items() if k not in ("retry_seconds", "resync_seconds")}
    on_list(list_call(_request_timeout=10, **watch_args))


def test_a_node_selector_counts_only_the_matching_nodes_and_says_so_when_none_has_gpus(monkeypatch):
    from gpu_agent.mechanisms.inventory import cluster

    nodes = {"a1": ({"pool": "a"}, "4"), "b1": ({"pool": "b"}, "8"), "a2": ({"pool": "a"}, "0")}
    selectors = []

    class Core:  # list_node as the API server answers it: the nodes whose labels match the selector
        def __init__(self, api):
            pass

        def list_node(self, _request_timeout, label_selector=None):
            selectors.append(label_selector)
            wanted = dict(p.split("=", 1) for p in label_selector.split(",")) if label_selector else {}
            return NS(items=[NS(metadata=NS(name=name), spec=NS(unschedulable=False),
                                status=NS(conditions=[NS(type="Ready", status="True")],
                                          allocatable={"nvidia.com/gpu": gpus}, capacity={"nvidia.com/gpu": gpus}))
                             for name, (labels, gpus) in sorted(nodes.items())
                             if all(labels.get(k) == v for k, v in wanted.items())])

    monkeypatch.setattr(cluster.client, "CoreV1Api", Core)
    monkeypatch.setattr(cluster, "list_then_watch", listing_once)

    def read(**kwargs):
        source = cluster.ClusterSource(api=None, **kwargs)
        source._thread.join(5)
        return source.read()

    pooled = read(node_selector="pool=a")
    assert selectors == ["pool=a"]
    assert pooled.inventory.count == 4 and {g.name.rsplit(" ", 1)[1] for g in pooled.inventory.gpus} == {"a1"}
    assert read().inventory.count == 12 and selectors[-1] is None
    del nodes["a1"]
    assert read(node_selector="pool=a").note == "no Ready node among the nodes labelled pool=a has nvidia.com/gpu"


def test_a_poll_of_unchanged_nodes_reuses_the_inventory_and_a_change_rebuilds_it(monkeypatch):
    """20,000 GPUs took 0.27 s to build, on every poll (every 0.5 s) of the cluster agent (issue 45)."""
    from gpu_agent.mechanisms.inventory import cluster

    monkeypatch.setattr(cluster.client, "CoreV1Api", lambda api: None)
    built = []
    monkeypatch.setattr(cluster, "inventory_of", lambda table: built.append(dict(table)) or inventory_of(table))
    source = cluster.ClusterSource(api=None, start=False)

    def named(name, n):
        out = node(str(n), str(n))
        out.metadata = NS(name=name)
        return out
    source._listed_nodes(NS(items=[named(f"n{k}", 4096) for k in range(5)]))
    first = source.read().inventory
    assert first.count == 5 * 4096 and source.read().inventory is first and len(built) == 1
    assert source.read().note is None
    source._node_event("MODIFIED", named("n2", 4000))
    assert source.read().inventory.count == 4 * 4096 + 4000 and len(built) == 2
    source._node_event("MODIFIED", named("n2", 4000))  # a heartbeat: the same counts
    source.read()
    assert len(built) == 2


def test_before_its_first_list_the_source_has_no_answer_and_an_empty_cluster_after_it_is_one(monkeypatch):
    """What the cluster agent without gracefulNoGPU waits for: a zero read before the watch's first list is no
    answer (it would exit on a cluster full of GPUs); the first list of a cluster with none is."""
    from gpu_agent.mechanisms.inventory import cluster

    monkeypatch.setattr(cluster.client, "CoreV1Api", lambda api: None)
    source = cluster.ClusterSource(api=None, start=False)
    before = source.read()
    assert (before.inventory.count, before.complete, before.answered) == (0, False, False)
    assert before.note == "waiting for the first list of nodes"
    source._listed_nodes(NS(items=[]))
    after = source.read()
    assert (after.inventory.count, after.answered, after.note) == (0, True, "no Ready node has nvidia.com/gpu")


def test_the_domain_folder_reads_each_nodes_gpu_capacity_from_the_same_node_watch():
    """ClusterSource.gpu_capacity: the device plugin's count of a node this watch sees (mechanisms/domain/trust.py
    checks a member's GPUs against it); None where there is no such report."""
    from gpu_agent.mechanisms.inventory.cluster import ClusterSource

    def named(name: str, n: NS) -> NS:
        n.metadata = NS(name=name)
        return n

    source = ClusterSource(None, start=False)
    source._listed_nodes(NS(items=[named("n1", node("3", "4")), named("n2", node(None, None)),
                                   named("n3", node("4", "4", ready=False))]))
    assert [source.gpu_capacity(n) for n in ("n1", "n2", "n3", "elsewhere")] == [4, None, None, None]
    source._node_event("MODIFIED", named("n2", node("8", "8")))
    assert source.gpu_capacity("n2") == 8


def test_a_deleted_node_takes_its_gpus_with_it_and_a_node_of_one_gpu_reports_its_one():
    from gpu_agent.mechanisms.inventory.cluster import ClusterSource

    def named(name: str, n: NS) -> NS:
        n.metadata = NS(name=name)
        return n

    source = ClusterSource(None, start=False)
    source._listed_nodes(NS(items=[named("n1", node("4", "4")), named("n2", node("2", "2"))]))
    assert source.read().inventory.count == 6
    source._node_event("DELETED", named("n1", node("4", "4")))  # the event carries its last state
    assert source.read().inventory.count == 2 and source.gpu_capacity("n1") is None
    source._node_event("DELETED", named("never-seen", node("4", "4")))
    source._node_event("ADDED", named("n3", node("1", "1")))
    assert source.read().inventory.count == 3 and source.gpu_capacity("n3") == 1


def test_the_node_watch_asks_for_a_list_every_resync_pauses_2s_after_a_failure_and_the_next_list_clears_it(monkeypatch):
    from gpu_agent.mechanisms.inventory import cluster

    api = object()
    made, calls = [], []

    class Core:
        def __init__(self, client_api):
            made.append(client_api)

        def list_node(self, _request_timeout=None, label_selector=None):
            return NS(items=[])

    def failing_then_listing(list_call, *, on_list, on_event, on_error, stop, **kwargs):
        calls.append(kwargs)
        on_error(RuntimeError("x" * 300))
        assert source.read().error == "watching nodes failed: RuntimeError: " + "x" * 200
        on_list(list_call(_request_timeout=10))

    log = io.StringIO()
    klog.setup(0, log)
    monkeypatch.setattr(cluster.client, "CoreV1Api", Core)
    monkeypatch.setattr(cluster, "list_then_watch", failing_then_listing)
    source = cluster.ClusterSource(api, start=False)
    source._run_nodes()
    assert made == [api] and calls == [{"retry_seconds": 2.0, "resync_seconds": 300}]
    assert source.read().error is None and source.read().answered
    assert [line.split("] ", 1)[1] for line in log.getvalue().splitlines()] == [
        "watching nodes failed: RuntimeError: " + "x" * 200 + "; retrying in 2s"]


def test_started_the_source_watches_nodes_and_a_dra_drivers_slices_each_on_a_thread_of_its_name(monkeypatch):
    from gpu_agent.mechanisms.inventory import cluster

    api = object()
    resources = []

    class Resource:
        def __init__(self, client_api):
            resources.append(client_api)

        def list_resource_slice(self, _request_timeout=None, field_selector=None):
            return {"items": [{"metadata": {"name": "s1"}, "spec": {
                "driver": "gpu.example.com", "nodeName": "n1", "pool": {"name": "n1", "generation": 1},
                "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-1"}}}]}}]}

    class Core:
        def __init__(self, client_api):
            pass

        def list_node(self, _request_timeout=None):
            n = node("8", "8")
            n.metadata = NS(name="n1")
            return NS(items=[n])

    def listing_once(list_call, *, on_list, on_event, on_error, stop, **kwargs):
        on_list(list_call(_request_timeout=10, **{k: v for k, v in kwargs.items() if k.endswith("selector")}))

    monkeypatch.setattr(cluster.client, "CoreV1Api", Core)
    monkeypatch.setattr(cluster.client, "ResourceV1Api", Resource)
    monkeypatch.setattr(cluster, "list_then_watch", listing_once)
    source = cluster.ClusterSource(api, dra_driver="gpu.example.com")
    source._thread.join(5)
    source._slice_thread.join(5)
    assert (source._thread.name, source._slice_thread.name) == ("node-watch", "slice-watch")
    assert resources == [api]
    reading = source.read()
    assert reading.answered and [g.uuid for g in reading.inventory.gpus] == ["GPU-1"]


def test_both_watches_failing_is_one_error_naming_each():
    from gpu_agent.mechanisms.inventory.cluster import ClusterSource

    source = ClusterSource(None, dra_driver="gpu.example.com", resource=object(), start=False)
    source._failed("nodes", "nodes")(RuntimeError("503"))
    source._failed("slices", "gpu.example.com ResourceSlices")(RuntimeError("403"))
    assert source.read().error == ("watching nodes failed: RuntimeError: 503; "
                                   "watching gpu.example.com ResourceSlices failed: RuntimeError: 403")
