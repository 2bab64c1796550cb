"""`gpu-agent chart-test`, what the chart's `helm test` Pod runs (roles/chart_test.py), against real HTTP servers on
loopback: a control plane, a cluster agent and node agents that answer what each test gives them, and an API server
whose EndpointSlices name the node agents (read through the real Kubernetes client). Time comes from a clock the
test drives."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from gpu_agent import cli
from gpu_agent.foundations.kube import api_client
from gpu_agent.roles import chart_test
from gpu_agent.roles.chart_test import ChartTest, ChartTestConfig
from tests.loopback_kubeconfig import LoopbackApiServer, QuietHandler

READY = {"status": "ready", "components": {
    "gpus": {"ready": True, "reason": "2 GPUs available"}, "registration": {"ready": True, "reason": "registered"},
    "queues": {"ready": True, "reason": "leasing"}}}
NO_GPUS = {"status": "notready", "components": {
    "gpus": {"ready": False, "reason": "no GPUs available: no node has allocatable nvidia.com/gpu"},
    "registration": {"ready": False, "reason": "waiting for GPUs"}, "queues": {"ready": False, "reason": "paused"}}}
NOT_REGISTERED = {"status": "notready", "components": {
    "gpus": {"ready": True, "reason": "2 GPUs available"},
    "registration": {"ready": False, "reason": "refused: 401 unauthorized (wrong registration token?)"}}}


class Served:
    """One HTTP server on loopback: GET path -> (status, JSON doc); an unknown path is a 404; `hang` holds every
    answer that long (a server that accepts but does not answer)."""

    def __init__(self, answers: dict[str, tuple[int, object]], hang: float = 0.0) -> None:
        self.answers, self.hang, self.asked = answers, hang, []
        served = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                served.asked.append(self.path)
                if served.hang:
                    threading.Event().wait(served.hang)
                status, doc = served.answers.get(self.path.split("?")[0], (404, {"error": "no such path"}))
                self.send_json(json.dumps(doc).encode(), status)

        self.server = LoopbackApiServer()
        self.server.serve(Handler)

    @property
    def port(self) -> int:
        return self.server.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def servers():
    made: list[Served] = []

    def serve(answers, hang=0.0):
        made.append(Served(answers, hang))
        return made[-1]
    yield serve
    for s in made:
        s.server.close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): a control plane scaled to 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SteppingClock:
    """monotonic() moves `step` seconds each time it is read: every check costs the same time."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step = 1000.0, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


def slices(*ports: int, namespace="ns", service="t-gpu-agent-node-agent", ready=True):
    """An EndpointSlice list: one node agent on 127.0.0.1 at each port, on nodes w1, w2, ..."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList", "metadata": {"resourceVersion": "1"},
            "items": [{"metadata": {"name": f"{service}-{i}", "namespace": namespace,
                                    "labels": {"kubernetes.io/service-name": service}},
                       "addressType": "IPv4",
                       "ports": [{"name": "http-metrics", "port": port, "protocol": "TCP"}],
                       "endpoints": [{"addresses": ["127.0.0.1"], "nodeName": f"w{i + 1}",
                                      "conditions": {"ready": ready}}]}
                      for i, port in enumerate(ports)]}


def release(servers, tmp_path, *, control_plane=(200, {"status": "ok"}), healthz=(200, READY), node_agents=2):
    """The release's servers: returns (control plane URL, cluster agent URL, the EndpointSlice lister)."""
    cp = servers({"/healthz": control_plane}).url if control_plane else f"http://127.0.0.1:{closed_port()}"
    ca = servers({"/livez": (200, {"status": "live"}), "/healthz": healthz})
    nodes = [servers({"/livez": (200, {"status": "live"})}) for _ in range(node_agents)]
    api = servers({"/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices": (200, slices(*(n.port for n in nodes)))})
    kubeconfig = api.server.kubeconfig(tmp_path)
    return cp, ca.url, kubeconfig, nodes, api


def run(cp, ca, kubeconfig, *, graceful=False, clock=None, timeout=30.0, request_timeout=2.0):
    lines: list[str] = []
    cfg = ChartTestConfig(namespace="ns", fullname="t-gpu-agent", controlPlaneUrl=cp, clusterAgentUrl=ca,
                          nodeAgentService="t-gpu-agent-node-agent", gracefulNoGPU=graceful, timeout=timeout,
                          requestTimeout=request_timeout)
    test = ChartTest(cfg, clock or SteppingClock(), list_endpoints=chart_test.endpoint_slices(api_client(kubeconfig, limit=None)),
                     out=lines.append)
    return test.run(), lines


def test_a_healthy_release_passes_with_one_ok_line_per_check(servers, tmp_path):
    cp, ca, kubeconfig, nodes, api = release(servers, tmp_path)
    code, lines = run(cp, ca, kubeconfig)
    assert code == 0, lines
    assert lines == [
        f"ok   control plane: {cp}/healthz answered 200",
        f"ok   cluster agent /livez: {ca}/livez answered 200 (live)",
        "ok   cluster agent /healthz: Ready: gpus: 2 GPUs available; registration: registered; queues: leasing",
        f"ok   node agent w1: http://127.0.0.1:{nodes[0].port}/livez answered 200 (live, Ready)",
        f"ok   node agent w2: http://127.0.0.1:{nodes[1].port}/livez answered 200 (live, Ready)",
        "chart-test: all 5 checks passed"]
    assert all(n.asked == ["/livez"] for n in nodes)
    assert api.asked == ["/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices?"
                         "labelSelector=kubernetes.io/service-name%3Dt-gpu-agent-node-agent"]


def test_a_control_plane_that_is_down_fails_the_test_naming_it_and_the_fix(servers, tmp_path):
    cp, ca, kubeconfig, _, _ = release(servers, tmp_path, control_plane=None)
    code, lines = run(cp, ca, kubeconfig)
    assert code == 1
    (failed,) = [line for line in lines if line.startswith("FAIL")]
    assert failed.startswith(f"FAIL control plane: {cp}/healthz did not answer within 2 s (")
    assert "fix: the control plane must run and answer" in failed
    assert "kubectl -n ns scale deploy/t-gpu-agent-control-plane --replicas=1" in failed
    assert lines[-1] == "chart-test: 1 of 5 checks failed: control plane"
    assert sum(line.startswith("ok ") for line in lines) == 4  # the other checks still ran and passed


def test_a_control_plane_that_answers_an_error_fails_with_its_answer(servers, tmp_path):
    cp, ca, kubeconfig, _, _ = release(servers, tmp_path, control_plane=(503, {"error": "database is locked"}))
    code, lines = run(cp, ca, kubeconfig)
    assert code == 1
    assert f"FAIL control plane: {cp}/healthz answered 503: {{\"error\": \"database is locked\"}}; fix: " in "\n".join(lines)


def test_no_gpus_with_graceful_no_gpu_is_a_pass_with_a_note_and_without_it_a_failure_saying_what_to_set(servers, tmp_path):
    cp, ca, kubeconfig, _, _ = release(servers, tmp_path, healthz=(503, NO_GPUS))
    code, lines = run(cp, ca, kubeconfig, graceful=True)
    assert code == 0, lines
    (note,) = [line for line in lines if line.startswith("note")]
    assert note.startswith("note cluster agent /healthz: NotReady because it counts no GPU, which gracefulNoGPU=true "
                           "allows")
    assert "gpus: no GPUs available: no node has allocatable nvidia.com/gpu" in note
    assert lines[-1] == "chart-test: all 5 checks passed"

    code, lines = run(cp, ca, kubeconfig, graceful=False)
    assert code == 1
    (failed,) = [line for line in lines if line.startswith("FAIL")]
    assert failed.startswith("FAIL cluster agent /healthz: NotReady, no GPUs: gpus: no GPUs available")
    assert "set gracefulNoGPU=true" in failed


def test_not_ready_for_another_reason_fails_naming_each_component_and_its_reason(servers, tmp_path):
    cp, ca, kubeconfig, _, _ = release(servers, tmp_path, healthz=(503, NOT_REGISTERED))
    code, lines = run(cp, ca, kubeconfig, graceful=True)  # gracefulNoGPU excuses no GPUs, nothing else
    assert code == 1
    (failed,) = [line for line in lines if line.startswith("FAIL")]
    assert failed.startswith("FAIL cluster agent /healthz: NotReady: registration: refused: 401 unauthorized")
    assert "kubectl -n ns logs deploy/t-gpu-agent-cluster-agent" in failed
    assert lines[-1] == "chart-test: 1 of 5 checks failed: cluster agent /healthz"


def test_a_node_agent_that_does_not_answer_in_time_fails_naming_its_node(servers, tmp_path):
    cp, ca, kubeconfig, nodes, _ = release(servers, tmp_path)
    nodes[1].hang = 2.0
    code, lines = run(cp, ca, kubeconfig, request_timeout=0.2)
    assert code == 1
    (failed,) = [line for line in lines if line.startswith("FAIL")]
    assert failed.startswith(f"FAIL node agent w2: http://127.0.0.1:{nodes[1].port}/livez did not answer within 0.2 s")
    assert "kubectl -n ns logs ds/t-gpu-agent-node-agent" in failed


def test_no_node_agent_endpoints_is_a_note(servers, tmp_path):
    cp, ca, kubeconfig, _, _ = release(servers, tmp_path, node_agents=0)
    code, lines = run(cp, ca, kubeconfig)
    assert code == 0
    assert any(line.startswith("note node agents: Service t-gpu-agent-node-agent has no endpoints") for line in lines)


def test_each_call_is_bounded_by_what_is_left_of_the_runs_timeout_and_none_is_made_without_time(servers, tmp_path):
    """Each read of the clock costs 4 s of a 10 s run: the first calls get what is left (at most the per-call
    bound), and once it is spent the remaining checks fail saying so, without calling anything."""
    cp, ca, kubeconfig, nodes, api = release(servers, tmp_path)
    asked: list[tuple[str, float]] = []

    def fetch(url, timeout):
        asked.append((url, timeout))
        return chart_test.http_get(url, timeout)
    lines: list[str] = []
    cfg = ChartTestConfig(namespace="ns", fullname="t-gpu-agent", controlPlaneUrl=cp, clusterAgentUrl=ca,
                          nodeAgentService="t-gpu-agent-node-agent", gracefulNoGPU=False, timeout=10.0,
                          requestTimeout=5.0)
    test = ChartTest(cfg, SteppingClock(step=4.0), fetch=fetch, out=lines.append,
                     list_endpoints=chart_test.endpoint_slices(api_client(kubeconfig, limit=None)))
    assert test.run() == 1
    assert asked == [(f"{cp}/healthz", 5.0), (f"{ca}/livez", 2.0)]  # 10 - 4 - 4 left for the second
    assert lines[2].startswith(f"FAIL cluster agent /healthz: no time left to ask {ca}/healthz (the test's bound, "
                               "test.timeoutSeconds, is 10 s)")
    assert lines[3].startswith("FAIL node agents: no time left to list Service t-gpu-agent-node-agent's endpoints")
    assert api.asked == [] and all(n.asked == [] for n in nodes)


def test_the_command_line_runs_the_checks_and_exits_1_when_one_fails(servers, tmp_path, capfd):
    cp, ca, kubeconfig, _, _ = release(servers, tmp_path, control_plane=None)
    argv = ["chart-test", "--namespace=ns", "--fullname=t-gpu-agent", f"--control-plane-url={cp}",
            f"--cluster-agent-url={ca}", "--node-agent-service=t-gpu-agent-node-agent", f"--kubeconfig={kubeconfig}",
            "--timeout=20", "--request-timeout=1"]
    assert cli.main(argv) == 1
    out = capfd.readouterr().out.splitlines()
    assert out[0].startswith(f"FAIL control plane: {cp}/healthz did not answer within 1 s")
    assert out[-1] == "chart-test: 1 of 5 checks failed: control plane"
    # Without a control plane of the chart's own (controlPlane.enabled=false) it is not asked: the rest passes.
    assert cli.main([a for a in argv if not a.startswith("--control-plane-url")]) == 0
    assert capfd.readouterr().out.splitlines()[-1] == "chart-test: all 4 checks passed"


def test_a_bad_timeout_is_a_usage_error(capfd):
    assert cli.main(["chart-test", "--timeout=0"]) == 2
    assert "--timeout and --request-timeout must be above 0" in capfd.readouterr().err


def test_each_cluster_agent_behind_its_service_is_asked_ready_or_not_and_none_at_all_fails(servers, tmp_path):
    """A NotReady cluster agent (no GPUs yet) is out of its Service, which then refuses every connection: the test
    asks each pod of the Service's EndpointSlices instead, ready or not, and names it by its pod."""
    cp = servers({"/healthz": (200, {"status": "ok"})}).url
    agents = [servers({"/livez": (200, {"status": "live"}), "/healthz": (503, NO_GPUS)}) for _ in range(2)]
    listed = slices(*(a.port for a in agents), service="t-gpu-agent-cluster-agent", ready=False)
    for i, item in enumerate(listed["items"]):
        item["endpoints"][0]["targetRef"] = {"kind": "Pod", "name": f"t-gpu-agent-cluster-agent-{i}", "namespace": "ns"}
    empty = {**slices(service="t-gpu-agent-cluster-agent"), "items": []}
    for answer, want in ((listed, 0), (empty, 1)):
        api = servers({"/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices": (200, answer)})
        lines: list[str] = []
        cfg = ChartTestConfig(namespace="ns", fullname="t-gpu-agent", controlPlaneUrl=cp, clusterAgentUrl="",
                              clusterAgentService="t-gpu-agent-cluster-agent", nodeAgentService="",
                              gracefulNoGPU=True, timeout=30.0, requestTimeout=2.0)
        code = ChartTest(cfg, SteppingClock(), list_endpoints=chart_test.endpoint_slices(
            api_client(str(api.server.kubeconfig(tmp_path)), limit=None)), out=lines.append).run()
        assert code == want, lines
        if want == 0:
            assert [line.split(":")[0] for line in lines[1:-1]] == [
                "ok   cluster agent t-gpu-agent-cluster-agent-0 /livez", "note cluster agent t-gpu-agent-cluster-agent-0 /healthz",
                "ok   cluster agent t-gpu-agent-cluster-agent-1 /livez", "note cluster agent t-gpu-agent-cluster-agent-1 /healthz"]
            assert all(a.asked == ["/livez", "/healthz"] for a in agents)
        else:
            assert lines[1].startswith("FAIL cluster agent: Service t-gpu-agent-cluster-agent has no endpoints"), lines


class ScriptedQueue:
    """A control plane's queue API on loopback: POST /v1/queue/items records the item, each GET of the list answers
    the next state of `states` for it (the last one from then on)."""

    def __init__(self, states: list[dict]) -> None:
        self.states, self.enqueued, self.auth = list(states), [], []
        queue = self

        class Handler(QuietHandler):
            def _answer(self, status: int, doc: object) -> None:
                self.send_json(json.dumps(doc).encode(), status)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                queue.auth.append(self.headers.get("Authorization"))
                queue.enqueued.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self._answer(201, {"id": 7, "created": True})

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/healthz":
                    return self._answer(200, {"status": "ok"})
                state = queue.states.pop(0) if len(queue.states) > 1 else queue.states[0]
                key = queue.enqueued[-1]["idempotencyKey"] if queue.enqueued else ""
                self._answer(200, {"items": [{"id": 7, "idempotencyKey": key, "deliveries": 1, "createdAt": 1.0,
                                              "failedAttempts": 0, **state}]})

        self.server = LoopbackApiServer()
        self.server.serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.httpd.server_address[1]}"


def test_one_work_item_runs_end_to_end_when_an_agent_is_ready_and_is_not_enqueued_when_none_is(servers, tmp_path):
    token = tmp_path / "adminToken"
    token.write_text("admin-token-0123456789\n")
    ready_agent = servers({"/livez": (200, {"status": "live"}), "/healthz": (200, READY)}).url
    no_gpu_agent = servers({"/livez": (200, {"status": "live"}), "/healthz": (503, NO_GPUS)}).url
    cases = (  # (the list's answers for the item, the agent, exit code, the work item's line)
        ([{"state": "queued"}, {"state": "leased"}, {"state": "done"}], ready_agent, 0, "ok   work item: helm-test-1 "
         "enqueued and done in"),
        ([{"state": "queued"}, {"state": "failed", "lastError": "creating pod refused"}], ready_agent, 1,
         "FAIL work item: helm-test-1 failed: creating pod refused; fix:"),
        ([{"state": "queued"}], ready_agent, 1, "FAIL work item: helm-test-1 not done within the test's bound (queued"),
        ([{"state": "queued"}], no_gpu_agent, 0, "note work item: not run: no cluster agent is Ready"))
    for states, agent, code, line in cases:
        queue = ScriptedQueue(states)
        lines, slept = [], []
        cfg = ChartTestConfig(namespace="ns", fullname="t-gpu-agent", controlPlaneUrl=queue.url, clusterAgentUrl=agent,
                              nodeAgentService="", gracefulNoGPU=True, timeout=10.0, requestTimeout=2.0,
                              adminTokenFile=str(token))
        test = ChartTest(cfg, SteppingClock(0.5), out=lines.append, sleep=slept.append, new_key=lambda: "helm-test-1")
        try:
            assert test.run() == code, lines
        finally:
            queue.server.close()
        assert next(x for x in lines if "work item" in x).startswith(line), lines
        if agent is no_gpu_agent:
            assert queue.enqueued == [], "nothing enqueued while no agent is Ready"
            continue
        assert queue.enqueued == [{"idempotencyKey": "helm-test-1", "payload": {"gpus": 1}}]
        assert queue.auth == ["Bearer admin-token-0123456789"] and slept and max(slept) <= ChartTest.WORK_POLL_SECONDS
