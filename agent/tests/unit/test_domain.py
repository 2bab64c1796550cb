"""Domain entries and the OCC writer against an in-memory API with scripted conflicts."""

import copy
import random

import pytest
from kubernetes import client

from gpu_agent.foundations.backoff import Backoff
from gpu_agent.foundations.clock import SystemClock
from gpu_agent.mechanisms.domain.entries import Entry, lowest_free_index, with_entry, without_entry
from gpu_agent.mechanisms.domain.reconciler import render_peers
from gpu_agent.mechanisms.domain.writer import DomainWriter, make_backoff


def domain(nodes=(), expected=2, rv=1, name="d1"):
    return {"metadata": {"name": name, "namespace": "default", "resourceVersion": str(rv)},
            "spec": {"expectedNodes": expected}, "status": {"nodes": list(nodes)}}


def node(name, index, status="Ready"):
    return {"name": name, "ip": "", "index": index, "status": status, "gpuUUIDs": []}


def member(node, domain="d1", name=None, **spec):
    """A GPUDomainMember as the watch delivers it: named and labelled as a node agent writes it."""
    from gpu_agent.mechanisms.domain.members import member_name

    return {"metadata": {"name": name or member_name(domain, node), "labels": {"gpu-agent.io/domain": domain}},
            "spec": {"domain": domain, "node": node, **spec}}


def test_index_is_kept_and_gaps_are_filled_lowest_first():
    nodes = [node("a", 0), node("c", 2), node("d", 3)]
    assert lowest_free_index(nodes, "c") == 2
    assert lowest_free_index(nodes, "new") == 1
    assert lowest_free_index([*nodes, node("b", 1)], "new") == 4


def test_an_index_held_for_a_node_that_left_is_its_own_again_and_nobody_elses_meanwhile():
    nodes = [node("a", 0)]
    assert lowest_free_index(nodes, "b", {"b": 2, "c": 1}) == 2  # back: its own index
    assert lowest_free_index(nodes, "new", {"b": 2, "c": 1}) == 3  # neither in use nor held for another
    assert lowest_free_index([node("x", 2)], "b", {"b": 2}) == 0  # taken meanwhile: the lowest free one


def test_with_entry_changes_only_its_own_entry_and_the_overall_status():
    obj = domain([node("a", 0), node("c", 2, "NotReady")])
    new = with_entry(obj, Entry("b", "10.0.0.2", ("GPU-1",), True))
    assert [n["name"] for n in new["status"]["nodes"]] == ["a", "b", "c"]
    assert new["status"]["nodes"][1] == {"name": "b", "ip": "10.0.0.2", "index": 1, "status": "Ready", "gpuUUIDs": ["GPU-1"]}
    assert new["status"]["nodes"][2] == node("c", 2, "NotReady")
    assert (new["status"]["status"], new["status"]["readyNodes"]) == ("Ready", 2)
    assert with_entry(new, Entry("b", "10.0.0.2", ("GPU-1",), True)) is None  # already so: no write
    gone = without_entry(new, "a")
    assert (gone["status"]["status"], gone["status"]["readyNodes"]) == ("NotReady", 1)
    assert without_entry(gone, "a") is None


class FakeCustom:
    """An API server holding one object: replace succeeds only at the current resourceVersion."""

    def __init__(self, obj, script=()):
        self.obj = obj
        self.script = list(script)  # exceptions to raise on the next replace calls
        self.gets = self.replaces = 0

    def get_namespaced_custom_object(self, *a, _request_timeout=None):
        self.gets += 1
        return copy.deepcopy(self.obj)

    def replace_namespaced_custom_object_status(self, g, v, ns, plural, name, body, _request_timeout=None):
        self.replaces += 1
        if self.script:
            raise self.script.pop(0)
        if body["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise client.ApiException(status=409, reason="Conflict")
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)
        self.obj = body
        return copy.deepcopy(body)


class SleepRecorder(SystemClock):
    """The writer's clock: its retry waits recorded, none waited."""

    def __init__(self):
        self.sleeps = []

    def sleep_blocking(self, seconds):
        self.sleeps.append(seconds)


@pytest.fixture
def writer(fixed_random):
    """writer(fake, strategy, rng) -> (a DomainWriter on `fake`, the sleeps its retries took)."""
    def make(fake, strategy="fulljitter", rng=None):
        clock = SleepRecorder()
        w = DomainWriter(client.ApiClient(), "default", "d1", strategy, 25.0, rng or fixed_random([0.5] * 50), clock,
                         custom_api=fake)
        return w, clock.sleeps
    return make


def conflict():
    return client.ApiException(status=409, reason="Conflict")


def test_conflicts_back_off_with_full_jitter_under_a_cap_of_nodes_over_rate(writer):
    fake = FakeCustom(domain(expected=100), [conflict()] * 12)
    w, sleeps = writer(fake)
    assert w.ensure(Entry("a", "", (), True))
    cap = 100 / 25.0
    bases = [min(cap, 0.005 * 2**n) for n in range(12)]
    assert sleeps == pytest.approx([b * 0.5 for b in bases])
    assert w.stats.conflicts == 12 and fake.gets == 13  # a fresh read after every conflict
    assert [n["name"] for n in fake.obj["status"]["nodes"]] == ["a"]


def test_dra_strategy_is_5ms_to_6s_times_u_075_125(fixed_random):
    b = make_backoff("dra", 10, 25.0, fixed_random([0.0, 1.0 - 1e-12, 0.5] * 20))
    got = [b.next_delay() for _ in range(12)]
    bases = [min(6.0, 0.005 * 2**n) for n in range(12)]
    factors = [0.75, 1.25, 1.0] * 4
    assert got == pytest.approx([x * f for x, f in zip(bases, factors, strict=False)])


def test_a_429_waits_at_least_its_retry_after(writer):
    throttled = client.ApiException(status=429, reason="Too Many Requests")
    throttled.headers = {"Retry-After": "3"}
    w, sleeps = writer(FakeCustom(domain(), [throttled]))
    assert w.ensure(Entry("a", "", (), True))
    assert sleeps == [3.0] and w.stats.throttled == 1


def test_a_newer_event_supersedes_the_retry_loop(writer):
    fake = FakeCustom(domain(), [conflict()] * 100)
    w, sleeps = writer(fake)
    calls = iter([False, False, True])
    assert w.ensure(Entry("a", "", (), True), superseded=lambda: next(calls)) is False
    assert fake.replaces == 3 and len(sleeps) == 2


def test_own_write_is_the_cache_so_the_next_ensure_needs_no_read(writer):
    fake = FakeCustom(domain())
    w, _ = writer(fake)
    assert w.ensure(Entry("a", "", (), True))
    gets = fake.gets
    assert w.ensure(Entry("a", "", (), False))  # a state transition is written, from the cache
    assert fake.gets == gets and fake.obj["status"]["nodes"][0]["status"] == "NotReady"
    w.observe(domain(rv=1))  # an older view from a lagging watch does not replace our write
    assert w.cached["metadata"]["resourceVersion"] == fake.obj["metadata"]["resourceVersion"]


def test_many_writers_keep_every_entry_and_unique_indices(writer):
    fake = FakeCustom(domain(expected=30))
    writers = [writer(fake, rng=random.Random(i))[0] for i in range(30)]
    pending = {f"n{i}": writers[i] for i in range(30)}
    # interleave: every writer reads, then only the first write of each round lands
    rounds = 0
    while pending:
        rounds += 1
        for name, w in list(pending.items()):
            if w.ensure(Entry(name, "", (), True), superseded=lambda: True):
                del pending[name]
    nodes = fake.obj["status"]["nodes"]
    assert sorted(n["name"] for n in nodes) == sorted(f"n{i}" for i in range(30))
    assert sorted(n["index"] for n in nodes) == list(range(30))
    assert fake.obj["status"]["status"] == "Ready"


def test_remove_gives_up_at_its_deadline(writer):
    fake = FakeCustom(domain([node("a", 0)]), [conflict()] * 100)
    w, _ = writer(fake, strategy="dra", rng=random.Random(0))
    w.clock = SleepRecorder()
    import time

    assert w.remove("a", deadline=time.monotonic() - 1) is False


def test_peers_file_is_sorted_by_index():
    text = render_peers("default", "d1", domain([node("z", 1), node("a", 0, "NotReady")]))
    assert text.splitlines()[1:] == ["0 a - NotReady", "1 z - Ready"]


def test_full_jitter_backoff_mode(fixed_random):
    b = Backoff(0.01, 1.0, rng=fixed_random([0.25, 0.75]), mode="full")
    assert [b.next_delay(), b.next_delay()] == pytest.approx([0.0025, 0.015])


def test_fold_keeps_indices_fills_gaps_and_drops_departed_members():
    from gpu_agent.mechanisms.domain.aggregate import fold

    obj = domain([node("a", 0), node("b", 1), node("c", 2)], expected=3)
    members = {"a": {"ready": True}, "c": {"ready": False, "ip": "10.0.0.3"}, "d": {"ready": True}, "e": {"ready": True}}
    new = fold(obj, members)
    assert [(n["name"], n["index"]) for n in new["status"]["nodes"]] == [("a", 0), ("d", 1), ("c", 2), ("e", 3)]
    assert new["status"]["nodes"][2]["status"] == "NotReady" and new["status"]["nodes"][2]["ip"] == "10.0.0.3"
    assert (new["status"]["status"], new["status"]["readyNodes"]) == ("Ready", 3)
    assert fold(new, members) is None  # nothing changed: no write


def test_member_writer_reapplies_only_after_its_grace():
    from gpu_agent.mechanisms.domain.aggregate import MemberWriter

    w = MemberWriter(client.ApiClient(), "default", "d1")
    e = Entry("a", "", (), True)
    assert w.needs_reapply(domain(), e)  # never applied: missing means apply
    import time

    w.applied_at = time.monotonic()
    assert not w.needs_reapply(domain(), e)  # just applied: the aggregator has not folded it yet
    w.applied_at -= MemberWriter.REAPPLY_AFTER + 1
    assert w.needs_reapply(domain(), e)


def test_a_member_whose_heartbeat_stops_changing_is_folded_notready_after_its_ttl_and_ready_again_on_the_next():
    from gpu_agent.mechanisms.domain.aggregate import HeartbeatTracker, fold

    now = [100.0]
    tracker = HeartbeatTracker(3.0, lambda: now[0])
    members = {"a": {"ready": True, "heartbeat": "t0", "heartbeatIntervalSeconds": 5},
               "old": {"ready": True}}  # a 0.1 agent: no heartbeat, trusted as before
    for n, spec in members.items():
        tracker.saw(n, spec)
    now[0] += 15.0
    assert tracker.silent(members) == frozenset()  # exactly the TTL: not yet
    now[0] += 0.5
    assert tracker.silent(members) == {"a"}
    tracker.saw("a", members["a"])  # the same heartbeat seen again (a relist) is not a heartbeat
    assert tracker.silent(members) == {"a"}
    obj = domain([node("a", 0), node("old", 1)], expected=2)
    folded = fold(obj, members, tracker.silent(members))
    assert [n["status"] for n in folded["status"]["nodes"]] == ["NotReady", "Ready"]
    assert folded["status"]["status"] == "NotReady"
    members["a"] = {**members["a"], "heartbeat": "t1"}
    tracker.saw("a", members["a"])
    assert tracker.silent(members) == frozenset()
    assert fold(folded, members, tracker.silent(members))["status"]["status"] == "Ready"


def test_fold_numbers_each_clique_from_zero_and_a_node_that_moves_clique_gets_a_new_index():
    from gpu_agent.mechanisms.domain.aggregate import fold

    members = {f"a{i}": {"ready": True, "clique": "rack-a"} for i in range(3)}
    members.update({f"b{i}": {"ready": i != 1, "clique": "rack-b"} for i in range(2)})
    first = fold(domain(expected=5), members)
    rows = [(n["name"], n.get("clique"), n["index"]) for n in first["status"]["nodes"]]
    assert rows == [("a0", "rack-a", 0), ("a1", "rack-a", 1), ("a2", "rack-a", 2), ("b0", "rack-b", 0), ("b1", "rack-b", 1)]
    assert first["status"]["cliques"] == [{"id": "rack-a", "nodes": 3, "readyNodes": 3},
                                          {"id": "rack-b", "nodes": 2, "readyNodes": 1}]
    # a1 leaves rack-a (a gap stays in rack-a) and joins rack-b, where the lowest free index is 2
    moved = fold(first, {**members, "a1": {"ready": True, "clique": "rack-b"}})
    rows = [(n["name"], n.get("clique"), n["index"]) for n in moved["status"]["nodes"]]
    assert rows == [("a0", "rack-a", 0), ("a2", "rack-a", 2), ("b0", "rack-b", 0), ("b1", "rack-b", 1), ("a1", "rack-b", 2)]
    # a new node of rack-a fills its gap
    filled = fold(moved, {**members, "a1": {"ready": True, "clique": "rack-b"}, "a9": {"ready": True, "clique": "rack-a"}})
    assert [(n["name"], n["index"]) for n in filled["status"]["nodes"] if n.get("clique") == "rack-a"] == \
        [("a0", 0), ("a9", 1), ("a2", 2)]


def test_fold_without_cliques_keeps_the_old_shape():
    from gpu_agent.mechanisms.domain.aggregate import fold

    new = fold(domain(expected=1), {"n1": {"ready": True}})
    assert "cliques" not in new["status"] and "clique" not in new["status"]["nodes"][0]


def test_a_full_clique_admits_no_more_nodes_and_the_rest_wait_until_a_place_frees():
    from gpu_agent.mechanisms.domain.aggregate import fold

    obj = domain(expected=2)
    obj["spec"]["maxNodesPerClique"] = 2
    members = {name: {"ready": True, "clique": "rack-a"} for name in ("n1", "n2", "n3")}
    full = fold(obj, members)
    assert [(n["name"], n["index"]) for n in full["status"]["nodes"]] == [("n1", 0), ("n2", 1)]
    assert full["status"]["cliques"] == [{"id": "rack-a", "nodes": 2, "readyNodes": 2, "waiting": ["n3"]}]
    del members["n1"]
    freed = fold(full, members)
    assert [(n["name"], n["index"]) for n in freed["status"]["nodes"]] == [("n3", 0), ("n2", 1)]
    assert "waiting" not in freed["status"]["cliques"][0]


def test_peers_file_lists_only_the_nodes_own_clique_and_changes_only_with_it():
    nodes = [dict(node("a0", 0), clique="rack-a"), dict(node("b0", 0), clique="rack-b"), dict(node("a1", 1), clique="rack-a")]
    text = render_peers("default", "d1", domain(nodes), "rack-a")
    assert text.splitlines() == ["# GPUDomain default/d1, clique rack-a: 2 node(s), sorted by index",
                                 "0 a0 - Ready", "1 a1 - Ready"]
    other_clique_changed = [nodes[0], dict(nodes[1], status="NotReady"), nodes[2], dict(node("b1", 1), clique="rack-b")]
    assert render_peers("default", "d1", domain(other_clique_changed), "rack-a") == text


def test_with_entry_indexes_within_the_nodes_clique():
    obj = domain([dict(node("a0", 0), clique="rack-a"), dict(node("b0", 0), clique="rack-b")])
    new = with_entry(obj, Entry("b1", "", (), True, "rack-b"))
    assert [(n["name"], n["index"]) for n in new["status"]["nodes"] if n.get("clique") == "rack-b"] == [("b0", 0), ("b1", 1)]
    assert with_entry(obj, Entry("a1", "", (), True, "rack-a"))["status"]["nodes"][1] == \
        {"name": "a1", "ip": "", "index": 1, "status": "Ready", "gpuUUIDs": [], "clique": "rack-a"}


def test_the_largest_status_we_plan_for_stays_under_a_quarter_of_etcds_request_limit():
    """144 nodes with 4 GPU UUIDs each, in 8 cliques of 18 (8 racks of NVL72-class nodes)."""
    import json

    from gpu_agent.mechanisms.domain.aggregate import fold

    members = {f"node-{c}-{i:02d}": {"ready": True, "ip": f"10.{c}.0.{i}", "clique": f"6f9619ff-8b86-d011-b42d-00c04fc964ff.{c}",
                                     "gpuUUIDs": [f"GPU-{c:02d}{i:06d}-0000-0000-0000-00000000000{g}" for g in range(4)]}
               for c in range(8) for i in range(18)}
    obj = fold(domain(expected=144), members)
    assert len(obj["status"]["nodes"]) == 144 and len(obj["status"]["cliques"]) == 8
    assert len(json.dumps(obj)) < 1.5 * 2**20 / 4


def test_folding_many_domains_waits_longer_for_a_pause_so_their_status_writes_do_not_crowd_the_api_server():
    from gpu_agent.mechanisms.domain.aggregate import EveryDomainAggregator

    folding = EveryDomainAggregator(None, "ns", interval=0.1)
    assert folding.window(1) == pytest.approx(0.1)  # one domain: as quick as the single aggregator
    assert folding.window(64) == pytest.approx(1.6)
    assert folding.window(10_000) == EveryDomainAggregator.MAX_INTERVAL
    # ... and a write nobody waits for may wait longer while members keep arriving
    assert (folding.bound(1), folding.bound(64), folding.bound(10_000)) == pytest.approx((5.0, 16.0, 20.0))


def test_one_watch_of_the_namespace_hands_each_member_to_its_domains_aggregator_whenever_that_starts(monkeypatch):
    """EveryDomainAggregator watches the namespace's members once and routes them by their domain label: an
    aggregator started after its members arrived begins with them, a relist replaces what each one has, and
    a member relabelled into another domain leaves the first."""
    from gpu_agent.mechanisms.domain.aggregate import Aggregator, EveryDomainAggregator

    monkeypatch.setattr(Aggregator, "run", lambda self: None)  # no API server here: the folding loops stay off
    folding = EveryDomainAggregator(None, "ns")

    def nodes(domain):
        return sorted(folding.aggregators[domain].members)

    folding._listed_members({"items": [member("a", "d1"), member("b", "d2"), member("c", "d3")]})
    folding._listed({"items": [domain(name="d1"), domain(name="d2")]})
    assert (nodes("d1"), nodes("d2")) == (["a"], ["b"])
    assert {(a.pending.quiet, a.pending.bound) for a in folding.aggregators.values()} == {(folding.window(2), 5.0)}
    assert all(agg.members_listed for agg in folding.aggregators.values())
    folding._member_event("ADDED", member("x", "d1"))
    assert (nodes("d1"), nodes("d2")) == (["a", "x"], ["b"])
    folding._event("ADDED", domain(name="d3"))  # a domain created after its member: it starts with it
    assert nodes("d3") == ["c"]
    moved = member("x", "d1")
    moved["metadata"]["labels"]["gpu-agent.io/domain"] = "d2"
    folding._member_event("MODIFIED", moved)
    assert (nodes("d1"), nodes("d2")) == (["a"], ["b"])  # d2 does not take a member named for d1 (MemberIndex)
    folding._member_event("DELETED", member("b", "d2"))
    assert nodes("d2") == []
    folding._listed_members({"items": [member("a", "d1"), member("y", "d3")]})  # a relist: all there is
    assert (nodes("d1"), nodes("d2"), nodes("d3")) == (["a"], [], ["y"])
    folding._event("DELETED", domain(name="d3"))
    folding._member_event("ADDED", member("z", "d3"))  # kept for a d3 created again, handed to nobody now
    assert sorted(folding.aggregators) == ["d1", "d2"] and sorted(folding.members["d3"]) == ["d3.y", "d3.z"]


def test_a_member_without_a_spec_is_left_out_and_every_other_member_is_still_folded():
    from gpu_agent.mechanisms.domain.aggregate import Aggregator

    folding = Aggregator(None, "ns", "gpus")
    good = member("n1", "gpus", gpuUUIDs=[])
    folding.listed_members({"items": [{"metadata": {"name": "broken"}}, {"metadata": {"name": "no-node"}, "spec": {}},
                                       good, "not an object"]})
    assert folding.members == {"n1": good["spec"]}
    folding.member_event("MODIFIED", {"metadata": {"name": "broken"}, "spec": None})
    folding.member_event("DELETED", {"metadata": {"name": "broken"}})
    assert folding.members == {"n1": good["spec"]}


def test_a_stopped_aggregator_ends_its_write_retries_for_a_domain_that_is_gone():
    import threading

    from gpu_agent.mechanisms.domain.aggregate import Aggregator

    class Gone:
        calls = 0

        def get_namespaced_custom_object(self, *args, _request_timeout=None):
            Gone.calls += 1
            raise client.ApiException(status=404, reason="Not Found")

    quick = type("Quick", (SystemClock,), {"sleep_blocking": lambda self, s: threading.Event().wait(0.01)})()
    folding = Aggregator(None, "ns", "deleted-domain", interval=0.01, clock=quick, watch_domain=False, custom_api=Gone())
    folding._watch = lambda: None  # members are handed in below; no API server here
    folding.listed_members({"items": [member("n1", "deleted-domain")]})
    runner = threading.Thread(target=folding.run, daemon=True)
    runner.start()
    deadline = threading.Event()
    for _ in range(200):  # poll to a deadline: the write is retrying
        if Gone.calls >= 3:
            break
        deadline.wait(0.01)
    assert Gone.calls >= 3
    folding.stop()
    runner.join(2)
    assert not runner.is_alive(), "the aggregator went on retrying after it was stopped"


def test_the_aggregator_waits_on_its_injected_clock_and_marks_a_silent_member_notready_after_its_ttl():
    """No wall time: the aggregator's batching, its wake-ups and its heartbeat TTL all run on a
    ManualClock the test advances; the member goes NotReady after 3 intervals of silence, not before."""
    import threading

    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.mechanisms.domain.aggregate import Aggregator

    clock = ManualClock()
    fake = FakeCustom(domain(expected=1))
    folding = Aggregator(None, "default", "d1", interval=0.1, heartbeat_ttl_intervals=3.0, clock=clock, watch_domain=False, custom_api=fake)
    folding._watch = lambda: None  # members are handed in below
    folding.listed_members({"items": [member("a", ready=True, heartbeat="t1", heartbeatIntervalSeconds=1)]})
    runner = threading.Thread(target=folding.run, daemon=True)
    runner.start()

    def status_after(seconds):
        """Advance the clock by `seconds` in steps, each once the aggregator waits on it again."""
        for _ in range(round(seconds / 0.1)):
            clock.step_thread(0.1)
        return fake.obj["status"].get("status"), [n["status"] for n in fake.obj["status"]["nodes"]]

    for _ in range(2000):  # poll to a deadline: the aggregator's thread is blocked on the clock
        if clock.blocked:
            break
        threading.Event().wait(0.001)
    try:
        assert status_after(0.2) == ("Ready", ["Ready"])
        assert status_after(2.5) == ("Ready", ["Ready"])  # 2.7 s of silence: within the TTL
        assert status_after(1.0) == ("NotReady", ["NotReady"])  # past 3 intervals
        assert fake.replaces == 2
    finally:
        folding.stop()
        clock.advance_blocking(1.0)
        runner.join(2)
    assert not runner.is_alive()


def test_write_schedule_timing_rules():
    from gpu_agent.mechanisms.domain.aggregate import WriteSchedule

    s = WriteSchedule(quiet=0.5, bound=5.0)
    assert not s.waiting and not s.due(0.0, prompt=True) and s.wait(0.0) == float("inf")
    s.changed(10.0)
    assert s.due(10.0, prompt=True)  # a change a reader waits for: at once
    assert not s.due(10.4, prompt=False) and s.wait(10.4) == pytest.approx(0.1)
    assert s.due(10.5, prompt=False)  # the arrivals paused for `quiet`
    for t in range(1, 25):  # arrivals every 0.2 s never pause: the bound writes
        s.changed(10.0 + 0.2 * t)
        assert s.due(10.0 + 0.2 * t, prompt=False) == (0.2 * t >= 5.0 - 1e-9)
    s.written()
    assert not s.waiting and not s.due(20.0, prompt=True)


def test_with_shared_arrivals_a_write_nobody_waits_for_waits_for_the_whole_namespace_to_pause():
    """One folder of many domains: a domain whose own members paused still waits while members arrive at any
    other domain (all land on one API server), until they pause too or its bound passes."""
    from gpu_agent.mechanisms.domain.aggregate import Arrivals, WriteSchedule

    arrivals = Arrivals()
    s = WriteSchedule(quiet=0.5, bound=5.0, shared=arrivals)
    s.changed(10.0)
    arrivals.saw(10.3)  # another domain's member
    assert not s.due(10.5, prompt=False) and s.wait(10.5) == pytest.approx(0.3)
    assert s.due(10.8, prompt=False)  # the namespace paused too
    for t in range(1, 30):  # another domain forming without a pause: only the bound writes this one
        arrivals.saw(10.0 + 0.2 * t)
        assert s.due(10.0 + 0.2 * t, prompt=False) == (0.2 * t >= 5.0 - 1e-9)
    assert s.due(10.2, prompt=True)  # a change a reader waits for does not wait for anyone


def test_a_members_heartbeat_is_no_arrival_but_a_join_a_change_or_a_departure_is():
    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.mechanisms.domain.aggregate import EveryDomainAggregator

    clock = ManualClock()
    folding = EveryDomainAggregator(None, "ns", clock=clock)
    folding._listed_members({"items": []})
    seen = []

    def event(kind, obj):
        clock.advance_blocking(1.0)  # no thread waits on it here
        folding._member_event(kind, obj)
        seen.append(folding.arrivals.last == clock.monotonic())

    event("ADDED", member("a", "d1", ready=False, heartbeat="t1"))
    event("MODIFIED", member("a", "d1", ready=False, heartbeat="t2"))
    event("MODIFIED", member("a", "d1", ready=True, heartbeat="t2"))
    event("MODIFIED", member("a", "d1", ready=True, heartbeat="t3"))
    event("DELETED", member("a", "d1", ready=True, heartbeat="t3"))
    assert seen == [True, False, True, False, True]


class DomainOnClock:
    """An Aggregator on a ManualClock over a FakeCustom, members handed in by the test: `arrive`
    returns once the aggregator has handled the change and waits on the clock again."""

    def __init__(self, expected, quiet):
        import threading

        from gpu_agent.foundations.clock import ManualClock
        from gpu_agent.mechanisms.domain.aggregate import Aggregator

        self.clock = ManualClock()
        self.fake = FakeCustom(domain(expected=expected))
        self.folding = Aggregator(None, "default", "d1", interval=quiet, clock=self.clock, watch_domain=False, custom_api=self.fake)
        self.folding._watch = lambda: None
        self.folding.listed_members({"items": []})  # the watch's first list: no member yet
        self.runner = threading.Thread(target=self.folding.run, daemon=True)
        self.runner.start()
        self._settle()
        assert self.written == (1, "NotReady", [])  # a domain never folded: its first status at once

    def _settle(self):
        import time

        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # poll to a deadline: handled the event, and waiting again
            if not self.folding._changed.is_set() and self.clock.blocked:
                self.clock.step_thread(0.0)
                return
            time.sleep(0.001)
        raise AssertionError("the aggregator did not get back to waiting on its clock")

    def arrive(self, name, kind="ADDED"):
        self.folding.member_event(kind, member(name, ready=True))
        self._settle()

    def step(self, seconds):
        for _ in range(round(seconds / 0.1)):
            self.clock.step_thread(0.1)

    @property
    def written(self):
        status = self.fake.obj["status"]
        return self.fake.replaces, status.get("status"), sorted(n["name"] for n in status["nodes"])

    def stop(self):
        self.folding.stop()
        self.clock.advance_blocking(1.0)
        self.runner.join(2)
        assert not self.runner.is_alive()


def test_a_domain_whose_members_stream_in_is_written_once_when_it_turns_ready():
    d = DomainOnClock(expected=4, quiet=0.5)
    try:
        for name in "abc":
            d.arrive(name)
            d.step(0.2)  # closer together than `quiet`: nothing written yet
        assert d.written == (1, "NotReady", [])
        d.arrive("d")  # the fourth: Ready, written at once (no clock time passes)
        assert d.written == (2, "Ready", ["a", "b", "c", "d"])
        d.arrive("b", kind="DELETED")  # loses readiness: at once too
        assert d.written == (3, "NotReady", ["a", "c", "d"])
        assert d.folding.write_reasons == {"prompt": 3}
    finally:
        d.stop()


def test_node_agents_of_a_whole_domain_restarted_at_once_come_back_with_their_own_indices_in_any_order():
    """The seed's "force-delete all IMEX daemons": every node agent's Pod deleted, each member with it, and the new
    Pods' members back in whatever order they start. A workload's rank is its node's index, so each node gets the
    index it had; a newcomer meanwhile takes another; after REJOIN_GRACE an index is free for anyone."""
    from gpu_agent.mechanisms.domain.aggregate import REJOIN_GRACE

    d = DomainOnClock(expected=2, quiet=0.5)

    def indices():
        return {n["name"]: n["index"] for n in d.fake.obj["status"]["nodes"]}
    try:
        d.arrive("w2")
        d.arrive("w3")
        assert indices() == {"w2": 0, "w3": 1}
        d.arrive("w3", kind="DELETED")
        d.arrive("w2", kind="DELETED")
        d.step(0.6)
        assert indices() == {}
        d.arrive("w3")  # back first: still 1, not the lowest free 0
        d.step(0.6)
        assert indices() == {"w3": 1}
        d.arrive("new")  # a newcomer takes neither held index
        d.step(0.6)
        assert indices() == {"w3": 1, "new": 2}
        d.arrive("w2")
        assert indices() == {"w2": 0, "w3": 1, "new": 2}
        d.arrive("new", kind="DELETED")
        d.step(REJOIN_GRACE + 1)
        d.arrive("late")  # the grace passed: 2 is nobody's any more
        d.step(0.6)
        assert indices() == {"w2": 0, "w3": 1, "late": 2}
    finally:
        d.stop()


def test_a_lone_change_to_a_notready_domain_is_written_once_the_arrivals_pause():
    d = DomainOnClock(expected=4, quiet=0.5)
    try:
        d.arrive("a")
        d.step(0.4)
        assert d.written == (1, "NotReady", [])
        d.step(0.2)
        assert d.written == (2, "NotReady", ["a"])
        assert d.folding.write_reasons == {"prompt": 1, "quiet": 1}
    finally:
        d.stop()


def test_a_long_formation_is_written_at_the_bound_while_members_keep_arriving():
    from gpu_agent.mechanisms.domain.aggregate import Aggregator

    d = DomainOnClock(expected=100, quiet=0.5)
    try:
        arrived = []
        for i in range(30):  # one every 0.2 s for 6 s: never a pause of `quiet`
            arrived.append(f"n{i:02d}")
            d.arrive(arrived[-1])
            d.step(0.2)
            if d.fake.replaces > 1:
                break
        replaces, status, names = d.written
        assert replaces == 2 and status == "NotReady" and names == arrived
        assert d.folding.write_reasons == {"prompt": 1, "bound": 1}
        assert len(arrived) == round(Aggregator.COALESCE_BOUND / 0.2)  # written at the bound (5 s after the first), not before
    finally:
        d.stop()
