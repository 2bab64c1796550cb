"""Ready never hides a dead work path, on the user's path: install, uninstall, install again.

Kubernetes up to 1.36.2 stops watching a built-in admission-policy param kind for good once the last
binding naming it is gone (kubernetes#130887). The chart's fencing policy took the Lease as its param,
so an uninstall of the last release left every later release with each work Pod refused while the agent
said Ready. The param is now a WorkFence of the chart's own (a custom kind's watch is made afresh), and
the leader proves its work path with dry runs at each leadership and after any refusal that is not the
item's, turning its queues NotReady, naming why, when that lasts 10 s.

This test first puts the cluster in the state that broke the old chart: it checks that no binding names
a Lease param, then makes and deletes one (the trigger), and proves the Lease watch dead with a probe
policy of its own that finds no Lease although the Lease exists. Then, on that cluster: install ga with
the defaults, 20 items done; uninstall; install ha with replicas=2, 20 items done; a policy of the test's
that refuses every work Pod turns ha's leader NotReady with the policy's message within the bound (the
items back in the queue, uncounted; an Event on the Deployment), and its removal turns it Ready and runs
them."""

from __future__ import annotations

import json
import time

from kubernetes import client

from e2e.conftest import remove_lease_param_anchor
from e2e.helpers import pod_http_get, wait_until
from e2e.release import CA, WAIT, Release, enqueue, items

REFUSAL = "e2e refuses every work pod of this release"


def lease_param_bindings(adm: client.AdmissionregistrationV1Api) -> list[str]:
    lease_policies = {p.metadata.name for p in adm.list_validating_admission_policy().items
                      if p.spec.param_kind is not None and p.spec.param_kind.kind == "Lease"}
    return [b.metadata.name for b in adm.list_validating_admission_policy_binding().items
            if b.spec.policy_name in lease_policies]


def lease_probe(name: str, namespace: str, lease: str) -> tuple[dict, dict]:
    """A policy with a Lease param that admits everything it finds its param for, and a binding to an existing
    Lease that matches only ConfigMaps carrying this test's label: refused "no params found" only when the API
    server's Lease watch is dead."""
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": name, "labels": {"e2e": "true"}},
              "spec": {"failurePolicy": "Fail", "paramKind": {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"},
                       "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                               "operations": ["CREATE"], "resources": ["configmaps"]}]},
                       "validations": [{"expression": "true"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": name, "labels": {"e2e": "true"}},
               "spec": {"policyName": name, "validationActions": ["Deny"],
                        "paramRef": {"name": lease, "namespace": namespace, "parameterNotFoundAction": "Deny"},
                        "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                                           "objectSelector": {"matchLabels": {name: "probe"}}}}}
    return policy, binding


def deny_work_pods(name: str, release: Release) -> tuple[dict, dict]:
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": name, "labels": {"e2e": "true"}},
              "spec": {"failurePolicy": "Fail",
                       "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                               "operations": ["CREATE"], "resources": ["pods"]}]},
                       "validations": [{"expression": "false", "message": REFUSAL}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": name, "labels": {"e2e": "true"}},
               "spec": {"policyName": name, "validationActions": ["Deny"],
                        "matchResources": {
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": release.namespace}},
                            "objectSelector": {"matchLabels": {"gpu-agent.io/work-item": "true",
                                                               "app.kubernetes.io/instance": release.name}}}}}
    return policy, binding


def delete_policy_binding(adm: client.AdmissionregistrationV1Api, name: str) -> None:
    try:
        adm.delete_validating_admission_policy_binding(name)
    except client.ApiException as e:
        if e.status != 404:
            raise


def delete_policy(adm: client.AdmissionregistrationV1Api, name: str) -> None:
    for delete in (adm.delete_validating_admission_policy_binding, adm.delete_validating_admission_policy):
        try:
            delete(name)
        except client.ApiException as e:
            if e.status != 404:
                raise


def probe_refusal(core: client.CoreV1Api, namespace: str, label: str) -> str:
    """"" when a dry-run ConfigMap the probe binding matches is admitted, else the API server's message."""
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "probe-", "labels": {label: "probe"}}}
    try:
        core.create_namespaced_config_map(namespace, body, dry_run="All")
        return ""
    except client.ApiException as e:
        return json.loads(e.body).get("message", "") if e.body else str(e.status)


def work_pod_refusal(core: client.CoreV1Api, release: Release) -> str:
    """"" when a dry-run work Pod of the release (no token: the fencing policy lets it by) is admitted, else why not."""
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "probe-", "labels": {
        "gpu-agent.io/work-item": "true", "app.kubernetes.io/instance": release.name}},
        "spec": {"containers": [{"name": "c", "image": "localhost/gpu-agent:dev"}]}}
    try:
        core.create_namespaced_pod(release.namespace, body, dry_run="All")
        return ""
    except client.ApiException as e:
        return json.loads(e.body).get("message", "") if e.body else str(e.status)


def refused_for_want_of_the_lease(core: client.CoreV1Api, namespace: str, label: str, within: float) -> str:
    """The probe's refusal naming its missing param, if one comes within `within` seconds; "" when it is admitted
    all along (its Lease found: the watch alive, or the binding not in force yet)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        message = probe_refusal(core, namespace, label)
        if "no params found" in message:
            return message
        time.sleep(0.2)
    return ""


def run_twenty(release: Release, prefix: str) -> tuple[float, float]:
    """Enqueue 20 short items; (seconds to the first work Pod made, seconds to all done), each within its bound."""
    keys = [f"{prefix}-{i}" for i in range(20)]
    started = time.monotonic()
    enqueue(release, keys, seconds=0)
    wait_until(lambda: release.pods("gpu-agent.io/work-item=true"), 5, f"{release.name}: a first work Pod made",
               interval=0.1)
    first = time.monotonic() - started
    wait_until(lambda: all(items(release).get(k) == "done" for k in keys), 30, f"{release.name}: 20 items done")
    return first, time.monotonic() - started


def leader(release: Release) -> tuple[str, int, dict]:
    """(pod, /healthz status, body) of the release's active cluster agent, ("", 0, {}) while none says it is."""
    for pod in release.pods(CA):
        if pod.status.phase != "Running" or pod.metadata.deletion_timestamp is not None:
            continue
        code, body = pod_http_get(release.core, release.namespace, pod.metadata.name, 8080, "healthz")
        if isinstance(body, dict) and body.get("active"):
            return pod.metadata.name, code, body
    return "", 0, {}


def queues(release: Release) -> dict:
    """The leader's `queues` entry of /healthz ({} while no agent leads)."""
    return leader(release)[2].get("components", {}).get("queues", {})


def test_install_uninstall_install_again_runs_work_where_the_lease_watch_is_dead_and_a_refused_path_is_not_ready(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    adm = client.AdmissionregistrationV1Api(api)
    leases = client.CoordinationV1Api(api)
    figures = []
    probe = f"e2e-lease-watch-probe-{namespace}"[:63]
    deny = f"e2e-deny-work-pods-{namespace}"[:63]
    fake_gpus.set(8)
    first, second = Release(api, core, apps, kubeconfig, namespace, name="ga"), None
    try:
        # 1. The state that broke the old chart: nothing binds a Lease param, and the API server's Lease watch is dead.
        # The suite's own anchor, kept while the last stable release's tests run (conftest.ANCHOR), goes first: in one
        # session those sort before this file, and the parallel phase never has it.
        remove_lease_param_anchor(api)
        others = lease_param_bindings(adm)
        assert not others, f"this test needs a cluster where no binding names a Lease param; found {others}"
        # The trigger: the last binding naming a Lease param gone for one policy refresh (about 1 s, a tick of the API
        # server's that nothing shows). The dead watch keeps what it had (a Lease it knew is still found), so each try
        # binds a Lease made after it: refused "no params found" although the Lease exists. Polled to a deadline:
        # first as it is (the watch may have died already, at an earlier uninstall), then after a longer gap each time.
        dead = ""
        for attempt, gap in enumerate((0.0, 1.5, 3.0, 6.0)):
            if gap:
                delete_policy_binding(adm, probe)
                wait_until(lambda: not lease_param_bindings(adm), 10, "no binding names a Lease param")
                time.sleep(gap)  # the refresh tick: no state to poll for
            lease = f"probe-{attempt}"
            leases.create_namespaced_lease(namespace, {"metadata": {"name": lease}, "spec": {"holderIdentity": "nobody"}})
            policy, binding = lease_probe(probe, namespace, lease)
            if not attempt:
                adm.create_validating_admission_policy(policy)
            adm.create_validating_admission_policy_binding(binding)
            dead = refused_for_want_of_the_lease(core, namespace, probe, within=5.0)
            if dead:
                break
        # An API server with the fix (kubernetes#134423) keeps the watch: the rest still runs, and says so.
        figures.append(f"Lease watch dead: the probe, its Lease present, refused: {dead[:160]}" if dead else
                       "Lease watch alive after its last binding went (this API server has kubernetes#130887 fixed)")
        delete_policy(adm, probe)

        # 2. Install with the defaults, work runs; uninstall.
        first.install(*WAIT)
        wait_until(lambda: queues(first).get("reason") == "leasing work", 30, "ga leasing work")
        took = run_twenty(first, "ga")
        figures.append(f"ga (defaults): first work Pod {took[0]:.1f} s after the enqueue, 20 done in {took[1]:.1f} s")
        first.uninstall()

        # 3. Install again, another release, two agents: work runs within the same bounds.
        second = Release(api, core, apps, kubeconfig, namespace, name="ha")
        second.install(*WAIT, "--set", "clusterAgent.replicas=2")
        wait_until(lambda: queues(second).get("reason") == "leasing work", 30, "ha leasing work")
        took = run_twenty(second, "ha")
        figures.append(f"ha (replicas=2) after ga's uninstall: first work Pod {took[0]:.1f} s, 20 done in {took[1]:.1f} s")

        # 4. A policy refusing every work Pod: the leader NotReady naming it within the bound, items back uncounted.
        policy, binding = deny_work_pods(deny, second)
        adm.create_validating_admission_policy(policy)
        adm.create_validating_admission_policy_binding(binding)
        wait_until(lambda: REFUSAL in work_pod_refusal(core, second), 20, "the deny policy in force (a dry run refused)")
        keys = [f"refused-{i}" for i in range(3)]
        enqueued = time.monotonic()
        enqueue(second, keys, seconds=0)
        down = wait_until(lambda: (lambda q: q if q and not q["ready"] else None)(queues(second)), 25,
                          "ha's queues NotReady")
        took_down = time.monotonic() - enqueued
        assert REFUSAL in down["reason"] and down["reason"].startswith("work pods refused: "), down
        pod, code, body = leader(second)
        assert code == 503 and body["components"]["queues"]["ready"] is False, (code, body)
        wait_until(lambda: all(items(second).get(k) == "queued" for k in keys), 15, "the refused items back in the queue")
        listed = json.loads(second.control_plane("import json; print(json.dumps(c.list_items(t)))").strip().splitlines()[-1])
        assert all(i.get("failedAttempts", 0) == 0 for i in listed if i["idempotencyKey"] in keys), listed
        events = wait_until(lambda: [e for e in core.list_namespaced_event(namespace).items
                                     if e.reason == "WorkPodsRefused" and e.involved_object.kind == "Deployment"], 15,
                            "a WorkPodsRefused Event on the Deployment")
        assert REFUSAL in events[0].message, events[0].message
        assert "gpu_agent_work_path_down 1.0" in pod_http_get(core, namespace, pod, 8080, "metrics")[1]
        figures.append(f"deny policy: queues NotReady {took_down:.1f} s after the enqueue: {down['reason'][:140]}")

        delete_policy(adm, deny)
        removed = time.monotonic()
        wait_until(lambda: queues(second).get("ready") is True, 30, "ha's queues Ready again")
        wait_until(lambda: all(items(second).get(k) == "done" for k in keys), 30, "the refused items done")
        figures.append(f"deny policy removed: Ready and 3 items done {time.monotonic() - removed:.1f} s later")
        print("\n" + "\n".join(figures))
    finally:
        delete_policy(adm, probe)
        delete_policy(adm, deny)
        first.uninstall_if_installed()
        if second is not None:
            second.uninstall_if_installed()
        fake_gpus.set(0)
