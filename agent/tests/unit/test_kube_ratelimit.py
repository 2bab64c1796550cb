"""The client-side rate limit on a real ApiClient (foundations/kube.py's `api_client`), against a tiny local HTTP
server: every request takes a token (a generated API method, `core_v1_list`'s lean list, a watch when it starts),
the events a watch streams take none, a request whose turn is further than its timeout is never sent; and each
agent's settings reach the buckets of the clients it builds."""

import argparse
import json
import math
import threading
import time
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client, watch

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.config import load
from gpu_agent.foundations.kube import api_client, api_status, core_v1_list, wait_bound
from gpu_agent.foundations.ratelimit import ApiLimit, RateLimited
from gpu_agent.roles import cluster_agent, node_agent
from tests.loopback_kubeconfig import LoopbackApiServer, QuietHandler

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns", "resourceVersion": "5"}}
EVENTS = [{"type": "ADDED", "object": {**POD, "metadata": {**POD["metadata"], "resourceVersion": "8"}}},
          {"type": "MODIFIED", "object": {**POD, "metadata": {**POD["metadata"], "resourceVersion": "9"}}},
          {"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "10"}}}]


class ApiServer(LoopbackApiServer):
    """Answers a Pod read, a Pod list, and a Pod watch (three events, then the end); records each request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        server = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server calls it by this name
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                server.requests.append(("GET", url.path, query))
                if url.path == "/api/v1/namespaces/ns/pods/p":
                    body = json.dumps(POD).encode()
                elif url.path == "/api/v1/namespaces/ns/pods" and query.get("watch") == ["true"]:
                    body = b"".join(json.dumps(e).encode() + b"\n" for e in EVENTS)
                elif url.path == "/api/v1/namespaces/ns/pods":
                    body = json.dumps({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "7"},
                                       "items": [POD]}).encode()
                else:
                    self.send_error(404)
                    return
                self.send_json(body)

        self.serve(Handler)


@pytest.fixture
def server():
    s = ApiServer()
    yield s
    s.close()


def counted(api):
    """Record every take of the client's bucket: (what, bound)."""
    takes = []
    take = api.limiter.take

    def counting(bound=math.inf, what="a request"):
        takes.append((what, bound))
        return take(bound, what)
    api.limiter.take = counting
    return takes


def until(condition, what):
    deadline = time.monotonic() + 5
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within 5 s: {what}")
        time.sleep(0.002)


def test_every_request_takes_a_token_a_watch_one_when_it_starts_and_the_third_of_a_burst_of_two_waits(server, tmp_path):
    clock = ManualClock(start=0.0)
    api = api_client(server.kubeconfig(tmp_path), limit=ApiLimit(1, 2, clock=clock).named("work"))
    takes = counted(api)
    pods = core_v1_list(api, "pods")

    pod = client.CoreV1Api(api).read_namespaced_pod("p", "ns", _request_timeout=10)  # generated: call_api
    listed = pods("ns", _request_timeout=10)  # the lean list: call_api
    assert pod.metadata.name == "p" and listed["metadata"]["resourceVersion"] == "7"
    assert len(server.requests) == 2 and clock.blocked == 0  # the burst of 2, at once

    events: list[dict] = []
    watching = threading.Thread(target=lambda: events.extend(watch.Watch().stream(
        pods, "ns", resource_version="7", allow_watch_bookmarks=True, timeout_seconds=5, _request_timeout=35)),
        daemon=True)
    watching.start()
    until(lambda: clock.blocked == 1, "the watch waits for its turn")
    time.sleep(0.05)
    assert len(server.requests) == 2, "the watch was sent before its turn"
    clock.advance_blocking(0.999)
    time.sleep(0.05)
    assert len(server.requests) == 2 and clock.blocked == 1, "the watch was sent before its turn"
    clock.advance_blocking(0.001)  # 1 s: its turn (1/qps after the burst)
    watching.join(5)
    assert not watching.is_alive()
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "BOOKMARK"]
    assert server.requests[2][2]["watch"] == ["true"]
    # One token per request (the events streamed over the watch took none); each bounded by its own timeout.
    assert takes == [("GET /api/v1/namespaces/ns/pods/p", 10.0), ("GET /api/v1/namespaces/ns/pods", 10.0),
                     ("GET /api/v1/namespaces/ns/pods", 35.0)]

    # The next turn is 1 s away: a request with a shorter timeout is refused at once, never sent, and reads as
    # one that got no answer (api_status None), which its callers already retry.
    with pytest.raises(RateLimited, match=r"client work \(kubeApiQps 1, kubeApiBurst 2\): GET "
                       r"/api/v1/namespaces/ns/pods/p would wait 1s for its turn, longer than its 0.5s timeout") as e:
        client.CoreV1Api(api).read_namespaced_pod("p", "ns", _request_timeout=0.5)
    assert api_status(e.value) is None and len(server.requests) == 3 and clock.blocked == 0


def test_a_client_without_a_limit_takes_no_turns(server, tmp_path):
    clock = ManualClock(start=0.0)
    for limit in (None, ApiLimit(0, 1, clock=clock)):
        api = api_client(server.kubeconfig(tmp_path), limit=limit)
        assert api.limiter is None
        for _ in range(5):
            core_v1_list(api, "pods")("ns", _request_timeout=10)
    assert len(server.requests) == 10 and clock.blocked == 0


def test_the_wait_is_bounded_by_the_requests_timeout():
    assert wait_bound(35) == 35.0 and wait_bound(0.5) == 0.5
    assert wait_bound((3, 7)) == 10.0  # (connect, read)
    assert wait_bound(None) == 10.0  # none named: REQUEST_TIMEOUT


def test_the_cluster_agents_settings_reach_the_bucket_of_each_client_it_builds(server, tmp_path):
    kubeconfig = server.kubeconfig(tmp_path)
    cfg = load(cluster_agent.SETTINGS, argparse.Namespace(), environ={
        "GPU_AGENT_EXECUTOR": "pod", "GPU_AGENT_KUBECONFIG": kubeconfig, "GPU_AGENT_GPU_SOURCE": "fake",
        "GPU_AGENT_FAKE_GPU_STATE_FILE": str(tmp_path / "gpus.json"), "GPU_AGENT_LISTEN_ADDRESS": "127.0.0.1:0",
        "GPU_AGENT_KUBE_API_QPS": "7.5", "GPU_AGENT_KUBE_API_BURST": "9"}, as_=cluster_agent.ClusterAgentConfig)
    agent = cluster_agent.ClusterAgent(cfg, ManualClock())
    work = agent.executor.core.api_client.limiter
    assert (work.qps, work.burst, work.client, work.observer) == (7.5, 9, "work", agent.metrics)
    defaults = load(cluster_agent.SETTINGS, argparse.Namespace(), environ={}, as_=cluster_agent.ClusterAgentConfig)
    assert (defaults.kubeApiQps, defaults.kubeApiBurst) == (100.0, 200)


def test_the_node_agents_settings_reach_the_bucket_of_each_client_it_builds(server, tmp_path):
    cfg = load(node_agent.SETTINGS, argparse.Namespace(), environ={
        "GPU_AGENT_KUBECONFIG": server.kubeconfig(tmp_path), "GPU_AGENT_DRA_DRIVER_NAME": "gpu.example.com",
        "GPU_AGENT_DRA_REGISTRY_DIR": str(tmp_path / "registry"), "GPU_AGENT_DRA_PLUGIN_DIR": str(tmp_path / "plugins"),
        "GPU_AGENT_DRA_CDI_DIR": str(tmp_path / "cdi"), "GPU_AGENT_FAKE_GPU_STATE_FILE": str(tmp_path / "gpus.json"),
        "GPU_AGENT_LISTEN_ADDRESS": "127.0.0.1:0", "GPU_AGENT_KUBE_API_QPS": "3", "GPU_AGENT_KUBE_API_BURST": "4"},
        as_=node_agent.NodeAgentConfig)
    agent = node_agent.NodeAgent(cfg, clock=ManualClock())
    dra = agent.dra.publisher.resource.api_client.limiter
    assert (dra.qps, dra.burst, dra.client, dra.observer) == (3.0, 4, "dra", agent.metrics)
    defaults = load(node_agent.SETTINGS, argparse.Namespace(), environ={}, as_=node_agent.NodeAgentConfig)
    assert (defaults.kubeApiQps, defaults.kubeApiBurst) == (10.0, 20)
