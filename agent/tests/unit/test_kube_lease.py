"""KubeLease against a fake CoordinationV1Api that keeps Leases as the API server does: a
resourceVersion per write, 409 for a create over an existing Lease or a write from a stale version,
404 for a Lease that is not there, and a delete that honours its precondition."""

import datetime as dt
from types import SimpleNamespace

import pytest
from kubernetes import client

from gpu_agent.mechanisms.leadership.elector import LeaseConflict, LeaseRecord
from gpu_agent.mechanisms.leadership.kube_lease import KubeLease


def api_error(status, reason):
    return client.ApiException(status=status, reason=reason)


class FakeCoordination:
    """The Lease calls KubeLease makes; every call's keyword arguments are kept for the test to read."""

    def __init__(self):
        self.leases = {}
        self.version = 0
        self.uids = 0
        self.calls = []
        self.fail = None  # an ApiException every call raises while set

    def _called(self, name, kwargs):
        self.calls.append((name, kwargs))
        if self.fail is not None:
            raise self.fail

    def _stored(self, namespace, body):
        self.version += 1
        body.metadata.resource_version = str(self.version)
        self.leases[(namespace, body.metadata.name)] = body
        return body

    def read_namespaced_lease(self, name, namespace, **kwargs):
        self._called("read", kwargs)
        if (namespace, name) not in self.leases:
            raise api_error(404, "Not Found")
        return self.leases[(namespace, name)]

    def create_namespaced_lease(self, namespace, body, **kwargs):
        self._called("create", kwargs)
        if (namespace, body.metadata.name) in self.leases:
            raise api_error(409, "AlreadyExists")
        if body.metadata.resource_version:
            raise api_error(400, "resourceVersion must not be set on create")
        self.uids += 1
        body.metadata.uid = f"uid-{self.uids}"
        return self._stored(namespace, body)

    def replace_namespaced_lease(self, name, namespace, body, **kwargs):
        self._called("replace", kwargs)
        current = self.leases.get((namespace, name))
        if current is None:
            raise api_error(404, "Not Found")
        if body.metadata.resource_version != current.metadata.resource_version:
            raise api_error(409, "Conflict")
        body.metadata.uid = current.metadata.uid
        return self._stored(namespace, body)

    def delete_namespaced_lease(self, name, namespace, body=None, **kwargs):
        self._called("delete", kwargs)
        current = self.leases.get((namespace, name))
        if current is None:
            raise api_error(404, "Not Found")
        wanted = body.preconditions.resource_version if body is not None and body.preconditions else None
        if wanted is not None and wanted != current.metadata.resource_version:
            raise api_error(409, "Conflict: the precondition failed")
        del self.leases[(namespace, name)]


class FakeApps:
    def __init__(self, uid="dep-uid-1", error=None):
        self.uid = uid
        self.error = error
        self.reads = 0

    def read_namespaced_deployment(self, name, namespace, **kwargs):
        self.reads += 1
        if self.error is not None:
            raise self.error
        return SimpleNamespace(metadata=client.V1ObjectMeta(name=name, namespace=namespace, uid=self.uid))


def kube_lease(coordination, apps=None, owner=""):
    return KubeLease(None, namespace="ns", name="agents", request_timeout=4.0, owner_deployment=owner,
                     coordination=coordination, apps=apps or FakeApps())


def record(holder="a", version="", transitions=0):
    return LeaseRecord(holder, 15.0, 1_700_000_000.0, 1_700_000_002.5, transitions, version)


def test_a_missing_lease_reads_as_none():
    assert kube_lease(FakeCoordination()).get() is None


def test_a_created_lease_reads_back_as_the_record_written_with_its_version_and_uid():
    api = FakeCoordination()
    lease = kube_lease(api)
    created = lease.create(record("a", transitions=3))
    assert created == LeaseRecord("a", 15.0, 1_700_000_000.0, 1_700_000_002.5, 3, "1", "uid-1")
    assert lease.get() == created
    stored = api.leases[("ns", "agents")]
    assert stored.spec.lease_duration_seconds == 15
    assert stored.spec.renew_time == dt.datetime.fromtimestamp(1_700_000_002.5, dt.UTC)
    assert stored.metadata.labels == {"app.kubernetes.io/managed-by": "gpu-agent"}
    assert stored.metadata.owner_references is None
    # every call is bounded by the request timeout
    assert {name: kwargs["_request_timeout"] for name, kwargs in api.calls} == {"create": 4.0, "read": 4.0}


def test_creating_over_an_existing_lease_is_a_conflict():
    api = FakeCoordination()
    kube_lease(api).create(record("a"))
    with pytest.raises(LeaseConflict):
        kube_lease(api).create(record("b"))
    assert api.leases[("ns", "agents")].spec.holder_identity == "a"


def test_an_update_from_a_stale_version_or_of_a_deleted_lease_is_a_conflict():
    api = FakeCoordination()
    lease = kube_lease(api)
    first = lease.create(record("a"))
    renewed = lease.update(first)
    assert renewed.version == "2" and renewed.uid == first.uid
    with pytest.raises(LeaseConflict):
        lease.update(first)  # version 1 is no longer current
    del api.leases[("ns", "agents")]
    with pytest.raises(LeaseConflict):  # 404 on replace: someone else deleted it
        lease.update(renewed)


def test_delete_is_conditional_on_the_version_read():
    api = FakeCoordination()
    lease = kube_lease(api)
    first = lease.create(record("a"))
    second = lease.update(first)
    with pytest.raises(LeaseConflict):
        lease.delete(first)
    assert lease.get() == second
    lease.delete(second)
    assert lease.get() is None
    lease.delete(second)  # already gone: 404 is not an error


def test_the_lease_is_owned_by_the_named_deployment_which_is_read_once():
    api, apps = FakeCoordination(), FakeApps(uid="dep-uid-7")
    lease = kube_lease(api, apps, owner="gpu-agent-cluster-agent")
    lease.update(lease.create(record("a")))
    (owner,) = api.leases[("ns", "agents")].metadata.owner_references
    assert (owner.api_version, owner.kind, owner.name, owner.uid) == \
        ("apps/v1", "Deployment", "gpu-agent-cluster-agent", "dep-uid-7")
    assert client.ApiClient().sanitize_for_serialization(owner) == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "gpu-agent-cluster-agent", "uid": "dep-uid-7"}
    assert apps.reads == 1


def test_a_missing_owner_leaves_the_lease_unowned_and_other_errors_name_the_deployment():
    api = FakeCoordination()
    apps = FakeApps(error=api_error(404, "Not Found"))
    kube_lease(api, apps, owner="gone").create(record("a"))
    assert api.leases[("ns", "agents")].metadata.owner_references is None
    forbidden = FakeApps(error=api_error(403, "Forbidden"))
    with pytest.raises(RuntimeError, match=r"reading Deployment ns/gone \(the Lease's owner\): 403 Forbidden"):
        kube_lease(FakeCoordination(), forbidden, owner="gone").create(record("a"))


def test_other_api_errors_name_the_call_and_the_lease():
    api = FakeCoordination()
    lease = kube_lease(api)
    api.fail = api_error(500, "Internal Server Error")
    with pytest.raises(RuntimeError, match="reading Lease ns/agents: 500 Internal Server Error"):
        lease.get()
    with pytest.raises(RuntimeError, match="creating Lease ns/agents: 500"):
        lease.create(record("a"))
