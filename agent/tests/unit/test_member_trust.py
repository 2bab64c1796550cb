"""The folder trusts only what it can check (mechanisms/domain/trust.py): a member's address and node against its
owner Pod, its GPUs against its Node's capacity. On a ManualClock, a fake API server holding the domain, and Pods
handed in as the watch would deliver them; no sleeps."""

import threading
import time

import pytest

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.mechanisms.domain.aggregate import Aggregator, EveryDomainAggregator, fold
from gpu_agent.mechanisms.domain.conditions import find, ready_condition
from gpu_agent.mechanisms.domain.members import MemberIndex, legacy_member_name, member_name
from gpu_agent.mechanisms.domain.transitions import transitions
from gpu_agent.mechanisms.domain.trust import GPU_CLAIM_GRACE, MemberTrust, NodeAgentPods
from tests.unit.test_domain import FakeCustom, domain


def pod(name, node, host_ip, uid="", pod_ip="10.244.0.9", host_ips=()):
    status = {"hostIP": host_ip, "podIP": pod_ip, "podIPs": [{"ip": pod_ip}]}
    if host_ips:
        status["hostIPs"] = [{"ip": ip} for ip in host_ips]
    return {"metadata": {"name": name, "uid": uid or f"uid-{name}"}, "spec": {"nodeName": node}, "status": status}


def member(node, ip, owner="", uid="", domain="d1", gpus=0, ready=True):
    """A node agent's GPUDomainMember as the watch delivers it, owned by Pod `owner` (none when "")."""
    meta = {"name": member_name(domain, node), "labels": {"gpu-agent.io/domain": domain}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": owner, "uid": uid or f"uid-{owner}"}]
    return {"metadata": meta, "spec": {"domain": domain, "node": node, "ip": ip, "ready": ready,
                                       "gpuUUIDs": [f"GPU-{node}-{i}" for i in range(gpus)]}}


def listed_pods(*pods):
    view = NodeAgentPods(lambda *a, **kw: None, "ns")
    view.listed_pods({"items": list(pods)})
    return view


def doubts(view, *objs, capacity=None, now=lambda: 0.0, trust=None):
    index = MemberIndex("d1", "d1")
    index.replace(objs)
    members = index.members()
    trust = trust or MemberTrust(view, capacity, monotonic=now)
    return trust.doubts(members, {n: index.owner(n) for n in members},
                        frozenset(n for n in members if index.is_legacy(n)))


def legacy_member(node, ip, domain="d1"):
    """0.1's member of a node: named `<domain>-<node>`, owned by nothing (0.1's node agents set no owner)."""
    obj = member(node, ip, domain=domain)
    obj["metadata"]["name"] = legacy_member_name(domain, node)
    return obj


# ---- the check alone --------------------------------------------------------------------------------------------

def test_a_member_whose_owner_pod_vouches_for_its_node_and_address_is_trusted():
    view = listed_pods(pod("na-a", "a", "10.0.0.1"), pod("na-b", "b", "10.0.0.2", pod_ip="10.244.1.5"),
                       pod("na-c", "c", "10.0.0.3", host_ips=("10.0.0.3", "fd00::3")))
    assert doubts(view, member("a", "10.0.0.1", "na-a"),
                  member("b", "10.244.1.5", "na-b"),  # its Pod's own address (a node agent on the Pod network)
                  member("c", "fd00::3", "na-c"),  # the second address of a dual-stack node
                  member("d", "", "na-a")  # claims no address ... but its Pod runs on another node
                  ) == {"d": "MemberNodeMismatch: member says node d, its Pod na-a runs on a"}


def test_a_lying_address_is_doubted_with_both_addresses_named():
    view = listed_pods(pod("na-a", "a", "10.0.0.1", pod_ip="10.244.0.7"))
    assert doubts(view, member("a", "10.0.0.9", "na-a")) == {
        "a": "MemberAddressMismatch: member says 10.0.0.9, its Pod na-a has 10.0.0.1, 10.244.0.7"}


def test_a_member_without_its_owner_pod_is_doubted():
    view = listed_pods(pod("na-a", "a", "10.0.0.1"))
    assert doubts(view, member("a", "10.0.0.1"), member("b", "10.0.0.2", "na-b"),
                  member("c", "10.0.0.1", "na-a", uid="uid-of-a-pod-since-replaced")) == {
        "a": "MemberOwnerMissing: the member names no owner Pod",
        "b": "MemberOwnerMissing: its owner Pod na-b is not a node agent Pod of ns (gone?)",
        "c": "MemberOwnerMissing: its owner Pod na-a is not a node agent Pod of ns (gone?)"}


def test_a_01_member_without_an_owner_is_vouched_for_by_the_node_agent_pods_on_its_node():
    """An upgrade from 0.1: the old node agents' members have 0.1's name and no owner; while they run (and after a
    0.2 agent replaced one on its node) the node agent Pods on the member's node vouch for its address. A member of
    the current name without an owner is still doubted: 0.2's agents always name theirs."""
    view = listed_pods(pod("old-a", "a", "10.0.0.1"), pod("new-b", "b", "10.0.0.2"))
    assert doubts(view, legacy_member("a", "10.0.0.1"), legacy_member("b", "10.0.0.2"),
                  legacy_member("c", "10.0.0.3"), legacy_member("d", "10.0.0.9"), member("e", "10.0.0.1")) == {
        "c": "MemberOwnerMissing: 0.1's member names no owner Pod, and no node agent Pod of ns runs on c",
        "d": "MemberOwnerMissing: 0.1's member names no owner Pod, and no node agent Pod of ns runs on d",
        "e": "MemberOwnerMissing: the member names no owner Pod"}
    assert doubts(view, legacy_member("a", "10.0.0.9")) == {
        "a": "MemberAddressMismatch: member says 10.0.0.9, the node agent Pods on a (old-a) have 10.0.0.1, 10.244.0.9"}


def test_before_the_pods_are_listed_nobody_is_doubted():
    view = NodeAgentPods(lambda *a, **kw: None, "ns")
    lying = member("a", "10.0.0.9", "na-a")
    assert doubts(view, lying) == {}  # the folder just started: no false alarm
    view.listed_pods({"items": [pod("na-a", "a", "10.0.0.1")]})
    assert set(doubts(view, lying)) == {"a"}


def test_the_pod_watch_keeps_the_view_current():
    view = listed_pods()
    view.pod_event("ADDED", pod("na-a", "a", "", pod_ip=""))  # scheduled, no address yet
    assert doubts(view, member("a", "10.0.0.1", "na-a")) == {
        "a": "MemberAddressMismatch: member says 10.0.0.1, its Pod na-a has no address yet"}
    view.pod_event("MODIFIED", pod("na-a", "a", "10.0.0.1"))
    assert doubts(view, member("a", "10.0.0.1", "na-a")) == {}
    view.pod_event("DELETED", pod("na-a", "a", "10.0.0.1"))
    assert set(doubts(view, member("a", "10.0.0.1", "na-a"))) == {"a"}


def test_more_gpus_than_the_node_reports_are_doubted_once_that_lasts_the_grace():
    view = listed_pods(pod("na-a", "a", "10.0.0.1"), pod("na-b", "b", "10.0.0.2"))
    now = [100.0]
    capacity = {"a": 4}.get  # b: no independent report (no device plugin, another GPU source): not checked
    trust = MemberTrust(view, capacity, monotonic=lambda: now[0])
    a8, b8 = member("a", "10.0.0.1", "na-a", gpus=8), member("b", "10.0.0.2", "na-b", gpus=8)
    assert doubts(view, a8, b8, trust=trust) == {}  # the kubelet may not have reported new GPUs yet
    now[0] += GPU_CLAIM_GRACE
    assert doubts(view, a8, b8, trust=trust) == {
        "a": "MemberGPUMismatch: member lists 8 GPUs, node a reports 4 nvidia.com/gpu in capacity"}
    a6 = member("a", "10.0.0.1", "na-a", gpus=6)
    assert doubts(view, a6, trust=trust) == {}  # another claim: its own grace
    now[0] += GPU_CLAIM_GRACE
    assert set(doubts(view, a6, trust=trust)) == {"a"}
    assert doubts(view, member("a", "10.0.0.1", "na-a", gpus=4), trust=trust) == {}  # within capacity
    assert trust.over_since == {}


# ---- what the doubt does to the status, the condition and the Events --------------------------------------------

def test_a_doubted_member_is_folded_notready_without_its_address_and_the_condition_says_why():
    members = {"a": {"node": "a", "ip": "10.0.0.1", "ready": True}, "b": {"node": "b", "ip": "10.0.0.9", "ready": True}}
    why = "MemberAddressMismatch: member says 10.0.0.9, its Pod na-b has 10.0.0.2"
    folded = fold(domain(expected=2), members, doubted={"b": why}, now="t")
    assert [(n["name"], n["ip"], n["status"]) for n in folded["status"]["nodes"]] == [
        ("a", "10.0.0.1", "Ready"), ("b", "", "NotReady")]  # the lie reaches no peer list
    ready = find(folded["status"]["conditions"])
    assert (ready["status"], ready["reason"]) == ("False", "MembersNotReady")
    assert ready["message"] == f"1 of 2 expected nodes Ready; untrusted: b ({why})"
    assert fold(folded, members, doubted={"b": why}, now="t") is None
    assert find(fold(folded, members, now="t")["status"]["conditions"])["status"] == "True"


def test_the_condition_names_a_bounded_number_of_doubts():
    doubted = {f"n{i}": f"MemberOwnerMissing: why {i}" for i in range(5)}
    _, _, message = ready_condition(expected=5, joined=dict.fromkeys(doubted, False), waiting={}, doubted=doubted)
    assert message == ("0 of 5 expected nodes Ready; untrusted: n0 (MemberOwnerMissing: why 0); "
                       "n1 (MemberOwnerMissing: why 1); n2 (MemberOwnerMissing: why 2) and 2 more")


def test_a_new_doubt_is_told_once_with_its_reason_instead_of_a_plain_notready():
    members = {"a": {"node": "a", "ip": "10.0.0.1", "ready": True}}
    before = fold(domain(expected=1), members, now="t")
    after = fold(before, members, doubted={"a": "MemberOwnerMissing: x"}, now="t")
    told = [(t.type, t.reason, t.note) for t in transitions(before, after, doubted={"a": "MemberOwnerMissing: x"})]
    assert told == [("Warning", "NodeUntrusted", "node a is NotReady: MemberOwnerMissing: x"),
                    ("Warning", "DomainNotReady", f"domain NotReady (MembersNotReady): {find(after['status']['conditions'])['message']}")]
    assert transitions(after, after, doubted={"a": "MemberOwnerMissing: x"}, doubted_before={"a": "MemberOwnerMissing: x"}) == []


# ---- the folder, end to end on its clock ------------------------------------------------------------------------

class Told:
    def __init__(self):
        self.events = []

    def record(self, regarding, type_, reason, action, note):
        self.events.append((reason, note))


class Folder:
    """An Aggregator with member checks on a ManualClock over a FakeCustom: members and Pods handed in by the test,
    each call returning once the folder has handled them and waits on its clock again."""

    def __init__(self, expected, pods_listed=True):
        self.clock = ManualClock()
        self.fake = FakeCustom(domain(expected=expected))
        self.pods = NodeAgentPods(lambda *a, **kw: None, "default", clock=self.clock)
        if pods_listed:
            self.pods.listed_pods({"items": [pod("na-a", "a", "10.0.0.1"), pod("na-b", "b", "10.0.0.2")]})
        self.told = Told()
        self.folding = Aggregator(None, "default", "d1", interval=0.1, clock=self.clock, watch_domain=False,
                                  custom_api=self.fake, recorder=self.told, pods=self.pods)
        self.folding._watch = lambda: None
        self.folding.listed_members({"items": []})
        self.runner = threading.Thread(target=self.folding.run, daemon=True)
        self.runner.start()
        self.settle()

    def settle(self):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # poll to a deadline: handled the change, and waiting again
            if not self.folding._changed.is_set() and self.clock.blocked:
                break
            time.sleep(0.001)
        else:
            raise AssertionError("the folder did not get back to waiting on its clock")
        for _ in range(6):  # the step at which doubts are looked at again (0.5 s), and the quiet period after
            self.clock.step_thread(0.1)

    def apply(self, obj):
        self.folding.member_event("MODIFIED", obj)
        self.settle()

    def pod_event(self, kind, obj):
        self.pods.pod_event(kind, obj)
        self.settle()

    def nodes(self):
        return [(n["name"], n["ip"], n["status"]) for n in self.fake.obj["status"]["nodes"]]

    def ready(self):
        cond = find(self.fake.obj["status"]["conditions"])
        return cond["status"], cond["message"]

    def stop(self):
        self.folding.stop()
        self.clock.advance_blocking(1.0)
        self.runner.join(2)
        assert not self.runner.is_alive()


def test_a_lying_member_turns_notready_with_the_reason_and_ready_again_once_it_tells_the_truth():
    f = Folder(expected=2)
    try:
        f.apply(member("a", "10.0.0.1", "na-a"))
        f.apply(member("b", "10.0.0.2", "na-b"))
        assert f.nodes() == [("a", "10.0.0.1", "Ready"), ("b", "10.0.0.2", "Ready")]  # the truth: trusted
        assert f.ready()[0] == "True"
        f.apply(member("b", "10.0.0.9", "na-b"))  # b points its peers elsewhere
        why = "MemberAddressMismatch: member says 10.0.0.9, its Pod na-b has 10.0.0.2, 10.244.0.9"
        assert f.nodes() == [("a", "10.0.0.1", "Ready"), ("b", "", "NotReady")]
        assert f.ready() == ("False", f"1 of 2 expected nodes Ready; untrusted: b ({why})")
        assert ("NodeUntrusted", f"node b is NotReady: {why}") in f.told.events
        assert not [e for e in f.told.events if e[0] == "NodeNotReady"]  # NodeUntrusted said why
        f.apply(member("b", "10.0.0.2", "na-b"))  # corrected
        assert f.nodes() == [("a", "10.0.0.1", "Ready"), ("b", "10.0.0.2", "Ready")]
        assert f.ready()[0] == "True" and f.told.events[-2:] == [("NodeReady", "node b is Ready again"),
                                                                  ("DomainReady", "domain Ready: 2 of 2 expected nodes Ready")]
    finally:
        f.stop()


def test_a_member_whose_owner_pod_is_gone_turns_notready_and_its_new_pods_member_is_trusted():
    f = Folder(expected=2)
    try:
        f.apply(member("a", "10.0.0.1", "na-a"))
        f.apply(member("b", "10.0.0.2", "na-b"))
        assert f.ready()[0] == "True"
        f.pod_event("DELETED", pod("na-b", "b", "10.0.0.2"))  # its member not yet garbage-collected
        assert f.nodes()[1] == ("b", "", "NotReady")
        assert "untrusted: b (MemberOwnerMissing: its owner Pod na-b is not a node agent Pod of default (gone?))" in f.ready()[1]
        f.pod_event("ADDED", pod("na-b2", "b", "10.0.0.2"))
        f.apply(member("b", "10.0.0.2", "na-b2"))  # the new Pod's agent applies its member
        assert f.nodes()[1] == ("b", "10.0.0.2", "Ready") and f.ready()[0] == "True"
    finally:
        f.stop()


def test_until_the_pods_are_listed_the_folder_marks_nobody():
    f = Folder(expected=1, pods_listed=False)
    try:
        f.apply(member("a", "10.0.0.9", "na-a"))
        assert f.nodes() == [("a", "10.0.0.9", "Ready")] and f.ready()[0] == "True"
        f.pods.listed_pods({"items": [pod("na-a", "a", "10.0.0.1")]})
        f.settle()
        assert f.nodes() == [("a", "", "NotReady")]
    finally:
        f.stop()


def test_one_pod_watch_serves_every_domains_checks(monkeypatch):
    monkeypatch.setattr(Aggregator, "run", lambda self: None)  # no API server here: the folding loops stay off
    folding = EveryDomainAggregator(None, "ns", check_members=True, gpu_capacity={"a": 4}.get)
    folding._listed_members({"items": []})
    folding._listed({"items": [domain(name="d1"), domain(name="d2")]})
    aggs = list(folding.aggregators.values())
    assert len(aggs) == 2 and all(a.pods is folding.pods and not a.watch_pods for a in aggs)
    assert all(a.trust is not None and a.trust.gpu_capacity is folding.gpu_capacity for a in aggs)
    unchecked = EveryDomainAggregator(None, "ns")  # as bench-domain and the e2e folders without Pods build it
    unchecked._listed({"items": [domain(name="d1")]})
    assert unchecked.pods is None and unchecked.aggregators["d1"].trust is None


@pytest.mark.parametrize("check", [True, False])
def test_a_lone_folder_watches_the_pods_itself_only_when_it_checks(check):
    folding = Aggregator(None, "ns", "d1", check_members=check)
    assert folding.watch_pods is check and (folding.trust is not None) is check
