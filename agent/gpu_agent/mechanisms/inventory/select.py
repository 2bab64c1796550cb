"""Choosing the GPU source from configuration: the settings every role that reads GPUs shares."""

from __future__ import annotations

from pathlib import Path

from gpu_agent.foundations import fake_state
from gpu_agent.foundations.config import Config, Setting
from gpu_agent.mechanisms.inventory.fake import FakeFileSource
from gpu_agent.mechanisms.inventory.nvml import NVMLSource
from gpu_agent.mechanisms.inventory.source import GPUSource

# gpuLossDebounce per source when unset. cluster: a kubelet restart reads allocatable 0 while the
# device plugin registers again; measured on the CI cluster (e2e/test_readiness.py prints it), the
# window covers the longest drop seen with a wide margin. fake and nvml: a loss is real, act at once.
LOSS_DEBOUNCE_DEFAULTS = {"cluster": 5.0, "fake": 0.0, "nvml": 0.0}

GPU_SOURCE_SETTINGS = [
    Setting("gpuSource", "choice", "fake", "where GPUs are read from: fake (state file), nvml (this node), "
            "cluster (allocatable nvidia.com/gpu of Ready nodes)", choices=("fake", "nvml", "cluster")),
    Setting("fakeGpuStateFile", "path", str(fake_state.default_path()), "fake GPU state file (gpuSource=fake)"),
    Setting("gpuPollInterval", "seconds", 0.5, "how often the GPU source is read", 0.05, 60),
    Setting("gpuLossDebounce", "seconds", "", "how long a loss of GPUs must hold before it is acted on (arrivals act "
            "at once; 0 = act at once); unset: the source's default, " + ", ".join(
                f"{k} {v:g}s" for k, v in sorted(LOSS_DEBOUNCE_DEFAULTS.items())), 0, 600, optional=True),
]


class GPUSourceConfig(Config):
    """The settings above, typed: what every role that reads GPUs declares."""
    gpuSource: str
    fakeGpuStateFile: str
    gpuPollInterval: float
    gpuLossDebounce: float | str  # "" while unset: see loss_debounce


def loss_debounce(cfg: GPUSourceConfig) -> float:
    return LOSS_DEBOUNCE_DEFAULTS[cfg.gpuSource] if cfg.gpuLossDebounce == "" else float(cfg.gpuLossDebounce)


def make_source(cfg: GPUSourceConfig) -> GPUSource:
    if cfg.gpuSource == "nvml":
        return NVMLSource()
    if cfg.gpuSource == "cluster":
        from gpu_agent.foundations.kube import api_client
        from gpu_agent.mechanisms.inventory.cluster import ClusterSource

        return ClusterSource(api_client(getattr(cfg, "kubeconfig", "")))
    return FakeFileSource(Path(cfg.fakeGpuStateFile))
