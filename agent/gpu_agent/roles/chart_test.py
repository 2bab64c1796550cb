"""`gpu-agent chart-test`: what `helm test <release>` runs in the chart's test Pod (templates/tests/pod-test.yaml).

One line per check, `ok`, `note` or `FAIL`, then a summary line; the exit code is 0 when no check failed, 1 when one
did (its line names what failed and what to do about it):

- the control plane's /healthz answers 200 (only where the chart runs the embedded control plane: an external one is
  the platform's own to watch);
- each cluster agent (each endpoint of its Service's EndpointSlices, ready or not: a NotReady agent is out of the
  Service, which then refuses every connection; or the one URL given) answers /livez with 200, and its /healthz says
  why it is Ready or not: NotReady only because it
  counts no GPU, with gracefulNoGPU on, is a pass with a note (the graceful no-GPU mode: live but NotReady until GPUs
  come); any other NotReady fails, naming each component that is not ready and its reason;
- each node agent behind the node agents' Service (each endpoint of its EndpointSlices, ready or not) answers /livez;
- one work item end to end, where the test is given the control plane's admin token (the chart's own control plane):
  enqueued with a key of its own and done within the time left; with no cluster agent Ready (no GPUs, graceful) it
  is not enqueued, and a note says why (an item enqueued there would wait for GPUs, and outlive the test).

The control plane is asked over TLS where its URL is https://, verified against controlPlaneCaFile (else the default
trusted CAs), the work item's calls as its /healthz; a certificate not verified fails the check naming that setting.
Every HTTP call (and the EndpointSlice list) has a timeout: the smaller of `requestTimeout` and what is left of
`timeout`, the whole run's bound (the chart's test.timeoutSeconds); a check with no time left fails saying so.
Time is read from the `Clock` it is given, so the unit tests drive it."""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from gpu_agent.foundations.clock import Clock
from gpu_agent.foundations.control_plane_client import ControlPlaneClient, ControlPlaneError, tls_failure
from gpu_agent.foundations.secrets import Secret

EXIT_OK = 0
EXIT_FAILED = 1
NO_GPUS = "no GPUs"  # how the cluster agent's `gpus` component's reason starts when it counts none


@dataclass(frozen=True)
class ChartTestConfig:
    namespace: str
    fullname: str  # the chart's object names' prefix, for the fixes the lines name
    controlPlaneUrl: str  # "" when the chart runs no control plane of its own: not checked
    clusterAgentUrl: str  # used when clusterAgentService is empty (outside a cluster)
    nodeAgentService: str  # "" when the chart runs no node agents: not checked
    gracefulNoGPU: bool
    timeout: float
    requestTimeout: float = 5.0
    clusterAgentService: str = ""  # the cluster agents' Service: each of its endpoints is checked
    adminTokenFile: str = ""  # the control plane's admin token: one work item is run end to end
    controlPlaneCaFile: str = ""  # what an https:// controlPlaneUrl is verified against; "": the default trusted CAs


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


@dataclass(frozen=True)
class Endpoint:
    address: str
    port: int
    node: str = ""
    ready: bool | None = None
    pod: str = ""

    def url(self, path: str) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}{path}"


Fetch = Callable[[str, float], Answer]  # (url, timeout) -> the answer; raises OSError when none came
ListEndpoints = Callable[[str, str, float], list[Endpoint]]  # (namespace, service, timeout)


def http_get(url: str, timeout: float, ca_file: str = "") -> Answer:
    """One GET, bounded by `timeout` (connect and each read); any status is an answer, no answer raises OSError.
    An https:// URL is verified against `ca_file` ("": the default trusted CAs), read at each call."""
    context = ssl.create_default_context(cafile=ca_file or None) if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return Answer(response.status, response.read())
    except urllib.error.HTTPError as e:
        with e:
            return Answer(e.code, e.read())


def endpoint_slices(api: Any) -> ListEndpoints:
    """Lists the endpoints of a Service through its EndpointSlices with the Kubernetes client `api`."""
    from kubernetes import client

    def listed(namespace: str, service: str, timeout: float) -> list[Endpoint]:
        selector = f"kubernetes.io/service-name={service}"
        slices = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(namespace, label_selector=selector, _request_timeout=timeout)
        found = []
        for s in slices.items:
            ports = [p.port for p in (s.ports or []) if p.port]
            for e in s.endpoints or []:
                ready = e.conditions.ready if e.conditions is not None else None
                pod = e.target_ref.name if e.target_ref is not None else ""
                found += [Endpoint(a, port, e.node_name or "", ready, pod or "") for a in e.addresses for port in ports[:1]]
        return sorted(found, key=lambda e: (e.node, e.address))
    return listed


@dataclass
class ChartTest:
    cfg: ChartTestConfig
    clock: Clock
    fetch: Fetch | None = None  # None: http_get, verifying https:// with cfg.controlPlaneCaFile
    list_endpoints: ListEndpoints | None = None
    out: Callable[[str], None] = print
    sleep: Callable[[float], None] = time.sleep
    failed: list[str] = field(default_factory=list)
    checks: int = 0
    agents_ready: int = 0
    new_key: Callable[[], str] = lambda: f"helm-test-{uuid.uuid4().hex[:12]}"

    def run(self) -> int:
        self.deadline = self.clock.monotonic() + self.cfg.timeout
        if self.cfg.controlPlaneUrl:
            self.control_plane()
        self.cluster_agents()
        if self.cfg.nodeAgentService:
            self.node_agents()
        if self.cfg.adminTokenFile and self.cfg.controlPlaneUrl:
            self.work_item()
        if self.failed:
            self.out(f"chart-test: {len(self.failed)} of {self.checks} checks failed: {', '.join(self.failed)}")
            return EXIT_FAILED
        self.out(f"chart-test: all {self.checks} checks passed")
        return EXIT_OK

    # --- one line per check ---------------------------------------------------------------------------------------

    def ok(self, what: str, text: str) -> None:
        self.checks += 1
        self.out(f"ok   {what}: {text}")

    def note(self, what: str, text: str) -> None:
        self.checks += 1
        self.out(f"note {what}: {text}")

    def fail(self, what: str, text: str, fix: str) -> None:
        self.checks += 1
        self.failed.append(what)
        self.out(f"FAIL {what}: {text}; fix: {fix}")

    def _timeout(self) -> float | None:
        left = self.deadline - self.clock.monotonic()
        return min(self.cfg.requestTimeout, left) if left > 0 else None

    def get(self, what: str, url: str, fix: str) -> Answer | None:
        """The answer to GET `url`, or None with the check failed (no answer, or no time left for one)."""
        timeout = self._timeout()
        if timeout is None:
            self.fail(what, f"no time left to ask {url} (the test's bound, test.timeoutSeconds, is "
                            f"{self.cfg.timeout:g} s)", "raise test.timeoutSeconds, or see why the checks before were slow")
            return None
        fetch = self.fetch or partial(http_get, ca_file=self.cfg.controlPlaneCaFile)
        try:
            return fetch(url, timeout)
        except OSError as e:
            if tls := tls_failure(e, self.cfg.controlPlaneCaFile):
                self.fail(what, f"{url}: {tls[0]}", f"{tls[1]} (--control-plane-ca-file)")
                return None
            reason = getattr(e, "reason", None) or e
            self.fail(what, f"{url} did not answer within {timeout:g} s ({reason})", fix)
            return None

    def _fix(self, component: str, kind: str = "deploy") -> str:
        ns, name = self.cfg.namespace, f"{self.cfg.fullname}-{component}"
        return f"see `kubectl -n {ns} get {kind}/{name}` and `kubectl -n {ns} logs {kind}/{name}`"

    # --- the checks ---------------------------------------------------------------------------------------------------

    def control_plane(self) -> None:
        what, url = "control plane", f"{self.cfg.controlPlaneUrl.rstrip('/')}/healthz"
        fix = (f"the control plane must run and answer: {self._fix('control-plane')} (scaled to 0? "
               f"`kubectl -n {self.cfg.namespace} scale deploy/{self.cfg.fullname}-control-plane --replicas=1`)")
        answer = self.get(what, url, fix)
        if answer is None:
            return
        if answer.status == 200:
            self.ok(what, f"{url} answered 200")
        else:
            self.fail(what, f"{url} answered {answer.status}: {_text(answer.body)}", fix)

    def cluster_agents(self) -> None:
        if not self.cfg.clusterAgentService:
            self.cluster_agent(self.cfg.clusterAgentUrl.rstrip("/"), "cluster agent")
            return
        service, fix = self.cfg.clusterAgentService, self._fix("cluster-agent")
        endpoints = self._endpoints("cluster agent", service)
        if endpoints is None:
            return
        if not endpoints:
            self.fail("cluster agent", f"Service {service} has no endpoints: no cluster agent pod runs", fix)
            return
        for e in endpoints:
            self.cluster_agent(e.url(""), f"cluster agent {e.pod or e.address}")

    def cluster_agent(self, base: str, who: str) -> None:
        fix = self._fix("cluster-agent")
        live = self.get(f"{who} /livez", f"{base}/livez", fix)
        if live is not None:
            if live.status == 200:
                self.ok(f"{who} /livez", f"{base}/livez answered 200 (live)")
            else:
                self.fail(f"{who} /livez", f"{base}/livez answered {live.status}: {_text(live.body)}", fix)
        what = f"{who} /healthz"
        answer = self.get(what, f"{base}/healthz", fix)
        if answer is None:
            return
        try:
            doc = json.loads(answer.body)
            components: dict[str, Any] = doc["components"]
        except (ValueError, KeyError, TypeError):
            self.fail(what, f"{base}/healthz answered {answer.status} without its JSON: {_text(answer.body)}", fix)
            return
        if answer.status == 200:
            self.agents_ready += 1
            self.ok(what, "Ready: " + "; ".join(f"{n}: {c.get('reason', '')}" for n, c in components.items()))
            return
        not_ready = {n: c.get("reason", "") for n, c in components.items() if not c.get("ready")}
        why = "; ".join(f"{n}: {r}" for n, r in not_ready.items()) or f"status {doc.get('status')}"
        gpus = components.get("gpus", {})
        no_gpus = not gpus.get("ready", True) and str(gpus.get("reason", "")).startswith(NO_GPUS)
        if no_gpus and self.cfg.gracefulNoGPU:
            self.note(what, f"NotReady because it counts no GPU, which gracefulNoGPU=true allows (live, queues paused "
                            f"until GPUs come; a pass): {why}")
        elif no_gpus:
            self.fail(what, f"NotReady, no GPUs: {why}", "make GPUs schedulable in the cluster (device plugin or "
                      "DRA driver), or set gracefulNoGPU=true to run without them, live but NotReady")
        else:
            self.fail(what, f"NotReady: {why}", f"the reasons above say what it waits for; {fix}")

    def _endpoints(self, what: str, service: str) -> list[Endpoint] | None:
        """The endpoints of `service`, or None with the check `what` failed (no time left, or the list refused)."""
        timeout = self._timeout()
        if timeout is None:
            self.fail(what, f"no time left to list Service {service}'s endpoints (test.timeoutSeconds is "
                            f"{self.cfg.timeout:g} s)", "raise test.timeoutSeconds")
            return None
        assert self.list_endpoints is not None, f"{what} checked without a way to list their endpoints"
        try:
            return self.list_endpoints(self.cfg.namespace, service, timeout)
        except Exception as error:  # noqa: BLE001 - the API server's refusal or silence is this check's failure, named
            self.fail(what, f"could not list the endpoints of Service {service}: {error}",
                      "the test Pod's ServiceAccount needs list on endpointslices (the chart's test Role) and the API "
                      "server must answer")
            return None

    def node_agents(self) -> None:
        service, ds_fix = self.cfg.nodeAgentService, self._fix("node-agent", "ds")
        endpoints = self._endpoints("node agents", service)
        if endpoints is None:
            return
        if not endpoints:
            self.note("node agents", f"Service {service} has no endpoints: no node agent runs (no node matches its "
                                     f"placement, or none has started); {ds_fix}")
            return
        for e in endpoints:
            what = f"node agent {e.node or e.address}"
            answer = self.get(what, e.url("/livez"), ds_fix)
            if answer is None:
                continue
            ready = "" if e.ready is None else ", Ready" if e.ready else ", NotReady (see its /healthz)"
            if answer.status == 200:
                self.ok(what, f"{e.url('/livez')} answered 200 (live{ready})")
            else:
                self.fail(what, f"{e.url('/livez')} answered {answer.status}: {_text(answer.body)}", ds_fix)


    WORK_POLL_SECONDS = 1.0

    def work_item(self) -> None:
        what = "work item"
        if not self.agents_ready:
            self.note(what, "not run: no cluster agent is Ready (it would wait for GPUs, and outlive the test)")
            return
        fix = (f"`kubectl -n {self.cfg.namespace} logs deploy/{self.cfg.fullname}-cluster-agent` says why it is not "
               "done; `gpu-agent queue list` shows the item's state and last error")
        try:
            with open(self.cfg.adminTokenFile, encoding="utf-8") as f:
                token = Secret(f.read().strip())
        except OSError as e:
            self.fail(what, f"cannot read the admin token {self.cfg.adminTokenFile}: {e.strerror or e}",
                      "the test Pod mounts it from the chart's tokens Secret (key adminToken)")
            return
        key, started = self.new_key(), self.clock.monotonic()
        state, error = "", ""
        # One client (one connection) for the enqueue and every poll; each call bounded by the time left.
        control_plane = ControlPlaneClient(self.cfg.controlPlaneUrl, timeout=self.cfg.requestTimeout,
                                           ca_file=self.cfg.controlPlaneCaFile)
        try:
            timeout = self._timeout()
            if timeout is None:
                self.fail(what, "no time left to enqueue one", "raise test.timeoutSeconds")
                return
            control_plane.timeout = timeout
            control_plane.enqueue(token, key, {"gpus": 1})
            while (timeout := self._timeout()) is not None:
                control_plane.timeout = timeout
                items = control_plane.list_items(token)
                item = next((i for i in items if i.get("idempotencyKey") == key), {})
                state, error = str(item.get("state", "")), str(item.get("lastError", ""))
                if state in ("done", "failed"):
                    break
                self.sleep(min(self.WORK_POLL_SECONDS, max(0.0, self.deadline - self.clock.monotonic())))
        except ControlPlaneError as e:
            self.fail(what, f"{key}: the control plane refused or did not answer: {e}", fix)
            return
        finally:
            control_plane.close()
        took = self.clock.monotonic() - started
        if state == "done":
            self.ok(what, f"{key} enqueued and done in {took:.1f} s")
        elif state == "failed":
            self.fail(what, f"{key} failed: {error}", fix)
        else:
            self.fail(what, f"{key} not done within the test's bound ({state or 'not listed'} after {took:.1f} s)", fix)


def _text(body: bytes, limit: int = 300) -> str:
    text = " ".join(body.decode("utf-8", "replace").split())
    return text if len(text) <= limit else text[:limit] + "..."
