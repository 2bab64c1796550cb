"""The chart's alerts fire on a real Prometheus beside the cluster (issue 50, part 2). The test starts its own
prometheus on this host for its duration (Debian's server, which ci/scripts/install-tools.sh caches beside promtool;
e2e/prometheus.py), with the scrape configs the Prometheus operator would make of the chart's PodMonitors (rendered
with `helm template` for this release: the test's namespace's pods, the monitors' selectors and port, job =
namespace/name) and the rules of the chart's PrometheusRule for this release, with its default selector (the
release's namespace and the monitors' jobs), the alerts under test held for FOR. Debian's prometheus has no
Kubernetes discovery: the test serves it the pods as that discovery would (e2e/prometheus.py PodDiscovery, each
refresh a list of the namespace's pods from the API server), and the operator's relabelling picks the targets.

Faults as a real GPU fails: the last GPU of the node gone (GPUAgentClusterAgentNotReady fires, and resolves when the
GPUs are back) and an Xid 79 (the node agent reads the GPU Lost: GPUAgentGPUUnhealthy fires, and resolves on the
clear). The firing and resolved times are Prometheus' own: the first evaluation its ALERTS series says the alert
fired at, and the endsAt it sent an Alertmanager stand-in once resolved.

GPUAgentGPUCriticalErrors counts the Xid events NVML delivers; a fake GPU's fault is a condition its file holds, not
an event (mechanisms/inventory/fake.py), so it stays quiet here: its promtool cases (charts/tests/promtool) cover it."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from e2e import cluster
from e2e import prometheus as prom
from e2e.helpers import wait_until
from e2e.release import CA, NODE_SCOPE, Release

FOR = 4.0  # seconds the alerts under test must hold before they fire (the chart's defaults are minutes)
INTERVAL = "2s"  # the PodMonitors' scrape interval (metrics.podMonitor.interval), rendered into the scrape configs
EVALUATION = "1s"
NODE_AGENT = "app.kubernetes.io/component=node-agent"
# How long a fault may take to fire its alert, or a recovery to resolve it: beside the parallel phase's other workers,
# the GPU change reaching the agents (kubelet, the cluster agent's read of allocatable, a re-registration) and the
# scrapes; the figures printed are what it took. FOR is asserted as a lower bound: no alert fires before it.
DEADLINE = 90

# How Prometheus reaches the pods. On the CI cluster as the Prometheus of a PodMonitor does: at each pod's own address
# (podIP:port, the target pod discovery gives a container port). This host routes to every pod: the control-plane
# node's are on its own bridge (ci/scripts/node-config.sh), each worker's pod CIDR is routed to the worker's network
# namespace (ci/scripts/node.sh, `ip route replace $pod_cidr via $ip`); and the chart's NetworkPolicies, which the CI
# cluster enforces (ci/scripts/netpol.sh), admit anyone to the agents' port `http` while networkPolicy.metricsFrom is
# empty (the default). That is the path the API server's pod proxy takes from this host to a worker's pod, which
# every e2e read of an agent's /healthz goes through. On another cluster (kind, k3d, existing) this host may not
# route to pods: the scrape goes through the API server's pod proxy, with the kubeconfig's credentials.
DIRECT = cluster.provider() == "ci"


def api_server_access(api, folder) -> dict[str, Any]:
    """The API server and the credentials to it as the suite's client has them from the kubeconfig, for a scrape
    through its pod proxy: its CA and client certificate and key as files (the client writes inline ones to temporary
    files of its own), or a bearer token, written here to a file only this user reads."""
    c = api.configuration
    tls: dict[str, Any] = {"ca_file": c.ssl_ca_cert} if c.ssl_ca_cert else {}
    if c.cert_file and c.key_file:
        tls.update(cert_file=c.cert_file, key_file=c.key_file)
    if not c.verify_ssl:
        tls["insecure_skip_verify"] = True
    access: dict[str, Any] = {"url": c.host, "tls_config": tls}
    token = (c.api_key or {}).get("authorization", "").removeprefix("Bearer ").strip()
    if token:
        path = folder / "token"
        path.touch(mode=0o600)
        path.write_text(token)
        access["authorization"] = {"type": "Bearer", "credentials_file": str(path)}
    return access


def pod_list(core):
    """The PodList of a namespace as the API server sends it (JSON), for PodDiscovery."""
    def list_pods(namespace: str) -> dict[str, Any]:
        resp = core.list_namespaced_pod(namespace, _preload_content=False, _request_timeout=10)
        return json.loads(resp.data)
    return list_pods


def fault(fake_gpus, *args: str) -> None:
    """`fake-gpu fault --node NODE ARGS` on this process's node, as a user breaks a GPU."""
    r = fake_gpus.command("fault", "--node", fake_gpus.node, *args)
    assert r.returncode == 0, r.stderr


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


@pytest.fixture
def alert_release(api, core, apps, kubeconfig, namespace, fake_gpus):
    """2 fake GPUs on this process's node and a release whose cluster agent is Ready on them, acts on a loss at once
    (clusterAgent.gpuLossDebounce=0) and stays up without GPUs (gracefulNoGPU). Side by side the release is scoped to
    the worker's node (NODE_SCOPE); in a process of its own the cluster agent counts every node's GPUs, so the other
    nodes are set to none."""
    if not NODE_SCOPE:
        for node in core.list_node().items:
            if node.metadata.name != fake_gpus.node and fake_gpus.allocatable(node.metadata.name):
                fake_gpus.set(0, node=node.metadata.name)
    fake_gpus.set(2)
    fault(fake_gpus, "--clear")  # whatever a failed run left
    r = Release(api, core, apps, kubeconfig, namespace, name=f"al{uuid.uuid4().hex[:5]}")
    try:
        r.install("--set", "gracefulNoGPU=true", "--set", "clusterAgent.gpuLossDebounce=0")
        wait_until(r.all_running, 90, "every release pod Running")
        wait_until(lambda: r.healthz()[0] == 200, 60, "the cluster agent Ready on 2 GPUs")
        yield r
    finally:
        try:
            fault(fake_gpus, "--clear")
        finally:
            r.uninstall_if_installed()
            fake_gpus.set(0)


@pytest.fixture
def watched(alert_release, api, core, tmp_path, request):
    """A prometheus on this host scraping the release as its PodMonitors select it, with its PrometheusRule's alerts:
    (release, prometheus, alertmanager stand-in). Where the scrape goes: DIRECT."""
    if prom.binary() is None:
        pytest.skip(prom.MISSING)
    r = alert_release
    docs = prom.render(r.name, r.namespace, "--set", "metrics.podMonitor.enabled=true",
                       "--set", f"metrics.podMonitor.interval={INTERVAL}",
                       *prom.alert_for(clusterAgentNotReady=f"{FOR:g}s", gpuUnhealthy=f"{FOR:g}s"))
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {f"{r.fullname}-cluster-agent", f"{r.fullname}-node-agent"}
    discovery = prom.PodDiscovery(pod_list(core))
    proxy = None if DIRECT else api_server_access(api, tmp_path)
    scrape = [prom.pod_monitor_scrape_config(m, discovery.url, proxy) for m in monitors]
    alertmanager = prom.Alertmanager()
    server = prom.Prometheus(tmp_path / "prometheus", scrape, prom.rule_groups(docs), alertmanager,
                             scrape_interval=INTERVAL, evaluation_interval=EVALUATION)
    try:
        server.start()
        yield r, server, alertmanager
    finally:
        server.stop()
        alertmanager.close()
        discovery.close()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(f"\nprometheus' configuration and log are in {server.folder}; {discovery.lists} pod lists served, "
                  f"failed: {discovery.failures[-3:]}; its log ends:\n{server.tail()}")


def test_the_last_gpu_gone_and_an_xid_79_fire_their_alerts_on_a_real_prometheus_and_resolve_on_recovery(
        watched, fake_gpus):
    r, server, alertmanager = watched
    ns, full = r.namespace, r.fullname
    agent = r.agent_pod()
    (node_agent,) = [p.metadata.name for p in r.pods(NODE_AGENT) if p.spec.node_name == fake_gpus.node]
    pods = {p.metadata.name for p in [*r.pods(CA), *r.pods(NODE_AGENT)] if p.metadata.deletion_timestamp is None}

    # Every agent pod discovered and scraped, by the job its monitor gives it; then two evaluations: all quiet.
    def scraped() -> bool:
        up = {(t["labels"]["pod"], t["labels"]["job"]) for t in server.targets() if t["health"] == "up"}
        return {pod for pod, _ in up} == pods and {job for _, job in up} == {f"{ns}/{full}-cluster-agent",
                                                                            f"{ns}/{full}-node-agent"}
    wait_until(scraped, 60, f"every agent pod of the release scraped up ({sorted(pods)})", interval=0.5)
    wait_until(lambda: server.query(f'gpu_agent_ready{{namespace="{ns}",pod="{agent}"}} == 1'), 30,
               "the cluster agent's gpu_agent_ready 1 scraped", interval=0.5)
    since = time.time()
    wait_until(lambda: server.last_evaluation() > since + 1, 30, "two rule evaluations", interval=0.2)
    quiet = {a["labels"]["alertname"]: a["state"] for a in server.alerts()}
    assert not {"GPUAgentClusterAgentNotReady", "GPUAgentGPUUnhealthy"} & set(quiet), quiet

    # The node's last GPU gone: the cluster agent NotReady -> GPUAgentClusterAgentNotReady firing, after FOR.
    broke = time.time()
    fake_gpus.set(0)
    seen = server.wait_alert("GPUAgentClusterAgentNotReady", "firing", DEADLINE, namespace=ns, pod=agent)
    alert = seen.alert
    assert alert is not None
    assert alert["labels"]["job"] == f"{ns}/{full}-cluster-agent" and alert["labels"]["severity"] == "warning", alert
    assert "no component reported" not in alert["annotations"]["description"], alert["annotations"]
    fired = server.fired_at("GPUAgentClusterAgentNotReady")[0]
    print(f"GPUAgentClusterAgentNotReady: the last GPU gone at {iso(broke)}, pending at {alert['activeAt']}, firing "
          f"at {iso(fired)} ({fired - broke:.1f} s after; for {FOR:g} s, scrape {INTERVAL}, evaluation {EVALUATION})")
    assert fired - broke >= FOR - 0.001, "fired sooner than `for` after the fault"
    assert fired - prom.seconds_of(alert["activeAt"]) >= FOR - 0.001, "fired sooner than `for` after pending"

    # The GPUs back: Ready again -> resolved (no longer listed), and sent resolved.
    back = time.time()
    fake_gpus.set(2)
    server.wait_alert("GPUAgentClusterAgentNotReady", "inactive", DEADLINE, namespace=ns, pod=agent)
    wait_until(lambda: alertmanager.resolved("GPUAgentClusterAgentNotReady"), 30, "the resolved notification")
    resolved = alertmanager.resolved("GPUAgentClusterAgentNotReady")
    assert resolved is not None
    ended = prom.seconds_of(resolved["endsAt"])
    print(f"GPUAgentClusterAgentNotReady: firing at {iso(fired)}, resolved at {resolved['endsAt']} (the GPUs back at "
          f"{iso(back)}; startsAt sent {resolved['startsAt']})")
    assert back <= ended and abs(prom.seconds_of(resolved["startsAt"]) - fired) < 0.002, (resolved, fired, back)

    # An Xid 79 on GPU 0 of the node: the node agent reads it Lost -> GPUAgentGPUUnhealthy firing, from its pod.
    broke = time.time()
    fault(fake_gpus, "--gpu", "0", "--xid", "79")
    seen = server.wait_alert("GPUAgentGPUUnhealthy", "firing", DEADLINE, namespace=ns, pod=node_agent)
    alert = seen.alert
    assert alert is not None
    assert alert["labels"]["job"] == f"{ns}/{full}-node-agent" and alert["labels"]["health"] == "Lost", alert
    assert float(alert["value"]) == 1, alert
    fired = server.fired_at("GPUAgentGPUUnhealthy")[0]
    print(f"GPUAgentGPUUnhealthy: Xid 79 at {iso(broke)}, firing at {iso(fired)} ({fired - broke:.1f} s after)")
    assert fired - broke >= FOR - 0.001, "fired before `for`"

    # The fault cleared: Healthy again -> resolved.
    back = time.time()
    fault(fake_gpus, "--clear")
    server.wait_alert("GPUAgentGPUUnhealthy", "inactive", DEADLINE, namespace=ns, pod=node_agent)
    wait_until(lambda: alertmanager.resolved("GPUAgentGPUUnhealthy"), 30, "the resolved notification")
    resolved = alertmanager.resolved("GPUAgentGPUUnhealthy")
    assert resolved is not None and back <= prom.seconds_of(resolved["endsAt"]), (resolved, back)
    print(f"GPUAgentGPUUnhealthy: firing at {iso(fired)}, resolved at {resolved['endsAt']} (cleared at {iso(back)})")
