"""Smoke tests of the cluster itself: what every later test relies on works for real."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pyhelm3
import pytest
from kubernetes import client

from e2e.cluster import tool
from e2e.helpers import apply, pod_log, wait_until

CHART = Path(__file__).parent / "charts" / "smoke"


def deployment_ready(apps, ns, name):
    d = apps.read_namespaced_deployment(name, ns)
    return d.status.ready_replicas == 1 and d.status.updated_replicas == 1 and d.status.observed_generation == d.metadata.generation


def test_deployment_with_http_readiness_probe_becomes_ready(api, apps, core, namespace):
    apply(api, namespace, "web.yaml.j2", name="web")
    wait_until(lambda: deployment_ready(apps, namespace, "web"), 60, "web Deployment Ready")
    pod = core.list_namespaced_pod(namespace, label_selector="app=web").items[0]
    ready = next(c for c in pod.status.conditions if c.type == "Ready")
    assert ready.status == "True"


def test_recreate_rollout_sampled_every_250ms_never_shows_two_pods(api, apps, core, namespace):
    apply(api, namespace, "web.yaml.j2", name="web", strategy="Recreate")
    wait_until(lambda: deployment_ready(apps, namespace, "web"), 60, "web Deployment Ready")
    samples, active_sets, stop = [], [], threading.Event()

    def sample():
        while not stop.is_set():
            pods = core.list_namespaced_pod(namespace, label_selector="app=web").items
            sets = apps.list_namespaced_replica_set(namespace, label_selector="app=web").items
            samples.append(sorted(p.metadata.name for p in pods if p.status.phase not in ("Succeeded", "Failed")))
            active_sets.append(sum(1 for r in sets if (r.status.replicas or 0) > 0))
            stop.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    first = core.list_namespaced_pod(namespace, label_selector="app=web").items[0].metadata.name
    patch = {"spec": {"template": {"metadata": {"annotations": {"revision-note": "v2"}}}}}
    apps.patch_namespaced_deployment("web", namespace, patch)
    wait_until(lambda: deployment_ready(apps, namespace, "web")
               and first not in [p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector="app=web").items],
               90, "the Recreate rollout to finish")
    stop.set()
    sampler.join()
    print(f"recreate sampler: {len(samples)} samples, max pods at once {max(map(len, samples))}, "
          f"max active ReplicaSets {max(active_sets)}")
    assert len(samples) >= 8
    assert max(len(s) for s in samples) == 1
    assert max(active_sets) == 1
    assert [first] in samples and any(s and s != [first] for s in samples)  # both pods seen, never together


def test_daemonset_runs_on_every_node(api, apps, core, namespace):
    nodes = sorted(n.metadata.name for n in core.list_node().items)
    apply(api, namespace, "daemonset.yaml.j2", name="daemon")
    wait_until(lambda: (lambda d: d.status.desired_number_scheduled == len(nodes)
                        and d.status.number_ready == d.status.desired_number_scheduled)(
        apps.read_namespaced_daemon_set("daemon", namespace)), 60, f"DaemonSet ready on {len(nodes)} node(s)")
    pods = core.list_namespaced_pod(namespace, label_selector="app=daemon").items
    assert sorted(p.spec.node_name for p in pods) == nodes, "one pod on every node"
    for pod in pods:
        wait_until(lambda p=pod: "daemon up" in pod_log(core, namespace, p.metadata.name), 30,
                   f"daemon log on {pod.spec.node_name}")


def test_pod_resolves_the_api_and_calls_it_with_its_token_within_rbac(api, core, namespace):
    apply(api, namespace, "api-probe.yaml.j2")
    wait_until(lambda: core.read_namespaced_pod("api-probe", namespace).status.phase in ("Succeeded", "Failed"), 60,
               "api-probe to finish")
    log = core.read_namespaced_pod_log("api-probe", namespace)
    result = json.loads(log.split("RESULT ", 1)[1])
    assert result["resolved"] == "10.96.0.1"
    assert result["own_pods"] == 200
    assert result["kube_system_secrets"] == 403
    assert core.read_namespaced_pod("api-probe", namespace).status.phase == "Succeeded"


def test_helm_install_upgrade_rollback_list_uninstall(kubeconfig, core, namespace):
    helm = pyhelm3.Client(executable=tool("helm"), kubeconfig=kubeconfig)

    async def run():
        chart = await helm.get_chart(str(CHART))
        release = "smoke"
        await helm.install_or_upgrade_release(release, chart, {"message": "one"}, namespace=namespace, wait=True)
        assert core.read_namespaced_config_map("smoke-smoke", namespace).data["message"] == "one"
        await helm.install_or_upgrade_release(release, chart, {"message": "two"}, namespace=namespace, wait=True)
        assert core.read_namespaced_config_map("smoke-smoke", namespace).data["message"] == "two"
        releases = list(await helm.list_releases(namespace=namespace))
        assert [r.name for r in releases] == [release]
        current = releases[0]
        assert (await current.current_revision()).revision == 2
        await current.rollback(revision=1, wait=True)
        assert core.read_namespaced_config_map("smoke-smoke", namespace).data["message"] == "one"
        assert (await current.current_revision()).revision == 3
        await helm.uninstall_release(release, namespace=namespace, wait=True)
        assert list(await helm.list_releases(namespace=namespace)) == []
        with pytest.raises(client.ApiException) as e:
            core.read_namespaced_config_map("smoke-smoke", namespace)
        assert e.value.status == 404

    asyncio.run(run())
