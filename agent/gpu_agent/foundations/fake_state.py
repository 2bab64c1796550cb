"""The fake GPU state file: one per node, written by `fake-gpu`, read by the agent.

The writer always replaces the file atomically (write a temporary file in the same
folder, fsync, rename), so a reader sees the old layout or the new one, never half of
one. The parser names the field at fault so that a bad file is easy to fix.

Each GPU may carry a fault that `fake-gpu fault` injected: `health` (Unhealthy or Lost; absent
means Healthy) and `healthReason` (what broke, e.g. "Xid 48 (double-bit ECC error)"). The file
says what the GPU is now; the agent's fake source turns that into health transitions as it would
NVML's answers and events.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from gpu_agent.foundations.files import write_atomic
from gpu_agent.foundations.gpus import GPU, HEALTH_STATES, HEALTHY, Inventory

__all__ = ["API_VERSION", "FakeStateError", "Inventory", "default_path", "gpus_json", "parse", "read", "render",
           "write_atomic"]

API_VERSION = "fake-gpu.gpu-agent.io/v1"
KIND = "FakeGPUState"
CLIQUE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # a fake rack's NVLink clique
UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
DEFAULT_PATH_ENV = "FAKE_GPU_STATE_FILE"
DEFAULT_PATH = ".run/fake-gpus.json"


class FakeStateError(Exception):
    """The state file is missing, unreadable or malformed; the message says which and how to fix."""


def default_path() -> Path:
    return Path(os.environ.get(DEFAULT_PATH_ENV) or DEFAULT_PATH)


# A real node has a handful of GPUs, a fake one at most MAX_GPUS (fake-gpu's maxCount; its figures are in
# fake_gpu/layout_source.py). A file far larger than the largest layout is refused before it is parsed, so a bad
# file can cost neither memory nor time (a 100,000-GPU file once kept 100 MiB): 8,192 GPUs each faulted with a
# reason of MAX_REASON characters render to 4,127,767 bytes, so 8 MiB holds them twice over.
MAX_FILE_BYTES = 8 << 20
MAX_GPUS = 8192
MAX_REASON = 256


def parse(text: str, source: str = "fake GPU state") -> Inventory:
    fix = "rewrite it with `fake-gpu set --count N`"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise FakeStateError(f"{source}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); {fix}") from None
    except (ValueError, RecursionError) as e:  # integers over Python's digit limit, absurd nesting
        raise FakeStateError(f"{source}: not usable JSON ({type(e).__name__}); {fix}") from None
    if not isinstance(doc, dict):
        raise FakeStateError(f"{source}: top level must be an object with a 'gpus' list")
    if doc.get("apiVersion") != API_VERSION:
        raise FakeStateError(f"{source}: apiVersion must be {API_VERSION!r}, got {doc.get('apiVersion')!r}")
    gpus_doc = doc.get("gpus")
    if not isinstance(gpus_doc, list):
        raise FakeStateError(f"{source}: field 'gpus' must be a list, got {type(gpus_doc).__name__}")
    if len(gpus_doc) > MAX_GPUS:
        raise FakeStateError(f"{source}: {len(gpus_doc)} GPUs; at most {MAX_GPUS} fit one node's fake state; {fix}")
    gpus: list[GPU] = []
    seen: set[str] = set()
    for i, g in enumerate(gpus_doc):
        where = f"{source}: gpus[{i}]"
        if not isinstance(g, dict):
            raise FakeStateError(f"{where} must be an object")
        uuid = g.get("uuid")
        if not isinstance(uuid, str) or not UUID_RE.match(uuid):
            raise FakeStateError(f"{where}.uuid must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got {uuid!r}")
        if uuid in seen:
            raise FakeStateError(f"{where}.uuid {uuid} appears twice")
        seen.add(uuid)
        name = g.get("name")
        if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
            raise FakeStateError(f"{where}.name must be a non-empty printable string of at most 256 characters")
        mem = g.get("memoryTotalBytes")
        if not isinstance(mem, int) or isinstance(mem, bool) or not 0 < mem <= 2**63 - 1:
            raise FakeStateError(f"{where}.memoryTotalBytes must be a positive integer, got {mem!r}")
        mig = g.get("migMode", False)
        if not isinstance(mig, bool):
            raise FakeStateError(f"{where}.migMode must be true or false, got {mig!r}")
        health = g.get("health", HEALTHY)
        if health not in HEALTH_STATES:
            raise FakeStateError(f"{where}.health must be one of {', '.join(HEALTH_STATES)}, got {health!r}; "
                                 f"clear it with `fake-gpu fault --clear --gpu {i}`")
        reason = g.get("healthReason", "")
        if not isinstance(reason, str) or len(reason) > MAX_REASON or not reason.isprintable():
            raise FakeStateError(f"{where}.healthReason must be a printable string of at most {MAX_REASON} "
                                 f"characters; clear it with `fake-gpu fault --clear --gpu {i}`")
        gpus.append(GPU(uuid=uuid, name=name, memory_total_bytes=mem, mig_mode=mig, index=i, health=health,
                        health_reason="" if health == HEALTHY else reason or "fault injected by fake-gpu"))
    clique = doc.get("clique", "")
    if not isinstance(clique, str) or not (clique == "" or CLIQUE_RE.match(clique)):
        raise FakeStateError(f"{source}: field 'clique' must be empty or 1-64 letters, digits, '.', '_' or '-', "
                             f"got {clique!r}; {fix} --clique NAME")
    return Inventory(tuple(gpus), clique=clique, fabric=f"fake fabric: clique {clique}" if clique else "fake fabric: no clique")


def read(path: Path) -> Inventory:
    fix = f"`fake-gpu set --count N --state-file {path}`"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise FakeStateError(f"fake GPU state file {path} does not exist; create it with {fix}") from None
    except OSError as e:
        raise FakeStateError(f"fake GPU state file {path} cannot be read: {e.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise FakeStateError(f"fake GPU state file {path} is larger than {MAX_FILE_BYTES} bytes; rewrite it with {fix}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FakeStateError(f"fake GPU state file {path} is not UTF-8 (byte {e.start}); rewrite it with {fix}") from None
    return parse(text, str(path))


def gpus_json(inventory: Inventory) -> list[dict[str, Any]]:
    """The file's `gpus`: each GPU as the inventory writes it, with `health` and `healthReason` where it is not healthy."""
    gpus = inventory.to_json()
    for doc_gpu, gpu in zip(gpus, inventory.gpus, strict=True):
        if not gpu.is_healthy:
            doc_gpu.update(health=gpu.health, healthReason=gpu.health_reason)
    return gpus


def render(inventory: Inventory, node: str = "") -> str:
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "node": node, "gpus": gpus_json(inventory)}
    if inventory.clique:
        doc["clique"] = inventory.clique
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
