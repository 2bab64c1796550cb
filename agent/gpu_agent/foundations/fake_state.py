"""The fake GPU state file: one per node, written by `fake-gpu`, read by the agent.

The writer always replaces the file atomically (write a temporary file in the same
folder, fsync, rename), so a reader sees the old layout or the new one, never half of
one. The parser names the field at fault so that a bad file is easy to fix.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from gpu_agent.foundations.files import write_atomic
from gpu_agent.foundations.gpus import GPU, Inventory

__all__ = ["API_VERSION", "FakeStateError", "Inventory", "default_path", "parse", "read", "render", "write_atomic"]

API_VERSION = "fake-gpu.gpu-agent.io/v1"
KIND = "FakeGPUState"
UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
DEFAULT_PATH_ENV = "FAKE_GPU_STATE_FILE"
DEFAULT_PATH = ".run/fake-gpus.json"


class FakeStateError(Exception):
    """The state file is missing, unreadable or malformed; the message says which and how to fix."""


def default_path() -> Path:
    return Path(os.environ.get(DEFAULT_PATH_ENV) or DEFAULT_PATH)


def parse(text: str, source: str = "fake GPU state") -> Inventory:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise FakeStateError(f"{source}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                             "rewrite it with `fake-gpu set --count N`") from None
    if not isinstance(doc, dict):
        raise FakeStateError(f"{source}: top level must be an object with a 'gpus' list")
    if doc.get("apiVersion") != API_VERSION:
        raise FakeStateError(f"{source}: apiVersion must be {API_VERSION!r}, got {doc.get('apiVersion')!r}")
    gpus_doc = doc.get("gpus")
    if not isinstance(gpus_doc, list):
        raise FakeStateError(f"{source}: field 'gpus' must be a list, got {type(gpus_doc).__name__}")
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
        if not isinstance(name, str) or not name:
            raise FakeStateError(f"{where}.name must be a non-empty string")
        mem = g.get("memoryTotalBytes")
        if not isinstance(mem, int) or isinstance(mem, bool) or mem <= 0:
            raise FakeStateError(f"{where}.memoryTotalBytes must be a positive integer, got {mem!r}")
        mig = g.get("migMode", False)
        if not isinstance(mig, bool):
            raise FakeStateError(f"{where}.migMode must be true or false, got {mig!r}")
        gpus.append(GPU(uuid=uuid, name=name, memory_total_bytes=mem, mig_mode=mig, index=i))
    return Inventory(tuple(gpus))


def read(path: Path) -> Inventory:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FakeStateError(f"fake GPU state file {path} does not exist; create it with "
                             f"`fake-gpu set --count N --state-file {path}`") from None
    except OSError as e:
        raise FakeStateError(f"fake GPU state file {path} cannot be read: {e.strerror}") from None
    return parse(text, str(path))


def render(inventory: Inventory, node: str = "") -> str:
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "node": node, "gpus": inventory.to_json()}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
