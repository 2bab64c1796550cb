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
        self.timeouts = []  # each read's _request_timeout

    def read_namespaced_deployment(self, name, namespace, **kwargs):
        self.reads += 1
        self.timeouts.append(kwargs.get("_request_timeout"))
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
    assert apps.reads == 1 and apps.timeouts == [4.0]  # bounded by the request timeout, as the Lease's calls are


def test_a_missing_owner_leaves_the_lease_unowned_and_other_errors_name_the_deployment():
    api = FakeCoordination()
    apps = FakeApps(error=api_error(404, "Not Found"))
    lease = kube_lease(api, apps, owner="gone")
    lease.update(lease.create(record("a")))
    assert api.leases[("ns", "agents")].metadata.owner_references is None
    assert apps.reads == 1  # a missing owner is read once too, not before every write
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
    with pytest.raises(RuntimeError, match="updating Lease ns/agents: 500"):
        lease.update(record("a", version="1"))
    with pytest.raises(RuntimeError, match="deleting Lease ns/agents: 500"):
        lease.delete(record("a", version="1"))


def test_without_fakes_the_lease_calls_go_through_the_api_client_it_was_given():
    api = client.ApiClient()
    lease = KubeLease(api, namespace="ns", name="agents")
    assert lease.coordination.api_client is api and lease.apps.api_client is api


def test_a_lease_written_by_hand_without_holder_times_or_transitions_reads_as_released_and_zero():
    """kubectl can create a Lease with an empty spec: nobody holds it (so a candidate takes it at once), and what is
    missing reads as zero, not as something an agent wrote."""
    api = FakeCoordination()
    api.leases[("ns", "agents")] = client.V1Lease(metadata=client.V1ObjectMeta(name="agents"), spec=client.V1LeaseSpec())
    assert kube_lease(api).get() == LeaseRecord("", 0.0, 0.0, 0.0, 0, "", "")


def test_a_lease_duration_under_a_second_is_written_as_one_the_least_the_api_server_takes():
    api = FakeCoordination()
    kube_lease(api).create(LeaseRecord("a", 0.4, 0.0, 0.0, 0))
    assert api.leases[("ns", "agents")].spec.lease_duration_seconds == 1


class WatchedLease(FakeCoordination):
    """FakeCoordination with the watch KubeLease.wait_released opens: `events` (type, holder) are what the API
    server sends on it, each the Lease as it then is, or ("ERROR", code); then the watch ends (its timeout).
    The watch's arguments are kept for the test to read."""

    def __init__(self, events):
        super().__init__()
        self.events = events
        self.watches = []

    def list_namespaced_lease(self, namespace, **kwargs) -> client.V1LeaseList:
        import json

        self.watches.append((namespace, kwargs))
        lines = []
        for kind, what in self.events:
            if kind == "ERROR":
                obj = {"kind": "Status", "code": what, "reason": "Expired", "message": "too old resource version"}
            else:
                obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                       "metadata": {"name": "agents", "namespace": namespace, "resourceVersion": "8"},
                       "spec": {"holderIdentity": what} if what else {}}
            lines.append((json.dumps({"type": kind, "object": obj}) + "\n").encode())

        class Response:
            def stream(self, amt=None, decode_content=False):
                yield from lines

            def close(self):
                pass

            def release_conn(self):
                pass
        return Response()


@pytest.mark.parametrize(("events", "released"), [
    ([("MODIFIED", "a"), ("MODIFIED", "")], True),  # renewed, then released: its holder cleared
    ([("MODIFIED", "a"), ("DELETED", "a")], True),  # renewed, then deleted (as the elector releases it)
    ([("MODIFIED", "a"), ("MODIFIED", "a")], False),  # only renewals until the watch's timeout
])
def test_waiting_for_the_release_watches_the_named_lease_from_the_version_seen_until_it_is_freed(events, released):
    api = WatchedLease(events)
    assert kube_lease(api).wait_released("7", 2.4) is released
    assert api.watches == [("ns", {"field_selector": "metadata.name=agents", "resource_version": "7", "timeout_seconds": 2,
                                   "_request_timeout": 2.4 + 4.0, "watch": True, "_preload_content": False})]


def test_a_wait_shorter_than_a_second_asks_the_api_server_for_one_and_an_expired_version_is_an_error_naming_it():
    api = WatchedLease([])
    assert kube_lease(api).wait_released("7", 0.3) is False
    assert api.watches[0][1]["timeout_seconds"] == 1  # the least the API server takes
    api = WatchedLease([("ERROR", 410)])
    with pytest.raises(RuntimeError, match="watching Lease ns/agents: 410 Expired: too old resource version"):
        kube_lease(api).wait_released("7", 2.0)
