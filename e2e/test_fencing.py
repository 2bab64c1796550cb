"""Work Pods fenced by the leadership, on a real cluster with the chart's defaults.

The chart's ValidatingAdmissionPolicy (clusterAgent.workPodFencing; its param the release's
WorkFence, which the leader writes before its first item) admits a work Pod only when its token
(annotations gpu-agent.io/leader, lease-uid, lease-transitions) is the Lease's leadership now: a Pod
made with a stale token (an earlier transition, another holder, another Lease's uid) is refused with
403 and a message naming both leaderships; one with the current token, and a work-labelled Pod with
no token (a person's), are admitted. A real item's Pod carries the Lease's
token and the finalizer the agent keeps until the ack. A work Pod deleted by hand while it runs is
a run: its item is acknowledged once, its Pod released and gone, and no second Pod made (UIDs from
the API server's watch, started before the enqueue)."""

from __future__ import annotations

import json
import time
import uuid

from kubernetes import client

from e2e.helpers import IMAGE, admission, wait_until
from e2e.release import WAIT, Release, WorkPods, enqueue, items
from gpu_agent.mechanisms.queues.pod_executor import pod_name

FINALIZER = "gpu-agent.io/work-item"
LEADER, LEASE_UID, TRANSITIONS = "gpu-agent.io/leader", "gpu-agent.io/lease-uid", "gpu-agent.io/lease-transitions"
RELEASE_PATCH = {"metadata": {"$deleteFromPrimitiveList/finalizers": [FINALIZER]}}


def token(lease: client.V1Lease) -> dict[str, str]:
    """The Lease's fencing token as a work Pod's annotations (null leaseTransitions is 0)."""
    return {LEADER: lease.spec.holder_identity, LEASE_UID: lease.metadata.uid,
            TRANSITIONS: str(lease.spec.lease_transitions or 0)}


def work_pod(release: Release, name: str, marks: dict[str, str] | None) -> dict:
    """A Pod the policy's binding selects (work-item and instance labels), asking no GPU."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "labels": {FINALIZER: "true", "app.kubernetes.io/instance": release.name},
        "finalizers": [FINALIZER], **({"annotations": marks} if marks is not None else {})},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0, "containers": [{
            "name": "c", "image": IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "600"]}]}}


def create(core, release: Release, name: str, marks: dict[str, str] | None, dry_run: bool = False) -> tuple[int, str]:
    """(201, "") when admitted, else (status, the API server's message). `dry_run`: admission only, nothing made."""
    return admission(lambda: core.create_namespaced_pod(release.namespace, work_pod(release, name, marks),
                                                        **({"dry_run": "All"} if dry_run else {})))


def release_and_delete(core, namespace: str, name: str) -> None:
    core.patch_namespaced_pod(name, namespace, RELEASE_PATCH, _content_type="application/strategic-merge-patch+json")
    core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)


def gone(core, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
        return False
    except client.ApiException as e:
        return e.status == 404


def queue(release: Release) -> dict[str, dict]:
    out = release.control_plane("import json; print(json.dumps(c.list_items(t)))")
    return {i["idempotencyKey"]: i for i in json.loads(out.strip().splitlines()[-1])}


def test_work_pods_are_admitted_only_under_the_leases_current_token_and_a_pod_deleted_while_it_runs_is_one_run(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    fake_gpus.set(2)
    release = Release(api, core, apps, kubeconfig, namespace, name="fence")
    leases = client.CoordinationV1Api(api)
    lease_name = f"{release.fullname}-cluster-agent"
    figures = []
    try:
        release.install(*WAIT)
        wait_until(lambda: (release.healthz()[1] or {}).get("active"), 60, "the cluster agent active")
        lease = leases.read_namespaced_lease(lease_name, namespace)
        current = token(lease)
        assert current[LEADER] == release.agent_pod(), current
        figures.append(f"the Lease: {current}")

        # 1. Stale tokens are refused by the API server, naming the fencing; the current one is admitted.
        stale = {
            "an earlier transition": {**current, TRANSITIONS: str(int(current[TRANSITIONS]) - 1)},
            "another holder": {**current, LEADER: "gpu-agent-deposed-0"},
            "another Lease's uid": {**current, LEASE_UID: str(uuid.uuid4())},
        }
        for i, (what, marks) in enumerate(stale.items()):
            status, message = create(core, release, f"fence-stale-{i}", marks)
            figures.append(f"{what}: {status} {message}")
            assert status == 403, figures[-1]
            assert "work pod fenced: created under leadership " + marks[LEADER] in message, figures[-1]
            assert f"the fence now names {current[LEADER]} (lease uid {current[LEASE_UID]}, transition " \
                   f"{current[TRANSITIONS]})" in message, figures[-1]
            assert gone(core, namespace, f"fence-stale-{i}")
        status, message = create(core, release, "fence-current", current)
        assert status == 201, f"the current token was refused: {status} {message}"
        status, message = create(core, release, "fence-no-token", None)  # a person's work-labelled Pod
        assert status == 201, f"a work-labelled Pod without a token was refused: {status} {message}"
        for name in ("fence-current", "fence-no-token"):
            release_and_delete(core, namespace, name)
        wait_until(lambda: gone(core, namespace, "fence-current") and gone(core, namespace, "fence-no-token"), 30,
                   "the admitted Pods released and deleted")

        # 2. A real item's Pod carries the Lease's token and the finalizer while it exists.
        pods = WorkPods(core, namespace)  # watching before the enqueue: every UID each name ever had
        enqueue(release, ["fence-token"], seconds=3)
        real = pod_name("fence-token")

        pod = wait_until(lambda: _read(core, namespace, real), 30, f"the item's Pod {real}")
        lease = leases.read_namespaced_lease(lease_name, namespace)
        on_pod = pod.metadata.annotations or {}
        assert {k: on_pod.get(k) for k in current} == token(lease), (on_pod, token(lease))
        assert FINALIZER in (pod.metadata.finalizers or []), pod.metadata.finalizers
        figures.append(f"{real}: finalizers {pod.metadata.finalizers}, token {[on_pod[k] for k in current]}")
        wait_until(lambda: queue(release)["fence-token"]["state"] == "done", 60, "the item done")
        wait_until(lambda: gone(core, namespace, real), 30, "its Pod released and deleted after the ack")

        # 3. Its Pod deleted by hand while it runs: a run. Acknowledged once, no second Pod.
        enqueue(release, ["fence-deleted"], seconds=30)
        victim = pod_name("fence-deleted")

        def running_pod():
            p = _read(core, namespace, victim)
            return p if p is not None and any(c.state.running for c in p.status.container_statuses or []) else None

        running = wait_until(running_pod, 60, f"the item's Pod {victim} running")
        uid = running.metadata.uid
        deleted_at = time.monotonic()
        core.delete_namespaced_pod(victim, namespace)
        held = wait_until(lambda: (lambda p: p if p is not None and p.metadata.deletion_timestamp else None)(
            _read(core, namespace, victim)), 10, "the deleted Pod held by its finalizer (deletionTimestamp set)")
        assert FINALIZER in (held.metadata.finalizers or []) and held.metadata.uid == uid
        wait_until(lambda: queue(release)["fence-deleted"]["state"] == "done", 60, "the deleted Pod's item acknowledged")
        acked = time.monotonic() - deleted_at
        wait_until(lambda: gone(core, namespace, victim), 30, "the deleted Pod gone (released after the ack)")
        # Nothing makes it again: the item stays done and no Pod of that name appears for 5 s.
        quiet_from = time.monotonic()
        while time.monotonic() - quiet_from < 5:
            assert gone(core, namespace, victim), "a second Pod for the deleted item's name"
            time.sleep(0.5)
        item = queue(release)["fence-deleted"]
        pods.stop()
        assert pods.complete(), pods.gaps
        executions = pods.executions()
        assert item["state"] == "done" and item["deliveries"] == 1 and item.get("failedAttempts", 0) == 0, item
        assert pods.uids.get(victim) == {uid}, pods.uids.get(victim)
        assert executions.get(real) == 1, executions
        assert set(items(release).values()) == {"done"}
        figures.append(f"{victim} deleted while running: item done {acked:.1f} s later, deliveries "
                       f"{item['deliveries']}, failed attempts {item.get('failedAttempts', 0)}, UIDs seen {len(pods.uids[victim])}")

        # 4. No fence, nobody has led since: with the agent scaled to 0 (the leader deletes the Lease as it stops) and
        # the WorkFence deleted, the last leader's token is refused, and so is a work Pod without one (the binding's
        # parameterNotFoundAction: Deny). The fence outlives a leader that stops (its successor overwrites it before
        # its first item): the Deployment owns it.
        fences = client.CustomObjectsApi(api)
        fence = fences.get_namespaced_custom_object("gpu-agent.io", "v1alpha1", namespace, "workfences", lease_name)
        assert fence["spec"] == {"holder": current[LEADER], "leaseUid": current[LEASE_UID],
                                 "leaseTransitions": int(current[TRANSITIONS])}, fence
        assert [o["kind"] for o in fence["metadata"]["ownerReferences"]] == ["Deployment"], fence["metadata"]
        apps.patch_namespaced_deployment_scale(lease_name, namespace, {"spec": {"replicas": 0}})
        wait_until(lambda: not [x for x in leases.list_namespaced_lease(namespace).items if x.metadata.name == lease_name],
                   60, "the Lease deleted by the stopping leader")
        fences.delete_namespaced_custom_object("gpu-agent.io", "v1alpha1", namespace, "workfences", lease_name)
        wait_until(lambda: create(core, release, "fence-probe", None, dry_run=True)[0] != 201, 10,
                   "the policy's copy of the fence gone (a dry run refused)")
        for name, marks in (("fence-leaderless", token(lease)), ("fence-leaderless-no-token", None)):
            status, message = create(core, release, name, marks)
            figures.append(f"no Lease, {name}: {status} {message}")
            # a binding without its param is a configuration error: 422 Invalid, naming the missing param
            assert status == 422 and "no params found" in message and gone(core, namespace, name), figures[-1]
        print("\n" + "\n".join(figures))
    finally:
        release.uninstall_if_installed()
        fake_gpus.set(0)


def _read(core, namespace: str, name: str):
    try:
        return core.read_namespaced_pod(name, namespace)
    except client.ApiException:
        return None
