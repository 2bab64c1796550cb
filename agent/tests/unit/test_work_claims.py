"""The ResourceClaimTemplates of work Pods through DRA (mechanisms/queues/work_claims.py), against a recording
stand-in of ResourceV1Api (issue 49): the template a count gets, word for word; the namespace of every call; what a
template that cannot be made says; and the most devices a node offers, asked of this driver's slices only."""

import asyncio

from gpu_agent.mechanisms.queues.work_claims import DraWorkClaims


class Resource:
    """ResourceV1Api's calls the claims make, recorded; `create_faults`: what each next create raises."""

    def __init__(self, slices=()):
        self.calls = []
        self.create_faults = []
        self.there = None
        self.slices = list(slices)

    def create_namespaced_resource_claim_template(self, namespace, body):
        self.calls.append(("create", namespace, body["metadata"]["name"]))
        if self.create_faults:
            raise self.create_faults.pop(0)

    def read_namespaced_resource_claim_template(self, name, namespace):
        self.calls.append(("read", namespace, name))
        return self.there

    def delete_namespaced_resource_claim_template(self, name, namespace):
        self.calls.append(("delete", namespace, name))

    def list_resource_slice(self, **selector):
        self.calls.append(("list", selector))
        return {"items": self.slices}


async def api(call, *args, **kwargs):
    return call(*args, **kwargs)


class Conflict(Exception):
    status, reason = 409, "AlreadyExists"


def test_a_template_asks_exactly_its_count_of_the_device_class_labelled_as_the_releases():
    claims = DraWorkClaims(None, "work", "gpu.example.com", release="rel")
    assert claims.template(2) == {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "rel-work-gpus-2", "labels": {
            "gpu-agent.io/work-claim": "true", "app.kubernetes.io/managed-by": "gpu-agent",
            "app.kubernetes.io/instance": "rel"}},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu.example.com", "allocationMode": "ExactCount", "count": 2}}]}}}}
    plain = DraWorkClaims(None, "work", "gpu.example.com")
    assert plain.template_name(1) == "gpu-agent-work-gpus-1"
    assert plain.template(1)["metadata"]["labels"] == {"gpu-agent.io/work-claim": "true",
                                                       "app.kubernetes.io/managed-by": "gpu-agent"}


def test_every_template_call_names_the_namespace_and_one_asking_something_else_is_replaced():
    resource = Resource()
    resource.create_faults = [Conflict()]
    resource.there = DraWorkClaims(None, "work", "old-class", release="rel").template(1)
    claims = DraWorkClaims(resource, "work", "gpu.example.com", release="rel")
    asyncio.run(claims.ensure(1, api))
    assert resource.calls == [("create", "work", "rel-work-gpus-1"), ("read", "work", "rel-work-gpus-1"),
                              ("delete", "work", "rel-work-gpus-1"), ("create", "work", "rel-work-gpus-1")]


def test_a_template_that_cannot_be_made_for_want_of_an_answer_says_so_naming_the_error():
    resource = Resource()
    resource.create_faults = [TimeoutError()]
    claims = DraWorkClaims(resource, "work", "gpu.example.com", release="rel")
    try:
        asyncio.run(claims.ensure(1, api))
    except RuntimeError as e:
        assert str(e) == "making ResourceClaimTemplate work/rel-work-gpus-1 failed: no answer TimeoutError"
    else:
        raise AssertionError("made without an answer")


def test_the_most_devices_on_a_node_are_asked_of_this_drivers_slices_and_no_node_offers_none():
    resource = Resource()
    assert asyncio.run(DraWorkClaims(resource, "work", "c", driver="gpu.example.com").most_on_a_node({"n1"}, api)) == 0
    assert asyncio.run(DraWorkClaims(resource, "work", "c").most_on_a_node(set(), api)) == 0
    assert resource.calls == [("list", {"field_selector": "spec.driver=gpu.example.com"}), ("list", {})]
