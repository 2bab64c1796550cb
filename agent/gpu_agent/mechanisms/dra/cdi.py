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
The spec names the lowest `cdiVersion` its fields need (0.3.0 for env and mounts), so an older runtime
parses it too (a CDI library refuses a spec newer than it knows).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from gpu_agent.foundations.files import write_atomic

CDI_VERSION = "0.3.0"
CLASS = "gpu"


def vendor(driver: str) -> str:
    return f"k8s.{driver}"


def kind(driver: str) -> str:
    return f"{vendor(driver)}/{CLASS}"


def spec_path(cdi_dir: Path, driver: str, claim_uid: str) -> Path:
    return cdi_dir / f"{vendor(driver)}-{CLASS}_{claim_uid}.json"


def device_id(driver: str, claim_uid: str, device: str) -> str:
    return f"{kind(driver)}={claim_uid}-{device}"


def write_spec(cdi_dir: Path, driver: str, claim_uid: str, devices: list[dict[str, Any]],
               mounts: list[dict[str, Any]] | None = None) -> Path:
    """`devices`: [{"device": "gpu-0", "env": ["K=V", ...]}, ...]. Returns the file written."""
    spec = {"cdiVersion": CDI_VERSION, "kind": kind(driver),
            "devices": [{"name": f"{claim_uid}-{d['device']}",
                         "containerEdits": {"env": list(d["env"]), **({"mounts": mounts} if mounts else {})}}
                        for d in devices]}
    if not spec["devices"]:
        # a spec needs at least one device; a claim of ours with no device of ours has nothing to inject
        spec["devices"] = [{"name": f"{claim_uid}-none", "containerEdits": {"env": [f"GPU_AGENT_CLAIM_EMPTY={claim_uid}"]}}]
    path = spec_path(cdi_dir, driver, claim_uid)
    write_atomic(path, json.dumps(spec, indent=1, sort_keys=True) + "\n")
    return path


def remove_spec(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
