"""CDI spec files: what the container runtime injects for a prepared claim.

One spec file per claim (`<vendor>-<class>_<claimUID>.json` in the CDI folder, written atomically),
one CDI device per allocated GPU named `<claimUID>-<device>` (the CDI library's advice: never reuse
a device name, so a runtime that caches specs cannot hand out an old one). Each device sets:
- `NVIDIA_VISIBLE_DEVICES`: the UUIDs of every GPU of that claim request, as NVIDIA's container
  toolkit and `fake-gpu smi -L` read it;
- `GPU_AGENT_GPU_<index>=<uuid>`: one variable per GPU, so two claims in one container add up
  instead of the last one winning;
- the sharing configuration (`GPU_AGENT_SHARING_STRATEGY`, ...) and `GPU_AGENT_CLAIM_<n>=<claimUID>`;
- optional extra edits (a mount of the fake GPUs' state file, on fake nodes).
A channel device (a GPUDomain's channel claim, channels.py) brings its own edits instead: the channel
device nodes, the domain's environment and a read-only mount of the domain's view (its peer list).
The spec names the lowest `cdiVersion` its contents need (`minimum_version`, the CDI library's own rules), so an
older runtime parses it too (a CDI library refuses a spec newer than it knows), and a newer one does not refuse it
as too old: a device name that starts with a digit (a claim UID may) needs 0.5.0, and containerd 2.x drops the
whole spec, "the spec version must be at least v0.5.0", so the container fails with "unresolvable CDI devices".
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from gpu_agent.foundations.files import write_atomic

BASE_VERSION = "0.3.0"  # env and mounts
CLASS = "gpu"


def vendor(driver: str) -> str:
    return f"k8s.{driver}"


def kind(driver: str) -> str:
    return f"{vendor(driver)}/{CLASS}"


def spec_path(cdi_dir: Path, driver: str, claim_uid: str) -> Path:
    return cdi_dir / f"{vendor(driver)}-{CLASS}_{claim_uid}.json"


def device_id(driver: str, claim_uid: str, device: str) -> str:
    return f"{kind(driver)}={claim_uid}-{device}"


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest cdiVersion whose rules admit `spec`, as tags.cncf.io/container-device-interface decides it
    (specs-go/version.go, requiresV040 and requiresV050; nothing here uses a later feature)."""
    edits = [d.get("containerEdits") or {} for d in spec.get("devices") or []] + [spec.get("containerEdits") or {}]
    if any(d.get("name", "")[:1].isdigit() for d in spec.get("devices") or []) or \
            any(n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts") or []):
        return "0.4.0"
    return BASE_VERSION


def write_spec(cdi_dir: Path, driver: str, claim_uid: str, devices: list[dict[str, Any]],
               mounts: list[dict[str, Any]] | None = None) -> Path:
    """`devices`: [{"device": "gpu-0", "env": ["K=V", ...]}, ...], a device with its own edits also carrying
    "deviceNodes" and "mounts" (then `mounts` is not added to it). Returns the file written."""
    def edits(d: dict[str, Any]) -> dict[str, Any]:
        own = "deviceNodes" in d or "mounts" in d
        extra = d.get("mounts") if own else mounts
        return {"env": list(d["env"]), **({"deviceNodes": d["deviceNodes"]} if d.get("deviceNodes") else {}),
                **({"mounts": extra} if extra else {})}

    spec: dict[str, Any] = {"kind": kind(driver),
                            "devices": [{"name": f"{claim_uid}-{d['device']}", "containerEdits": edits(d)} for d in devices]}
    if not spec["devices"]:
        # a spec needs at least one device; a claim of ours with no device of ours has nothing to inject
        spec["devices"] = [{"name": f"{claim_uid}-none", "containerEdits": {"env": [f"GPU_AGENT_CLAIM_EMPTY={claim_uid}"]}}]
    spec["cdiVersion"] = minimum_version(spec)
    path = spec_path(cdi_dir, driver, claim_uid)
    write_atomic(path, json.dumps(spec, indent=1, sort_keys=True) + "\n")
    return path


def remove_spec(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
