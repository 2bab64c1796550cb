"""What a user may add to every work Pod (the cluster agent's `workPods` setting; the chart's `workPods` values).

The setting holds a mapping of tolerations, nodeSelector, affinity, runtimeClassName, imagePullSecrets, resources,
priorityClassName, labels and annotations, checked once at start by `parse_work_pods` (a ValueError saying which key
is wrong and why; the settings loader names the setting and how to set it). What the agent needs on its Pods is
not the user's to change: a label or annotation key under `gpu-agent.io/` and the labels `app.kubernetes.io/managed-by`
and `app.kubernetes.io/instance` (the work labels and the release selector the sweep and the watch list by, the
fencing token, the item's id and key) are refused, and so are `nvidia.com/gpu` in resources and resource claims (the
GPUs are the item's to ask for). The Pod executor still puts its own keys last, so they win even over a shape that
did not come through here. The chart refuses the same keys at render.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

AGENT_PREFIX = "gpu-agent.io/"
AGENT_LABELS = frozenset({"app.kubernetes.io/managed-by", "app.kubernetes.io/instance"})
GPU_RESOURCE = "nvidia.com/gpu"
KEYS = ("tolerations", "nodeSelector", "affinity", "runtimeClassName", "imagePullSecrets", "resources",
        "priorityClassName", "labels", "annotations")
TOLERATION_FIELDS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
AFFINITY_FIELDS = frozenset({"nodeAffinity", "podAffinity", "podAntiAffinity"})
RESOURCE_FIELDS = frozenset({"requests", "limits"})

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def agent_owned(key: str, *, label: bool) -> bool:
    """A label (or annotation) key the agent sets on its work Pods, or may set in a later version."""
    return key.startswith(AGENT_PREFIX) or (label and key in AGENT_LABELS)


def _qualified(key: object) -> bool:
    if not isinstance(key, str):
        return False
    prefix, slash, name = key.rpartition("/")
    return bool(_NAME.fullmatch(name)) and (not slash or bool(_DNS_SUBDOMAIN.fullmatch(prefix)))


def _text(value: object) -> str | None:
    """A scalar as the API server takes it (a YAML number is fine for a label value); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    return str(value)


def _string_map(raw: object, where: str, *, label: bool | None) -> dict[str, str]:
    """labels (label=True), annotations (label=False) or nodeSelector (label=None: any label key, the agent's too)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping of keys to strings")
    out: dict[str, str] = {}
    for key, value in raw.items():
        text = _text(value)
        if not _qualified(key):
            raise ValueError(f"{where} key {key!r} is not a Kubernetes qualified name (prefix/name)")
        if text is None:
            raise ValueError(f"{where}.{key} must be a string, got {type(value).__name__}")
        if label is not None and agent_owned(key, label=label):
            raise ValueError(f"{where} key {key!r} is the agent's own (keys under {AGENT_PREFIX}"
                             f"{' and ' + ', '.join(sorted(AGENT_LABELS)) if label else ''} are set by the agent on "
                             "every work Pod); choose another key")
        if label is not False and text and not _NAME.fullmatch(text):
            raise ValueError(f"{where}.{key} value {text!r} is not a Kubernetes label value")
        out[key] = text
    return out


def _mapping(raw: object, where: str, fields: frozenset[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping")
    unknown = sorted(str(k) for k in raw if k not in fields)
    if unknown:
        raise ValueError(f"{where} has unknown field {unknown[0]!r}; known: {', '.join(sorted(fields))}")
    return dict(raw)


def _name(raw: object, where: str) -> str:
    if not isinstance(raw, str) or (raw and not _DNS_SUBDOMAIN.fullmatch(raw)):
        raise ValueError(f"{where} must be a lowercase DNS subdomain name, got {raw!r}")
    return raw


def _resources(raw: object) -> dict[str, dict[str, str]]:
    if isinstance(raw, dict) and "claims" in raw:
        raise ValueError("resources.claims is the agent's own: an item's GPUs are claimed for it (dra.deviceClassName)")
    out: dict[str, dict[str, str]] = {}
    for part, amounts in _mapping(raw, "resources", RESOURCE_FIELDS).items():
        if not amounts:
            continue
        if not isinstance(amounts, dict):
            raise ValueError(f"resources.{part} must be a mapping of resource names to quantities")
        shown: dict[str, str] = {}
        for name, quantity in amounts.items():
            if name == GPU_RESOURCE:
                raise ValueError(f"resources.{part}.{GPU_RESOURCE} is the agent's own: each item asks for its GPUs "
                                 "(its payload's gpus)")
            text = _text(quantity)
            if not _qualified(name) or text is None or not text:
                raise ValueError(f"resources.{part}.{name} must be a resource name with a quantity, got {quantity!r}")
            shown[str(name)] = text
        out[part] = shown
    return out


def _pull_secrets(raw: object) -> list[dict[str, str]]:
    if not isinstance(raw, list):
        raise ValueError("imagePullSecrets must be a list of Secret names or {name: ...}")
    out: list[dict[str, str]] = []
    for entry in raw:
        name = entry.get("name") if isinstance(entry, dict) and set(entry) == {"name"} else entry
        if not isinstance(name, str) or not name:
            raise ValueError(f"imagePullSecrets entry {entry!r} is not a Secret name or {{name: ...}}")
        out.append({"name": _name(name, "imagePullSecrets name")})
    return out


def _tolerations(raw: object) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise ValueError("tolerations must be a list of tolerations")
    return [_mapping(t, f"tolerations[{i}]", TOLERATION_FIELDS) for i, t in enumerate(raw)]


def parse_work_pods(raw: object) -> dict[str, Any]:
    """The shape as the executor applies it: only the keys set (a key left empty is dropped, so an empty block is
    {}), pull secrets as [{name: ...}]. ValueError naming the key when it is not one of KEYS or not what it holds."""
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, dict):
        raise ValueError("it must be a mapping of " + ", ".join(KEYS))
    unknown = sorted(str(k) for k in raw if k not in KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; known: {', '.join(KEYS)}")
    parse: dict[str, Callable[[Any], Any]] = {
        "tolerations": _tolerations,
        "nodeSelector": lambda v: _string_map(v, "nodeSelector", label=None),
        "affinity": lambda v: _mapping(v, "affinity", AFFINITY_FIELDS),
        "runtimeClassName": lambda v: _name(v, "runtimeClassName"),
        "imagePullSecrets": _pull_secrets,
        "resources": _resources,
        "priorityClassName": lambda v: _name(v, "priorityClassName"),
        "labels": lambda v: _string_map(v, "labels", label=True),
        "annotations": lambda v: _string_map(v, "annotations", label=False),
    }
    out: dict[str, Any] = {}
    for key in KEYS:
        value = raw.get(key)
        if value is None or value in ("", [], {}):
            continue
        parsed = parse[key](value)
        if parsed not in ("", [], {}):
            out[key] = parsed
    return out
