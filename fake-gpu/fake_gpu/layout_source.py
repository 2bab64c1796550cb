"""The desired layout per node, from a ConfigMap the fake-gpu DaemonSet watches.

    data:
      <node name>: '{"count": 4, "product": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "clique": "rack-a",
                     "faults": {"2": {"health": "Lost", "healthReason": "Xid 79 (GPU has fallen off the bus)"}}}'
      maxCount: "64"

`faults` (written by `fake-gpu fault --node`) names the GPUs, by index, that are not healthy; the
DaemonSet writes them into the state file (the node agent's fake source reads them) and reports those
GPUs Unhealthy to kubelet, so the node's allocatable drops. A node with no entry gets `defaultCount`
GPUs. An entry that does not parse or breaks a limit is refused: the previous layout stays in force and the error is logged (and shown by
`fake-gpu status`). `fake-gpu set` validates the same way before it writes anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from fake_gpu.layout import (
    DEFAULT_MEMORY_MIB,
    DEFAULT_PRODUCT,
    FAULT_STATES,
    MAX_GPUS,
    Fault,
    LayoutError,
    check_clique,
)
from gpu_agent.foundations.fake_state import MAX_REASON

# The layout ConfigMap is per release (<release>-fake-gpu-layout), labelled LAYOUT_SELECTOR so that
# `fake-gpu set` finds it; charts before 0.2 named it LEGACY_CONFIGMAP whatever the release.
LEGACY_CONFIGMAP = "gpu-agent-fake-gpu-layout"
LAYOUT_SELECTOR = "app.kubernetes.io/name=fake-gpu,app.kubernetes.io/component=layout"


@dataclass(frozen=True)
class NodeLayout:
    count: int
    product: str = DEFAULT_PRODUCT
    memory_mib: int = DEFAULT_MEMORY_MIB
    clique: str = ""  # the node's fake NVLink clique ("": none, a plain server)
    faults: tuple[tuple[int, Fault], ...] = ()  # (GPU index, fault), sorted by index; every other GPU is healthy

    @property
    def fault_map(self) -> dict[int, Fault]:
        return dict(self.faults)

    def to_json(self) -> str:
        doc: dict[str, Any] = {"count": self.count, "product": self.product, "memoryMiB": self.memory_mib}
        if self.clique:
            doc["clique"] = self.clique
        if self.faults:
            doc["faults"] = {str(i): {"health": f.health, "healthReason": f.reason} for i, f in self.faults}
        return json.dumps(doc, sort_keys=True)


def with_faults(faults: dict[int, Fault]) -> tuple[tuple[int, Fault], ...]:
    return tuple(sorted(faults.items()))


def max_count(data: dict[str, str]) -> int:
    try:
        value = int(data.get("maxCount", MAX_GPUS))
    except (TypeError, ValueError):
        return MAX_GPUS
    return value if 0 <= value <= 4096 else MAX_GPUS


def validate(layout: NodeLayout, limit: int) -> NodeLayout:
    if not isinstance(layout.count, int) or isinstance(layout.count, bool) or layout.count < 0:
        raise LayoutError(f"count must be 0 or more, got {layout.count!r}")
    if layout.count > limit:
        raise LayoutError(f"count must be at most maxCount={limit}, got {layout.count}")
    if not isinstance(layout.memory_mib, int) or isinstance(layout.memory_mib, bool) or not 0 < layout.memory_mib <= 1 << 40:
        raise LayoutError(f"memoryMiB must be a positive integer, got {layout.memory_mib!r}")
    if not isinstance(layout.product, str) or not layout.product.strip():
        raise LayoutError("product must be a non-empty string")
    check_clique(layout.clique, "clique")
    for i, fault in layout.faults:
        if not 0 <= i < layout.count:
            raise LayoutError(f"faults: GPU {i} is not among the node's {layout.count} GPUs (0 to {layout.count - 1}); "
                              f"clear it with `fake-gpu fault --clear --gpu {i} --node NODE`")
        if fault.health not in FAULT_STATES:
            raise LayoutError(f"faults.{i}.health must be one of {', '.join(FAULT_STATES)}, got {fault.health!r}; "
                              "clear it with `fake-gpu fault --clear`")
        if not isinstance(fault.reason, str) or not fault.reason or len(fault.reason) > MAX_REASON \
                or not fault.reason.isprintable():
            raise LayoutError(f"faults.{i}.healthReason must be a non-empty printable string of at most {MAX_REASON} "
                              "characters")
    return layout


def parse_faults(doc: Any, node: str) -> tuple[tuple[int, Fault], ...]:
    fix = f"rewrite it with `fake-gpu fault --node {node} ...` or clear it with `fake-gpu fault --node {node} --clear`"
    if not isinstance(doc, dict):
        raise LayoutError(f"layout of node {node}: faults must be an object like "
                          f'{{"2": {{"health": "Lost", "healthReason": "..."}}}}; {fix}')
    faults = {}
    for key, value in doc.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 4):
            raise LayoutError(f"layout of node {node}: faults key {str(key)[:20]!r} must be a GPU index like \"2\"; {fix}")
        if not isinstance(value, dict) or set(value) - {"health", "healthReason"}:
            raise LayoutError(f"layout of node {node}: faults.{key} must be an object with health and healthReason; {fix}")
        faults[int(key)] = Fault(value.get("health", ""), value.get("healthReason", "fault injected by fake-gpu"))
    return with_faults(faults)


def parse_entry(text: str, node: str, limit: int) -> NodeLayout:
    if len(text) > 16384:  # room for a fault on each of maxCount GPUs
        raise LayoutError(f"layout of node {node} is {len(text)} characters; a layout is a small object like {{\"count\": 4}}")
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise LayoutError(f"layout of node {node} is not valid JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # integers over Python's digit limit, absurd nesting
        raise LayoutError(f"layout of node {node} is not usable JSON: {type(e).__name__}") from None
    if not isinstance(doc, dict):
        raise LayoutError(f"layout of node {node} must be an object like {{\"count\": 4}}")
    unknown = set(doc) - {"count", "product", "memoryMiB", "clique", "faults"}
    if unknown:
        raise LayoutError(f"layout of node {node} has unknown field(s) {', '.join(sorted(unknown))}; "
                          "known: count, product, memoryMiB, clique, faults")
    # validate() refuses a count that is not an int (missing included).
    return validate(NodeLayout(cast(int, doc.get("count")), doc.get("product", DEFAULT_PRODUCT),
                               doc.get("memoryMiB", DEFAULT_MEMORY_MIB), doc.get("clique", ""),
                               parse_faults(doc.get("faults", {}), node)), limit)


def layout_for(data: dict[str, str] | None, node: str, default_count: int) -> NodeLayout:
    data = data or {}
    limit = max_count(data)
    if node in data:
        return parse_entry(data[node], node, limit)
    return validate(NodeLayout(default_count), limit)
