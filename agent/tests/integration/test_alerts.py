"""The chart's alerts on a real Prometheus (issue 50, part 2), no cluster: the server of Debian's prometheus package
(ci/scripts/install-tools.sh caches it beside promtool) scrapes the rig's cluster agent (a real process on loopback,
fake GPUs moved by the real fake-gpu command) every second and evaluates, every second, the rules of the chart's
PrometheusRule as `helm template` renders them, its `selector` value picking this scrape job and the alerts under
test held for FOR. The last GPU gone fires GPUAgentClusterAgentNotReady and the GPUs back resolve it; an Xid 79 (the
GPU Lost) fires GPUAgentGPUUnhealthy and its clear resolves it. Each is read from Prometheus' own API (pending, then
firing, then no longer listed) and from what it sent its Alertmanager (a stand-in on loopback: startsAt, endsAt).

The prometheus binary missing, the test skips saying how to get it; `make test` fails a run with any skip
(scripts/test_report.py) and its tools stage installs the binary first, so CI never skips it."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from e2e import prometheus as prom
from tests.integration.harness import LOGS, wait_until

pytestmark = pytest.mark.integration

JOB = "gpu-agent-rig"
FOR = 2.0  # seconds: the `for` of the alerts under test (their defaults are minutes)
SCRAPE = 1.0  # seconds: scrape and evaluation intervals
EVALUATION = 1.0
# Beyond FOR + SCRAPE + EVALUATION (the worst case once the agent exports the change: a scrape to read it, an
# evaluation to see it, FOR pending), what a fault may take on a loaded machine: the fake-gpu command, the agent's
# 0.1 s poll of its GPUs (a re-registration on loopback to be Ready again), the test's 0.1 s poll of the API.
SLACK = 3.0


@pytest.fixture
def alerting(rig, tmp_path, request):
    """The rig (control plane, cluster agent on 2 fake GPUs, Ready) and a Prometheus scraping its agent: (rig,
    prometheus, alertmanager). The rules are the chart's, this job selected, the two alerts under test held FOR."""
    binary = prom.binary()
    if binary is None:
        pytest.skip(prom.MISSING)
    rig.start_control_plane()
    rig.set_gpus(2)
    rig.start_agent()
    rig.wait_health(200, 30)
    groups = prom.rule_groups(prom.render("rig", "rig", "--set", f'metrics.prometheusRule.selector=job="{JOB}"',
                                          *prom.alert_for(clusterAgentNotReady=f"{FOR:g}s", gpuUnhealthy=f"{FOR:g}s")))
    target = rig.agent_url.removeprefix("http://")
    # The labels a PodMonitor's relabelling gives a pod's target (namespace, pod), for the alerts' descriptions.
    scrape = [{"job_name": JOB, "static_configs": [{"targets": [target],
                                                    "labels": {"namespace": "rig", "pod": "cluster-agent"}}]}]
    alertmanager = prom.Alertmanager()
    server = prom.Prometheus(tmp_path / "prometheus", scrape, groups, alertmanager, scrape_interval=f"{SCRAPE:g}s",
                             evaluation_interval=f"{EVALUATION:g}s")
    LOGS.append(server.log)  # test_zz_secrets greps it with the rest
    try:
        server.start()
        yield rig, server, alertmanager
    finally:
        server.stop()
        alertmanager.close()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(f"\n===== prometheus.log (its configuration and rules beside it, in {server.folder}) =====\n"
                  f"{server.tail(6000)}")


def fired_and_resolved(server: prom.Prometheus, alertmanager: prom.Alertmanager, name: str) -> str:
    """The alert's firing and resolved times as Prometheus gives them: the first evaluation it was firing at (its
    ALERTS series, which the startsAt it sent its Alertmanager repeats) and the endsAt it sent once resolved."""
    fired = server.fired_at(name)
    resolved = alertmanager.resolved(name)
    assert fired and resolved, (fired, resolved)
    assert abs(prom.seconds_of(resolved["startsAt"]) - fired[0]) < 0.002, (resolved, fired)
    firing = datetime.fromtimestamp(fired[0], UTC).isoformat(timespec="milliseconds")
    return f"firing at {firing} (ALERTS), resolved at {resolved['endsAt']} (endsAt sent to the Alertmanager)"


def test_the_last_gpu_gone_fires_cluster_agent_not_ready_and_an_xid_79_fires_gpu_unhealthy_each_resolving(alerting):
    rig, server, alertmanager = alerting
    bound = FOR + SCRAPE + EVALUATION + SLACK
    # The agent scraped, Ready, and at least two evaluations after that: nothing under test pending or firing.
    wait_until(lambda: [t for t in server.targets() if t["health"] == "up"], 15, "the agent's target up", interval=0.1)
    wait_until(lambda: server.query(f'gpu_agent_ready{{job="{JOB}"}} == 1'), 15, "gpu_agent_ready 1 scraped",
               interval=0.1)
    scraped = time.time()
    wait_until(lambda: server.last_evaluation() > scraped + EVALUATION, 15, "two rule evaluations", interval=0.1)
    quiet = {a["labels"]["alertname"]: a["state"] for a in server.alerts()}
    assert not {"GPUAgentClusterAgentNotReady", "GPUAgentGPUUnhealthy"} & set(quiet), quiet

    # The last GPU gone: the agent NotReady -> pending, then firing FOR later; nothing Unhealthy about it.
    began = time.time()  # the fault is after this (a lower bound: FOR) and before the command returns (an upper one)
    rig.set_gpus(0)
    fault = time.time()
    seen = server.wait_alert("GPUAgentClusterAgentNotReady", "firing", bound + 10)
    after = seen.at - fault
    alert = seen.alert
    assert alert is not None
    held = prom.seconds_of(alert["activeAt"])
    print(f"GPUAgentClusterAgentNotReady firing {after:.2f} s after the last GPU went (pending after "
          f"{seen.first.get('pending', seen.at) - fault:.2f} s; bound {bound:g} s: for {FOR:g} + scrape {SCRAPE:g} + "
          f"evaluation {EVALUATION:g} + {SLACK:g} s slack)")
    assert "pending" in seen.first, f"never seen pending before firing: `for` not held ({seen.first})"
    assert seen.at - began >= FOR, f"fired {seen.at - began:.2f} s after the fault began: sooner than `for`"
    assert after <= bound, f"fired {after:.2f} s after the fault: later than {bound:g} s"
    # (a sample's time is in milliseconds, activeAt in nanoseconds)
    assert server.fired_at("GPUAgentClusterAgentNotReady")[0] - held >= FOR - 0.001, "fired before `for` had passed"
    assert alert["labels"] == {"alertname": "GPUAgentClusterAgentNotReady", "severity": "warning", "job": JOB,
                               "instance": rig.agent_url.removeprefix("http://"), "namespace": "rig",
                               "pod": "cluster-agent"}, alert["labels"]
    # the description names what holds readiness down, as /healthz does (the rule queries gpu_agent_component_ready)
    down = sorted(name for name, c in rig.healthz()[1]["components"].items() if not c["ready"])
    assert down and f"NotReady: {', '.join(down)}." in alert["annotations"]["description"], (down, alert["annotations"])
    assert not server.alerts("GPUAgentGPUUnhealthy"), "a GPU gone is not an Unhealthy GPU"

    # The GPUs back: Ready again, the alert resolved (no longer listed) and sent resolved.
    recovering = time.time()
    rig.set_gpus(2)
    back = time.time()
    gone = server.wait_alert("GPUAgentClusterAgentNotReady", "inactive", SCRAPE + EVALUATION + SLACK + 10).at - back
    wait_until(lambda: alertmanager.resolved("GPUAgentClusterAgentNotReady"), 10, "the resolved notification",
               interval=0.1)
    print(f"GPUAgentClusterAgentNotReady resolved {gone:.2f} s after the GPUs came back; "
          f"{fired_and_resolved(server, alertmanager, 'GPUAgentClusterAgentNotReady')}")
    assert gone <= SCRAPE + EVALUATION + SLACK, f"resolved {gone:.2f} s after the recovery"
    resolved = alertmanager.resolved("GPUAgentClusterAgentNotReady")
    assert resolved is not None and recovering <= prom.seconds_of(resolved["endsAt"]) <= time.time()

    # An Xid 79 on GPU 0: Lost -> GPUAgentGPUUnhealthy firing (health="Lost", 1 GPU); the agent Ready on the other.
    began = time.time()
    r = rig.fake_gpu("fault", "--gpu", "0", "--xid", "79")
    assert r.returncode == 0, r.stderr
    fault = time.time()
    seen = server.wait_alert("GPUAgentGPUUnhealthy", "firing", bound + 10)
    after = seen.at - fault
    alert = seen.alert
    assert alert is not None
    print(f"GPUAgentGPUUnhealthy firing {after:.2f} s after an Xid 79 (pending after "
          f"{seen.first.get('pending', seen.at) - fault:.2f} s; bound {bound:g} s)")
    assert "pending" in seen.first, f"never seen pending before firing: `for` not held ({seen.first})"
    assert seen.at - began >= FOR, f"fired {seen.at - began:.2f} s after the fault began: sooner than `for`"
    assert after <= bound, f"fired {after:.2f} s after the fault: later than {bound:g} s"
    assert alert["labels"]["health"] == "Lost" and alert["labels"]["severity"] == "warning", alert["labels"]
    assert float(alert["value"]) == 1, alert
    assert alert["annotations"]["description"].startswith(f"1 GPU(s) Lost for more than {FOR:g}s"), alert
    assert not [a for a in server.alerts("GPUAgentClusterAgentNotReady") if a["state"] == "firing"], \
        "one GPU of two Lost: the agent stays Ready on the other"

    # The fault cleared: Healthy again, the alert resolved.
    r = rig.fake_gpu("fault", "--clear")
    assert r.returncode == 0, r.stderr
    back = time.time()
    gone = server.wait_alert("GPUAgentGPUUnhealthy", "inactive", SCRAPE + EVALUATION + SLACK + 10).at - back
    wait_until(lambda: alertmanager.resolved("GPUAgentGPUUnhealthy"), 10, "the resolved notification", interval=0.1)
    print(f"GPUAgentGPUUnhealthy resolved {gone:.2f} s after the clear; "
          f"{fired_and_resolved(server, alertmanager, 'GPUAgentGPUUnhealthy')}")
    assert gone <= SCRAPE + EVALUATION + SLACK, f"resolved {gone:.2f} s after the clear"
