"""The labels GPU feature discovery would put on a node with these GPUs, kept current.

    layout applied (count, product, memory) -> desired labels -> NodeLabeler (patch on change, retry) -> Node

A fake GPU node should look like a real one to everything that selects GPU nodes: the
gpu-agent chart's node agent (its default nodeAffinity matches `nvidia.com/gpu.present=true`),
the GPU operator's operands, users' own selectors. So each fake-gpu pod labels its node the way
GPU feature discovery does (present, count, product with spaces as dashes, memory in MiB) and
marks the labels as its own with `gpu-agent.io/fake-gpu-release=<release>`; the chart's
post-delete hook (`fake-gpu unlabel-nodes`) removes them from exactly the nodes so marked.

`present` stays "true" at 0 GPUs: a GPU node whose GPUs all fell off is still a GPU node, and the
node agent must stay on it to notice them come back. The pods never remove labels themselves: a
rolling update or a drain would then take every node agent off the node for a moment.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from fake_gpu.real_gpu_guard import DEFAULT_RESOURCE, owner_annotation
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT

log = get_logger("fake_gpu.node_labels")

RELEASE = "gpu-agent.io/fake-gpu-release"


def gpu_labels(resource: str = DEFAULT_RESOURCE) -> tuple[str, str, str, str]:
    """GFD's label names for `resource` (present, count, product, memory): `nvidia.com/gpu.present` and so on by
    default; another resource name (chart value resourceName) gets its own, so a node's real labels stay untouched."""
    return f"{resource}.present", f"{resource}.count", f"{resource}.product", f"{resource}.memory"


PRESENT, COUNT, PRODUCT, MEMORY = gpu_labels()
ALL = (PRESENT, COUNT, PRODUCT, MEMORY, RELEASE)

_NOT_IN_A_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]")


def product_label(product: str) -> str:
    """GFD's form: spaces become dashes; anything else a label value cannot hold too; at most 63
    characters, starting and ending alphanumeric."""
    value = _NOT_IN_A_LABEL_VALUE.sub("-", product.strip())[:63]
    return value.strip("-_.") or "unknown"


def desired(count: int, product: str, memory_mib: int, release: str,
            resource: str = DEFAULT_RESOURCE) -> dict[str, str]:
    present, count_label, product_name, memory = gpu_labels(resource)
    return {present: "true", count_label: str(count), product_name: product_label(product), memory: str(memory_mib),
            RELEASE: release}


class NodeLabeler:
    """Holds the labels this node should carry and writes them when they change; a failed write is
    retried (`run`'s loop) until one succeeds or the daemon stops. `patch_node(name, body)` is
    CoreV1Api.patch_node, or a fake in unit tests."""

    RETRY_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)

    def __init__(self, node: str, patch_node: Callable[[str, dict[str, Any]], object]) -> None:
        self.node = node
        self.patch_node = patch_node
        self.want: dict[str, str] | None = None
        self.written: dict[str, str] | None = None
        self.failures = 0
        self.changed = threading.Event()
        self._lock = threading.Lock()

    def set(self, labels: dict[str, str]) -> None:
        with self._lock:
            self.want = dict(labels)
        self.changed.set()

    def sync(self) -> bool:
        """One write if the node's labels are not yet what they should be. True when they are."""
        with self._lock:
            want = self.want
        if want is None or want == self.written:
            return True
        try:
            self.patch_node(self.node, {"metadata": {"labels": want}})
        except Exception as e:  # noqa: BLE001 - any failure is retried; the reason is logged
            self.failures += 1
            log.warning("labelling node %s failed (%s); retrying", self.node, getattr(e, "reason", None) or e)
            return False
        self.written = want
        self.failures = 0
        log.info("node %s labelled %s", self.node, ", ".join(f"{k}={v}" for k, v in sorted(want.items())))
        return True

    def retry_after(self) -> float:
        return self.RETRY_SECONDS[min(self.failures, len(self.RETRY_SECONDS)) - 1] if self.failures else 0.0

    def run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            self.changed.clear()
            wait = None if self.sync() else self.retry_after()
            # Woken by a change (or stop: the daemon sets `changed` too); a failed write retries after `wait`.
            self.changed.wait(wait)


def unlabel_nodes(core: Any, release: str, resource: str = DEFAULT_RESOURCE) -> list[str]:
    """The post-delete hook's work: take this release's labels off every node it marked, and its claim on the node's
    resource (real_gpu_guard.owner_annotation), so that a real device plugin there later is not taken for fake-gpu."""
    marked = core.list_node(label_selector=f"{RELEASE}={release}", _request_timeout=REQUEST_TIMEOUT).items
    names = [n.metadata.name for n in marked]
    for name in names:
        core.patch_node(name, {"metadata": {"labels": {k: None for k in (*gpu_labels(resource), RELEASE)},
                                            "annotations": {owner_annotation(resource): None}}},
                        _request_timeout=REQUEST_TIMEOUT)
    return names
