"""`helm test <release>` on the cluster (issue 50): the chart's test Pod (templates/tests/pod-test.yaml) runs
`gpu-agent chart-test` and passes on a healthy install, its lines saying what it checked; with the control plane
scaled to 0 it fails naming it. A passing test Pod is deleted at once (hook-succeeded), before `helm test --logs`
could read it (helm/helm#9098), so its log is followed from the moment it starts."""

from __future__ import annotations

import re
import threading
import uuid

import pytest
from kubernetes import client

from e2e.helpers import wait_until
from e2e.release import WAIT, Release, helm, items


@pytest.fixture
def release(api, core, apps, kubeconfig, namespace, fake_gpus):
    fake_gpus.set(0)
    r = Release(api, core, apps, kubeconfig, namespace, name=f"ga{uuid.uuid4().hex[:5]}")
    try:
        yield r
    finally:
        r.uninstall_if_installed()


def follow_test_log(core, namespace: str, pod: str) -> tuple[threading.Thread, list[str]]:
    """A thread that waits for the test Pod to start and reads its log until the container exits."""
    lines: list[str] = []

    def follow():
        def started():
            try:
                p = core.read_namespaced_pod(pod, namespace)
            except client.ApiException:
                return None
            return p.status.phase in ("Running", "Succeeded", "Failed") or None
        wait_until(started, 120, f"test Pod {pod} started")
        lines.extend(core.read_namespaced_pod_log(pod, namespace, follow=True, _request_timeout=150).splitlines())

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    return thread, lines


def install_without_gpus(release: Release) -> None:
    """gracefulNoGPU on a cluster without GPUs: every pod runs, the cluster agent live but NotReady (so no --wait,
    which would wait for a Ready that does not come)."""
    release.install("--set", "gracefulNoGPU=true")
    wait_until(lambda: release.all_running(at_least=3), 120, "every pod of the release running")
    wait_until(lambda: all(ready(p) for p in release.pods("app.kubernetes.io/component=control-plane")), 60,
               "the control plane Ready (in its Service)")


def ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def helm_test(release: Release):
    return helm("test", "--kubeconfig", release.kubeconfig, "-n", release.namespace, release.name, "--timeout", "150s",
                check=False)


def test_helm_test_passes_on_a_healthy_install_and_its_log_says_what_it_checked(release, core):
    install_without_gpus(release)
    pod = f"{release.fullname}-test"
    follower, lines = follow_test_log(core, release.namespace, pod)
    r = helm_test(release)
    follower.join(160)
    assert r.returncode == 0, (r.stdout, r.stderr, lines)
    assert re.search(rf"TEST SUITE:\s+{pod}.*?Phase:\s+Succeeded", r.stdout, re.S), r.stdout
    ns, full = release.namespace, release.fullname
    assert lines[0] == f"ok   control plane: https://{full}-control-plane.{ns}.svc:8700/healthz answered 200", lines
    # The cluster agent, NotReady, is out of its Service: asked at its pod's address, named by its pod.
    (agent,) = release.pods("app.kubernetes.io/component=cluster-agent")
    who, ip = f"cluster agent {agent.metadata.name}", agent.status.pod_ip
    assert lines[1] == f"ok   {who} /livez: http://{ip}:8080/livez answered 200 (live)", lines
    # No GPUs at install, gracefulNoGPU on: NotReady is a pass with a note.
    assert lines[2].startswith(f"note {who} /healthz: NotReady because it counts no GPU, which gracefulNoGPU=true "
                               "allows"), lines
    node_lines = [line for line in lines if line.startswith(("ok   node agent ", "FAIL node agent", "note node agents"))]
    node_agents = core.list_namespaced_pod(ns, label_selector=f"app.kubernetes.io/instance={release.name},"
                                                              "app.kubernetes.io/component=node-agent").items
    assert len(node_lines) == len(node_agents) and all(line.startswith("ok   node agent ") for line in node_lines), lines
    assert {p.spec.node_name for p in node_agents} == {line.split()[3].rstrip(":") for line in node_lines}
    # No cluster agent Ready: no work item enqueued (it would wait for GPUs and outlive the test).
    assert "note work item: not run: no cluster agent is Ready" in lines[-2], lines
    assert not [k for k in items(release) if k.startswith("helm-test-")]
    assert lines[-1] == f"chart-test: all {4 + len(node_agents)} checks passed"
    # hook-succeeded: nothing of the test is left.
    assert not core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=test").items


def test_helm_test_fails_naming_the_control_plane_when_it_is_scaled_to_zero(release, core, apps):
    install_without_gpus(release)
    name, ns = f"{release.fullname}-control-plane", release.namespace
    apps.patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": 0}})
    wait_until(lambda: not release.pods("app.kubernetes.io/component=control-plane"), 90, "the control plane's pods gone")
    r = helm_test(release)
    assert r.returncode != 0, r.stdout
    assert re.search(r"Phase:\s+Failed", r.stdout), r.stdout
    # A failed test Pod stays (no hook-failed in its delete policy): its log is the report.
    log = core.read_namespaced_pod_log(f"{release.fullname}-test", ns).splitlines()
    (failed,) = [line for line in log if line.startswith("FAIL control plane: ")]
    assert f"https://{name}.{ns}.svc:8700/healthz did not answer" in failed
    assert f"kubectl -n {ns} scale deploy/{name} --replicas=1" in failed
    assert re.fullmatch(r"chart-test: 1 of \d+ checks failed: control plane", log[-1]), log
    # Back to one replica, the test passes again (before-hook-creation replaces the failed Pod).
    apps.patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": 1}})
    wait_until(lambda: release.control_plane_pod(), 90, "the control plane back")
    assert helm_test(release).returncode == 0


def test_helm_test_runs_one_work_item_end_to_end_where_the_agent_is_ready(release, core, fake_gpus):
    fake_gpus.set(2)
    release.install(*WAIT)
    pod = f"{release.fullname}-test"
    follower, lines = follow_test_log(core, release.namespace, pod)
    r = helm_test(release)
    follower.join(160)
    assert r.returncode == 0, (r.stdout, r.stderr, lines)
    assert any(line.startswith("ok   cluster agent ") and "/healthz: Ready: " in line for line in lines), lines
    (done,) = [line for line in lines if line.startswith("ok   work item: helm-test-")]
    key = done.split()[3]
    # The control plane's own record of it (not the test's word): enqueued once, done.
    assert items(release).get(key) == "done", items(release)
    print(f"helm test's work item: {done[len('ok   work item: '):]}")
