"""The node agent (DaemonSet): this node's GPUs, read through NVML or the fake source.

    GPU source -> InventoryMonitor -> /healthz (gpus entry with UUIDs), /metrics

It is ready whenever its GPU source can be read, with any number of GPUs (zero included): it
reports the truth about the node. A source that cannot be read makes it NotReady, with the
reason. (Publishing the node's entry into the shared GPUDomain comes with domain formation.)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.config import VERBOSITY, Config, Setting
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.mechanisms.inventory.monitor import InventoryEvent, InventoryMonitor
from gpu_agent.mechanisms.inventory.select import GPU_SOURCE_SETTINGS, make_source
from gpu_agent.roles.endpoints import EndpointServer

log = get_logger(__name__)

SETTINGS = [
    VERBOSITY,
    Setting("listenAddress", "address", "127.0.0.1:8081", "HOST:PORT for /livez, /healthz, /version, /metrics"),
    Setting("nodeName", "str", os.environ.get("NODE_NAME") or socket.gethostname(), "this node's name"),
    *GPU_SOURCE_SETTINGS,
]


class NodeAgent:
    def __init__(self, cfg: Config, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.health = HealthRegistry(self.clock, ["gpus"])
        self.metrics = AgentMetrics()
        self.monitor = InventoryMonitor(make_source(cfg), self.clock, self.health, cfg.gpuPollInterval,
                                        self._gpus_changed, zero_is_ready=True)
        host, _, port = cfg.listenAddress.rpartition(":")
        self.endpoints = EndpointServer(host, int(port), self.health, self.metrics)

    async def _gpus_changed(self, event: InventoryEvent) -> None:
        self.metrics.gpus.set(event.inventory.count)
        self.metrics.gpu_generation.set(event.generation)

    async def _heartbeat(self) -> None:
        while True:
            self.health.beat()
            await self.clock.sleep(1.0)

    async def run(self, stop: asyncio.Event) -> None:
        log.info("effective configuration: %s", json.dumps(self.cfg.redacted(), sort_keys=True))
        self.endpoints.start()
        log.info("node agent for %s serving on http://%s", self.cfg.nodeName, self.endpoints.address)
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._heartbeat()), tg.create_task(self.monitor.run())]
                await stop.wait()
                log.info("shutting down")
                for t in tasks:
                    t.cancel()
        finally:
            self.endpoints.stop()
            self.monitor.source.close()
