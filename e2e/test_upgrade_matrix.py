"""`helm install/upgrade/rollback --wait` with every supported value set, as platform teams run them,
with a stream of work: each operation completes, leadership is handed over instead of dropped,
and no item is lost or run twice.

The readiness model behind it (agent/gpu_agent/roles/cluster_agent.py): a registered hot standby is
Ready; only the leader is *active* (`active` in /healthz: queues open, leasing work). So a rolling
update with leader election is a hand-over: the new pod becomes a Ready standby, the old leader
stops, pauses its queues and releases the Lease, and the standby (watching the Lease) leads at once.

Evidence from outside the agents:
- who is active: every cluster agent pod's own /healthz, all probed at once every 250 ms (a
  0.1.x agent has no `active`: its 200 counts as active);
- executions: the API server's watch of work Pods (an item run twice is a second UID under its
  deterministic name);
- each operation's outcome: helm's exit status with `--wait --timeout 3m`.

Each value set is one test with its own namespace and release: install the last stable release
with that value set's nearest equivalent, upgrade to this chart with the value set (a), upgrade
again with one value changed (b), roll back to (a)'s revision (c). A persistent control plane
keeps the queue across its own replacement. `test_install_wait_*` installs each value set fresh
with `--wait`; the GitOps test applies `helm template` output without Helm."""

from __future__ import annotations

import base64
import secrets
import subprocess
import time

import pytest
import yaml
from kubernetes import client

from e2e.cluster import tool
from e2e.helpers import PodLogs, Sampler, wait_until
from e2e.release import (
    CA,
    CHART,
    WAIT,
    Active,
    Release,
    WorkPods,
    enqueue,
    helm,
    items,
    longest_leaderless,
    lost_and_doubled,
    operation,
    persistent_control_plane,
    remove_volume,
    without_gpu_node_selector,
)

TOKENS_SECRET = "users-tokens"
# value set -> (this chart's values, the last stable release's nearest equivalent)
VALUE_SETS = {
    "defaults": ([], []),
    "graceful-no-gpu": (["--set", "gracefulNoGPU=true"], ["--set", "gracefulNoGPU=true"]),
    "replicas-2": (["--set", "clusterAgent.replicas=2"], []),
    "join-matching": (["--set", "domain.name=fabric", "--set", "domain.joinMatching=true"], []),
    "existing-tokens": (["--set", f"controlPlane.existingTokensSecret={TOKENS_SECRET}"], []),
}
# Value sets whose rollouts are hand-overs (leader election, GPUs present): the goal applies.
HAND_OVER = {"defaults", "replicas-2", "join-matching", "existing-tokens"}
MAX_LEADERLESS_HAND_OVER = 2.0


def tokens_secret(core, namespace: str) -> None:
    """A Secret made outside the chart (sealed or external secrets in GitOps)."""
    core.create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name=TOKENS_SECRET),
        data={k: base64.b64encode(secrets.token_urlsafe(24).encode()).decode()
              for k in ("registrationToken", "adminToken")}))


@pytest.mark.serial(reason="the last stable chart has no clusterAgent.gpuNodeSelector: its agent counts and uses every node's GPUs, "
                           "and its CRDs replace the current ones; beside each other the rows only meet releases that "
                           "expect both", among="last-stable")
@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_upgrade_from_last_stable_a_changed_value_and_rollback_hand_over_with_wait(
        value_set, last_stable, api, core, apps, kubeconfig, namespace, fake_gpus):
    version, old_chart = last_stable
    current, old = VALUE_SETS[value_set]
    fake_gpus.set(4)
    if value_set == "existing-tokens":
        tokens_secret(core, namespace)
    release = Release(api, core, apps, kubeconfig, namespace, name=f"mx-{value_set}"[:20])
    volume = persistent_control_plane(core, namespace, release)
    persistent = ["--set", "controlPlane.persistence.enabled=true"]
    active = Active(release)
    try:
        args = without_gpu_node_selector(release.args("--set", f"image.tag={version}", *persistent, *old))
        args[args.index(str(CHART))] = str(old_chart)
        started = time.monotonic()
        helm("install", *args, *WAIT)
        print(f"\n[{value_set}] helm install {version} --wait: {time.monotonic() - started:.1f} s")
        wait_until(lambda: len(active()) == 1, 60, f"the {version} agent active")
        pods = WorkPods(core, namespace)
        ops, keys = {}, []
        # every cluster agent's log followed from its start: a slow hand-over's old leader is gone when it is read
        with Sampler(active, 0.25) as sampler, PodLogs(core, namespace, CA) as agent_logs:
            for op, command in (
                    ("upgrade from last stable", ["upgrade", *release.args(*persistent, *current), *WAIT]),
                    ("upgrade, a changed value", ["upgrade", *release.args(*persistent, *current, "--set", "logVerbosity=3"),
                                                  *WAIT]),
                    ("rollback", ["rollback", "--kubeconfig", release.kubeconfig, "-n", namespace, release.name, "2",
                                  *WAIT])):
                batch = [f"mx{len(ops)}-{i}" for i in range(4)]
                keys += batch
                ops[op] = operation(release, active, batch, command)
        samples = sampler.samples
        lost, doubled = lost_and_doubled(release, pods, keys)
        measured = [v for _, v in samples if isinstance(v, list)]
        failed = [(round(t - samples[0][0], 2), v) for t, v in samples if not isinstance(v, list)]
        most = max((len(v) for v in measured), default=0)
        for op, o in ops.items():
            gap, o["around"] = longest_leaderless(active, *o["window"])
            o["leaderless"] = gap
            print(f"[{value_set}] {op}: helm {o['took']:.1f} s, longest without an active agent {gap:.2f} s")
        print(f"[{value_set}] {len(measured)} samples ({len(samples) - len(measured)} failed), most active at once "
              f"{most}; {len(keys)} items, {len(lost)} lost, {len(doubled)} doubled ({pods.events} pod events watched)")
        assert len(measured) >= 40, f"the sampler took only {len(measured)} usable samples"
        assert pods.complete(), pods.gaps
        assert most <= 1, [v for v in measured if len(v) > 1][:5]
        assert not lost and not doubled, (lost, doubled)
        if value_set in HAND_OVER:
            for op in ("upgrade, a changed value", "rollback"):
                if ops[op]["leaderless"] > MAX_LEADERLESS_HAND_OVER:  # what each agent said meanwhile (issue 49)
                    for pod, lines in agent_logs.between(*ops[op]["window"]).items():
                        print(f"[{value_set}] {op}: {pod} said:")
                        for t, text in lines:
                            print(f"  +{t - ops[op]['window'][0]:6.2f}s {text[:300]}")
                assert ops[op]["leaderless"] <= MAX_LEADERLESS_HAND_OVER, (op, ops[op]["leaderless"], ops[op]["around"],
                                                                           failed)
    finally:
        release.uninstall_if_installed()
        remove_volume(core, namespace, volume)
        fake_gpus.set(0)


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_install_wait_of_each_value_set_with_gpus_present_succeeds(
        value_set, api, core, apps, kubeconfig, namespace, fake_gpus):
    current, _ = VALUE_SETS[value_set]
    fake_gpus.set(2)
    if value_set == "existing-tokens":
        tokens_secret(core, namespace)
    release = Release(api, core, apps, kubeconfig, namespace, name=f"iw-{value_set}"[:20])
    try:
        started = time.monotonic()
        helm("install", *release.args(*current), *WAIT)
        took = time.monotonic() - started
        agents = [p for p in release.pods(CA) if p.metadata.deletion_timestamp is None]
        assert all(c.ready for p in agents for c in p.status.container_statuses or []), "--wait returned before Ready"
        active = Active(release)
        wait_until(lambda: len(active()) == 1, 30, "one active cluster agent")
        print(f"\n[{value_set}] helm install --wait: {took:.1f} s, {len(agents)} agent pod(s) Ready, 1 active")
    finally:
        release.uninstall_if_installed()
        fake_gpus.set(0)


def test_a_gitops_install_without_hooks_or_lookup_gives_a_working_release(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    """What Argo CD's and Flux's plain-manifest paths do: render, then server-side apply. No hooks
    run (no CRD migration, no skew check, no cleanup) and `lookup` sees nothing; the tokens come
    from a Secret made outside the chart."""
    fake_gpus.set(2)
    tokens_secret(core, namespace)
    release = Release(api, core, apps, kubeconfig, namespace, name="gitops")
    values = [a for a in release.args("--set", f"controlPlane.existingTokensSecret={TOKENS_SECRET}")
              if a not in ("--kubeconfig", release.kubeconfig)]  # rendered without a cluster
    render = lambda *extra: helm("template", *values, "--no-hooks", *extra).stdout  # noqa: E731 - a one-line renderer, local to the test
    manifests = render("--include-crds")
    docs = [d for d in yaml.safe_load_all(manifests) if d]
    assert not [d for d in docs if "helm.sh/hook" in ((d.get("metadata") or {}).get("annotations") or {})]
    kubectl = [tool("kubectl"), "--kubeconfig", release.kubeconfig, "-n", namespace]
    try:
        started = time.monotonic()
        r = subprocess.run([*kubectl, "apply", "--server-side", "--force-conflicts", "--field-manager=gitops", "-f", "-"],
                           input=manifests, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        active = Active(release)
        wait_until(lambda: len(active()) == 1, 120, "one active cluster agent")
        enqueue(release, ["gitops-1"], seconds=1)
        wait_until(lambda: items(release) == {"gitops-1": "done"}, 90, "the item done")
        print(f"\ngitops: {len(docs)} objects applied server-side, agent active and an item done "
              f"{time.monotonic() - started:.1f} s after the apply")
    finally:
        subprocess.run([*kubectl, "delete", "--ignore-not-found", "--wait=false", "-f", "-"], input=render(),
                       capture_output=True, text=True, timeout=120)
        fake_gpus.set(0)
