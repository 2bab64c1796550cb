"""Releases on the cluster: upgrade from the last stable release with work running, the downgrade
back, a failed upgrade rolled back, and a first install with a domain on a cluster without the CRDs.
The DRA bats suite's "upgrade" group, with live work counted from outside the agent.

"Last stable" is built from the commit releases.yaml records (ci/scripts/build-images.sh
last-stable: a git worktree, its own wheels and Dockerfile), so nothing comes from outside. The
upgrade and first-install tests delete the CRDs, so they are `disruptive` (skipped on
CLUSTER=existing)."""

from __future__ import annotations

import time
import uuid

import pytest
from kubernetes import client

from e2e.helpers import Sampler, wait_until
from e2e.release import (
    APP_VERSION,
    CA,
    CHART,
    WAIT,
    Active,
    Release,
    WorkPods,
    enqueue,
    helm,
    items,
    leaderless,
    longest_not_ready,
    lost_and_doubled,
    operation,
    persistent_control_plane,
    remove_volume,
)
from gpu_agent.mechanisms.queues.pod_executor import pod_name as _pod_name
from gpu_agent_hooks.cli import apply_crds

CRDS = ("gpudomains.gpu-agent.io", "gpudomainmembers.gpu-agent.io")
GROUP = "gpu-agent.io"


def delete_crds(api) -> None:
    """As on a cluster that never had this project (every GPUDomain of every namespace goes too)."""
    ext = client.ApiextensionsV1Api(api)
    for name in CRDS:
        try:
            ext.delete_custom_resource_definition(name)
        except client.ApiException as e:
            assert e.status == 404
    wait_until(lambda: not [c for c in ext.list_custom_resource_definition().items if c.metadata.name in CRDS], 60,
               "the CRDs gone")


def stored_versions(api) -> dict[str, list[str]]:
    ext = client.ApiextensionsV1Api(api)
    return {name: list(ext.read_custom_resource_definition(name).status.stored_versions) for name in CRDS}


def served_versions(api) -> dict[str, set[str]]:
    ext = client.ApiextensionsV1Api(api)
    return {name: {v.name for v in ext.read_custom_resource_definition(name).spec.versions if v.served} for name in CRDS}


@pytest.mark.disruptive
def test_upgrade_from_last_stable_with_work_running_loses_and_doubles_nothing(
        last_stable, api, core, apps, kubeconfig, namespace, fake_gpus):
    version, old_chart = last_stable
    delete_crds(api)
    fake_gpus.set(4)
    release = Release(api, core, apps, kubeconfig, namespace, name="up")
    volume = persistent_control_plane(core, namespace, release)
    custom = client.CustomObjectsApi(api)
    try:
        old = ["--set", f"image.tag={version}", "--set", "gracefulNoGPU=true",
               "--set", "controlPlane.persistence.enabled=true"]
        args = release.args(*old)
        args[args.index(str(CHART))] = str(old_chart)
        # The last stable release could not create its domain on a first install (issue 10): as its
        # users did, install, then add the domain.
        helm("install", *args, "--timeout", "120s")
        helm("upgrade", *args, "--set", "domain.name=fabric", "--timeout", "120s")
        wait_until(lambda: release.healthz()[0] == 200, 90, f"the {version} cluster agent Ready")
        domain = lambda v: custom.get_namespaced_custom_object(GROUP, v, namespace, "gpudomains", "fabric")  # noqa: E731 - a one-line reader, local to the test
        wait_until(lambda: (domain("v1alpha1").get("status") or {}).get("status") == "Ready", 60,
                   f"the {version} domain Ready")
        # An object a user wrote under v1alpha1 before the upgrade.
        custom.create_namespaced_custom_object(GROUP, "v1alpha1", namespace, "gpudomains", {
            "apiVersion": f"{GROUP}/v1alpha1", "kind": "GPUDomain", "metadata": {"name": "users"},
            "spec": {"expectedNodes": 3, "nodeSelector": {"rack": "r1"}}})
        assert stored_versions(api) == {name: ["v1alpha1"] for name in CRDS}
        before_uid = domain("v1alpha1")["metadata"]["uid"]
        members = lambda: sorted(m["metadata"]["name"] for m in custom.list_namespaced_custom_object(  # noqa: E731 - a one-line reader, local to the test
            GROUP, "v1alpha1", namespace, "gpudomainmembers")["items"])
        old_members = members()
        assert old_members and all(n.startswith("fabric-") for n in old_members), old_members  # 0.1's names

        pods = WorkPods(core, namespace)
        first = [f"up-a{i}" for i in range(12)]
        enqueue(release, first)
        wait_until(lambda: pods.executions(), 60, "the first work pods")
        in_flight = sum(1 for state in items(release).values() if state == "leased")
        with Sampler(lambda: release.healthz()[0], 0.5) as health:
            started = time.monotonic()
            release.upgrade("--set", "gracefulNoGPU=true", "--set", "controlPlane.persistence.enabled=true",
                            "--set", "domain.name=fabric", "--set", "hooks.backoffLimit=0")
            upgraded = time.monotonic() - started
            wait_until(lambda: release.healthz()[0] == 200, 120, "the upgraded cluster agent Ready")
            ready_again = time.monotonic() - started
            wait_until(lambda: (domain("v1beta1").get("status") or {}).get("status") == "Ready", 60,
                       "the domain Ready again")
            domain_ready = time.monotonic() - started
            # Each new node agent applies its member under the new name (<domain>.<node>), then deletes its 0.1 one.
            renamed = {f"fabric.{n[len('fabric-'):]}" for n in old_members}
            wait_until(lambda: (lambda now: renamed <= set(now) and not any(n.startswith("fabric-") for n in now))(members()),
                       60, f"0.1's members {old_members} replaced by {sorted(renamed)}")
        samples = health.samples
        second = [f"up-b{i}" for i in range(4)]
        enqueue(release, second)
        wait_until(lambda: (lambda s: set(s.values()) == {"done"} and len(s) == len(first) + len(second))(items(release)),
                   240, "every item done", interval=1.0)
        wait_until(lambda: set(pods.executions()) >= {_pod_name(k) for k in first + second}, 30,
                   "a work pod seen for every item")
        pods.stop()
        executions = pods.executions()
        lost = [k for k in first + second if _pod_name(k) not in executions]
        doubled = {name: n for name, n in executions.items() if n > 1}
        not_ready = longest_not_ready(samples)
        print(f"\nupgrade {version} -> {APP_VERSION}: helm upgrade {upgraded:.1f} s, agent Ready again after "
              f"{ready_again:.1f} s (longest NotReady {not_ready:.1f} s over {len(samples)} samples), domain Ready "
              f"after {domain_ready:.1f} s; {in_flight} item(s) in flight at the start, {len(first) + len(second)} "
              f"items, {len(lost)} lost, {len(doubled)} doubled ({pods.events} pod events watched)")
        assert len(samples) >= 4, "the readiness sampler took too few samples to measure anything"
        if pods.gaps:
            print(f"work-pod watch gaps (relisted): {[(round(t, 2), why) for t, why in pods.gaps]}")
        assert pods.complete(), pods.gaps
        assert not lost and not doubled, (lost, doubled)
        assert domain_ready < 120
        # The same objects, read under v1beta1 too; still stored at v1alpha1 (one release behind), so
        # that a rollback to the last stable release can read every one of them.
        assert domain("v1beta1")["metadata"]["uid"] == before_uid
        users = custom.get_namespaced_custom_object(GROUP, "v1beta1", namespace, "gpudomains", "users")
        assert users["apiVersion"] == f"{GROUP}/v1beta1" and users["spec"] == {"expectedNodes": 3, "nodeSelector": {"rack": "r1"}}
        assert stored_versions(api) == {name: ["v1alpha1"] for name in CRDS}
        assert served_versions(api) == {name: {"v1alpha1", "v1beta1"} for name in CRDS}
        # No pod of the old version is left, and a fresh 0 -> 4 -> 0 cycle works.
        old_pods = [p.metadata.name for p in release.pods(f"app.kubernetes.io/instance={release.name}")
                    if (p.metadata.labels or {}).get("app.kubernetes.io/version") == version]
        assert not old_pods, old_pods
        for count, code in ((0, 503), (4, 200), (0, 503)):
            fake_gpus.set(count)
            wait_until(lambda c=code: release.healthz()[0] == c, 30, f"/healthz {code} at {count} GPUs")
    finally:
        fake_gpus.set(0)
        release.uninstall()
        remove_volume(core, namespace, volume)


@pytest.mark.serial(reason="the last stable chart has no clusterAgent.gpuNodeSelector: its agent counts and uses every node's GPUs, and its CRDs replace the current ones")
def test_downgrade_and_rollback_to_last_stable_keep_the_work_and_the_users_domains_and_upgrading_again_restores(
        last_stable, api, core, apps, kubeconfig, namespace, fake_gpus):
    """The bats suite's "downgrade: current-dev -> last-stable", and `helm rollback` to a last-stable
    revision, with work running and a GPUDomain a user made: this release still stores v1alpha1,
    which the last stable release serves, so both succeed and every object stays."""
    version, old_chart = last_stable
    fake_gpus.set(2)
    release = Release(api, core, apps, kubeconfig, namespace, name="down")
    volume = persistent_control_plane(core, namespace, release)
    custom = client.CustomObjectsApi(api)
    common = ["--set", "gracefulNoGPU=true", "--set", "controlPlane.persistence.enabled=true",
              "--set", "domain.name=fabric", "--set", "hooks.backoffLimit=0"]
    read = lambda v, name: custom.get_namespaced_custom_object(GROUP, v, namespace, "gpudomains", name)  # noqa: E731 - a one-line reader, local to the test
    try:
        helm("install", *release.args(*common), *WAIT)
        wait_until(lambda: (read("v1beta1", "fabric").get("status") or {}).get("status") == "Ready", 60, "the domain Ready")
        users_spec = {"expectedNodes": 3, "nodeSelector": {"rack": "r1"}, "maxNodesPerClique": 2}
        custom.create_namespaced_custom_object(GROUP, "v1beta1", namespace, "gpudomains", {
            "apiVersion": f"{GROUP}/v1beta1", "kind": "GPUDomain", "metadata": {"name": "users"}, "spec": users_spec})
        uids = {name: read("v1beta1", name)["metadata"]["uid"] for name in ("fabric", "users")}
        assert stored_versions(api) == {name: ["v1alpha1"] for name in CRDS}
        old_args = release.args("--set", f"image.tag={version}", *common)
        old_args[old_args.index(str(CHART))] = str(old_chart)
        history = ["--kubeconfig", release.kubeconfig, "-n", namespace, release.name]
        pods, active, keys, seen = WorkPods(core, namespace), Active(release), [], {}
        with Sampler(active, 0.25) as sampler:
            for step, command, runs in (("downgrade to last stable", ["upgrade", *old_args, *WAIT], version),     # rev 2
                                        ("upgrade again", ["upgrade", *release.args(*common), *WAIT], APP_VERSION),  # 3
                                        ("rollback to last stable", ["rollback", *history, "2", *WAIT], version),  # 4
                                        ("rollback to this release", ["rollback", *history, "3", *WAIT], APP_VERSION)):
                batch = [f"down{len(seen)}-{i}" for i in range(3)]
                keys += batch
                o = operation(release, active, batch, command)
                agent = next(p for p in release.pods(CA) if p.metadata.deletion_timestamp is None)
                assert agent.metadata.labels["app.kubernetes.io/version"] == runs, (step, agent.metadata.labels)
                served = "v1alpha1" if runs == version else "v1beta1"
                now = {name: read(served, name) for name in ("fabric", "users")}
                assert {name: d["metadata"]["uid"] for name, d in now.items()} == uids, step  # the same objects
                seen[step] = (o, now["users"]["spec"], served_versions(api))
                wait_until(lambda v=served: (read(v, "fabric").get("status") or {}).get("status") == "Ready", 90,
                           f"the domain Ready after: {step}")
        samples = sampler.samples
        lost, doubled = lost_and_doubled(release, pods, keys)
        measured = [v for _, v in samples if isinstance(v, list)]
        for step, (o, spec, served) in seen.items():
            print(f"{step}: helm {o['took']:.1f} s, longest without an active agent "
                  f"{leaderless(active, *o['window']):.1f} s; the user's spec {spec}; served "
                  f"{ {n.split('.')[0]: sorted(v) for n, v in served.items()} }")
        print(f"{len(measured)} samples, most active at once {max(map(len, measured), default=0)}; {len(keys)} items, "
              f"{len(lost)} lost, {len(doubled)} doubled ({pods.events} pod events watched)")
        assert len(measured) >= 40 and max(map(len, measured)) <= 1
        assert pods.complete(), pods.gaps
        assert not lost and not doubled, (lost, doubled)
        # What the last stable release does not know is not shown while it runs, and is back after the upgrade:
        # the API server prunes unknown fields when it reads an object, and nothing rewrote the user's.
        assert seen["downgrade to last stable"][1] == {k: v for k, v in users_spec.items() if k != "maxNodesPerClique"}
        assert seen["upgrade again"][1] == users_spec and seen["rollback to this release"][1] == users_spec
        assert stored_versions(api) == {name: ["v1alpha1"] for name in CRDS}
    finally:
        release.uninstall_if_installed()
        remove_volume(core, namespace, volume)
        apply_crds(api, CHART / "crds")  # this release's CRDs for the tests after this one, whatever happened
        fake_gpus.set(0)


def test_a_failed_upgrade_rolled_back_restores_service_and_keeps_the_stored_objects(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    fake_gpus.set(2)
    release = Release(api, core, apps, kubeconfig, namespace, name="rb")
    release.install("--set", "gracefulNoGPU=true", "--set", "domain.name=fabric")
    wait_until(lambda: release.healthz()[0] == 200, 90, "the cluster agent Ready")
    custom = client.CustomObjectsApi(api)
    uid = custom.get_namespaced_custom_object(GROUP, "v1beta1", namespace, "gpudomains", "fabric")["metadata"]["uid"]
    # An image that never becomes live: the upgrade fails, and Recreate has already stopped the agent.
    r = helm("upgrade", *release.args("--set", "gracefulNoGPU=true", "--set", "domain.name=fabric",
                                      "--set", "clusterAgent.image.tag=no-such-tag"), "--wait", "--timeout", "25s", check=False)
    assert r.returncode != 0
    wait_until(lambda: release.healthz()[0] == 0, 30, "the agent gone with the failed upgrade")
    keys = [f"rb-{i}" for i in range(4)]
    enqueue(release, keys)  # queued while nothing serves
    started = time.monotonic()
    helm("rollback", "--kubeconfig", release.kubeconfig, "-n", namespace, release.name, "1", "--wait", "--timeout", "120s")
    wait_until(lambda: release.healthz()[0] == 200, 90, "the cluster agent Ready after the rollback")
    print(f"\nrollback: service back {time.monotonic() - started:.1f} s after `helm rollback`")
    wait_until(lambda: set(items(release).values()) == {"done"}, 120, "the items queued during the outage done", interval=1.0)
    assert custom.get_namespaced_custom_object(GROUP, "v1beta1", namespace, "gpudomains", "fabric")["metadata"]["uid"] == uid
    ext = client.ApiextensionsV1Api(api)
    for name in CRDS:
        crd = ext.read_custom_resource_definition(name)
        assert {v.name for v in crd.spec.versions if v.served} == {"v1alpha1", "v1beta1"}
        assert crd.status.stored_versions == ["v1alpha1"]
    release.uninstall()
    fake_gpus.set(0)


@pytest.mark.disruptive
def test_first_install_with_a_domain_on_a_cluster_that_never_had_the_crds(api, core, apps, kubeconfig, namespace,
                                                                          fake_gpus):
    delete_crds(api)
    fake_gpus.set(1)
    release = Release(api, core, apps, kubeconfig, namespace, name=f"fi{uuid.uuid4().hex[:4]}")
    release.install("--set", "domain.name=fabric")
    custom = client.CustomObjectsApi(api)
    wait_until(lambda: (custom.get_namespaced_custom_object(GROUP, "v1beta1", namespace, "gpudomains", "fabric")
                        .get("status") or {}).get("status") == "Ready", 90, "the chart's GPUDomain Ready")
    assert stored_versions(api) == {name: ["v1alpha1"] for name in CRDS}
    release.uninstall()
    fake_gpus.set(0)
