"""Which GPUDomains a node joins and leaves (membership.py), with recording reconcilers."""

import asyncio

from gpu_agent.foundations.clock import SystemClock
from gpu_agent.mechanisms.domain.membership import DomainMembership, selector_matches, wanted_domains


def test_a_selector_matches_when_every_label_it_names_has_its_value_and_an_empty_one_matches_every_node():
    labels = {"rack": "a", "zone": "z1"}
    assert selector_matches({"rack": "a"}, labels)
    assert selector_matches({"rack": "a", "zone": "z1"}, labels)
    assert not selector_matches({"rack": "b"}, labels)
    assert not selector_matches({"pool": "gpu"}, labels)
    assert selector_matches(None, labels) and selector_matches({}, labels)


def test_the_named_domain_is_always_wanted_and_matching_ones_only_once_the_labels_are_known():
    domains = {"d-a": {"rack": "a"}, "d-b": {"rack": "b"}, "all": None}
    assert wanted_domains("chart", True, domains, None) == {"chart"}
    assert wanted_domains("chart", True, domains, {"rack": "a"}) == {"chart", "d-a", "all"}
    assert wanted_domains("chart", False, domains, {"rack": "a"}) == {"chart"}
    assert wanted_domains("", True, domains, {"rack": "c"}) == {"all"}


class RecordingReconciler:
    def __init__(self, name, events):
        self.name, self.events = name, events
        self.clock = SystemClock()

    def set_gpus(self, uuids, ready, clique="", healthy=None, message=""):
        self.events.append(("gpus", self.name, tuple(uuids), ready, clique))
        if healthy is not None or message:
            self.events.append(("health", self.name, healthy, message))

    async def run(self):
        self.events.append(("run", self.name))
        await asyncio.Event().wait()

    def remove_entry(self, deadline):
        self.events.append(("removed", self.name))
        return True


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_node_joins_a_domain_when_its_labels_match_and_leaves_it_when_they_stop_matching(tasks):
    events = []
    membership = DomainMembership(None, "ns", "n1", named="", join_matching=True,
                                  make_reconciler=lambda name: RecordingReconciler(name, events))
    membership.join_matching = False  # no watch threads: the test feeds what they would see
    membership.set_gpus(["GPU-1"], True, "rack-a")
    tasks.start(membership.run())
    await settle()
    membership.join_matching = True
    membership._domains_listed({"items": [{"metadata": {"name": "d-a"}, "spec": {"nodeSelector": {"rack": "a"}}},
                                          {"metadata": {"name": "d-b"}, "spec": {"nodeSelector": {"rack": "b"}}}]})
    await settle()
    assert events == [], "nothing joined before the node's labels are known"
    membership._node_seen({"metadata": {"name": "n1", "labels": {"rack": "a"}}})
    await settle()
    assert events == [("gpus", "d-a", ("GPU-1",), True, "rack-a"), ("run", "d-a")]
    membership.set_gpus(["GPU-1", "GPU-2"], True, "rack-a")
    assert events[-1] == ("gpus", "d-a", ("GPU-1", "GPU-2"), True, "rack-a")
    membership._node_seen({"metadata": {"name": "n1", "labels": {"rack": "b"}}})
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert ("removed", "d-a") in events and ("run", "d-b") in events
    assert set(membership.joined) == {"d-b"}
    membership._domain_event("DELETED", {"metadata": {"name": "d-b"}})
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert ("removed", "d-b") in events and membership.joined == {}


async def test_the_gpus_health_reaches_every_joined_domain_and_one_joined_later(tasks):
    events = []
    membership = DomainMembership(None, "ns", "n1", named="chart", join_matching=False,
                                  make_reconciler=lambda name: RecordingReconciler(name, events))
    membership.set_gpus(["GPU-1", "GPU-2"], False, "", 0, "no healthy GPU: GPU-1 Lost, GPU-2 Lost")
    tasks.start(membership.run())
    await settle()
    assert ("health", "chart", 0, "no healthy GPU: GPU-1 Lost, GPU-2 Lost") in events
    membership.set_gpus(["GPU-1", "GPU-2"], True, "", 2, "")
    assert events[-2:] == [("gpus", "chart", ("GPU-1", "GPU-2"), True, ""), ("health", "chart", 2, "")]
    membership.join_matching = True
    membership._node_seen({"metadata": {"name": "n1", "labels": {"rack": "a"}}})
    membership._domains_listed({"items": [{"metadata": {"name": "d-a"}, "spec": {"nodeSelector": {"rack": "a"}}}]})
    await settle()
    assert ("health", "d-a", 2, "") in events
