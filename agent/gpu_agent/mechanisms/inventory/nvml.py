"""The NVML source, through NVIDIA's binding `nvidia-ml-py` (module `pynvml`).

pynvml loads libnvidia-ml once, on the first successful `nvmlInit()`; a failed load is
retried on the next init. So this source calls `nvmlInit()` on every read until one
succeeds (a node whose driver appears late still works), then keeps NVML initialised.
"Library not found" and "driver not loaded" are the normal state of a node without an
NVIDIA driver: zero GPUs, with that reason. Every other NVML error is reported as an
error with its NVML name, and NVML is re-initialised on the next read.
"""

from __future__ import annotations

from typing import Any

from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.mechanisms.inventory.fabric import NOT_SUPPORTED, GPUFabric, node_fabric
from gpu_agent.mechanisms.inventory.source import Reading


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NVMLSource:
    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml  # imported lazily: the fake source must work without it
            nvml = pynvml
        self._nvml = nvml
        self._initialised = False

    def _zero_reason(self, err: Exception) -> str | None:
        n = self._nvml
        code = getattr(err, "value", None)
        if code == n.NVML_ERROR_LIBRARY_NOT_FOUND:
            return "NVML library not found (no NVIDIA driver installed on this node)"
        if code == n.NVML_ERROR_DRIVER_NOT_LOADED:
            return "NVIDIA driver not loaded"
        return None

    def _describe(self, err: Exception) -> str:
        code = getattr(err, "value", None)
        return f"NVML error {code}: {err}"

    def read(self) -> Reading:
        n = self._nvml
        if not self._initialised:
            try:
                n.nvmlInit()
            except n.NVMLError as e:
                reason = self._zero_reason(e)
                if reason is not None:
                    return Reading(Inventory(), note=reason)
                return Reading(Inventory(), error=f"nvmlInit failed: {self._describe(e)}")
            self._initialised = True
        try:
            gpus, fabrics = [], []
            for i in range(n.nvmlDeviceGetCount()):
                h = n.nvmlDeviceGetHandleByIndex(i)
                mem = n.nvmlDeviceGetMemoryInfo(h)
                try:
                    current, _pending = n.nvmlDeviceGetMigMode(h)
                    mig = current == n.NVML_DEVICE_MIG_ENABLE
                except n.NVMLError as e:
                    if getattr(e, "value", None) != n.NVML_ERROR_NOT_SUPPORTED:
                        raise
                    mig = False
                gpus.append(GPU(uuid=_text(n.nvmlDeviceGetUUID(h)), name=_text(n.nvmlDeviceGetName(h)),
                                memory_total_bytes=int(mem.total), mig_mode=mig, index=i))
                fabrics.append(self._fabric(h))
        except n.NVMLError as e:
            # A GPU that fell off the bus or a driver reload: start over on the next read.
            self.close()
            return Reading(Inventory(), error=f"reading GPUs failed: {self._describe(e)}")
        fabric = node_fabric(fabrics)
        inventory = Inventory(tuple(gpus), clique=fabric.clique, fabric=fabric.reason if gpus else "")
        return Reading(inventory, note=None if gpus else "NVML reports no GPUs")

    def _fabric(self, handle: Any) -> GPUFabric:
        """This GPU's fabric; a driver or binding without the call, or a GPU without a fabric, is "not supported"."""
        n = self._nvml
        get = getattr(n, "nvmlDeviceGetGpuFabricInfo", None)
        if get is None:
            return GPUFabric(NOT_SUPPORTED)
        try:
            info = get(handle)
        except n.NVMLError as e:
            if getattr(e, "value", None) in (n.NVML_ERROR_NOT_SUPPORTED, getattr(n, "NVML_ERROR_FUNCTION_NOT_FOUND", -1)):
                return GPUFabric(NOT_SUPPORTED)
            raise
        return GPUFabric(int(info.state), int(info.status), bytes(info.clusterUuid), int(info.cliqueId))

    def driver_version(self) -> str | None:
        if not self._initialised:
            return None
        try:
            return _text(self._nvml.nvmlSystemGetDriverVersion())
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
