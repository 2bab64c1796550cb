"""`fake-gpu smi -L`: what `nvidia-smi -L` prints, for the fake GPUs this container was given."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from gpu_agent.foundations import fake_state

PER_GPU = re.compile(r"GPU_AGENT_GPU_(\d+)")


def visible_uuids(env: Mapping[str, str]) -> list[str]:
    """The GPUs this container was given, each once: NVIDIA_VISIBLE_DEVICES (the device plugin's, or one DRA claim's),
    then the DRA driver's GPU_AGENT_GPU_<index> variables in index order. A container with two claims has two CDI
    devices that each set NVIDIA_VISIBLE_DEVICES, and the last one wins; the per-GPU variables add up."""
    listed = [u for u in env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if u.startswith("GPU-")]
    per_gpu = sorted((int(m.group(1)), v) for k, v in env.items() if (m := PER_GPU.fullmatch(k)) and v.startswith("GPU-"))
    return list(dict.fromkeys(listed + [u for _, u in per_gpu]))


def list_gpus() -> list[str]:
    visible = visible_uuids(os.environ)
    names: dict[str, str] = {}
    state = Path(os.environ.get("FAKE_GPU_STATE_FILE", "/run/fake-gpu/state.json"))
    try:
        names = {g.uuid: g.name for g in fake_state.read(state).gpus}
    except fake_state.FakeStateError:
        pass
    return [f"GPU {i}: {names.get(u, 'NVIDIA GPU (fake)')} (UUID: {u})" for i, u in enumerate(visible)]
