"""The NVML source against a stand-in for the pynvml module (the real one is proven on a GPU
machine by scripts/gpu-check.sh)."""

from types import SimpleNamespace

import pytest

from gpu_agent.mechanisms.inventory.nvml import NVMLSource


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"code {value}")
        self.value = value


class FakeNVML:
    NVMLError = NVMLError
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, gpus=(), init_errors=()):
        self.gpus = list(gpus)
        self.init_errors = list(init_errors)
        self.inits = 0
        self.shutdowns = 0
        self.lost = False

    def nvmlInit(self):
        self.inits += 1
        if self.init_errors:
            raise NVMLError(self.init_errors.pop(0))

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if self.lost:
            raise NVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetName(self, h):
        return h["name"].encode()  # older bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["mem"], free=h["mem"], used=0)

    def nvmlDeviceGetMigMode(self, h):
        if h.get("mig") is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return [h["mig"], h["mig"]]


H200 = {"uuid": "GPU-33964205-8823-9be7-440a-d72735a288f4", "name": "NVIDIA H200", "mem": 150754820096, "mig": 0}


def test_reads_count_uuid_name_memory_and_mig_mode():
    nvml = FakeNVML([H200, {**H200, "uuid": "GPU-2", "mig": 1}, {**H200, "uuid": "GPU-3", "mig": None}])
    r = NVMLSource(nvml).read()
    assert r.error is None and r.inventory.count == 3
    g = r.inventory.gpus[0]
    assert (g.uuid, g.name, g.memory_total_bytes, g.mig_mode) == (H200["uuid"], "NVIDIA H200", 150754820096, False)
    assert [g.mig_mode for g in r.inventory.gpus] == [False, True, False]


def test_library_not_found_and_driver_not_loaded_mean_zero_gpus_not_an_error():
    for code, words in ((12, "library not found"), (9, "driver not loaded")):
        r = NVMLSource(FakeNVML(init_errors=[code])).read()
        assert r.error is None and r.inventory.count == 0 and words in r.note


def test_other_errors_are_reported_distinctly():
    r = NVMLSource(FakeNVML(init_errors=[4])).read()
    assert r.inventory.count == 0 and "NVML error 4" in r.error


def test_a_driver_that_appears_late_is_picked_up():
    nvml = FakeNVML([H200], init_errors=[12, 9])
    src = NVMLSource(nvml)
    assert src.read().inventory.count == 0
    assert src.read().inventory.count == 0
    assert src.read().inventory.count == 1
    assert nvml.inits == 3
    src.read()
    assert nvml.inits == 3  # initialised once, then kept


def test_a_lost_gpu_stays_listed_as_lost_under_its_last_uuid_and_nvml_stays_initialised():
    nvml = FakeNVML([H200])
    src = NVMLSource(nvml)
    assert src.read().inventory.count == 1
    nvml.lost = True
    r = src.read()
    assert r.error is None and [(g.uuid, g.health) for g in r.inventory.gpus] == [(H200["uuid"], "Lost")]
    assert "GPU_IS_LOST" in r.inventory.gpus[0].health_reason and nvml.shutdowns == 0
    nvml.lost = False
    r = src.read()
    assert [(g.uuid, g.health) for g in r.inventory.gpus] == [(H200["uuid"], "Healthy")] and nvml.inits == 1


def test_other_errors_while_reading_are_errors_and_nvml_is_reinitialised():
    nvml = FakeNVML([H200])
    src = NVMLSource(nvml)
    assert src.read().inventory.count == 1
    nvml.nvmlDeviceGetMemoryInfo = lambda h: (_ for _ in ()).throw(NVMLError(999))
    r = src.read()
    assert "NVML error 999" in r.error and nvml.shutdowns == 1
    del nvml.nvmlDeviceGetMemoryInfo
    assert src.read().inventory.count == 1 and nvml.inits == 2


class FabricNVML(FakeNVML):
    """NVML whose GPUs report fabric info (as nvmlDeviceGetGpuFabricInfo does), or an error code."""

    NVML_ERROR_FUNCTION_NOT_FOUND = 13

    def nvmlDeviceGetGpuFabricInfo(self, h):
        fabric = h.get("fabric")
        if isinstance(fabric, int):
            raise NVMLError(fabric)
        return SimpleNamespace(**fabric)


RACK = bytes(range(16))


def gb200(i, state=3, status=0, cluster=RACK, clique=7):
    return {"uuid": f"GPU-00000000-0000-0000-0000-00000000000{i}", "name": "NVIDIA GB200", "mem": 1 << 37, "mig": 0,
            "fabric": {"state": state, "status": status, "clusterUuid": cluster, "cliqueId": clique}}


def reading_of(*gpus):
    return NVMLSource(FabricNVML(list(gpus))).read()


def test_the_clique_of_a_node_whose_gpus_agree_and_completed_registration():
    r = reading_of(gb200(0), gb200(1))
    assert r.inventory.clique == "00010203-0405-0607-0809-0a0b0c0d0e0f.7"
    assert r.inventory.fabric == "fabric completed: clique 00010203-0405-0607-0809-0a0b0c0d0e0f.7"


def test_no_clique_when_gpus_disagree_are_still_registering_failed_or_have_no_fabric():
    cases = [
        ((gb200(0), gb200(1, clique=8)), "GPUs disagree on their clique"),
        ((gb200(0), gb200(1, cluster=bytes(16))), "GPUs disagree on their clique"),
        ((gb200(0), gb200(1, state=2)), "fabric registration in progress on GPU(s) 1"),
        ((gb200(0, state=1), gb200(1, state=1)), "fabric registration not started on GPU(s) 0, 1"),
        ((gb200(0, status=5), gb200(1)), "fabric registration failed on GPU(s) 0 (NVML status 5)"),
        (({**H200, "fabric": {"state": 0, "status": 0, "clusterUuid": bytes(16), "cliqueId": 0}},),
         "fabric not supported (no multi-node NVLink)"),
        (({**H200, "fabric": FakeNVML.NVML_ERROR_NOT_SUPPORTED},), "fabric not supported (no multi-node NVLink)"),
        (({**H200, "fabric": FabricNVML.NVML_ERROR_FUNCTION_NOT_FOUND},), "fabric not supported (no multi-node NVLink)"),
    ]
    for gpus, reason in cases:
        r = reading_of(*gpus)
        assert r.error is None and r.inventory.count == len(gpus)
        assert r.inventory.clique == "" and r.inventory.fabric.startswith(reason), (gpus, r.inventory.fabric)


def test_a_binding_without_the_fabric_call_means_no_fabric_and_other_fabric_errors_are_errors():
    r = NVMLSource(FakeNVML([H200])).read()  # FakeNVML has no nvmlDeviceGetGpuFabricInfo
    assert r.inventory.clique == "" and r.inventory.fabric.startswith("fabric not supported")
    lost = reading_of({**H200, "fabric": FakeNVML.NVML_ERROR_GPU_IS_LOST})
    assert lost.error is None and [g.health for g in lost.inventory.gpus] == ["Lost"]
    broken = reading_of({**H200, "fabric": 999})
    assert broken.error is not None and "NVML error 999" in broken.error


# -- health events: a scripted NVML event set ------------------------------------------------------------------

import queue  # noqa: E402 - the event tests' own imports
import threading  # noqa: E402
import time  # noqa: E402

from gpu_agent.foundations.clock import ManualClock  # noqa: E402
from gpu_agent.mechanisms.inventory.gpu_health import HealthTracker  # noqa: E402
from gpu_agent.mechanisms.inventory.nvml import describe_events  # noqa: E402

XID_CRITICAL, ECC_SINGLE, ECC_DOUBLE, PSTATE = 0x8, 0x1, 0x2, 0x4
H200_B = {**H200, "uuid": "GPU-bbbbbbbb-8823-9be7-440a-d72735a288f4"}


class EventNVML(FakeNVML):
    """NVML with events: each GPU's supported types (`events`: a mask, or an NVML error code), and an event set whose
    wait returns what the test `send`s, raising TIMEOUT (10) after the wait's timeout, as nvmlEventSetWait_v2 does."""

    NVML_ERROR_TIMEOUT = 10

    def __init__(self, gpus):
        super().__init__(gpus)
        self.queue = queue.Queue()
        self.registered = {}
        self.sets_created = self.sets_freed = 0
        self.waits = []  # the timeout of each wait
        self.waiting = threading.Event()

    def nvmlDeviceGetSupportedEventTypes(self, h):
        mask = h.get("events", XID_CRITICAL | ECC_SINGLE | ECC_DOUBLE | PSTATE)
        if mask < 0:
            raise NVMLError(-mask)
        return mask

    def nvmlDeviceGetUUID(self, h):
        if "uuid" not in h:
            raise NVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return h["uuid"]

    def nvmlEventSetCreate(self):
        self.sets_created += 1
        return f"set-{self.sets_created}"

    def nvmlDeviceRegisterEvents(self, h, mask, event_set):
        self.registered[h["uuid"]] = (mask, event_set)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self.waits.append(timeout_ms)
        self.waiting.set()
        try:
            item = self.queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(self.NVML_ERROR_TIMEOUT) from None
        if isinstance(item, int):
            raise NVMLError(item)
        return item

    def nvmlEventSetFree(self, event_set):
        self.sets_freed += 1

    def send(self, gpu, event_type, data=0):
        self.queue.put(SimpleNamespace(device=gpu, eventType=event_type, eventData=data, gpuInstanceId=0,
                                       computeInstanceId=0))


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def watched():
    """A source over two GPUs on a manual clock (recovery 60 s), read once: its event thread is waiting."""
    nvml = EventNVML([H200, H200_B])
    clock = ManualClock()
    src = NVMLSource(nvml, tracker=HealthTracker(clock=clock, recovery=60, source="nvml"), event_wait_ms=50)
    assert src.read().inventory.count == 2
    wait_for(nvml.waiting.is_set)
    yield nvml, src, clock
    src.close()


def healths(src):
    return [(g.health, g.health_reason) for g in src.read().inventory.gpus]


def test_each_gpu_is_registered_for_the_health_events_it_supports():
    nvml = EventNVML([{**H200, "events": XID_CRITICAL | PSTATE}, {**H200_B, "events": PSTATE},
                      {**H200, "uuid": "GPU-3", "events": -FakeNVML.NVML_ERROR_NOT_SUPPORTED}])
    src = NVMLSource(nvml, event_wait_ms=50)
    src.read()
    try:
        assert nvml.registered == {H200["uuid"]: (XID_CRITICAL, "set-1")}  # PState is not a health event
        assert src.supported_events == {H200["uuid"]: XID_CRITICAL | PSTATE, H200_B["uuid"]: PSTATE, "GPU-3": 0}
        assert describe_events(src.supported_events[H200["uuid"]]) == "P-state change, critical Xid"
        wait_for(nvml.waiting.is_set)
    finally:
        src.close()
    assert nvml.sets_freed == 1


def test_a_critical_xid_event_makes_its_gpu_unhealthy_until_the_recovery_window_passes(watched):
    nvml, src, clock = watched
    nvml.send(H200_B, XID_CRITICAL, 48)
    wait_for(lambda: src.tracker.health_of(H200_B["uuid"]) == "Unhealthy")
    assert healths(src) == [("Healthy", ""), ("Unhealthy", "Xid 48 (double-bit ECC error)")]
    clock.advance_blocking(59)
    assert healths(src)[1][0] == "Unhealthy"
    clock.advance_blocking(1)
    assert healths(src) == [("Healthy", ""), ("Healthy", "")]  # the same UUID, answering: back without a restart


def test_ignored_xids_and_single_bit_ecc_leave_the_gpu_healthy_and_double_bit_ecc_does_not(watched):
    nvml, src, _ = watched
    nvml.send(H200, XID_CRITICAL, 13)
    nvml.send(H200, ECC_SINGLE)
    nvml.send(H200, ECC_DOUBLE)
    wait_for(lambda: src.events.delivered == 3)
    assert healths(src) == [("Unhealthy", "double-bit ECC error (uncorrectable)"), ("Healthy", "")]


def test_an_event_that_cannot_be_handled_is_dropped_and_the_thread_goes_on(watched):
    nvml, src, _ = watched
    nvml.send({"no uuid": True}, XID_CRITICAL, 48)  # nvmlDeviceGetUUID answers GPU_IS_LOST
    nvml.send(7, XID_CRITICAL, 48)  # the binding breaks some other way (a TypeError)
    nvml.send(H200, XID_CRITICAL, 79)
    wait_for(lambda: src.events.delivered == 1)
    assert healths(src)[0] == ("Unhealthy", "Xid 79 (GPU has fallen off the bus)")
    assert len(src.events.errors) == 1 and "TypeError" in src.events.errors[0]


def test_a_wait_that_fails_is_retried_after_a_second_on_the_clock(watched):
    nvml, src, clock = watched
    nvml.queue.put(999)
    wait_for(lambda: src.events.errors)
    assert "NVML error 999" in src.events.errors[0]
    waits = len(nvml.waits)
    wait_for(lambda: clock.blocked == 1)  # the thread waits on the clock, not on NVML
    assert len(nvml.waits) == waits
    clock.advance_blocking(1.0)
    nvml.send(H200, XID_CRITICAL, 94)
    wait_for(lambda: src.tracker.health_of(H200["uuid"]) == "Unhealthy")


def test_close_stops_the_event_thread_within_one_wait_and_frees_the_set(watched):
    nvml, src, _ = watched
    thread = src.events._thread
    started = time.monotonic()
    src.close()
    assert time.monotonic() - started < 1.0 and not thread.is_alive()
    assert nvml.sets_freed == 1 and nvml.shutdowns == 1 and src.events is None
    assert set(nvml.waits) == {50}


def test_events_are_registered_again_after_nvml_is_reinitialised(watched):
    nvml, src, _ = watched
    src.close()
    assert src.read().inventory.count == 2 and nvml.sets_created == 2
    nvml.send(H200, XID_CRITICAL, 48)
    wait_for(lambda: src.tracker.health_of(H200["uuid"]) == "Unhealthy")


def test_gpu_is_lost_on_one_gpu_marks_that_gpu_lost_and_the_others_read_on(watched):
    nvml, src, _ = watched
    original = nvml.nvmlDeviceGetMemoryInfo

    def memory(h):
        if h is H200_B:
            raise NVMLError(FakeNVML.NVML_ERROR_GPU_IS_LOST)
        return original(h)

    nvml.nvmlDeviceGetMemoryInfo = memory
    r = src.read()
    assert r.error is None
    assert [(g.uuid, g.health) for g in r.inventory.gpus] == [(H200["uuid"], "Healthy"), (H200_B["uuid"], "Lost")]
    del nvml.nvmlDeviceGetMemoryInfo
    assert healths(src) == [("Healthy", ""), ("Healthy", "")]  # listed and answering again
