"""The WorkFence the leader writes its token into (mechanisms/leadership/kube_fence.py), against an in-memory
custom-objects API that keeps resourceVersions as the API server does: a write names the version it read and
conflicts when the object moved since."""

import asyncio
from types import SimpleNamespace

import pytest
from kubernetes import client

from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.mechanisms.leadership.kube_fence import FenceNotWritten, KubeWorkFence, token_of


class Store:
    def __init__(self):
        self.obj, self.version, self.writes = None, 0, []
        self.before_write = None  # called between the agent's read and its write: someone else's write
        self.timeouts = []  # every call's _request_timeout

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, _request_timeout):
        self.timeouts.append(_request_timeout)
        if self.obj is None:
            raise client.ApiException(status=404, reason="Not Found")
        return {**self.obj, "metadata": {**self.obj["metadata"], "resourceVersion": str(self.version)}}

    def _write(self, body, create):
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None
            hook()
        if create and self.obj is not None:
            raise client.ApiException(status=409, reason="AlreadyExists")
        if not create and body["metadata"].get("resourceVersion") != str(self.version):
            raise client.ApiException(status=409, reason="Conflict")
        self.obj, self.version = body, self.version + 1
        self.writes.append(body["spec"])

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, _request_timeout):
        assert (group, version, plural) == ("gpu-agent.io", "v1alpha1", "workfences")
        self.timeouts.append(_request_timeout)
        self._write(body, create=True)

    def replace_namespaced_custom_object(self, group, version, namespace, plural, name, body, _request_timeout):
        self.timeouts.append(_request_timeout)
        self._write(body, create=False)


class Apps:
    def __init__(self, error=None):
        self.error = error
        self.timeouts = []  # each read's _request_timeout

    def read_namespaced_deployment(self, name, namespace, _request_timeout):
        self.timeouts.append(_request_timeout)
        if self.error is not None:
            raise self.error
        return SimpleNamespace(metadata=SimpleNamespace(name=name, uid="dep-uid"))


class Fence:
    """The fence with its calls made inline (each one still a call of its own): `publish` runs to its end."""

    def __init__(self, store, apps=None, owner="ga-cluster-agent"):
        self.fence = KubeWorkFence(None, namespace="ns", name="ga-cluster-agent", custom=store, apps=apps or Apps(),
                                   **({"owner_deployment": owner} if owner is not None else {}))

    def publish(self, token, still_leading):
        async def inline(fn, *args, **kwargs):
            return fn(*args, **kwargs)
        return asyncio.run(self.fence.publish(token, still_leading, inline))


def fence(store, apps=None, owner="ga-cluster-agent"):
    """`owner`: the Deployment that owns the fence; None: the argument left out."""
    return Fence(store, apps, owner)


A1, B2 = LeaderToken("agent-a", "lease-uid", 1), LeaderToken("agent-b", "lease-uid", 2)


def test_the_leader_creates_the_fence_owned_by_the_deployment_then_writes_only_a_new_token():
    store = Store()
    assert fence(store).publish(A1, lambda: True)
    meta = {"name": "ga-cluster-agent", "namespace": "ns", "labels": {"app.kubernetes.io/managed-by": "gpu-agent"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "ga-cluster-agent", "uid": "dep-uid"}]}
    assert store.obj == {"apiVersion": "gpu-agent.io/v1alpha1", "kind": "WorkFence", "metadata": meta,  # no version: a create
                         "spec": {"holder": "agent-a", "leaseUid": "lease-uid", "leaseTransitions": 1}}
    assert store.writes == [{"holder": "agent-a", "leaseUid": "lease-uid", "leaseTransitions": 1}]
    assert not fence(store).publish(A1, lambda: True) and len(store.writes) == 1  # already there: no write
    assert fence(store).publish(B2, lambda: True)
    assert store.obj["metadata"] == {**meta, "resourceVersion": "1"}  # the update names the version it read
    assert store.writes[-1] == {"holder": "agent-b", "leaseUid": "lease-uid", "leaseTransitions": 2}
    assert store.timeouts == [5.0] * 5  # read, create, read, read, replace: each bounded by the request timeout


def test_an_agent_that_no_longer_holds_the_lease_never_writes_and_says_so():
    store = Store()
    fence(store).publish(B2, lambda: True)
    with pytest.raises(FenceNotWritten, match="no longer holds the Lease"):
        fence(store).publish(A1, lambda: False)
    assert store.writes == [{"holder": "agent-b", "leaseUid": "lease-uid", "leaseTransitions": 2}]


def test_a_write_between_the_read_and_the_write_is_a_conflict_read_again_so_the_newer_token_is_seen():
    """A deposed leader read the fence, paused; its successor wrote; its conditional write conflicts, it reads
    again and (no longer leading by its own clock by then) writes nothing over the successor's token."""
    store = Store()
    fence(store).publish(A1, lambda: True)
    leading = iter([True, False])

    def successor_writes():  # what the successor's own publish writes, landing between our read and our write
        spec = {"holder": "agent-b", "leaseUid": "lease-uid", "leaseTransitions": 2}
        store.obj, store.version = {"metadata": {"name": "ga-cluster-agent"}, "spec": spec}, store.version + 1
        store.writes.append(spec)

    store.before_write = successor_writes
    with pytest.raises(FenceNotWritten, match="no longer holds the Lease"):
        fence(store).publish(LeaderToken("agent-a", "lease-uid", 3), lambda: next(leading))
    assert store.writes[-1]["holder"] == "agent-b"


def test_a_missing_crd_or_role_names_what_to_do():
    class Missing(Store):
        def create_namespaced_custom_object(self, *args, **kwargs):
            raise client.ApiException(status=404, reason="Not Found")

    with pytest.raises(FenceNotWritten) as missing:
        fence(Missing()).publish(A1, lambda: True)
    assert str(missing.value) == (
        "creating WorkFence ns/ga-cluster-agent: 404 Not Found; the WorkFence CRD (workfences.gpu-agent.io) is not "
        "installed: the chart's crds hook installs it (helm upgrade), or set clusterAgent.workPodFencing=false")

    class Forbidden(Store):
        def get_namespaced_custom_object(self, *args, **kwargs):
            raise client.ApiException(status=403, reason="Forbidden")

    with pytest.raises(FenceNotWritten) as forbidden:
        fence(Forbidden()).publish(A1, lambda: True)
    assert str(forbidden.value) == ("reading WorkFence ns/ga-cluster-agent: 403 Forbidden; the cluster agent's Role "
                                    "must allow workfences create, get and update (the chart's does)")

    class Failing(Store):
        def get_namespaced_custom_object(self, *args, **kwargs):
            raise client.ApiException(status=500, reason="Internal Server Error")

    with pytest.raises(FenceNotWritten) as failing:  # no hint, and no message of the API server's to add
        fence(Failing()).publish(A1, lambda: True)
    assert str(failing.value) == "reading WorkFence ns/ga-cluster-agent: 500 Internal Server Error"


def test_the_crds_own_refusal_of_a_lower_transition_is_told_in_the_api_servers_words():
    """What the CRD's transition rule answers a write that goes back on the same Lease (422, its message)."""
    import json

    class Ruled(Store):
        def _write(self, body, create):
            old = (self.obj or {}).get("spec")
            new = body["spec"]
            if old and old["leaseUid"] == new["leaseUid"] and new["leaseTransitions"] < old["leaseTransitions"]:
                e = client.ApiException(status=422, reason="Unprocessable Entity")
                e.body = json.dumps({"message": "spec: Forbidden: spec.leaseTransitions may not go back"})
                raise e
            super()._write(body, create)

    store = Ruled()
    fence(store).publish(B2, lambda: True)
    with pytest.raises(FenceNotWritten) as refused:
        fence(store).publish(A1, lambda: True)
    assert str(refused.value) == ("updating WorkFence ns/ga-cluster-agent: 422 Unprocessable Entity: spec: Forbidden: "
                                  "spec.leaseTransitions may not go back")


def test_a_fence_changed_under_every_write_gives_up_after_three_saying_so():
    class Busy(Store):  # someone writes between each of our reads and our write
        def _write(self, body, create):
            self.version += 1
            raise client.ApiException(status=409, reason="Conflict")

    store = Busy()
    store.obj = {"metadata": {"name": "ga-cluster-agent"}, "spec": {"holder": "agent-b", "leaseUid": "lease-uid",
                                                                   "leaseTransitions": 2}}
    with pytest.raises(FenceNotWritten) as busy:
        fence(store).publish(A1, lambda: True)
    assert str(busy.value) == "WorkFence ns/ga-cluster-agent changed under every one of 3 writes"
    assert store.timeouts.count(5.0) == 6  # three reads, three writes


def test_without_an_owner_deployment_the_fence_is_unowned_and_no_deployment_is_read():
    store, apps = Store(), Apps()
    fence(store, apps, owner=None).publish(A1, lambda: True)
    assert "ownerReferences" not in store.obj["metadata"] and apps.timeouts == []


def test_a_missing_owner_leaves_the_fence_unowned_read_once_and_other_errors_name_the_deployment():
    store, apps = Store(), Apps(error=client.ApiException(status=404, reason="Not Found"))
    owned = fence(store, apps)
    owned.publish(A1, lambda: True)
    owned.publish(B2, lambda: True)
    assert "ownerReferences" not in store.obj["metadata"]
    assert apps.timeouts == [5.0]  # read once, bounded by the request timeout
    with pytest.raises(FenceNotWritten) as forbidden:
        fence(Store(), Apps(error=client.ApiException(status=403, reason="Forbidden"))).publish(A1, lambda: True)
    assert str(forbidden.value) == "reading Deployment ns/ga-cluster-agent (the WorkFence's owner): 403 Forbidden"


def test_without_fakes_the_fence_calls_go_through_the_api_client_it_was_given():
    api = client.ApiClient()
    work_fence = KubeWorkFence(api, namespace="ns", name="f")
    assert work_fence.custom.api_client is api and work_fence.apps.api_client is api


def test_a_fence_missing_fields_reads_them_as_empty_and_zero_and_one_without_a_spec_as_none():
    assert token_of({"spec": {"holder": "agent-a"}}) == LeaderToken("agent-a", "", 0)
    assert token_of({"spec": {"leaseUid": "u", "leaseTransitions": 4}}) == LeaderToken("", "u", 4)
    assert token_of({"metadata": {}}) is None and token_of(None) is None
