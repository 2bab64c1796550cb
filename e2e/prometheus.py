"""A real Prometheus for the alert tests (issue 50, part 2): the server of Debian's prometheus package, which
ci/scripts/install-tools.sh takes out beside promtool into the CI cache (no install: no service, no user), started
by a test for its own duration on a free loopback port with a data folder of its own, evaluating the chart's
PrometheusRule as `helm template` renders it, and sending its alerts to an Alertmanager stand-in on loopback that
records what arrives (each alert's startsAt, and its endsAt once resolved: the firing and resolved times Prometheus
itself gives it). Used by agent/tests/integration/test_alerts.py (the cluster agent on loopback, a static target)
and e2e/test_alerts.py (a release's agents, found as the chart's PodMonitors select them).

Debian builds its prometheus without Kubernetes discovery: `kubernetes_sd_configs` is refused as an unknown field
(and consul's), while file, HTTP, DNS and Docker discovery are in. So the pods a PodMonitor's Prometheus would
discover are served to this one by the test itself (PodDiscovery: `http_sd_configs` on loopback, each refresh a list
of the namespace's pods from the API server, turned into the targets and `__meta_kubernetes_pod_*` labels that
Prometheus' own pod discovery makes of them), and the relabelling the Prometheus operator generates for a PodMonitor
applies to them unchanged (pod_monitor_scrape_config).

Every read of its HTTP API names a timeout; every wait polls to a deadline."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import requests
import yaml

from e2e.cluster import CI_TOOLS
from e2e.release import BASE, CHART, helm

VERSION = "2.42.0"  # Debian 12's (ci/scripts/install-tools.sh, prometheus_version)
MISSING = (f"the prometheus server binary is not in {CI_TOOLS} nor on PATH: `bash ci/scripts/install-tools.sh` "
           f"takes it (and promtool) out of Debian's prometheus package {VERSION}")


def binary() -> str | None:
    """The prometheus server: the CI cache's first, then PATH; None when neither has it."""
    cached = CI_TOOLS / "prometheus"
    return str(cached) if cached.exists() else shutil.which("prometheus")


def render(release: str, namespace: str, *sets: str) -> list[dict[str, Any]]:
    """The chart as `helm template` renders it with the PrometheusRule on (metrics.prometheusRule.enabled)."""
    out = helm("template", release, str(CHART), "--namespace", namespace, *BASE,
               "--set", "metrics.prometheusRule.enabled=true", *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def rule_groups(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rule groups of the rendered PrometheusRule: what a Prometheus operator hands its Prometheus."""
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alert_for(**alerts: str) -> list[str]:
    """--set arguments giving alerts (values keys, e.g. clusterAgentNotReady="2s") a `for` of their own."""
    return [a for key, hold in alerts.items() for a in ("--set", f"metrics.prometheusRule.alerts.{key}.for={hold}")]


def label_name(key: str) -> str:
    """A Kubernetes label key as Prometheus names its meta label: every character outside [a-zA-Z0-9_] an _."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `kubernetes_sd_configs` of role pod makes of these pods (the API's JSON: a PodList's items), as target
    groups (Prometheus 2.42, discovery/kubernetes/pod.go): a pod without an IP yet gives none; every container port a
    target at podIP:port, with the pod's labels (name, IP, ready, phase, node, host IP, UID, controller, its labels
    and annotations, each with a ...present twin) and the container's (name, image, port name, number, protocol, init);
    a container without ports one target at the pod's IP."""
    groups: list[dict[str, Any]] = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        if not status.get("podIP"):
            continue
        ready = next((c["status"].lower() for c in status.get("conditions") or [] if c["type"] == "Ready"), "unknown")
        labels = {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"],
                  "__meta_kubernetes_pod_ip": status["podIP"], "__meta_kubernetes_pod_ready": ready,
                  "__meta_kubernetes_pod_phase": status.get("phase", ""),
                  "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
                  "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
                  "__meta_kubernetes_pod_uid": meta.get("uid", "")}
        controller = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        if controller:
            labels["__meta_kubernetes_pod_controller_kind"] = controller["kind"]
            labels["__meta_kubernetes_pod_controller_name"] = controller["name"]
        for kind in ("label", "annotation"):
            for key, value in (meta.get(kind + "s") or {}).items():
                labels[f"__meta_kubernetes_pod_{kind}_{label_name(key)}"] = value
                labels[f"__meta_kubernetes_pod_{kind}present_{label_name(key)}"] = "true"
        containers = [(c, "false") for c in spec.get("containers") or []]
        containers += [(c, "true") for c in spec.get("initContainers") or []]
        for container, init in containers:
            own = {"__meta_kubernetes_pod_container_name": container["name"],
                   "__meta_kubernetes_pod_container_image": container.get("image", ""),
                   "__meta_kubernetes_pod_container_init": init}
            for port in container.get("ports") or [None]:
                target = {**labels, **own, "__address__": status["podIP"]}
                if port is not None:
                    target.update({"__address__": f"{status['podIP']}:{port['containerPort']}",
                                   "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                                   "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                                   "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")})
                address = target.pop("__address__")
                groups.append({"targets": [address], "labels": target})
    return groups


def pod_monitor_scrape_config(monitor: dict[str, Any], discovery: str,
                              api_server: dict[str, Any] | None = None) -> dict[str, Any]:
    """The scrape config the Prometheus operator makes of a PodMonitor with one podMetricsEndpoint (its
    generatePodMonitorConfig): its namespace's pods (`discovery`: the URL of a PodDiscovery, where the operator names
    kubernetes_sd_configs of role pod in that namespace); of them the pods not done (phase neither Succeeded nor
    Failed) whose labels match its selector, at their container port of the endpoint's name; the labels namespace,
    container, pod, endpoint and job = namespace/name (which the chart's alert selector expects); instance = the
    pod's address; its interval.

    `api_server` (url, and tls_config and authorization: the credentials to it) where this host does not route to
    the pods: each pod's /metrics read through the API server's pod proxy instead
    (https://API/api/v1/namespaces/NS/pods/POD:PORT/proxy/PATH), its instance label still the pod's address."""
    meta, spec = monitor["metadata"], monitor["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    port, path = endpoint["port"], endpoint.get("path", "/metrics")
    relabel: list[dict[str, Any]] = [
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        *({"action": "keep", "regex": f"({re.escape(value)});true",
           "source_labels": [f"__meta_kubernetes_pod_label_{label_name(key)}",
                             f"__meta_kubernetes_pod_labelpresent_{label_name(key)}"]}
          for key, value in spec["selector"]["matchLabels"].items()),
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": re.escape(port)},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": port},
    ]
    config: dict[str, Any] = {
        "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/0",
        "metrics_path": path,
        "http_sd_configs": [{"url": f"{discovery}?namespace={meta['namespace']}", "refresh_interval": "1s"}],
        "relabel_configs": relabel,
    }
    if "interval" in endpoint:
        config["scrape_interval"] = config["scrape_timeout"] = endpoint["interval"]
    if api_server is not None:
        host = api_server["url"].split("://", 1)[1].rstrip("/")
        relabel += [
            {"source_labels": ["__address__"], "target_label": "instance"},  # the pod's address, as scraped directly
            {"source_labels": ["__meta_kubernetes_namespace", "__meta_kubernetes_pod_name",
                               "__meta_kubernetes_pod_container_port_number"], "regex": "(.+);(.+);(.+)",
             "target_label": "__metrics_path__", "replacement": f"/api/v1/namespaces/$1/pods/$2:$3/proxy{path}"},
            {"target_label": "__address__", "replacement": host},
        ]
        config.update({"scheme": "https", **{k: v for k, v in api_server.items() if k != "url"}})
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def seconds_of(stamp: str) -> float:
    """An RFC 3339 time as Prometheus writes it (nanoseconds; Z or an offset) -> seconds since the epoch."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    assert m, f"not an RFC 3339 time: {stamp!r}"
    whole = datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3))).timestamp()
    return whole + float("0." + (m.group(2) or "0"))


class Loopback:
    """An HTTP server on a free loopback port, on a thread of its own, answering through `answer(method, path, body)
    -> (status, JSON-able body)`; `close()` stops it."""

    def __init__(self, answer: Callable[[str, str, bytes], tuple[int, Any]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, reply = answer(self.command, self.path, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer  # http.server calls do_<METHOD>

            def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reports what it needs
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class Alertmanager(Loopback):
    """An Alertmanager stand-in: what Prometheus POSTs to /api/v2/alerts, each alert with the wall time it arrived.
    Prometheus sends an alert when it fires (startsAt: when it fired) and when it resolves (endsAt: when it resolved),
    and again every resend delay while it fires."""

    def __init__(self) -> None:
        self.received: list[tuple[float, dict[str, Any]]] = []
        self._lock = threading.Lock()
        super().__init__(self._answer)

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        if (method, path) != ("POST", "/api/v2/alerts"):
            return 404, {}
        arrived = time.time()
        with self._lock:
            self.received.extend((arrived, alert) for alert in json.loads(body))
        return 200, {}

    def sent(self, alertname: str) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return [(t, a) for t, a in self.received if a["labels"].get("alertname") == alertname]

    def resolved(self, alertname: str) -> dict[str, Any] | None:
        """The last notification that `alertname` resolved (its endsAt is in the past when sent), or None."""
        for arrived, alert in reversed(self.sent(alertname)):
            if seconds_of(alert["endsAt"]) <= arrived:
                return alert
        return None


class PodDiscovery(Loopback):
    """Prometheus' pod discovery, served to its `http_sd_configs` (see the module's docstring): GET /pods?namespace=NS
    lists that namespace's pods with `list_pods(namespace)` (the API's PodList as JSON) and answers what
    kubernetes_sd_configs of role pod would make of them (pod_targets). A list that fails is answered 503, which
    Prometheus takes as "keep the targets you have", as its own discovery does while the API server is away."""

    def __init__(self, list_pods: Callable[[str], dict[str, Any]]) -> None:
        self.lists = 0
        self.failures: list[str] = []
        self._list_pods = list_pods
        super().__init__(self._answer)
        self.url = f"http://{self.address}/pods"

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        url = urlsplit(path)
        namespace = parse_qs(url.query).get("namespace", [""])[0]
        if (method, url.path) != ("GET", "/pods") or not namespace:
            return 404, {}
        try:
            pods = self._list_pods(namespace)["items"]
        except Exception as e:  # noqa: BLE001 (any failure of the list: answered, kept, named by the test)
            self.failures.append(f"{type(e).__name__}: {e}"[:300])
            return 503, {}
        self.lists += 1
        return 200, pod_targets(pods)


class Prometheus:
    """One prometheus process under `folder` (its configuration, rules, data and log), alerting `alertmanager`.
    `scrape_configs` and the global intervals are Prometheus' own configuration; `rules` the rule groups."""

    def __init__(self, folder: Path, scrape_configs: list[dict[str, Any]], rules: list[dict[str, Any]],
                 alertmanager: Alertmanager, scrape_interval: str = "1s", evaluation_interval: str = "1s") -> None:
        found = binary()
        assert found, MISSING
        self.binary, self.folder = found, folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rules.yaml").write_text(yaml.safe_dump({"groups": rules}, sort_keys=False))
        config = {
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": evaluation_interval},
            "rule_files": [str(folder / "rules.yaml")],
            "alerting": {"alertmanagers": [{"api_version": "v2",
                                            "static_configs": [{"targets": [alertmanager.address]}]}]},
            "scrape_configs": scrape_configs,
        }
        self.config = folder / "prometheus.yaml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = folder / "prometheus.log"
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> Prometheus:
        """Start it on a free loopback port (another, up to 3 tries, if the port was taken before it bound it) and
        wait for /-/ready."""
        for _ in range(3):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen([self.binary, f"--config.file={self.config}",
                                              f"--storage.tsdb.path={self.folder / 'data'}",
                                              f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"],
                                             stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                if self._ready():
                    return self
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.stop()
                raise AssertionError(f"prometheus not ready within {timeout}s: {self.tail()}")
            if "address already in use" not in self.tail():
                raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.tail()}")
        raise AssertionError(f"prometheus found no free port in 3 tries: {self.tail()}")

    def _ready(self) -> bool:
        try:
            return requests.get(self.url + "/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    # its HTTP API ----------------------------------------------------------------------------------------------------
    def api(self, path: str, **params: str) -> Any:
        r = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=5)
        body = r.json()
        assert r.status_code == 200 and body.get("status") == "success", (path, params, r.status_code, body)
        return body["data"]

    def targets(self) -> list[dict[str, Any]]:
        targets: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return targets

    def query(self, promql: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=promql)["result"]
        return result

    def alerts(self, alertname: str | None = None) -> list[dict[str, Any]]:
        """The active alerts (pending or firing) of /api/v1/alerts; a resolved alert is not listed."""
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return [a for a in alerts if alertname is None or a["labels"]["alertname"] == alertname]

    def last_evaluation(self) -> float:
        """When the rule groups were last evaluated, all of them (seconds since the epoch; 0 before the first)."""
        groups = self.api("rules")["groups"]
        stamps = [seconds_of(g["lastEvaluation"]) if not g["lastEvaluation"].startswith("0001-") else 0.0
                  for g in groups]
        return min(stamps) if stamps else 0.0

    def fired_at(self, alertname: str, window: str = "15m") -> list[float]:
        """The evaluation times at which `alertname` was firing (the ALERTS series Prometheus writes), oldest first."""
        series = self.query(f'ALERTS{{alertname="{alertname}",alertstate="firing"}}[{window}]')
        return sorted(float(ts) for s in series for ts, _ in s["values"])

    def wait_alert(self, alertname: str, state: str, timeout: float, **labels: str) -> Watched:
        """Poll /api/v1/alerts every 0.1 s until `alertname` (with `labels`) is in `state` (pending or firing), or gone
        (state "inactive": no such alert listed). Returns what was seen on the way."""
        seen = Watched()
        deadline = time.monotonic() + timeout
        while True:
            matching = [a for a in self.alerts(alertname) if all(a["labels"].get(k) == v for k, v in labels.items())]
            now = time.time()
            for a in matching:
                seen.first.setdefault(a["state"], now)
            if (state == "inactive" and not matching) or any(a["state"] == state for a in matching):
                seen.at = now
                seen.alert = next((a for a in matching if a["state"] == state), None)
                return seen
            if time.monotonic() > deadline:
                raise AssertionError(f"{alertname}{labels or ''} not {state} within {timeout}s; listed: {matching}; "
                                     f"targets: {[(t['labels'], t['health'], t['lastError']) for t in self.targets()]}")
            time.sleep(0.1)


class Watched:
    """What a wait_alert saw: when (wall time) each state was first listed, when the state waited for was, the alert."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.at = 0.0
        self.alert: dict[str, Any] | None = None
