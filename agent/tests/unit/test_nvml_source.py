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
    assert r.error is None and r.inventory.count == 3 and r.note is None
    g = r.inventory.gpus[0]
    assert (g.uuid, g.name, g.memory_total_bytes, g.mig_mode) == (H200["uuid"], "NVIDIA H200", 150754820096, False)
    assert [g.mig_mode for g in r.inventory.gpus] == [False, True, False]
    assert [g.index for g in r.inventory.gpus] == [0, 1, 2]


def test_a_node_whose_nvml_lists_no_gpu_reads_zero_saying_so_and_no_fabric():
    r = NVMLSource(FakeNVML([])).read()
    assert (r.error, r.note, r.inventory.count) == (None, "NVML reports no GPUs", 0)
    assert (r.inventory.clique, r.inventory.fabric) == ("", "")  # not node_fabric's "no GPUs": nothing to say


def test_by_default_the_source_is_pynvml_with_the_nvml_recovery_window():
    import pynvml

    src = NVMLSource()  # nothing is called before the first read
    assert src._nvml is pynvml and (src.tracker.recovery, src.tracker.source) == (60.0, "nvml")


def test_library_not_found_and_driver_not_loaded_mean_zero_gpus_not_an_error():
    # the note is the reason /healthz gives for zero GPUs ("no GPUs available: NVIDIA driver not loaded")
    for code, note in ((12, "NVML library not found (no NVIDIA driver installed on this node)"),
                       (9, "NVIDIA driver not loaded")):
        r = NVMLSource(FakeNVML(init_errors=[code])).read()
        assert r.error is None and r.inventory.count == 0 and r.note == note


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


def test_a_binding_without_function_not_found_still_reads_not_supported_and_takes_every_other_code_for_an_error():
    class OlderNVML(FakeNVML):  # the fabric call, but no NVML_ERROR_FUNCTION_NOT_FOUND constant
        nvmlDeviceGetGpuFabricInfo = FabricNVML.nvmlDeviceGetGpuFabricInfo

    plain = NVMLSource(OlderNVML([{**H200, "fabric": FakeNVML.NVML_ERROR_NOT_SUPPORTED}])).read()
    assert plain.error is None and plain.inventory.fabric.startswith("fabric not supported")
    uninitialised = NVMLSource(OlderNVML([{**H200, "fabric": 1}])).read()  # NVML_ERROR_UNINITIALIZED
    assert uninitialised.error == "reading GPUs failed: NVML error 1: code 1"


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
        self.waited_on = set()  # the event sets waited on
        self.freed = []  # the event sets freed
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
        if "register_error" in h:
            raise NVMLError(h["register_error"])
        self.registered[h["uuid"]] = (mask, event_set)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self.waits.append(timeout_ms)
        self.waited_on.add(event_set)
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
        self.freed.append(event_set)

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
    log = log_at(1)
    nvml.send({"no uuid": True}, XID_CRITICAL, 48)  # nvmlDeviceGetUUID answers GPU_IS_LOST
    for _ in range(12):
        nvml.send(7, XID_CRITICAL, 48)  # the binding breaks some other way (a TypeError)
    nvml.send(H200, XID_CRITICAL, 79)
    wait_for(lambda: src.events.delivered == 1)
    assert healths(src)[0] == ("Unhealthy", "Xid 79 (GPU has fallen off the bus)")
    broken = "TypeError: argument of type 'int' is not iterable"
    assert src.events.errors == [broken] * 10  # the latest ten
    assert messages(log, "cannot be named") == [
        "NVML event critical Xid for a GPU that cannot be named (NVML error 15); the next read judges it"]
    assert messages(log, "could not be handled") == [
        f"an NVML event could not be handled ({broken}); the watch goes on"] * 12


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
    assert set(nvml.waits) == {50} and nvml.waited_on == {"set-1"} and nvml.freed == ["set-1"]


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


# -- what the source says, and the edges of the event watch ------------------------------------------------------

import io  # noqa: E402

from gpu_agent.foundations import klog  # noqa: E402
from gpu_agent.mechanisms.inventory.nvml import EventWatch  # noqa: E402


def log_at(v):
    stream = io.StringIO()
    klog.setup(v, stream)
    return stream


def messages(stream, containing=""):
    """Each line's message (after klog's header), those containing `containing`."""
    return [line.split("] ", 1)[1] for line in stream.getvalue().splitlines() if containing in line]


class Recorder:
    """The tracker's metrics: the kind of each event it was handed."""

    def __init__(self):
        self.events = []

    def gpu_health_transition(self, to):
        pass

    def gpu_health_counts(self, counts):
        pass

    def gpu_health_event(self, kind):
        self.events.append(kind)


def test_describe_events_names_each_bit_the_unknown_ones_by_value_and_an_empty_mask_none():
    """What `gpu-agent inventory` prints for each GPU's supported and registered events."""
    assert describe_events(0) == "none"
    assert describe_events(XID_CRITICAL | 0x20 | 1 << 40) == "critical Xid, 0x20, 0x10000000000"


def test_registering_for_events_says_for_each_gpu_what_it_got_and_counts_the_gpus_registered():
    log = log_at(1)
    nvml = EventNVML([{**H200, "uuid": "GPU-1", "events": -999},  # its event types cannot be read
                      {**H200, "uuid": "GPU-2", "events": -FakeNVML.NVML_ERROR_NOT_SUPPORTED},  # no events: no fault
                      {**H200, "uuid": "GPU-3", "events": PSTATE},
                      {**H200, "uuid": "GPU-4", "register_error": 5},
                      {**H200, "uuid": "GPU-5", "events": XID_CRITICAL | ECC_DOUBLE}])
    src = NVMLSource(nvml, event_wait_ms=50)
    try:
        assert src.read().inventory.count == 5
        assert src.registered_events == {"GPU-5": XID_CRITICAL | ECC_DOUBLE}
        assert src.supported_events["GPU-1"] == 0 and src.events._thread.name == "nvml-events"
    finally:
        src.close()
    none = "supports none of the health events (critical Xid, ECC); GPU_IS_LOST still marks it"
    assert messages(log, "GPU") == [
        "GPU GPU-1: its event types cannot be read (NVML error 999: code 999); no health events from it",
        f"GPU GPU-1 {none}", f"GPU GPU-2 {none}", f"GPU GPU-3 {none}",
        "GPU GPU-4: registering for single-bit ECC, double-bit ECC, critical Xid failed (NVML error 5: code 5)",
        "GPU GPU-5: watching double-bit ECC, critical Xid events",
        "NVML health events: 1 of 5 GPUs registered"]


def test_a_binding_without_events_or_an_event_set_is_said_once_and_health_comes_from_gpu_is_lost():
    log = log_at(0)
    src = NVMLSource(FakeNVML([H200]))  # no nvmlEventSetCreate
    src.read()
    src.read()
    assert src.events is not None and src.events.event_set is None  # the attempt is made once
    src.close()

    class NoSet(EventNVML):
        def nvmlEventSetCreate(self):
            raise NVMLError(999)

    src = NVMLSource(NoSet([H200]))
    src.read()
    src.read()
    assert src.events is not None and src.events.event_set is None
    src.close()
    assert messages(log) == [
        "this NVML binding has no events; GPU health comes from GPU_IS_LOST alone",
        "NVML event set cannot be created (NVML error 999: code 999); GPU health comes from GPU_IS_LOST alone"]


def test_an_event_set_no_gpu_registered_for_is_freed_on_close_and_a_failed_free_is_only_logged():
    log = log_at(1)
    nvml = EventNVML([{**H200, "events": PSTATE}])  # no health event: the set is made, no thread waits on it
    src = NVMLSource(nvml, event_wait_ms=50)
    src.read()
    assert src.events._thread is None
    src.close()
    assert nvml.freed == ["set-1"] and nvml.shutdowns == 1

    def fails(event_set):
        raise NVMLError(999)

    nvml.nvmlEventSetFree = fails
    src.read()
    src.close()
    assert nvml.shutdowns == 2 and messages(log, "freeing") == ["freeing the NVML event set failed: code 999"]


def test_close_leaves_the_set_of_an_event_thread_that_did_not_stop_allocated_saying_so():
    """Freeing a set a thread still waits on would be a use after free. The thread is given one wait and 2 s."""
    log = log_at(0)
    nvml = EventNVML([{**H200, "events": PSTATE}])
    src = NVMLSource(nvml, event_wait_ms=750)
    src.read()
    timeouts = []
    src.events.stop = lambda timeout: timeouts.append(timeout) or False  # the thread is still in its wait
    src.close()
    assert timeouts == [2.75] and nvml.freed == [] and nvml.shutdowns == 1
    assert messages(log, "did not stop") == [
        "the NVML event thread did not stop within 2.8s; its event set is left allocated"]


def test_stop_waits_for_the_event_thread_no_longer_than_its_timeout():
    entered, release = threading.Event(), threading.Event()

    class Wedged:  # a wait that does not end within its timeout
        NVMLError = NVMLError

        def nvmlEventSetWait_v2(self, event_set, timeout_ms):
            entered.set()
            release.wait(10)
            raise NVMLError(10)

    tracker = HealthTracker(clock=ManualClock(), recovery=0)
    assert EventWatch(Wedged(), "set", tracker).stop(0.01) is True  # never started: nothing to wait for
    watch = EventWatch(Wedged(), "set", tracker)
    watch.start()
    assert entered.wait(5)
    try:
        assert watch.stop(0.01) is False
    finally:
        release.set()
    assert watch.stop(5) is True


def test_each_event_type_is_handed_on_as_its_kind_and_the_other_types_are_dropped():
    metrics = Recorder()
    nvml = EventNVML([H200, H200_B])
    src = NVMLSource(nvml, tracker=HealthTracker(clock=ManualClock(), recovery=60, source="nvml", metrics=metrics),
                     event_wait_ms=50)
    src.read()
    try:
        nvml.send(H200, PSTATE)
        nvml.send(H200, ECC_SINGLE)
        nvml.send(H200, XID_CRITICAL | ECC_DOUBLE, 13)  # both bits: the Xid's event (13: ignored)
        nvml.send(H200_B, ECC_DOUBLE | ECC_SINGLE)
        wait_for(lambda: src.tracker.health_of(H200_B["uuid"]) == "Unhealthy")
        assert metrics.events == ["ecc_single", "xid_ignored", "ecc_double"] and src.events.delivered == 3
        assert healths(src) == [("Healthy", ""), ("Unhealthy", "double-bit ECC error (uncorrectable)")]
    finally:
        src.close()


def test_failed_waits_are_logged_once_per_error_the_last_ten_kept_and_timeouts_just_wait_again(watched):
    nvml, src, clock = watched
    log = log_at(0)
    for code in [999] * 11 + [998]:
        nvml.queue.put(code)
    wait_for(lambda: clock.blocked == 1)  # the first failure handled: its second on the clock
    for _ in range(11):
        clock.step_thread(1.0)  # each the next failure's
    assert len(src.events.errors) == 10
    assert (src.events.errors[0], src.events.errors[-1]) == ("NVML error 999: code 999", "NVML error 998: code 998")
    assert messages(log) == [
        f"waiting for NVML events failed (NVML error {code}: code {code}); retrying, logged once" for code in (999, 998)]
    clock.advance_blocking(1.0)
    waits = len(nvml.waits)
    wait_for(lambda: len(nvml.waits) >= waits + 3)  # two waits timed out, and it waits on
    nvml.send(H200, XID_CRITICAL, 48)
    wait_for(lambda: src.tracker.health_of(H200["uuid"]) == "Unhealthy")


def test_a_gpu_lost_before_it_ever_answered_is_left_out_logged_once_and_the_others_read_on():
    log = log_at(0)
    gpu3 = {**H200, "uuid": "GPU-3"}
    nvml = FakeNVML([H200, H200_B, gpu3])
    lost = {0}
    memory = nvml.nvmlDeviceGetMemoryInfo

    def lost_or_memory(h):
        if nvml.gpus.index(h) in lost:
            raise NVMLError(FakeNVML.NVML_ERROR_GPU_IS_LOST)
        return memory(h)

    nvml.nvmlDeviceGetMemoryInfo = lost_or_memory
    src = NVMLSource(nvml)
    for _ in range(2):
        r = src.read()
        assert r.error is None and [(g.uuid, g.index) for g in r.inventory.gpus] == [(H200_B["uuid"], 1), ("GPU-3", 2)]
    assert messages(log, "index") == [
        "GPU at index 0 is lost (NVML_ERROR_GPU_IS_LOST) and never answered; not listed (logged once)"]
    lost.clear()
    assert [g.health for g in src.read().inventory.gpus] == ["Healthy"] * 3
    lost.add(0)  # lost again, having answered: listed as Lost, and the others after it read on
    assert [(g.uuid, g.health) for g in src.read().inventory.gpus] == [
        (H200["uuid"], "Lost"), (H200_B["uuid"], "Healthy"), ("GPU-3", "Healthy")]


def test_node_fabric_names_every_state_still_pending_every_gpu_that_failed_and_every_clique_they_disagree_on():
    from gpu_agent.mechanisms.inventory.fabric import GPUFabric, NodeFabric, node_fabric

    assert node_fabric([]) == NodeFabric("", "no GPUs")  # every GPU listed is Lost: none answered with its fabric
    done = GPUFabric(3, 0, RACK, 7)
    assert node_fabric([GPUFabric(2), GPUFabric(9), GPUFabric(1), done]) == NodeFabric(
        "", "fabric registration in progress, not started, state 9 on GPU(s) 0, 1, 2")
    assert node_fabric([GPUFabric(3, 5, RACK, 7), done, GPUFabric(3, 6, RACK, 7)]) == NodeFabric(
        "", "fabric registration failed on GPU(s) 0, 2 (NVML status 5)")
    assert node_fabric([done, GPUFabric(3, 0, RACK, 8)]) == NodeFabric(
        "", "GPUs disagree on their clique (00010203-0405-0607-0809-0a0b0c0d0e0f.7, 00010203-0405-0607-0809-0a0b0c0d0e0f.8)")
