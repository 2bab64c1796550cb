"""The desired layout per node, from a ConfigMap the fake-gpu DaemonSet watches.

    data:
      <node name>: '{"count": 4, "product": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "clique": "rack-a",
                     "faults": {"2": {"health": "Lost", "healthReason": "Xid 79 (GPU has fallen off the bus)"}}}'
      maxCount: "64"

`maxCount` is at most MAX_COUNT (8,192: measured below). `faults` (written by `fake-gpu fault --node`) names the GPUs, by index, that are not healthy; the
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
from gpu_agent.foundations import fake_state
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


# The most fake GPUs one node may carry (the chart's maxCount and defaultCount allow no more), from
# agent/bench/bench_fake_gpu_node.py (`make bench-fake-gpu`: every GPU faulted, the largest form of each document;
# "short": a reason as `fake-gpu fault` writes it, "long": MAX_REASON characters), on a 2-core machine:
#                         8,192 GPUs                             what breaks, and where
#   layout entry          671 KB short, 2.5 MB long; parse 25-35 ms  the ConfigMap's 1 MiB: long reasons on every GPU
#                                                                   past ~3,300 GPUs, short ones past ~12,800
#   build (DaemonSet)     83-88 ms                                 linear: 16,384 take 180 ms
#   state file            2.3-4.1 MB; render 205-370 ms,           fake_state.MAX_FILE_BYTES (8 MiB) past ~16,600
#                         node agent parse 57-80 ms                 (16,384: render about 1 s a change)
#   ListAndWatch (gRPC)   450 KB in 26 ms (55 bytes a device)       kubelet's 4 MiB receive: RESOURCE_EXHAUSTED
#                                                                   between 73,728 and 81,920 devices
#   Allocate              4 ms for 3,196 devices                    execve's 128 KiB per environment string: a
#                                                                   container given more than 3,196 GPUs (plugin.py
#                                                                   refuses it by name)
# So 8,192: ListAndWatch at 11 % of its limit, every change of a node's layout applied in well under a second,
# a fault on every GPU fitting the ConfigMap as `fake-gpu fault` writes it, and three nodes (the CI cluster's)
# making a 20,000-GPU cluster. Past it the cost per change passes a second while nothing needs more. The node
# agent reads as many (fake_state.MAX_GPUS is this number).
MAX_COUNT = fake_state.MAX_GPUS
# A node's layout entry: its count, product, memory and clique, then a fault on each of `limit` GPUs; a fault
# `"1023": {"health": "Unhealthy", "healthReason": "..."}, ` is 56 characters and its reason (ASCII, as
# `fake-gpu fault` writes it) at most fake_state.MAX_REASON.
LAYOUT_BASE_CHARS = 1024
FAULT_CHARS = 64 + MAX_REASON


def max_layout_chars(limit: int) -> int:
    """The longest layout entry a node with maxCount `limit` may have: room for a fault on every GPU."""
    return LAYOUT_BASE_CHARS + limit * FAULT_CHARS


def max_count(data: dict[str, str]) -> int:
    try:
        value = int(data.get("maxCount", MAX_GPUS))
    except (TypeError, ValueError):
        return MAX_GPUS
    return value if 0 <= value <= MAX_COUNT else MAX_GPUS


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
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= len(str(MAX_COUNT))):
            raise LayoutError(f"layout of node {node}: faults key {str(key)[:20]!r} must be a GPU index like \"2\"; {fix}")
        if not isinstance(value, dict) or set(value) - {"health", "healthReason"}:
            raise LayoutError(f"layout of node {node}: faults.{key} must be an object with health and healthReason; {fix}")
        faults[int(key)] = Fault(value.get("health", ""), value.get("healthReason", "fault injected by fake-gpu"))
    return with_faults(faults)


def parse_entry(text: str, node: str, limit: int) -> NodeLayout:
    if len(text) > max_layout_chars(limit):
        raise LayoutError(f"layout of node {node} is {len(text)} characters, more than the {max_layout_chars(limit)} a node "
                          f"of at most maxCount={limit} GPUs needs (a fault on each); rewrite it with "
                          f"`fake-gpu set --node {node} --count N`")
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
