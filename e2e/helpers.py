"""Helpers of the e2e suite: polling to a deadline, samplers, and manifests rendered with jinja2."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import urllib3
import yaml
from kubernetes import client, utils

MANIFESTS = Path(__file__).parent / "manifests"
IMAGE = "localhost/gpu-agent:dev"
_env = jinja2.Environment(loader=jinja2.FileSystemLoader(MANIFESTS), undefined=jinja2.StrictUndefined)


# The node this process's GPU Pods go to: the one it owns when it runs beside other workers (e2e/conftest.py
# fake_gpus), so that its Pods never take another worker's GPUs; None: wherever the scheduler finds GPUs.
GPU_NODE: str | None = None


def render(template: str, **values: Any) -> list[dict[str, Any]]:
    text = _env.get_template(template).render(image=IMAGE, **{"gpu_node": GPU_NODE, **values})
    return [doc for doc in yaml.safe_load_all(text) if doc]


def apply(api: client.ApiClient, namespace: str, template: str, **values: Any) -> None:
    for doc in render(template, namespace=namespace, **values):
        utils.create_from_dict(api, doc, namespace=namespace)


def transient(error: BaseException) -> bool:
    """Whether an error of a poll's read says nothing about what the test waits for: the API server busy or
    restarting (429, 5xx) or the connection to it failing. Anything else (a 404, a 403, a TypeError) is an answer."""
    if isinstance(error, client.ApiException):
        return error.status == 429 or (error.status or 0) >= 500
    return isinstance(error, urllib3.exceptions.HTTPError)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.25, *,
               clock=time.monotonic, sleep=time.sleep):
    """Poll `predicate` every `interval` seconds until it returns something true (returned) or `timeout` passes
    (AssertionError naming `what`). A transient error of one read (see `transient`) is polled through, as
    gomega's Eventually does, and named in the timeout's message if it was the last thing seen; any other error
    ends the wait at once."""
    deadline = clock() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            last_error = None
        except Exception as error:  # re-raised at once unless transient
            if not transient(error):
                raise
            value, last_error = None, error
        if value:
            return value
        if clock() > deadline:
            seen = f" (the last read failed: {type(last_error).__name__}: {last_error})" if last_error else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{seen}") from last_error
        sleep(interval)


def pod_log(core: client.CoreV1Api, namespace: str, pod: str, container: str | None = None) -> str:
    """The Pod's log so far, for polls: "" while there is none yet. The client answers an empty log with None,
    and a container that has not started (or a kubelet being restarted) with an ApiException."""
    try:
        return core.read_namespaced_pod_log(pod, namespace, container=container, _request_timeout=10) or ""
    except client.ApiException:
        return ""


def api_server_requests(api: client.ApiClient, verb: str, resource: str, subresource: str = "") -> float:
    """How many requests of `verb` on `resource` (and `subresource`) the API server has answered since it started,
    whoever sent them: its own count (`apiserver_request_total` on /metrics), every code."""
    request = api.param_serialize("GET", "/metrics", header_params={"Accept": "text/plain"}, auth_settings=["BearerToken"])
    response = api.call_api(*request, _request_timeout=10)
    response.read()
    assert response.status == 200, f"/metrics of the API server answered {response.status}"
    wanted = {f'verb="{verb}"', f'resource="{resource}"', f'subresource="{subresource}"', 'group=""'}
    total = 0.0
    for line in response.data.decode().splitlines():
        if line.startswith("apiserver_request_total{"):
            labels, _, value = line.rpartition(" ")
            if wanted <= set(labels[len("apiserver_request_total{"):-1].split(",")):
                total += float(value)
    return total


def token_client(api: client.ApiClient, token: str) -> client.ApiClient:
    """`api`'s cluster, authenticated by `token` alone."""
    config = copy.copy(api.configuration)
    config.api_key, config.api_key_prefix = {"authorization": "Bearer " + token}, {}
    config.cert_file = config.key_file = None  # a client certificate would authenticate first
    return client.ApiClient(config)


def pod_bound_client(api: client.ApiClient, pod: client.V1Pod, seconds: int = 600) -> client.ApiClient:
    """A client authenticated as the kubelet authenticates `pod`: a token of its ServiceAccount bound to the Pod,
    whose user carries the Pod's node (user extra authentication.kubernetes.io/node-name)."""
    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        pod.spec.service_account_name, pod.metadata.namespace, client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=seconds, bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid)))).status.token
    return token_client(api, token)


def impersonating(api: client.ApiClient, user: str) -> client.ApiClient:
    """`api`'s credentials (an admin's), acting as `user` (e.g. system:serviceaccount:NS:NAME)."""
    return client.ApiClient(api.configuration, header_name="Impersonate-User", header_value=user)


def admission(call: Callable[[], object]) -> tuple[int, str]:
    """(201, "") when the API server admits `call()` (a create), else (its status, its message)."""
    try:
        call()
        return 201, ""
    except client.ApiException as e:
        try:
            return e.status, json.loads(e.body)["message"]
        except (TypeError, ValueError, KeyError):
            return e.status, str(e.body)


def pod_http_get(core: client.CoreV1Api, namespace: str, pod: str, port: int, path: str,
                 timeout: float | None = None) -> tuple[int, Any]:
    """GET through the API server's pod proxy; (status, parsed JSON or text). A 503 is an answer too.
    `timeout`: seconds for the whole call (a timeout raises)."""
    import json

    try:
        resp = core.connect_get_namespaced_pod_proxy_with_path(f"{pod}:{port}", namespace, path, _preload_content=False,
                                                               _request_timeout=timeout)
        status, body = resp.status, resp.data
    except client.ApiException as e:
        status, body = e.status, (e.body or b"")
    text = body.decode() if isinstance(body, bytes) else str(body)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def exec_api(api: client.ApiClient) -> client.CoreV1Api:
    """A CoreV1Api on an ApiClient of its own, for `kubernetes.stream`: it swaps the request path of the client it
    is given for the call's whole length, so another thread's call on a shared client in that window went out as a
    websocket handshake (the bench saw a pod list fail with "Handshake status 200 OK")."""
    return client.CoreV1Api(client.ApiClient(api.configuration))


def exec_python(api: client.ApiClient, namespace: str, pod: str, code: str) -> str:
    """Run Python in a pod's container (the image carries the agent's own client)."""
    from kubernetes.stream import stream

    return stream(exec_api(api).connect_get_namespaced_pod_exec, pod, namespace,
                  command=["python3", "-c", code], stderr=True, stdin=False, stdout=True, tty=False)


def exec_in(api: client.ApiClient, namespace: str, pod: str, container: str, argv: list[str]) -> str:
    """Run a command in one container of a pod; its stdout and stderr together."""
    from kubernetes.stream import stream

    return stream(exec_api(api).connect_get_namespaced_pod_exec, pod, namespace, container=container,
                  command=argv, stderr=True, stdin=False, stdout=True, tty=False, _request_timeout=60)


def domain_status(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict:
    """A GPUDomain's status; {} while it cannot be read (not made yet, or the read failed)."""
    try:
        return custom.get_namespaced_custom_object("gpu-agent.io", "v1beta1", namespace, "gpudomains", name).get("status") or {}
    except client.ApiException:
        return {}


class Sampler:
    """Calls `probe` every `interval` seconds in a thread and keeps (monotonic time, value)."""

    def __init__(self, probe, interval: float) -> None:
        self.probe, self.interval = probe, interval
        self.samples: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                value = self.probe()
            except Exception as e:  # noqa: BLE001 - recorded, judged by the test
                value = f"error: {type(e).__name__}"
            self.samples.append((started, value))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def drops(samples: list[tuple[float, object]], good, until: float | None = None) -> list[float]:
    """Durations of the runs of samples where `good(value)` is false; with `until`, a run still
    open at the last sample counts up to that time."""
    out, start = [], None
    for t, v in samples:
        if not good(v) and start is None:
            start = t
        elif good(v) and start is not None:
            out.append(t - start)
            start = None
    if start is not None and until is not None:
        out.append(until - start)
    return out


class LogFollower:
    """Follows one pod's log (kubelet timestamps) in a thread until its container ends; keeps every line with the
    moment it arrived, so the lines of a shutdown can be read after the pod is gone."""

    def __init__(self, core: client.CoreV1Api, namespace: str, pod: str) -> None:
        self.core, self.namespace, self.pod = core, namespace, pod
        self.lines: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"log-{pod}")

    def _run(self) -> None:
        try:
            stream = self.core.read_namespaced_pod_log(self.pod, self.namespace, follow=True, timestamps=True,
                                                       since_seconds=1, _preload_content=False, _request_timeout=(5, 120))
            for line in stream.stream(amt=None):  # urllib3 chunks; split below
                for text in line.decode(errors="replace").splitlines():
                    self.lines.append((time.monotonic(), text))
        except Exception as e:  # noqa: BLE001 - recorded, printed by the test
            self.errors.append(f"{type(e).__name__}: {e}"[:200])

    def __enter__(self) -> LogFollower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(60)


class PodLogs(Sampler):
    """Every pod of a selector followed from the moment a list finds it (LogFollower each), so that the lines of a
    pod that shut down and is gone can still be read: a hand-over's old leader's, say. A Sampler whose probe, once a
    second, lists the pods and follows those not yet followed (a failed list is a sample's error; the next tries)."""

    def __init__(self, core: client.CoreV1Api, namespace: str, selector: str) -> None:
        self.core, self.namespace, self.selector = core, namespace, selector
        self.followers: dict[str, LogFollower] = {}
        super().__init__(self._follow_new, 1.0)

    def _follow_new(self) -> int:
        for pod in self.core.list_namespaced_pod(self.namespace, label_selector=self.selector, _request_timeout=5).items:
            name = pod.metadata.name
            if name not in self.followers and pod.status.phase in ("Running", "Succeeded", "Failed"):
                self.followers[name] = LogFollower(self.core, self.namespace, name).__enter__()
        return len(self.followers)

    def between(self, start: float, end: float) -> dict[str, list[tuple[float, str]]]:
        """Each pod's lines that arrived between two monotonic moments."""
        return {pod: [(t, text) for t, text in f.lines if start <= t <= end] for pod, f in self.followers.items()}

