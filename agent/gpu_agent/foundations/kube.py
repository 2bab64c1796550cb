"""Kubernetes access: building API clients (in-cluster first, then kubeconfig), the one
list-then-watch loop every local view of cluster objects is kept by, and a lean list call for
core/v1 objects.

Footprint: the `kubernetes` package loads each API group's module on first use, and
`client.CoreV1Api` alone costs about 22 MiB of RSS (thousands of generated methods with their
docstrings and validators). A role that only lists and watches one core kind uses
`core_v1_list` instead, which goes through the same ApiClient (auth, TLS, proxies) and hands back
plain dicts.

Client-side rate limit: every ApiClient `api_client` builds with a `limit` sends each request through its own
token bucket (foundations/ratelimit.py: client-go's QPS and burst). The hook is `ApiClient.call_api`, which every
request of the client goes through: each generated API method (through `_call_with_legacy_options`),
`core_v1_list`'s lean list, and so a `watch.Watch().stream` of either (it calls the list method with
watch=True: one request, one token, when the watch starts; the events streamed over it take none). The
Watch's own ApiClient only deserializes events; it sends nothing. Retries inside one call (urllib3's, on a
failed connection) are not requests the API server answered and take no further token."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.ratelimit import ApiLimit, TokenBucket
from gpu_agent.foundations.threads import StopEvent

log = get_logger(__name__)

# Every call to the API server names a timeout: a hung call would hold whatever waits on it (a work
# item, a lease, a shutdown). Ten seconds is well inside what the callers protect.
REQUEST_TIMEOUT = 10.0
# A watch has the server end it (timeout_seconds); this much longer the client gives up on a connection
# that went silent without ending.
WATCH_GRACE = 30.0


def api_status(e: BaseException) -> int | None:
    """The HTTP status of an API error (kubernetes.client.ApiException or a fake of it); None: no answer."""
    status = getattr(e, "status", None)
    return status if isinstance(status, int) and status > 0 else None


def api_message(e: BaseException) -> str:
    """The API server's own message (its Status body's), at most 300 characters; names no secret."""
    body = getattr(e, "body", None)
    try:
        message = str(json.loads(body)["message"]) if body else ""
    except (TypeError, ValueError, KeyError):
        message = str(body or "")
    return message[:300]


class LimitedApiClient(client.ApiClient):
    """An ApiClient whose every request first takes its turn from `limiter` (None: no limit)."""

    limiter: TokenBucket | None = None

    def call_api(self, method: str, url: str, header_params: Any = None, body: Any = None, post_params: Any = None,
                 _request_timeout: Any = None) -> Any:
        if self.limiter is not None:
            self.limiter.take(wait_bound(_request_timeout), what=f"{method} {urlsplit(url).path}")
        return super().call_api(method, url, header_params=header_params, body=body, post_params=post_params,
                                _request_timeout=_request_timeout)


def wait_bound(request_timeout: Any) -> float:
    """How long a request may wait for its turn: its timeout (a (connect, read) pair: both), or REQUEST_TIMEOUT
    for one that names none (every call of the agents names one)."""
    if isinstance(request_timeout, (int, float)) and not isinstance(request_timeout, bool) and request_timeout > 0:
        return float(request_timeout)
    if isinstance(request_timeout, tuple) and len(request_timeout) == 2:
        return float(sum(t for t in request_timeout if isinstance(t, (int, float))))
    return REQUEST_TIMEOUT


def api_client(kubeconfig: str = "", *, limit: ApiLimit | None, connections: int | None = None) -> client.ApiClient:
    """A client of the API server (in-cluster first, then the kubeconfig). `limit`: its client-side rate limit
    (a bucket of its own); None: none, which only a short-lived tool should ask for (the hooks). `connections`:
    how many open connections it keeps for reuse, for a user that holds many at once (the client's default is 5
    per CPU). A pool smaller than the connections in use closes each one it cannot keep when it is released,
    and the next call pays a new TCP and TLS handshake, on both ends."""
    if kubeconfig:
        # config.new_client_from_config's steps, with this module's client class
        configuration = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        api = LimitedApiClient(configuration=configuration)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = LimitedApiClient()
    api.limiter = limit.bucket() if limit is not None else None
    if connections is not None:
        # read when the pool for the API server's host is made, at the first call (none has been made yet)
        api.rest_client.pool_manager.connection_pool_kw["maxsize"] = connections
    return api


def core_v1_list(api: client.ApiClient | None, plural: str) -> Callable[..., Any]:
    """`list_namespaced_<kind>` of core/v1 `plural` (e.g. "configmaps") as plain dicts; it takes
    the keyword arguments `watch.Watch().stream` and `list_then_watch` pass, so it can be watched.
    Without a namespace it lists a cluster-scoped kind (e.g. "nodes"); without `api`, the default client
    (as the generated API classes do)."""
    api = api if api is not None else client.ApiClient()
    def list_namespaced(namespace: str | None = None, *, field_selector: str | None = None, label_selector: str | None = None,
                        resource_version: str | None = None, timeout_seconds: int | None = None,
                        watch: bool | None = None, allow_watch_bookmarks: bool | None = None,
                        _preload_content: bool = True, _request_timeout: Any = None) -> Any:
        query = [(name, value) for name, value in (
            ("fieldSelector", field_selector), ("labelSelector", label_selector), ("resourceVersion", resource_version),
            ("timeoutSeconds", timeout_seconds), ("watch", watch), ("allowWatchBookmarks", allow_watch_bookmarks))
            if value is not None]
        path = f"/api/v1/namespaces/{{namespace}}/{plural}" if namespace is not None else f"/api/v1/{plural}"
        request = api.param_serialize("GET", path, path_params={"namespace": namespace} if namespace is not None else {},
                                      query_params=query, header_params={"Accept": "application/json"},
                                      auth_settings=["BearerToken"])
        response = api.call_api(*request, _request_timeout=_request_timeout)
        if not 200 <= response.status < 300:
            response.read()
            raise ApiException(status=response.status, reason=response.reason)
        if not _preload_content:
            return response.response
        response.read()
        return json.loads(cast(bytes, response.data))  # read() above filled it
    list_namespaced.__name__ = f"list_namespaced_{plural}"
    return list_namespaced


def device_count(resources: Any, name: str) -> int:
    """How many of the extended resource `name` a node's capacity or allocatable map holds: a Kubernetes quantity,
    which the API server writes in its canonical form (5000 reads "5k"). Missing, malformed or not a whole number: 0."""
    try:
        value = parse_quantity((resources or {}).get(name) or "0")
    except ValueError:
        return 0
    return max(0, int(value)) if value == int(value) else 0


def items_of(listed: Any) -> list[Any]:
    items: list[Any] = listed["items"] if isinstance(listed, dict) else listed.items
    return items


def _resource_version(listed: Any) -> str:
    version: str = listed["metadata"]["resourceVersion"] if isinstance(listed, dict) else listed.metadata.resource_version
    return version


def list_then_watch(list_call: Callable[..., Any], *args: Any, on_list: Callable[[Any], None],
                    on_event: Callable[[str, Any], None], on_error: Callable[[Exception], None],
                    stop: threading.Event, retry_seconds: float = 1.0, resync_seconds: int = 240, clock: Clock | None = None,
                    **kwargs: Any) -> None:
    """Keep a local view current as client-go's reflector does: list (handing the whole list to `on_list`),
    then watch from the list's resourceVersion (each event to `on_event(type, object)`), asking for bookmarks.
    A watch that ends cleanly (the server's `resync_seconds` timeout) is resumed from the last version seen,
    an event's or a bookmark's, without listing: a relist hands every caller the whole list again (the work
    Pods' watch wakes every item in flight on one). A 410 Gone (that version compacted away) lists again at
    once; any other error goes to `on_error`, then a pause of `retry_seconds`, then a list, since what the
    caller missed meanwhile is unknown. Works for typed and custom-object list calls alike. Runs until `stop`
    is set; its pauses wait on `clock` (the system's by default). A `stop` that is a StopEvent
    (foundations/threads.py) ends it at once, also while its watch waits on a quiet stream (its connection is shut
    down by the stop); a plain threading.Event, at the watch's next event or end."""
    clock = clock or SystemClock()
    version: str | None = None  # None: list first
    while not stop.is_set():
        just_listed = version is None
        take_back: list[Callable[[], None]] = []  # the registrations of this watch's connections with `stop`
        try:
            if version is None:
                listed = list_call(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
                if stop.is_set():
                    return  # stopped while listing: whoever stopped us no longer wants the view
                on_list(listed)
                version = _resource_version(listed)
            w = watch.Watch()
            for event in w.stream(_shut_down_on(stop, list_call, take_back), *args, resource_version=version,
                                  allow_watch_bookmarks=True, timeout_seconds=resync_seconds,
                                  _request_timeout=resync_seconds + WATCH_GRACE, **kwargs):
                if stop.is_set():  # checked before delivering: no event reaches a stopped caller
                    w.stop()
                    return
                version, just_listed = _event_version(event) or version, False
                if event["type"] != "BOOKMARK":  # a bookmark carries only a version, no change
                    on_event(event["type"], event["object"])
        except Exception as e:  # noqa: BLE001 - reported by the caller, then list again
            if stop.is_set():
                return  # stopped: the stop's shutdown of the connection ended the read, by design; no error
            version = None  # expired (410 Gone) or failed: the list is the only way back to a consistent view
            if isinstance(e, ApiException) and e.status == 410 and not just_listed:
                continue  # the usual expiry of an old version: list again at once, as the reflector does
            # an error, or a 410 on a version just listed, no event since (a server that cannot watch): report, pause
            on_error(e)
            clock.wait_blocking(stop, retry_seconds)
        finally:
            for forget in take_back:
                forget()


def _shut_down_on(stop: threading.Event, list_call: Callable[..., Any],
                  take_back: list[Callable[[], None]]) -> Callable[..., Any]:
    """`list_call` as the watch calls it (watch=True: it answers with the open response): each response it opens
    is shut down when `stop` is set, a StopEvent (foundations/threads.py), by the thread that sets it, so a read
    blocked on a quiet stream returns at once (the stream ends or fails; the loop sees `stop` and reports
    nothing), instead of at the next event or the server's timeout (`resync_seconds`, minutes). A response opened
    after the stop is shut down as soon as it is (the stop came while its request was in flight). Each
    registration goes into `take_back`, undone once the watch is over. With a plain threading.Event nothing is
    registered: the watch sees its stop at its next event. `wraps`: Watch reads the list call's signature and
    docstring (its return type, to deserialize events, and whether it watches or follows)."""
    if not isinstance(stop, StopEvent):
        return list_call

    @functools.wraps(list_call)
    def call(*args: Any, **kwargs: Any) -> Any:
        response = list_call(*args, **kwargs)
        take_back.append(stop.on_set(lambda: _shut_down(response)))
        return response
    return call


def _shut_down(response: Any) -> None:
    """Shut the read side of an open response's socket (urllib3 2.3's HTTPResponse.shutdown; from another thread:
    the read blocked in it returns). Shut down rather than closed: a close could wait on a TLS socket's lock,
    which the blocked read holds. A response already over (closed, released to its pool) has none to shut."""
    try:
        response.shutdown()
    except (AttributeError, ValueError, RuntimeError, OSError) as e:  # over already, or an older urllib3 (no shutdown)
        log.v(4, "shutting down a stopped watch's connection: %s", e)


def _event_version(event: dict[str, Any]) -> str | None:
    """The resourceVersion a watch event carries (typed or plain, a bookmark's too); None if it has none."""
    obj = event.get("raw_object", event.get("object"))
    if isinstance(obj, dict):
        version = (obj.get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None
    metadata = getattr(obj, "metadata", None)
    version = getattr(metadata, "resource_version", None)
    return str(version) if version else None
