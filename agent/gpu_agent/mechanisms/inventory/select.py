"""Choosing the GPU source from configuration: the settings every role that reads GPUs shares."""

from __future__ import annotations

from pathlib import Path

from gpu_agent.foundations import fake_state
from gpu_agent.foundations.config import Config, Setting
from gpu_agent.mechanisms.inventory.fake import FakeFileSource
from gpu_agent.mechanisms.inventory.nvml import NVMLSource
from gpu_agent.mechanisms.inventory.source import GPUSource

GPU_SOURCE_SETTINGS = [
    Setting("gpuSource", "choice", "fake", "where GPUs are read from: fake (state file), nvml (this node), "
            "cluster (allocatable nvidia.com/gpu of Ready nodes)", choices=("fake", "nvml", "cluster")),
    Setting("fakeGpuStateFile", "path", str(fake_state.default_path()), "fake GPU state file (gpuSource=fake)"),
    Setting("gpuPollInterval", "seconds", 0.5, "how often the GPU source is read", 0.05, 60),
]


def make_source(cfg: Config) -> GPUSource:
    if cfg.gpuSource == "nvml":
        return NVMLSource()
    if cfg.gpuSource == "cluster":
        from gpu_agent.foundations.kube import api_client
        from gpu_agent.mechanisms.inventory.cluster import ClusterSource

        return ClusterSource(api_client(getattr(cfg, "kubeconfig", "")))
    return FakeFileSource(Path(cfg.fakeGpuStateFile))
