"""GPUDomainMember names and the aggregator's intake of members (members.py), the node agent's side of the
upgrade from 0.1's names (MemberWriter), and the domains a node agent refuses to join (membership.py)."""

import asyncio
import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client

from gpu_agent.mechanisms.domain import members as members_module
from gpu_agent.mechanisms.domain.entries import Entry
from gpu_agent.mechanisms.domain.members import (
    MemberIndex,
    domain_name_problem,
    legacy_member_name,
    member_name,
)

SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def obj(node, domain="train", name=None, label=None, **spec):
    return {"metadata": {"name": name or member_name(domain, node), "resourceVersion": "1",
                         "labels": {"gpu-agent.io/domain": domain if label is None else label}},
            "spec": {"domain": domain, "node": node, **spec}}


@pytest.fixture
def warnings():
    """The warnings members.py logs, as their messages."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    members_module.log._log.addHandler(handler)
    try:
        yield records
    finally:
        members_module.log._log.removeHandler(handler)


# ---- names ---------------------------------------------------------------------------------------

def test_the_pair_that_shared_a_name_in_0_1_gets_two_names():
    assert legacy_member_name("train", "rack1-n1") == legacy_member_name("train-rack1", "n1")  # 0.1's collision
    assert member_name("train", "rack1-n1") == "train.rack1-n1"
    assert member_name("train-rack1", "n1") == "train-rack1.n1"


def test_a_name_past_253_characters_is_cut_with_a_hash_of_the_pair_and_stays_a_valid_object_name():
    domain = "d" * 63
    long_node = ".".join(["n" * 60] * 4)  # 243 characters: a node name may have 253
    name = member_name(domain, long_node)
    assert len(name) == 253 and SUBDOMAIN.match(name)
    assert name.startswith(f"{domain}.{long_node}"[:242]) and re.fullmatch(r"-[0-9a-f]{10}", name[242:])
    other = member_name(domain, long_node[:-1] + "m")  # the same 242-character prefix, another node
    assert other != name and other[:242] == name[:242]
    # A cut that ends on a dot drops it: "-" cannot start the next label.
    node = "n" * (242 - 64 - 1) + "." + "x" * 80
    assert f"{domain}.{node}"[241] == "."
    cut = member_name(domain, node)
    assert SUBDOMAIN.match(cut) and cut.startswith(f"{domain}.{node}"[:241]) and re.fullmatch(r"-[0-9a-f]{10}", cut[241:])


def test_a_name_that_fits_is_the_pair_itself():
    node = "n" * (253 - 64)
    assert member_name("d" * 63, node) == "d" * 63 + "." + node  # exactly 253


labels = st.text("ab-", min_size=1, max_size=4).filter(lambda s: s[0] != "-" and s[-1] != "-")
nodes = st.lists(labels, min_size=1, max_size=3).map(".".join)


@settings(max_examples=400, deadline=None)
@given(st.tuples(labels, nodes), st.tuples(labels, nodes))
def test_two_pairs_never_share_a_member_name(a, b):
    """Small alphabets with '-' and '.' make the 0.1 kind of collision likely; member_name must avoid it."""
    if a != b:
        assert member_name(*a) != member_name(*b)


@settings(max_examples=200, deadline=None)
@given(st.text("ab", min_size=1, max_size=63), st.lists(st.text("ab-", min_size=1, max_size=63).filter(
    lambda s: s[0] != "-" and s[-1] != "-"), min_size=1, max_size=5).map(".".join).filter(lambda n: len(n) <= 253))
def test_every_member_name_is_a_valid_object_name(domain, node):
    name = member_name(domain, node)
    assert len(name) <= 253 and SUBDOMAIN.match(name), name


def test_a_domain_name_must_be_a_dns_label():
    assert domain_name_problem("train-rack1") is None
    assert "not a DNS label" in domain_name_problem("train.rack1")
    assert domain_name_problem("x" * 64) is not None and domain_name_problem("Train") is not None


# ---- the index -----------------------------------------------------------------------------------

@pytest.mark.parametrize("first", ["legacy", "canonical"])
def test_during_an_upgrade_the_canonical_member_wins_and_the_legacy_ones_deletion_keeps_the_node(first):
    index = MemberIndex("train", "train")
    legacy = obj("n1", name=legacy_member_name("train", "n1"), ip="old")
    canonical = obj("n1", ip="new")
    for o in ([legacy, canonical] if first == "legacy" else [canonical, legacy]):
        index.event("ADDED", o)
    assert index.members() == {"n1": canonical["spec"]}
    index.event("DELETED", legacy)
    assert index.members() == {"n1": canonical["spec"]}


def test_a_0_1_member_alone_is_read_and_its_deletion_removes_the_node():
    index = MemberIndex("train", "train")
    legacy = obj("n1", name=legacy_member_name("train", "n1"))
    index.replace([legacy])
    assert index.members() == {"n1": legacy["spec"]}
    index.event("DELETED", legacy)
    assert index.members() == {}


def test_members_of_another_domain_or_under_another_nodes_name_are_left_out(warnings):
    index = MemberIndex("train", "train")
    index.replace([obj("n1"),
                   obj("n2", domain="infer", label="train", name="train.n2"),  # spec.domain another's
                   obj("n3", label="infer"),  # the label another's
                   obj("n4", name=member_name("train", "n1") + "x"),  # a name that is not n4's
                   obj("n5", name=member_name("train", "n6"))])  # squatting n6's name
    assert index.members() == {"n1": obj("n1")["spec"]}
    assert len(warnings) == 4 and all("left out of the fold" in w for w in warnings)


def test_an_unreadable_member_is_logged_once_however_often_it_changes_and_again_after_it_was_deleted(warnings):
    index = MemberIndex("train", "train")
    broken = {"metadata": {"name": "train.n9", "resourceVersion": "1"}}
    index.replace([broken, obj("n1")])
    for rv in range(2, 6):  # every relist and every change of it
        index.event("MODIFIED", {**broken, "metadata": {**broken["metadata"], "resourceVersion": str(rv)}})
        index.replace([broken, obj("n1")])
    assert warnings == ["member train.n9 of train left out of the fold: it has no spec.node"]
    index.event("DELETED", broken)
    index.event("ADDED", broken)
    assert len(warnings) == 2 and list(index.members()) == ["n1"]


def test_a_member_moved_to_another_node_under_its_old_name_leaves_the_fold_and_the_event_names_both_nodes():
    index = MemberIndex("train", "train")
    index.replace([obj("n1"), obj("n2")])
    moved = obj("n2", name=member_name("train", "n1"))  # n1's object now saying n2 (only an admin could)
    assert index.event("MODIFIED", moved) == {"n1"}  # n1's member changed; the object is no member of n2
    assert index.members() == {"n2": obj("n2")["spec"]}


def test_a_member_that_turns_unreadable_leaves_the_fold():
    index = MemberIndex("train", "train")
    index.event("ADDED", obj("n1"))
    index.event("MODIFIED", {"metadata": {"name": "train.n1"}, "spec": {"node": ""}})
    assert index.members() == {}


def test_the_aggregator_keeps_a_node_whose_legacy_member_is_deleted_and_its_heartbeat_follows_the_canonical():
    from gpu_agent.mechanisms.domain.aggregate import Aggregator

    folding = Aggregator(None, "ns", "train")
    legacy = obj("n1", name=legacy_member_name("train", "n1"), heartbeat="t0", heartbeatIntervalSeconds=1)
    folding.listed_members({"items": [legacy]})
    assert folding.members == {"n1": legacy["spec"]}
    canonical = obj("n1", heartbeat="t1", heartbeatIntervalSeconds=1)
    folding.member_event("ADDED", canonical)
    folding.member_event("DELETED", legacy)
    assert folding.members == {"n1": canonical["spec"]}
    assert folding.heartbeats.seen["n1"][0] == "t1"
    folding.member_event("DELETED", canonical)
    assert folding.members == {} and "n1" not in folding.heartbeats.seen


# ---- the node agent's side: 0.1's member deleted after the canonical one is applied ----------------

class Members:
    """An API server's GPUDomainMembers: apply, get, delete (with preconditions), recorded."""

    def __init__(self, objects=(), fail_delete=None):
        self.objects = {o["metadata"]["name"]: o for o in objects}
        self.calls = []
        self.fail_delete = fail_delete

    def patch_namespaced_custom_object(self, g, v, ns, plural, name, body, **kw):
        self.calls.append(("apply", name))
        self.objects[name] = {**body, "metadata": {**body["metadata"], "uid": f"uid-{name}", "resourceVersion": "1"}}
        return body

    def get_namespaced_custom_object(self, g, v, ns, plural, name, _request_timeout=None):
        self.calls.append(("get", name))
        if name not in self.objects:
            raise client.ApiException(status=404, reason="Not Found")
        return self.objects[name]

    def delete_namespaced_custom_object(self, g, v, ns, plural, name, _request_timeout=None, body=None):
        self.calls.append(("delete", name, body.preconditions.uid if body else None))
        if self.fail_delete:
            raise self.fail_delete.pop(0)
        if name not in self.objects:
            raise client.ApiException(status=404, reason="Not Found")
        del self.objects[name]


def writer(fake):
    from gpu_agent.mechanisms.domain.aggregate import MemberWriter

    return MemberWriter(client.ApiClient(), "ns", "train", custom_api=fake)


def test_the_new_agent_joins_with_one_call_then_deletes_its_own_0_1_member_once_at_its_first_heartbeat():
    old = obj("n1", name="train-n1")
    old["metadata"].update(uid="u-old", resourceVersion="7")
    fake = Members([old])
    w = writer(fake)
    assert w.ensure(Entry("n1", "", (), True))
    assert fake.calls == [("apply", "train.n1")]  # the join: one call, what a forming domain waits on
    assert w.ensure(Entry("n1", "", (), True))  # the first heartbeat looks for the 0.1 member
    assert fake.calls[1:] == [("apply", "train.n1"), ("get", "train-n1"), ("delete", "train-n1", "u-old")]
    assert w.ensure(Entry("n1", "", (), True))  # the next: no more looking
    assert fake.calls[4:] == [("apply", "train.n1")]
    assert set(fake.objects) == {"train.n1"}


def test_a_0_1_name_holding_another_pairs_member_is_left_alone():
    other = obj("rack1-n1", name="train-rack1-n1")  # ("train", "rack1-n1") in 0.1: the name of ("train-rack1", "n1")
    fake = Members([other])
    w = writer(fake)
    w.domain = w.name = "train-rack1"
    assert w.ensure(Entry("n1", "", (), True)) and w.ensure(Entry("n1", "", (), True))
    assert "train-rack1-n1" in fake.objects and not [c for c in fake.calls if c[0] == "delete"]
    assert w.legacy_done


def test_a_failed_deletion_of_the_0_1_member_is_tried_again_at_the_next_apply_and_on_removal():
    old = obj("n1", name="train-n1")
    old["metadata"].update(uid="u-old", resourceVersion="7")
    fake = Members([old], fail_delete=[client.ApiException(status=409, reason="Conflict"),
                                       client.ApiException(status=500, reason="Internal")])
    w = writer(fake)
    assert w.ensure(Entry("n1", "", (), True)) and not w.legacy_done  # the join does not look
    assert w.ensure(Entry("n1", "", (), True)) and not w.legacy_done  # changed since the read
    assert w.ensure(Entry("n1", "", (), True)) and not w.legacy_done  # the API server's trouble
    assert w.remove("n1") and w.legacy_done  # removal deletes it too
    assert fake.objects == {}


# ---- joining ---------------------------------------------------------------------------------------

async def test_a_node_agent_writing_members_does_not_join_a_domain_with_a_dot_and_says_so_once(tasks):
    from gpu_agent.mechanisms.domain import membership as membership_module
    from gpu_agent.mechanisms.domain.membership import DomainMembership

    joined, said = [], []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    membership_module.log._log.addHandler(handler)

    class Reconciler:
        def __init__(self, name):
            joined.append(name)

        def set_gpus(self, *a):
            pass

        async def run(self):
            await asyncio.Event().wait()

    try:
        for writes_members, expect in ((True, ["ok"]), (False, ["a.b", "ok"])):
            joined.clear()
            m = DomainMembership(None, "ns", "n1", named="", join_matching=True, make_reconciler=Reconciler,
                                 writes_members=writes_members)
            m.join_matching = False  # no watch threads: the test feeds what they would see
            tasks.start(m.run())
            for _ in range(5):
                await asyncio.sleep(0)
            m.join_matching = True
            m._node_seen({"metadata": {"name": "n1", "labels": {}}})
            for _ in range(3):  # the domains listed again and again
                m._domains_listed({"items": [{"metadata": {"name": "a.b"}}, {"metadata": {"name": "ok"}}]})
                for _ in range(5):
                    await asyncio.sleep(0)
            assert sorted(joined) == expect
    finally:
        membership_module.log._log.removeHandler(handler)
    assert [s for s in said if "not joining" in s] == [
        "not joining GPUDomain ns/a.b: its name 'a.b' is not a DNS label (lowercase letters, digits and '-', at most 63 "
        "characters), so the member names <domain>.<node> would not be unique; recreate the GPUDomain under such a name"]
