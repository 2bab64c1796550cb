"""`fake-gpu set/cycle/status/fault --node NODE`: change a node's desired layout on a cluster.

A fault travels the same route as a count: into the node's entry of the layout ConfigMap, which the
fake-gpu DaemonSet on that node watches and applies (state file for the node agent, ListAndWatch
for kubelet), so a test can break one GPU of one node from outside the cluster.

Everything is checked before anything is written: the node must exist, fake-gpu must be
installed in the namespace (its layout ConfigMap exists; with several releases there, --release
picks one), and the layout must pass the same validation the DaemonSet applies. A refused change
leaves the previous layout in force.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes import client, config

from fake_gpu import node_labels
from fake_gpu.layout import Fault, LayoutError
from fake_gpu.layout_source import (
    LAYOUT_SELECTOR,
    LEGACY_CONFIGMAP,
    NodeLayout,
    max_count,
    parse_entry,
    validate,
    with_faults,
)
from fake_gpu.real_gpu_guard import DEFAULT_RESOURCE
from gpu_agent.foundations.kube import REQUEST_TIMEOUT


class ClusterLayout:
    def __init__(self, namespace: str, kubeconfig: str | None = None, release: str | None = None) -> None:
        try:
            config.load_kube_config(config_file=kubeconfig)
        except config.ConfigException:
            config.load_incluster_config()
        self.core = client.CoreV1Api()
        self.namespace = namespace
        self.release = release

    def _configmap(self) -> client.V1ConfigMap:
        selector = LAYOUT_SELECTOR + (f",app.kubernetes.io/instance={self.release}" if self.release else "")
        found = self.core.list_namespaced_config_map(self.namespace, label_selector=selector,
                                                     _request_timeout=REQUEST_TIMEOUT).items
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            releases = ", ".join(sorted((_meta(cm).labels or {}).get("app.kubernetes.io/instance", "?") for cm in found))
            raise LayoutError(f"namespace {self.namespace!r} holds several fake-gpu releases ({releases}); "
                              "pick one with --release NAME")
        if not self.release:
            try:
                return self.core.read_namespaced_config_map(LEGACY_CONFIGMAP, self.namespace,
                                                            _request_timeout=REQUEST_TIMEOUT)
            except client.ApiException as e:
                if e.status != 404:
                    raise
        which = f"release {self.release!r} of fake-gpu" if self.release else "fake-gpu"
        raise LayoutError(f"{which} is not installed in namespace {self.namespace!r} (no layout ConfigMap labelled "
                          f"{selector}); install charts/fake-gpu or pass --namespace") from None

    def _check_node(self, node: str) -> None:
        try:
            self.core.read_node(node, _request_timeout=REQUEST_TIMEOUT)
        except client.ApiException as e:
            if e.status == 404:
                names = ", ".join(_meta(n).name or "" for n in self.core.list_node(_request_timeout=REQUEST_TIMEOUT).items)
                raise LayoutError(f"unknown node {node!r}; nodes: {names}") from None
            raise

    def set(self, node: str, count: int, product: str, memory_mib: int, clique: str | None = None) -> NodeLayout:
        """`clique` None keeps the node's current clique; "" takes it away. The faults of GPUs that stay are kept."""
        self._check_node(node)
        return _compare_and_swap(lambda: self._set_once(node, count, product, memory_mib, clique))

    def _set_once(self, node: str, count: int, product: str, memory_mib: int, clique: str | None) -> NodeLayout:
        cm = self._configmap()
        try:
            current = json.loads((cm.data or {}).get(node) or "{}")
        except ValueError:
            current = {}
        if not isinstance(current, dict):
            current = {}
        if clique is None:
            clique = current.get("clique", "")
        faults: tuple[tuple[int, Fault], ...] = ()
        try:
            faults = tuple((i, f) for i, f in parse_entry((cm.data or {}).get(node) or "", node, 1 << 30).faults
                           if i < count)
        except LayoutError:
            pass  # no entry yet, or a broken one that this write replaces
        layout = validate(NodeLayout(count, product, memory_mib, clique, faults), max_count(cm.data or {}))
        self._write(cm, node, layout)
        return layout

    def _write(self, cm: client.V1ConfigMap, node: str, layout: NodeLayout) -> None:
        # resourceVersion makes this a compare-and-swap: a concurrent edit is not overwritten.
        patch = {"metadata": {"resourceVersion": _meta(cm).resource_version}, "data": {node: layout.to_json()}}
        self.core.patch_namespaced_config_map(_meta(cm).name or "", self.namespace, patch, _request_timeout=REQUEST_TIMEOUT)

    def fault(self, node: str, gpu: int | None, fault: Fault | None, *, write: bool = True) -> NodeLayout:
        """Set `fault` on GPU `gpu` of `node` (None: clear it; with `gpu` None too, clear every fault of the node).
        `write` False checks the node and the GPU and changes nothing (an error that does not act)."""
        self._check_node(node)
        return _compare_and_swap(lambda: self._fault_once(node, gpu, fault, write))

    def _fault_once(self, node: str, gpu: int | None, fault: Fault | None, write: bool) -> NodeLayout:
        cm = self._configmap()
        data = cm.data or {}
        if node not in data:
            raise LayoutError(f"node {node} has no layout in the fake-gpu ConfigMap yet (it runs the default count); "
                              f"set one first with `fake-gpu set --node {node} --count N`")
        layout = parse_entry(data[node], node, max_count(data))
        if gpu is not None and not 0 <= gpu < layout.count:
            raise LayoutError(f"--gpu must be between 0 and {layout.count - 1} (node {node} has {layout.count} fake GPUs), "
                              f"got {gpu}")
        if not write:
            return layout
        faults = layout.fault_map
        if fault is not None and gpu is not None:
            faults[gpu] = fault
        elif gpu is not None:
            faults.pop(gpu, None)
        else:
            faults = {}
        layout = validate(NodeLayout(layout.count, layout.product, layout.memory_mib, layout.clique, with_faults(faults)),
                          max_count(data))
        self._write(cm, node, layout)
        return layout

    def status(self) -> dict[str, Any]:
        cm = self._configmap()
        nodes = {}
        for n in self.core.list_node(_request_timeout=REQUEST_TIMEOUT).items:
            name = _meta(n).name or ""
            desired = (cm.data or {}).get(name)
            nodes[name] = {"desired": json.loads(desired) if desired else "default",
                           "allocatable": ((n.status.allocatable if n.status else None) or {}).get("nvidia.com/gpu", "0")}
        return {"namespace": self.namespace, "maxCount": max_count(cm.data or {}), "nodes": nodes}


# A write of another node's entry (another test, another terminal) between this one's read and its write.
CONFLICT_TRIES = 8


def _compare_and_swap(attempt: Callable[[], NodeLayout]) -> NodeLayout:
    """Run a read-modify-write again when its write lost the race (409 Conflict on the resourceVersion): each try
    reads the ConfigMap afresh, so nobody's entry is overwritten and nobody's change is lost."""
    for tries in range(1, CONFLICT_TRIES + 1):
        try:
            return attempt()
        except client.ApiException as e:
            if e.status != 409 or tries == CONFLICT_TRIES:
                raise
    raise AssertionError("unreachable")


def _meta(obj: client.V1ConfigMap | client.V1Node) -> client.V1ObjectMeta:
    """An object's metadata (the API server always sends it; the model calls it optional)."""
    return obj.metadata or client.V1ObjectMeta()


def unlabel_nodes(kubeconfig: str | None, release: str, resource: str = DEFAULT_RESOURCE) -> list[str]:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    return node_labels.unlabel_nodes(client.CoreV1Api(), release, resource)
