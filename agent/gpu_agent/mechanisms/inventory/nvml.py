"""The NVML source, through NVIDIA's binding `nvidia-ml-py` (module `pynvml`).

pynvml loads libnvidia-ml once, on the first successful `nvmlInit()`; a failed load is
retried on the next init. So this source calls `nvmlInit()` on every read until one
succeeds (a node whose driver appears late still works), then keeps NVML initialised.
"Library not found" and "driver not loaded" are the normal state of a node without an
NVIDIA driver: zero GPUs, with that reason. Every other NVML error is reported as an
error with its NVML name, and NVML is re-initialised on the next read.

Health. A GPU whose own calls answer `GPU_IS_LOST` (fallen off the bus) stays listed, as Lost,
under the UUID it last answered with; the other GPUs are read as usual. Once NVML is initialised
the source registers each GPU for the event types it supports among critical Xid and single- and
double-bit ECC (`nvmlDeviceGetSupportedEventTypes`, `nvmlDeviceRegisterEvents`) and a thread waits
on the event set (`nvmlEventSetWait_v2`, EVENT_WAIT_MS at a time, so `close()` returns promptly),
handing each event to the health tracker (mechanisms/inventory/gpu_health.py), which decides what
it means; every read's GPUs carry the tracker's verdict.
"""

from __future__ import annotations

import threading
from typing import Any

from gpu_agent.foundations.clock import SystemClock
from gpu_agent.foundations.gpus import GPU, LOST, Inventory
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.threads import start_thread
from gpu_agent.foundations.xids import LOST_REASON
from gpu_agent.mechanisms.inventory.fabric import NOT_SUPPORTED, GPUFabric, node_fabric
from gpu_agent.mechanisms.inventory.gpu_health import ECC_DOUBLE, ECC_SINGLE, XID, HealthTracker
from gpu_agent.mechanisms.inventory.source import Reading

log = get_logger(__name__)

# NVML's event type bits (pynvml's nvmlEventType*; the values are NVML's ABI).
EVENT_ECC_SINGLE = 0x1
EVENT_ECC_DOUBLE = 0x2
EVENT_XID_CRITICAL = 0x8
WANTED_EVENTS = EVENT_ECC_SINGLE | EVENT_ECC_DOUBLE | EVENT_XID_CRITICAL
EVENT_NAMES = {0x1: "single-bit ECC", 0x2: "double-bit ECC", 0x4: "P-state change", 0x8: "critical Xid",
               0x10: "clock change", 0x80: "power source change", 0x100: "MIG config change",
               0x200: "single-bit ECC storm", 0x400: "DRAM retirement", 0x800: "DRAM retirement failure",
               0x1000: "non-fatal poison", 0x2000: "fatal poison", 0x4000: "GPU unavailable",
               0x8000: "GPU recovery action"}
EVENT_WAIT_MS = 500  # one wait on the event set: how long close() may wait for the event thread
NVML_ERROR_TIMEOUT = 10


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe_events(mask: int) -> str:
    """`critical Xid, double-bit ECC` for a mask of event types; unknown bits by value."""
    names = [EVENT_NAMES.get(1 << b, hex(1 << b)) for b in range(64) if mask >> b & 1]
    return ", ".join(names) or "none"


class EventWatch:
    """The thread that waits on one NVML event set and hands each event to the tracker."""

    def __init__(self, nvml: Any, event_set: Any, tracker: HealthTracker, wait_ms: int = EVENT_WAIT_MS) -> None:
        self._nvml = nvml
        self.event_set = event_set
        self.tracker = tracker
        self.wait_ms = wait_ms
        self.stopping = threading.Event()
        self.waits = 0  # waits that ended (an event or the timeout)
        self.delivered = 0
        self.errors: list[str] = []  # the errors other than a timeout, latest last (bounded)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_thread("nvml-events", self._run, self.stopping)

    def _run(self) -> None:
        n = self._nvml
        logged: set[object] = set()
        while not self.stopping.is_set():
            try:
                data = n.nvmlEventSetWait_v2(self.event_set, self.wait_ms)
            except n.NVMLError as e:
                code = getattr(e, "value", None)
                self.waits += 1
                if code == getattr(n, "NVML_ERROR_TIMEOUT", NVML_ERROR_TIMEOUT):
                    continue
                self.errors = [*self.errors[-9:], f"NVML error {code}: {e}"]
                if code not in logged:  # the same failure every half second would flood the log
                    logged.add(code)
                    log.warning("waiting for NVML events failed (NVML error %s: %s); retrying, logged once", code, e)
                self.tracker.clock.wait_blocking(self.stopping, 1.0)
                continue
            self.waits += 1
            try:
                self._deliver(data)
            except Exception as e:  # noqa: BLE001 - one odd event must not end the watch for every GPU
                self.errors = [*self.errors[-9:], f"{type(e).__name__}: {e}"]
                log.warning("an NVML event could not be handled (%s: %s); the watch goes on", type(e).__name__, e)

    def _deliver(self, data: Any) -> None:
        n = self._nvml
        event_type = int(data.eventType)
        if event_type & EVENT_XID_CRITICAL:
            kind, xid = XID, int(data.eventData)
        elif event_type & EVENT_ECC_DOUBLE:
            kind, xid = ECC_DOUBLE, 0
        elif event_type & EVENT_ECC_SINGLE:
            kind, xid = ECC_SINGLE, 0
        else:
            return
        try:
            uuid = _text(n.nvmlDeviceGetUUID(data.device))
        except n.NVMLError as e:
            # A GPU that cannot name itself is lost: the next read marks it so under its last UUID.
            log.v(1, "NVML event %s for a GPU that cannot be named (NVML error %s); the next read judges it",
                  describe_events(event_type), getattr(e, "value", None))
            return
        self.delivered += 1
        self.tracker.event(uuid, kind, xid)

    def stop(self, timeout: float) -> bool:
        """Stop waiting; True once the thread has ended (it ends within one wait)."""
        self.stopping.set()
        if self._thread is None:
            return True
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()


class NVMLSource:
    name = "nvml"

    def __init__(self, nvml: Any = None, tracker: HealthTracker | None = None, event_wait_ms: int = EVENT_WAIT_MS) -> None:
        if nvml is None:
            import pynvml  # imported lazily: the fake source must work without it
            nvml = pynvml
        self._nvml = nvml
        self._initialised = False
        self.tracker = tracker or HealthTracker(clock=SystemClock(), recovery=60.0, source=self.name)
        self.event_wait_ms = event_wait_ms
        self.events: EventWatch | None = None
        self.supported_events: dict[str, int] = {}  # UUID -> the event types its GPU supports (gpu-check prints them)
        self.registered_events: dict[str, int] = {}  # UUID -> the types this source registered for
        self._last_good: dict[int, GPU] = {}  # by index: each GPU as last read, to name it once it stops answering
        self._unnamed_lost: set[int] = set()

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

    def _lost(self, err: Exception) -> bool:
        return bool(getattr(err, "value", None) == self._nvml.NVML_ERROR_GPU_IS_LOST)

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
            gpus, fabrics, handles = [], [], []
            conditions: dict[str, tuple[str, str]] = {}
            for i in range(n.nvmlDeviceGetCount()):
                try:
                    gpu, handle = self._read_gpu(i)
                    self._last_good[i] = gpu
                    gpu_fabric = self._fabric(handle)
                except n.NVMLError as e:
                    if not self._lost(e):
                        raise
                    known = self._last_good.get(i)
                    if known is None:
                        if i not in self._unnamed_lost:
                            self._unnamed_lost.add(i)
                            log.warning("GPU at index %d is lost (NVML_ERROR_GPU_IS_LOST) and never answered; not "
                                        "listed (logged once)", i)
                        continue
                    gpus.append(known)
                    conditions[known.uuid] = (LOST, LOST_REASON)
                    continue
                self._unnamed_lost.discard(i)
                gpus.append(gpu)
                fabrics.append(gpu_fabric)
                handles.append((gpu.uuid, handle))
        except n.NVMLError as e:
            # A driver reload or the like: start over on the next read.
            self.close()
            return Reading(Inventory(), error=f"reading GPUs failed: {self._describe(e)}")
        if self.events is None and handles:
            self._watch_events(handles)
        listed = self.tracker.observe(gpus, conditions)
        fabric = node_fabric(fabrics)
        inventory = Inventory(listed, clique=fabric.clique, fabric=fabric.reason if listed else "")
        return Reading(inventory, note=None if listed else "NVML reports no GPUs")

    def _read_gpu(self, i: int) -> tuple[GPU, Any]:
        n = self._nvml
        h = n.nvmlDeviceGetHandleByIndex(i)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        try:
            current, _pending = n.nvmlDeviceGetMigMode(h)
            mig = current == n.NVML_DEVICE_MIG_ENABLE
        except n.NVMLError as e:
            if getattr(e, "value", None) != n.NVML_ERROR_NOT_SUPPORTED:
                raise
            mig = False
        gpu = GPU(uuid=_text(n.nvmlDeviceGetUUID(h)), name=_text(n.nvmlDeviceGetName(h)),
                  memory_total_bytes=int(mem.total), mig_mode=mig, index=i)
        return gpu, h

    def _watch_events(self, handles: list[tuple[str, Any]]) -> None:
        """Register each GPU for the health events it supports and start the thread that waits for them. A
        binding or driver without events leaves health to GPU_IS_LOST alone (logged)."""
        n = self._nvml
        if not hasattr(n, "nvmlEventSetCreate"):
            log.warning("this NVML binding has no events; GPU health comes from GPU_IS_LOST alone")
            self.events = EventWatch(n, None, self.tracker)  # never started: marks the attempt made
            return
        try:
            event_set = n.nvmlEventSetCreate()
        except n.NVMLError as e:
            log.warning("NVML event set cannot be created (%s); GPU health comes from GPU_IS_LOST alone",
                        self._describe(e))
            self.events = EventWatch(n, None, self.tracker)
            return
        not_supported = getattr(n, "NVML_ERROR_NOT_SUPPORTED", 3)
        for uuid, h in handles:
            try:
                supported = int(n.nvmlDeviceGetSupportedEventTypes(h))
            except n.NVMLError as e:
                if getattr(e, "value", None) != not_supported:
                    log.warning("GPU %s: its event types cannot be read (%s); no health events from it", uuid,
                                self._describe(e))
                supported = 0
            self.supported_events[uuid] = supported
            wanted = supported & WANTED_EVENTS
            if not wanted:
                log.info("GPU %s supports none of the health events (critical Xid, ECC); GPU_IS_LOST still marks it",
                         uuid)
                continue
            try:
                n.nvmlDeviceRegisterEvents(h, wanted, event_set)
            except n.NVMLError as e:
                log.warning("GPU %s: registering for %s failed (%s)", uuid, describe_events(wanted), self._describe(e))
                continue
            self.registered_events[uuid] = wanted
            log.v(1, "GPU %s: watching %s events", uuid, describe_events(wanted))
        self.events = EventWatch(n, event_set, self.tracker, self.event_wait_ms)
        if self.registered_events:
            self.events.start()
        log.info("NVML health events: %d of %d GPUs registered", len(self.registered_events), len(handles))

    def _stop_events(self) -> None:
        events, self.events = self.events, None
        self.registered_events = {}
        if events is None or events.event_set is None:
            return
        if not events.stop(events.wait_ms / 1000 + 2):
            # Freeing a set a thread still waits on would be a use after free: leave it (the process ends soon).
            log.warning("the NVML event thread did not stop within %.1fs; its event set is left allocated",
                        events.wait_ms / 1000 + 2)
            return
        try:
            self._nvml.nvmlEventSetFree(events.event_set)
        except self._nvml.NVMLError as e:
            log.v(1, "freeing the NVML event set failed: %s", e)

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
        self._stop_events()
        if self._initialised:
            self._initialised = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
