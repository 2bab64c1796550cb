"""The WorkFence the leader writes its token into (mechanisms/leadership/kube_fence.py), against an in-memory
custom-objects API that keeps resourceVersions as the API server does: a write names the version it read and
conflicts when the object moved since."""

import asyncio
from types import SimpleNamespace

import pytest
from kubernetes import client

from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.mechanisms.leadership.kube_fence import FenceNotWritten, KubeWorkFence


class Store:
    def __init__(self):
        self.obj, self.version, self.writes = None, 0, []
        self.before_write = None  # called between the agent's read and its write: someone else's write

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, _request_timeout):
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
        self._write(body, create=True)

    def replace_namespaced_custom_object(self, group, version, namespace, plural, name, body, _request_timeout):
        self._write(body, create=False)


class Apps:
    def read_namespaced_deployment(self, name, namespace, _request_timeout):
        return SimpleNamespace(metadata=SimpleNamespace(name=name, uid="dep-uid"))


class Fence:
    """The fence with its calls made inline (each one still a call of its own): `publish` runs to its end."""

    def __init__(self, store):
        self.fence = KubeWorkFence(None, namespace="ns", name="ga-cluster-agent", owner_deployment="ga-cluster-agent",
                                   custom=store, apps=Apps())

    def publish(self, token, still_leading):
        async def inline(fn, *args, **kwargs):
            return fn(*args, **kwargs)
        return asyncio.run(self.fence.publish(token, still_leading, inline))


def fence(store):
    return Fence(store)


A1, B2 = LeaderToken("agent-a", "lease-uid", 1), LeaderToken("agent-b", "lease-uid", 2)


def test_the_leader_creates_the_fence_owned_by_the_deployment_then_writes_only_a_new_token():
    store = Store()
    assert fence(store).publish(A1, lambda: True)
    assert store.obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "ga-cluster-agent", "uid": "dep-uid"}]
    assert store.writes == [{"holder": "agent-a", "leaseUid": "lease-uid", "leaseTransitions": 1}]
    assert not fence(store).publish(A1, lambda: True) and len(store.writes) == 1  # already there: no write
    assert fence(store).publish(B2, lambda: True)
    assert store.writes[-1] == {"holder": "agent-b", "leaseUid": "lease-uid", "leaseTransitions": 2}


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

    with pytest.raises(FenceNotWritten, match=r"workfences\.gpu-agent\.io\) is not installed.*workPodFencing=false"):
        fence(Missing()).publish(A1, lambda: True)

    class Forbidden(Store):
        def get_namespaced_custom_object(self, *args, **kwargs):
            raise client.ApiException(status=403, reason="Forbidden")

    with pytest.raises(FenceNotWritten, match="Role must allow workfences create, get and update"):
        fence(Forbidden()).publish(A1, lambda: True)


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
    with pytest.raises(FenceNotWritten, match=r"422 Unprocessable Entity: spec: Forbidden: spec\.leaseTransitions may not go back"):
        fence(store).publish(A1, lambda: True)
