"""The GPUDomain's Ready condition, its Events and the folder's answer to a spec change, on fakes and a ManualClock."""

import pytest
from kubernetes import client

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.events import (
    QUEUE_LIMIT,
    SERIES_FLUSH,
    SERIES_WINDOW,
    SPAM_BURST,
    SPAM_REFILL,
    EventRecorder,
)
from gpu_agent.mechanisms.domain.aggregate import fold
from gpu_agent.mechanisms.domain.conditions import MESSAGE_LIMIT, find, ready_condition, set_condition
from gpu_agent.mechanisms.domain.entries import Entry, with_entry, without_entry
from gpu_agent.mechanisms.domain.transitions import transitions
from tests.unit.test_domain import DomainOnClock, FakeCustom, domain


def member(node, ready=True, clique=""):
    spec = {"node": node, "domain": "d1", "ready": ready, "gpuUUIDs": []}
    return {**spec, "clique": clique} if clique else spec


def ready_of(obj):
    cond = find(obj["status"]["conditions"])
    return cond["status"], cond["reason"], cond["message"]


def test_each_reason_in_its_order():
    assert ready_condition(expected=3, joined={}, waiting={}) == ("Unknown", "Initializing", "no node has joined yet (3 expected)")
    assert ready_condition(expected=2, joined={"a": True, "b": True, "c": False}, waiting={"r1": ["d"]})[:2] == ("True", "MembersReady")
    status, reason, message = ready_condition(expected=3, joined={"a": True, "b": True}, waiting={"r1": ["c"]}, limit=2)
    assert (status, reason) == ("False", "CliqueFull") and "c wait for a place in clique r1" in message and "maxNodesPerClique 2" in message
    status, reason, message = ready_condition(expected=3, joined={"a": True, "b": False}, waiting={}, silent={"b"})
    assert (status, reason, message) == ("False", "MembersMissing", "2 of 3 expected nodes joined; no heartbeat: b")
    status, reason, message = ready_condition(expected=2, joined={"a": True, "b": False}, waiting={})
    assert (status, reason, message) == ("False", "MembersNotReady", "1 of 2 expected nodes Ready; NotReady: b")
    # Once anything was folded, an empty domain is missing its members, no longer initializing.
    assert ready_condition(expected=1, joined={}, waiting={}, previous={"reason": "MembersReady"})[1] == "MembersMissing"


def test_a_message_names_a_bounded_number_of_nodes_and_fits_the_cap():
    joined = {f"node-with-a-rather-long-name-{i:04d}": False for i in range(2000)}
    _, _, message = ready_condition(expected=3000, joined=joined, waiting={})
    assert "and 1990 more" in message and len(message) < 1000
    conditions = set_condition([], "Ready", "False", "X", "x" * 5000, 1, "t0")
    assert len(conditions[0]["message"].encode()) <= MESSAGE_LIMIT


def test_last_transition_time_moves_only_with_the_status():
    c1 = set_condition(None, "Ready", "False", "MembersMissing", "1 of 2", 1, "t1")
    c2 = set_condition(c1, "Ready", "False", "MembersNotReady", "1 of 2 Ready", 2, "t2")
    assert c2[0]["lastTransitionTime"] == "t1" and c2[0]["observedGeneration"] == 2 and c2[0]["reason"] == "MembersNotReady"
    c3 = set_condition(c2, "Ready", "True", "MembersReady", "2 of 2", 2, "t3")
    assert c3[0]["lastTransitionTime"] == "t3"
    other = set_condition([{"type": "Other", "status": "True"}], "Ready", "True", "R", "m", None, "t")
    assert [c["type"] for c in other] == ["Other", "Ready"] and "observedGeneration" not in other[1]


def test_fold_writes_the_condition_and_the_generation_it_answers():
    obj = {**domain(expected=2), "metadata": {**domain()["metadata"], "generation": 4}}
    first = fold(obj, {}, now="t0")
    assert ready_of(first)[:2] == ("Unknown", "Initializing") and first["status"]["observedGeneration"] == 4
    assert first["status"]["status"] == "NotReady"  # the 0.2 field, unchanged in meaning
    one = fold(first, {"a": member("a")}, now="t1")
    assert ready_of(one) == ("False", "MembersMissing", "1 of 2 expected nodes joined")
    two = fold(one, {"a": member("a"), "b": member("b")}, now="t2")
    assert ready_of(two)[:2] == ("True", "MembersReady") and find(two["status"]["conditions"])["lastTransitionTime"] == "t2"
    assert fold(two, {"a": member("a"), "b": member("b")}, now="t3") is None  # nothing changed: no write
    silent = fold(two, {"a": member("a"), "b": member("b")}, frozenset({"b"}), now="t4")
    assert ready_of(silent) == ("False", "MembersNotReady", "1 of 2 expected nodes Ready; no heartbeat: b")
    respec = {**two, "metadata": {**two["metadata"], "generation": 5}, "spec": {"expectedNodes": 3}}
    answered = fold(respec, {"a": member("a"), "b": member("b")}, now="t5")
    assert answered["status"]["observedGeneration"] == 5 and ready_of(answered)[1] == "MembersMissing"
    assert find(answered["status"]["conditions"])["observedGeneration"] == 5


def test_a_full_clique_is_the_reason_while_a_node_waits():
    obj = {**domain(expected=3), "spec": {"expectedNodes": 3, "maxNodesPerClique": 2}}
    out = fold(obj, {n: member(n, clique="r1") for n in "abc"}, now="t")
    assert ready_of(out)[:2] == ("False", "CliqueFull") and "c wait for a place in clique r1" in ready_of(out)[2]


def test_the_optimistic_writers_write_the_condition_too():
    obj = {**domain(expected=1), "metadata": {**domain()["metadata"], "generation": 2}}
    joined = with_entry(obj, Entry("a", "10.0.0.1", (), True))
    assert ready_of(joined)[:2] == ("True", "MembersReady") and joined["status"]["observedGeneration"] == 2
    assert with_entry(joined, Entry("a", "10.0.0.1", (), True)) is None
    left = without_entry(joined, "a")
    assert ready_of(left)[:2] == ("False", "MembersMissing")


def test_transitions_tell_joins_leaves_readiness_waiting_and_the_domain():
    obj = {**domain(expected=2), "spec": {"expectedNodes": 2, "maxNodesPerClique": 2}}
    first = fold(obj, {}, now="t0")
    a = fold(first, {"a": member("a", clique="r1")}, now="t1")
    assert [(t.reason, t.note) for t in transitions(first, a)] == [("NodeJoined", "node a joined at index 0 in clique r1")]
    ab = fold(a, {"a": member("a", clique="r1"), "b": member("b", clique="r1")}, now="t2")
    assert [t.reason for t in transitions(a, ab)] == ["NodeJoined", "DomainReady"]
    full = fold(ab, {n: member(n, clique="r1") for n in "abc"}, now="t3")
    assert [(t.type, t.reason) for t in transitions(ab, full)] == [("Warning", "NodeWaiting")]
    quiet = fold(full, {n: member(n, clique="r1") for n in "abc"}, frozenset({"b"}), now="t4")
    told = transitions(full, quiet, {"b": 16.4})
    assert (told[0].reason, told[0].note) == ("NodeNotReady", "node b turned NotReady: no heartbeat for 16 s")
    assert told[1].reason == "DomainNotReady" and "(CliqueFull)" in told[1].note and told[1].type == "Warning"
    gone = fold(quiet, {"a": member("a", clique="r1"), "c": member("c", clique="r1")}, now="t5")
    assert {t.reason for t in transitions(quiet, gone)} == {"NodeLeft", "NodeJoined", "DomainReady"}  # c took b's place
    back = fold(gone, {"a": member("a", clique="r1", ready=False), "c": member("c", clique="r1")}, now="t6")
    again = fold(back, {"a": member("a", clique="r1"), "c": member("c", clique="r1")}, now="t7")
    assert transitions(back, again)[0].note == "node a is Ready again"
    assert "its node agent reports it NotReady" in transitions(gone, back)[0].note


class FakeEvents:
    def __init__(self, fail=0):
        self.created, self.patched, self.fail = [], [], fail

    def create_namespaced_event(self, namespace, body, _request_timeout=None):
        assert _request_timeout is not None
        if self.fail:
            self.fail -= 1
            raise client.ApiException(status=503, reason="Service Unavailable")
        self.created.append(body)

    def patch_namespaced_event(self, name, namespace, body, _content_type=None, _request_timeout=None):
        assert _request_timeout is not None and _content_type == "application/merge-patch+json"
        self.patched.append((name, body["series"]["count"]))


REF = {"apiVersion": "gpu-agent.io/v1alpha1", "kind": "GPUDomain", "name": "d1", "namespace": "ns", "uid": "u1"}


def recorder(fake):
    return EventRecorder(None, controller="gpu-agent.io/cluster-agent", instance="pod-1", clock=ManualClock(),
                         events_api=fake)


def test_an_event_is_created_with_the_fields_kubectl_reads():
    fake = FakeEvents()
    r = recorder(fake)
    r.record(REF, "Normal", "NodeJoined", "Fold", "node a joined at index 0")
    assert fake.created == []  # queued: the caller never waits on the API server
    r.drain()
    (event,) = fake.created
    assert event["regarding"] == REF and event["metadata"]["namespace"] == "ns" and event["metadata"]["name"].startswith("d1.")
    assert (event["type"], event["reason"], event["action"], event["note"]) == ("Normal", "NodeJoined", "Fold", "node a joined at index 0")
    assert event["reportingController"] == "gpu-agent.io/cluster-agent" and event["reportingInstance"] == "pod-1"
    assert event["eventTime"].endswith("Z")


def test_repeats_become_one_series_flushed_at_most_every_flush_period():
    fake = FakeEvents()
    r = recorder(fake)
    for _ in range(5):
        r.record(REF, "Warning", "NodeNotReady", "Fold", "node b turned NotReady")
        r.drain()
    assert len(fake.created) == 1 and fake.patched == [(fake.created[0]["metadata"]["name"], 2)]
    r.clock.advance_blocking(SERIES_FLUSH)
    r.drain()
    assert fake.patched[-1][1] == 5 and len(fake.patched) == 2
    r.clock.advance_blocking(SERIES_WINDOW)  # the series ends: the next occurrence is a new Event
    r.drain()
    r.record(REF, "Warning", "NodeNotReady", "Fold", "node b turned NotReady")
    r.drain()
    assert len(fake.created) == 2


def test_a_flapping_object_is_held_to_the_spam_filters_burst_and_refill():
    fake = FakeEvents()
    r = recorder(fake)
    for i in range(SPAM_BURST + 10):  # each note different: no series helps
        r.record(REF, "Warning", "NodeNotReady", "Fold", f"node n{i} turned NotReady")
    r.drain()
    assert len(fake.created) == SPAM_BURST and r.dropped == 10
    other = {**REF, "name": "d2"}
    r.record(other, "Normal", "NodeJoined", "Fold", "node x joined")  # another object has its own bucket
    r.clock.advance_blocking(SPAM_REFILL)
    r.record(REF, "Normal", "NodeJoined", "Fold", "after the refill")
    r.drain()
    assert [e["note"] for e in fake.created[-2:]] == ["node x joined", "after the refill"]


def test_the_queue_is_bounded_and_a_failed_call_is_logged_and_forgotten():
    fake = FakeEvents(fail=1)
    r = recorder(fake)
    for i in range(QUEUE_LIMIT + 5):
        r.record({**REF, "name": f"d{i}"}, "Normal", "NodeJoined", "Fold", "n")
    assert r.dropped == 5
    r.drain()
    assert len(fake.created) == QUEUE_LIMIT - 1 and r.created == QUEUE_LIMIT - 1


class Told:
    def __init__(self):
        self.events = []

    def record(self, regarding, type_, reason, action, note):
        self.events.append((regarding["name"], reason, note))


def test_the_folder_tells_each_written_change_and_answers_a_spec_change_at_once():
    d = DomainOnClock(expected=2, quiet=0.5)
    told = Told()
    d.folding.recorder = told
    try:
        d.arrive("a")
        d.arrive("b")  # Ready: written at once
        assert [e[1] for e in told.events] == ["NodeJoined", "NodeJoined", "DomainReady"]
        # A user raises expectedNodes: the watch delivers the new generation, the folder answers it at once.
        writes = d.fake.replaces
        respec = {**d.fake.obj, "metadata": {**d.fake.obj["metadata"], "generation": 2}, "spec": {"expectedNodes": 3}}
        d.fake.obj = respec
        d.folding.domain_seen(respec)
        d._settle()
        status = d.fake.obj["status"]
        assert d.fake.replaces == writes + 1 and status["observedGeneration"] == 2
        assert ready_of(d.fake.obj)[:2] == ("False", "MembersMissing")
        assert told.events[-1][1] == "DomainNotReady"
        # The watch delivering the folder's own write again is no change: nothing written.
        d.folding.domain_seen(d.fake.obj)
        d._settle()
        assert d.fake.replaces == writes + 1
    finally:
        d.stop()


@pytest.mark.parametrize("expected", [1, 3])
def test_a_new_domain_is_initializing_until_a_member_is_folded(expected):
    d = DomainOnClock(expected=expected, quiet=0.5)
    try:
        assert ready_of(d.fake.obj)[:2] == ("Unknown", "Initializing")
    finally:
        d.stop()


def test_a_domain_event_before_the_members_are_listed_writes_nothing():
    """A new leader's folder: the domain's own watch may deliver it before the members are listed; folding
    then would write an empty status over the previous leader's (every node dropped, its index lost)."""
    import threading
    import time

    from gpu_agent.mechanisms.domain.aggregate import Aggregator

    clock = ManualClock()
    formed = fold({**domain(expected=1), "metadata": {**domain()["metadata"], "generation": 1}}, {"a": member("a")}, now="t")
    fake = FakeCustom(formed)
    folding = Aggregator(None, "default", "d1", interval=0.1, clock=clock, watch_domain=False, custom_api=fake)
    folding._watch = lambda: None  # the members' list comes late (below)
    runner = threading.Thread(target=folding.run, daemon=True)
    runner.start()
    try:
        folding.domain_seen(formed)
        deadline = time.monotonic() + 5
        while not (clock.blocked and not folding._changed.is_set()) and time.monotonic() < deadline:
            time.sleep(0.001)  # poll to a deadline: the loop handled the wake-up and waits on its clock again
        for _ in range(10):
            clock.step_thread(0.1)
        assert fake.replaces == 0 and [n["name"] for n in fake.obj["status"]["nodes"]] == ["a"]
        folding.listed_members({"items": [{"metadata": {"name": "d1.a", "labels": {"gpu-agent.io/domain": "d1"}},
                                           "spec": member("a")}]})
        for _ in range(10):
            clock.step_thread(0.1)
        assert fake.replaces == 0, "the members as listed match the status: still nothing to write"
    finally:
        folding.stop()
        clock.advance_blocking(1.0)
        runner.join(2)
