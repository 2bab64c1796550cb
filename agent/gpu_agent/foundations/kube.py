"""Kubernetes access: building API clients (in-cluster first, then kubeconfig), and the one
list-then-watch loop every local view of cluster objects is kept by."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client, config, watch


def api_client(kubeconfig: str = "") -> client.ApiClient:
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def items_of(listed: Any) -> list[Any]:
    return listed["items"] if isinstance(listed, dict) else listed.items


def _resource_version(listed: Any) -> str:
    return listed["metadata"]["resourceVersion"] if isinstance(listed, dict) else listed.metadata.resource_version


def list_then_watch(list_call: Callable[..., Any], *args: Any, on_list: Callable[[Any], None],
                    on_event: Callable[[str, Any], None], on_error: Callable[[Exception], None],
                    stop: threading.Event, retry_seconds: float = 1.0, resync_seconds: int = 240, **kwargs: Any) -> None:
    """Keep a local view current: list (handing the whole list to `on_list`), then watch from
    the list's resourceVersion (each event to `on_event(type, object)`). A watch that ends
    (its timeout, a 410 Gone, an outage) lists again; an error goes to `on_error`, then a pause.
    Works for typed and custom-object list calls alike. Runs until `stop` is set."""
    while not stop.is_set():
        try:
            listed = list_call(*args, **kwargs)
            on_list(listed)
            w = watch.Watch()
            for event in w.stream(list_call, *args, resource_version=_resource_version(listed),
                                  timeout_seconds=resync_seconds, **kwargs):
                on_event(event["type"], event["object"])
                if stop.is_set():
                    w.stop()
        except Exception as e:  # noqa: BLE001 - reported by the caller, then list again
            on_error(e)
            stop.wait(retry_seconds)
