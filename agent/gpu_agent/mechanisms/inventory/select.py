"""Choosing the GPU source from configuration: the settings every role that reads GPUs shares."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpu_agent.foundations import fake_state
from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.config import Config, Setting
from gpu_agent.foundations.ratelimit import ApiLimit
from gpu_agent.foundations.xids import DEFAULT_IGNORED_XIDS
from gpu_agent.mechanisms.inventory.fake import FakeFileSource
from gpu_agent.mechanisms.inventory.gpu_health import HealthChange, HealthMetrics, HealthTracker
from gpu_agent.mechanisms.inventory.nvml import NVMLSource
from gpu_agent.mechanisms.inventory.source import GPUSource

# gpuLossDebounce per source when unset. cluster: a kubelet restart reads allocatable 0 while the
# device plugin registers again; measured on the CI cluster (e2e/test_readiness.py prints it), the
# window covers the longest drop seen with a wide margin. fake and nvml: a loss is real, act at once.
LOSS_DEBOUNCE_DEFAULTS = {"cluster": 5.0, "fake": 0.0, "nvml": 0.0}

# gpuHealthRecovery per source when unset. nvml: a GPU marked Unhealthy counts again once it has answered
# normally with no new critical event for a minute (a reset takes seconds; a GPU still failing raises its
# Xid again well within a minute). fake: a cleared fault is healthy at the next read, so tests see recovery
# at once. cluster: health is the device plugin's (allocatable), nothing to recover here.
HEALTH_RECOVERY_DEFAULTS = {"cluster": 0.0, "fake": 0.0, "nvml": 60.0}

GPU_SOURCE_SETTINGS = [
    Setting("gpuSource", "choice", "fake", "where GPUs are read from: fake (state file), nvml (this node), "
            "cluster (allocatable nvidia.com/gpu of Ready nodes, or with draDriverName the devices of that DRA driver's "
            "ResourceSlices)", choices=("fake", "nvml", "cluster")),
    Setting("fakeGpuStateFile", "path", str(fake_state.default_path()), "fake GPU state file (gpuSource=fake)"),
    Setting("gpuPollInterval", "seconds", 0.5, "how often the GPU source is read", 0.05, 60),
    Setting("gpuLossDebounce", "seconds", "", "how long a loss of GPUs must hold before it is acted on (arrivals act "
            "at once; 0 = act at once); unset: the source's default, " + ", ".join(
                f"{k} {v:g}s" for k, v in sorted(LOSS_DEBOUNCE_DEFAULTS.items())), 0, 600, optional=True),
    Setting("gpuHealthIgnoredXids", "xids", DEFAULT_IGNORED_XIDS, "critical Xids that leave a GPU Healthy: application "
            "errors (13 graphics engine exception, 31 memory page fault, 43 GPU stopped processing, 45 preemptive "
            "cleanup, 68 video processor exception, 109 context switch timeout; the device plugin's list); every other "
            "critical Xid and every double-bit ECC error marks the GPU Unhealthy"),
    Setting("gpuHealthRecovery", "seconds", "", "how long a GPU marked Unhealthy must answer normally with no new "
            "critical event before it counts again (no restart needed); unset: the source's default, " + ", ".join(
                f"{k} {v:g}s" for k, v in sorted(HEALTH_RECOVERY_DEFAULTS.items()) if k != "cluster"),
            0, 3600, optional=True),
]


class GPUSourceConfig(Config):
    """The settings above, typed: what every role that reads GPUs declares."""
    gpuSource: str
    fakeGpuStateFile: str
    gpuPollInterval: float
    gpuLossDebounce: float | str  # "" while unset: see loss_debounce
    gpuHealthIgnoredXids: tuple[int, ...]
    gpuHealthRecovery: float | str  # "" while unset: see health_recovery


def loss_debounce(cfg: GPUSourceConfig) -> float:
    return LOSS_DEBOUNCE_DEFAULTS[cfg.gpuSource] if cfg.gpuLossDebounce == "" else float(cfg.gpuLossDebounce)


def health_recovery(cfg: GPUSourceConfig) -> float:
    return HEALTH_RECOVERY_DEFAULTS[cfg.gpuSource] if cfg.gpuHealthRecovery == "" else float(cfg.gpuHealthRecovery)


def make_source(cfg: GPUSourceConfig, *, metrics: HealthMetrics | None = None, clock: Clock | None = None,
                api_limit: ApiLimit | None = None, on_health: Callable[[HealthChange], None] | None = None) -> GPUSource:
    """The configured source; `metrics` receives its GPUs' health transitions and counts (nvml and fake), and
    `on_health` each change (gpu_health.py: it must only queue). `api_limit`: the client-side rate limit of the
    cluster source's API client; None: none (a one-shot command)."""
    tracker = HealthTracker(clock=clock or SystemClock(), recovery=health_recovery(cfg),
                            ignored_xids=cfg.gpuHealthIgnoredXids, source=cfg.gpuSource, metrics=metrics,
                            on_change=on_health)
    if cfg.gpuSource == "nvml":
        return NVMLSource(tracker=tracker)
    if cfg.gpuSource == "cluster":
        from gpu_agent.foundations.kube import api_client
        from gpu_agent.mechanisms.inventory.cluster import ClusterSource

        limit = api_limit.named("gpus") if api_limit is not None else None
        return ClusterSource(api_client(getattr(cfg, "kubeconfig", ""), limit=limit),
                             node_selector=getattr(cfg, "gpuNodeSelector", ""), dra_driver=getattr(cfg, "draDriverName", ""))

    return FakeFileSource(Path(cfg.fakeGpuStateFile), tracker)
