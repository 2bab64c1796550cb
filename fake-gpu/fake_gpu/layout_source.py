"""The desired layout per node, from a ConfigMap the fake-gpu DaemonSet watches.

    data:
      <node name>: '{"count": 4, "product": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "clique": "rack-a"}'
      maxCount: "64"

A node with no entry gets `defaultCount` GPUs. An entry that does not parse or breaks a
limit is refused: the previous layout stays in force and the error is logged (and shown by
`fake-gpu status`). `fake-gpu set` validates the same way before it writes anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from fake_gpu.layout import DEFAULT_MEMORY_MIB, DEFAULT_PRODUCT, MAX_GPUS, LayoutError, check_clique

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

    def to_json(self) -> str:
        doc = {"count": self.count, "product": self.product, "memoryMiB": self.memory_mib}
        return json.dumps({**doc, "clique": self.clique} if self.clique else doc, sort_keys=True)


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
    return layout


def parse_entry(text: str, node: str, limit: int) -> NodeLayout:
    if len(text) > 4096:
        raise LayoutError(f"layout of node {node} is {len(text)} characters; a layout is a small object like {{\"count\": 4}}")
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise LayoutError(f"layout of node {node} is not valid JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # integers over Python's digit limit, absurd nesting
        raise LayoutError(f"layout of node {node} is not usable JSON: {type(e).__name__}") from None
    if not isinstance(doc, dict):
        raise LayoutError(f"layout of node {node} must be an object like {{\"count\": 4}}")
    unknown = set(doc) - {"count", "product", "memoryMiB", "clique"}
    if unknown:
        raise LayoutError(f"layout of node {node} has unknown field(s) {', '.join(sorted(unknown))}; "
                          "known: count, product, memoryMiB, clique")
    # validate() refuses a count that is not an int (missing included).
    return validate(NodeLayout(cast(int, doc.get("count")), doc.get("product", DEFAULT_PRODUCT),
                               doc.get("memoryMiB", DEFAULT_MEMORY_MIB), doc.get("clique", "")), limit)


def layout_for(data: dict[str, str] | None, node: str, default_count: int) -> NodeLayout:
    data = data or {}
    limit = max_count(data)
    if node in data:
        return parse_entry(data[node], node, limit)
    return validate(NodeLayout(default_count), limit)
