"""`fake-gpu smi -L`: what `nvidia-smi -L` prints, for the fake GPUs this container was given."""

from __future__ import annotations

import os
from pathlib import Path

from gpu_agent.foundations import fake_state


def list_gpus() -> list[str]:
    visible = [u for u in os.environ.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if u.startswith("GPU-")]
    names: dict[str, str] = {}
    state = Path(os.environ.get("FAKE_GPU_STATE_FILE", "/run/fake-gpu/state.json"))
    try:
        names = {g.uuid: g.name for g in fake_state.read(state).gpus}
    except fake_state.FakeStateError:
        pass
    return [f"GPU {i}: {names.get(u, 'NVIDIA GPU (fake)')} (UUID: {u})" for i, u in enumerate(visible)]
