"""Each cluster's identity at the reference control plane (issue 48, part 6), over real HTTP on loopback with an
injected clock: a cluster with a registration token of its own is registered and deregistered with that token alone
(one cluster's token never acts for another, nor the shared token for it; 403 naming the fix); a new token takes over
at its first use; an admin resets it. An agent's earlier credentials are retired when a registration naming it
(`holder`) or a renewal gives it a new one: the newest of them after credentialOverlap, the others at once, so at
most two of an agent's work at a time, while another replica's are left alone."""

import pytest
import requests

from gpu_agent.foundations.control_plane_client import ControlPlaneClient, ControlPlaneError
from gpu_agent.foundations.secrets import Secret
from tests.unit.test_control_plane import ADMIN, INV, REG, Clock, start

OVERLAP = 60.0  # the control plane's default credentialOverlap


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def cp(tmp_path, clock):
    server = start(tmp_path / "cp.sqlite", clock, ttl=3600.0)
    yield server, ControlPlaneClient(server.url, timeout=5)
    server.stop()


def refused(call, status=403):
    with pytest.raises(ControlPlaneError) as e:
        call()
    assert e.value.kind == "unauthorized" and e.value.status == status, e.value
    return str(e.value)


def registered(client):
    return {r["clusterId"]: r for r in client.status(ADMIN)["registrations"]}


def works(client, credential):
    """Whether the control plane takes the credential (a lease call: None, the queue being empty)."""
    try:
        client.lease(credential, 5)
    except ControlPlaneError as e:
        assert e.status == 401, e
        return False
    return True


# ---- identity ------------------------------------------------------------------------------------

def test_one_clusters_token_can_neither_register_nor_deregister_another_and_the_other_keeps_working(cp):
    _, client = cp
    token_a, token_b = client.issue_cluster_token(ADMIN, "a"), client.issue_cluster_token(ADMIN, "b")
    client.register(token_a, "a", 1, INV)
    cred_b = client.register(token_b, "b", 1, INV).credential.token
    before = registered(client)["b"]

    said = refused(lambda: client.deregister(token_a, "b"))
    assert "belongs to cluster 'a', not to 'b'" in said
    said = refused(lambda: client.register(token_a, "b", 7, INV))
    assert "belongs to cluster 'a', not to 'b'" in said
    # Nor may the shared token act for a cluster whose own token is in use; the error says what to do.
    for call in (lambda: client.deregister(REG, "a"), lambda: client.register(REG, "a", 7, INV)):
        said = refused(call)
        assert "cluster 'a' has a registration token of its own" in said
        assert "POST /admin/clusters/a/token" in said and "DELETE /admin/clusters/a/token" in said
    assert REG.reveal() not in said and token_a.reveal() not in said  # no secret in any refusal

    after = registered(client)["b"]
    assert after == before and after["generation"] == 1  # untouched
    assert works(client, cred_b)
    # Its own token does both, and the cluster's binding outlives its deregistration.
    client.deregister(token_b, "b")
    assert "b" not in registered(client) and not works(client, cred_b)
    client.register(token_b, "b", 2, INV)
    refused(lambda: client.register(REG, "b", 3, INV))


def test_the_shared_token_still_acts_for_a_cluster_without_its_own_token(cp):
    _, client = cp
    client.register(REG, "legacy", 1, INV)
    client.register(REG, "legacy", 2, INV)
    client.deregister(REG, "legacy")
    assert "legacy" not in registered(client)
    token = client.issue_cluster_token(ADMIN, "other")
    refused(lambda: client.register(token, "legacy", 1, INV))  # another cluster's token: never
    client.register(token, "other", 1, INV)
    client.register(REG, "legacy", 3, INV)  # a cluster bound to its token binds nobody else


def test_a_new_token_takes_over_at_its_first_use_and_an_admin_can_reset_the_binding(cp):
    _, client = cp
    client.register(REG, "c", 1, INV)
    first = client.issue_cluster_token(ADMIN, "c")
    client.register(REG, "c", 2, INV)  # not used yet: the shared token, what the cluster used before, still works
    client.register(first, "c", 3, INV)  # its first use binds the cluster to it
    refused(lambda: client.register(REG, "c", 4, INV))

    second = client.issue_cluster_token(ADMIN, "c")  # rotation: the Secret is updated after this
    client.register(first, "c", 4, INV)  # the one before still works until the new one is used
    client.register(second, "c", 5, INV)
    assert "token not accepted" in refused(lambda: client.register(first, "c", 6, INV), 401)
    refused(lambda: client.register(REG, "c", 6, INV))

    assert client.reset_cluster_token(ADMIN, "c") is True
    client.register(REG, "c", 6, INV)  # the shared token acts for it again
    refused(lambda: client.register(second, "c", 7, INV), 401)
    assert client.reset_cluster_token(ADMIN, "c") is False
    assert registered(client)["c"]["generation"] == 6


def test_the_admin_routes_take_the_admin_token_only_and_name_a_bad_cluster_id(cp):
    server, client = cp
    token = client.issue_cluster_token(ADMIN, "c")
    for who, status in ((REG, 403), (token, 403), (Secret("nope"), 401)):
        refused(lambda who=who: client.issue_cluster_token(who, "c"), status)
        refused(lambda who=who: client.reset_cluster_token(who, "c"), status)
    admin = {"Authorization": "Bearer " + ADMIN.reveal()}
    for bad in ("-c", "c_", "a%20b", "x" * 254):
        for method in ("POST", "DELETE"):
            r = requests.request(method, f"{server.url}/admin/clusters/{bad}/token", headers=admin, timeout=5)
            assert r.status_code == 422 and r.json()["error"].startswith("path parameter 'clusterId': "), (bad, r.text)
    # A cluster's own token is no credential, and a credential no registration token.
    cred = client.register(token, "c", 1, INV).credential.token
    refused(lambda: client.lease(token, 5))
    refused(lambda: client.register(cred, "c", 2, INV))
    doc = requests.get(server.url + "/openapi.json", headers=admin, timeout=5).json()
    path = doc["paths"]["/admin/clusters/{clusterId}/token"]
    assert set(path) == {"post", "delete"} and path["post"]["parameters"][0]["schema"]["type"] == "string"
    assert "403" in doc["paths"]["/v1/deregister"]["post"]["responses"]


@pytest.mark.parametrize("holder", ["", "with space", "x" * 254, 7])
def test_a_bad_holder_is_refused_naming_the_field(cp, holder):
    server, _ = cp
    r = requests.post(server.url + "/v1/register", json={"clusterId": "c", "generation": 1, "gpus": [], "holder": holder},
                      headers={"Authorization": "Bearer " + REG.reveal()}, timeout=5)
    assert r.status_code == 422 and "'holder'" in r.json()["error"], r.text


def test_a_clusters_token_is_stored_hashed(tmp_path, clock):
    server = start(tmp_path / "cp.sqlite", clock)
    token = ControlPlaneClient(server.url).issue_cluster_token(ADMIN, "c").reveal()
    server.stop()
    assert token.encode() not in b"".join(p.read_bytes() for p in tmp_path.iterdir())


# ---- credential chains ---------------------------------------------------------------------------

def test_two_renewals_leave_two_credentials_and_the_oldest_is_refused_after_the_overlap(cp, clock):
    server, client = cp
    first = client.register(REG, "c", 1, INV, holder="pod-a").credential.token
    second = client.renew(first).token
    assert works(client, first) and works(client, second)  # the overlap: calls under way with the first land
    clock.now += 10
    third = client.renew(second).token
    assert server.cp.store.valid_credentials("c") == 2  # the first stopped: it was two credentials old
    assert "expired" in refused(lambda: client.lease(first, 5), 401)
    clock.now += OVERLAP - 0.5
    assert works(client, second) and works(client, third)
    clock.now += 1
    assert "expired" in refused(lambda: client.lease(second, 5), 401)  # like an expired one
    assert server.cp.store.valid_credentials("c") == 1 and works(client, third)


def test_periodic_re_registrations_keep_at_most_two_of_an_agents_credentials_and_leave_another_replicas_alone(cp, clock):
    server, client = cp
    standby = client.register(REG, "c", 1, INV, holder="pod-b").credential.token
    leader = []
    for generation in range(1, 21):  # twenty minutes of re-registrations, one a minute (reregistrationInterval)
        leader.append(client.register(REG, "c", generation, INV, holder="pod-a").credential.token)
        assert server.cp.store.valid_credentials("c") <= 3  # two of pod-a's and pod-b's one
        clock.now += 30
        assert works(client, leader[-1]) and (len(leader) < 2 or works(client, leader[-2]))
        clock.now += 30
    assert server.cp.store.valid_credentials("c") == 2  # pod-a's newest and pod-b's
    assert not any(works(client, old) for old in leader[:-1])
    assert works(client, standby)  # another replica of the cluster: its credential lives to its own expiry


def test_a_registration_without_a_holder_retires_nothing_as_before(cp):
    server, client = cp
    creds = [client.register(REG, "c", g, INV).credential.token for g in (1, 2, 3)]
    assert all(works(client, c) for c in creds) and server.cp.store.valid_credentials("c") == 3


def test_a_restarted_agent_under_the_same_name_retires_what_its_predecessor_held(cp, clock):
    server, client = cp
    old = client.renew(client.register(REG, "c", 1, INV, holder="pod-a").credential.token).token  # then it died
    clock.now += 5
    new = client.register(REG, "c", 1, INV, holder="pod-a").credential.token  # no credential in hand: a fresh start
    clock.now += OVERLAP
    assert not works(client, old) and works(client, new) and server.cp.store.valid_credentials("c") == 1
