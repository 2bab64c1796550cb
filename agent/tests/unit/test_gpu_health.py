"""The GPU health state machine on a manual clock: which events act, recovery, lost, and what it logs and counts."""

import io

import pytest

from gpu_agent.foundations import klog
from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.gpus import GPU, HEALTHY, LOST, UNHEALTHY
from gpu_agent.foundations.metrics import NodeMetrics
from gpu_agent.foundations.xids import DEFAULT_IGNORED_XIDS, LOST_REASON, describe_xid, parse_xids
from gpu_agent.mechanisms.inventory.gpu_health import (
    ECC_DOUBLE,
    ECC_SINGLE,
    MAX_UNLISTED,
    XID,
    HealthChange,
    HealthTracker,
    health_event,
)

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def gpu(uuid, index=0):
    return GPU(uuid, "NVIDIA H200", 1 << 37, index=index)


class Recorder:
    """The metrics sink, recording what the tracker reports."""

    def __init__(self):
        self.transitions, self.counts, self.events = [], [], []

    def gpu_health_transition(self, to):
        self.transitions.append(to)

    def gpu_health_counts(self, counts):
        self.counts.append(dict(counts))

    def gpu_health_event(self, kind):
        self.events.append(kind)


@pytest.fixture
def log():
    stream = io.StringIO()
    klog.setup(0, stream)  # what an agent at -v 0 writes
    return stream


def tracker(recovery=60.0, **kw):
    clock = ManualClock(start=1000.0)
    metrics = Recorder()
    return HealthTracker(clock=clock, recovery=recovery, source="nvml", metrics=metrics, **kw), clock, metrics


def health(t, *uuids, conditions=None):
    return {g.uuid: (g.health, g.health_reason) for g in t.observe([gpu(u, i) for i, u in enumerate(uuids)], conditions)}


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 150])
def test_every_critical_xid_not_ignored_makes_the_gpu_unhealthy_naming_it(xid, log):
    t, _, metrics = tracker()
    health(t, A, B)
    t.event(A, XID, xid)
    got = health(t, A, B)
    assert got[A] == (UNHEALTHY, describe_xid(xid)) and got[B][0] == "Healthy"
    assert metrics.transitions == ["Unhealthy"] and metrics.events == ["xid_critical"]
    assert metrics.counts[-1] == {"Healthy": 1, "Unhealthy": 1, "Lost": 0}
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and f"GPU {A} (index 0) Healthy -> Unhealthy: Xid {xid}" in lines[0]


def test_the_well_known_xids_are_named_by_meaning():
    assert describe_xid(79) == "Xid 79 (GPU has fallen off the bus)"
    assert describe_xid(48) == "Xid 48 (double-bit ECC error)"
    assert describe_xid(150) == "Xid 150"


@pytest.mark.parametrize("xid", DEFAULT_IGNORED_XIDS)
def test_application_xids_are_ignored_by_default_and_counted(xid, log):
    t, _, metrics = tracker()
    health(t, A)
    t.event(A, XID, xid)
    assert health(t, A)[A] == ("Healthy", "")
    assert metrics.transitions == [] and metrics.events == ["xid_ignored"] and log.getvalue() == ""


def test_the_ignored_xids_are_a_setting():
    t, _, metrics = tracker(ignored_xids=parse_xids("48, 13"))
    health(t, A)
    t.event(A, XID, 48)
    t.event(A, XID, 31)  # no longer ignored
    assert health(t, A)[A] == (UNHEALTHY, describe_xid(31))
    assert metrics.events == ["xid_ignored", "xid_critical"]  # counted as the setting judges them
    t, _, _ = tracker(ignored_xids=())
    health(t, A)
    t.event(A, XID, 13)  # [] : every critical Xid acts
    assert health(t, A)[A][0] == UNHEALTHY


def test_a_double_bit_ecc_error_acts_and_a_single_bit_one_is_only_counted(log):
    t, _, metrics = tracker()
    health(t, A, B)
    assert metrics.counts == [{"Healthy": 2, "Unhealthy": 0, "Lost": 0}]
    for _ in range(3):
        t.event(A, ECC_SINGLE)
    t.event(B, ECC_DOUBLE)
    got = health(t, A, B)
    assert got[A] == ("Healthy", "") and got[B] == (UNHEALTHY, "double-bit ECC error (uncorrectable)")
    assert metrics.events == ["ecc_single"] * 3 + ["ecc_double"] and metrics.transitions == ["Unhealthy"]


def test_recovery_needs_the_whole_window_without_a_new_critical_event(log):
    t, clock, metrics = tracker(recovery=60)
    health(t, A)
    t.event(A, XID, 48)
    clock.advance_blocking(59.9)
    assert health(t, A)[A][0] == UNHEALTHY
    t.event(A, XID, 94)  # a new critical event starts the window again
    clock.advance_blocking(30)
    assert health(t, A)[A] == (UNHEALTHY, describe_xid(94))
    clock.advance_blocking(29.9)
    assert health(t, A)[A][0] == UNHEALTHY
    clock.advance_blocking(0.1)
    assert health(t, A)[A] == ("Healthy", "")
    assert metrics.transitions == ["Unhealthy", "Healthy"]
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "Unhealthy -> Healthy: answering normally with no critical event for 60s" in lines[1]


def test_with_no_window_an_event_still_shows_in_one_reading():
    t, _, _ = tracker(recovery=0)
    health(t, A)
    t.event(A, XID, 48)
    assert health(t, A)[A][0] == UNHEALTHY
    assert health(t, A)[A][0] == "Healthy"


def test_health_since_is_the_wall_time_of_the_last_transition():
    t, clock, _ = tracker(recovery=10)
    (g,) = t.observe([gpu(A)])
    assert g.health_since == 0.0  # never changed
    clock.advance_blocking(5)
    t.event(A, XID, 48)
    (g,) = t.observe([gpu(A)])
    assert g.health_since == 1005.0
    clock.advance_blocking(10)
    (g,) = t.observe([gpu(A)])
    assert (g.health, g.health_since) == ("Healthy", 1015.0)


def test_a_lost_gpu_is_lost_until_it_answers_again(log):
    t, clock, metrics = tracker(recovery=60)
    health(t, A)
    lost = {A: (LOST, LOST_REASON)}
    assert health(t, A, conditions=lost)[A] == (LOST, LOST_REASON)
    clock.advance_blocking(600)
    assert health(t, A, conditions=lost)[A][0] == LOST  # time alone brings nothing back
    assert health(t, A)[A] == ("Healthy", "")  # no critical event before it was lost: healthy at once
    assert metrics.transitions == ["Lost", "Healthy"]
    assert [line.split("] ", 1)[1] for line in log.getvalue().splitlines()] == [
        f"GPU {A} (index 0) Healthy -> Lost: {LOST_REASON}", f"GPU {A} (index 0) Lost -> Healthy: answering normally"]


def test_a_gpu_back_from_lost_soon_after_a_critical_xid_is_unhealthy_until_the_window_passes():
    t, clock, _ = tracker(recovery=60)
    health(t, A)
    t.event(A, XID, 79)
    assert health(t, A, conditions={A: (LOST, LOST_REASON)})[A][0] == LOST
    clock.advance_blocking(20)
    got = health(t, A)
    assert got[A][0] == UNHEALTHY and "Xid 79" in got[A][1]
    clock.advance_blocking(40)
    assert health(t, A)[A][0] == "Healthy"


def test_a_lost_gpu_that_leaves_and_comes_back_listed_is_judged_against_what_it_was():
    t, _, metrics = tracker()
    health(t, A, conditions={A: (LOST, LOST_REASON)})
    health(t)  # NVML no longer lists it
    assert t.health_of(A) == LOST
    assert health(t, A)[A][0] == "Healthy" and metrics.transitions == ["Lost", "Healthy"]


def test_a_healthy_gpu_that_leaves_is_forgotten_so_new_uuids_cannot_grow_the_tracker():
    t, _, _ = tracker()
    for i in range(500):
        health(t, f"GPU-{i:08x}-0000-0000-0000-000000000000")
    assert len(t._tracks) == 1


def test_an_event_for_a_gpu_the_source_does_not_list_is_logged_once_and_ignored(log):
    t, _, metrics = tracker()
    health(t, A)
    for _ in range(3):
        t.event(B, XID, 48)
    assert health(t, A, B)[B] == ("Healthy", "")  # listed later: the old event does not count
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and f"for GPU {B}, which the nvml source does not list: ignored (logged once)" in lines[0]
    assert metrics.transitions == []


def test_a_persisting_fault_with_no_recovery_window_clears_at_the_next_read(log):
    """The fake source: the state file says Unhealthy while the fault is set."""
    t, _, metrics = tracker(recovery=0)
    fault = {A: (UNHEALTHY, "Xid 48 (double-bit ECC error)")}
    assert health(t, A, conditions=fault)[A] == (UNHEALTHY, "Xid 48 (double-bit ECC error)")
    assert health(t, A, conditions=fault)[A][0] == UNHEALTHY
    assert health(t, A)[A] == ("Healthy", "")
    assert health(t, A, conditions={A: (LOST, "Xid 79 (GPU has fallen off the bus)")})[A][0] == LOST
    assert health(t, A, conditions=fault)[A][0] == UNHEALTHY  # answering again, but faulty
    assert metrics.transitions == ["Unhealthy", "Healthy", "Lost", "Unhealthy"]
    assert len(log.getvalue().splitlines()) == 4


def test_node_metrics_take_the_trackers_reports():
    from prometheus_client.parser import text_string_to_metric_families

    metrics = NodeMetrics()
    t = HealthTracker(clock=ManualClock(), recovery=0, metrics=metrics)
    t.observe([gpu(A), gpu(B, 1)])
    t.event(A, XID, 79)
    t.event(A, XID, 13)
    t.observe([gpu(A), gpu(B, 1)], {B: (LOST, LOST_REASON)})
    samples = {(s.name, tuple(sorted(s.labels.values()))): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("gpu_agent_gpus_by_health", ("Unhealthy",))] == 1
    assert samples[("gpu_agent_gpus_by_health", ("Lost",))] == 1
    assert samples[("gpu_agent_gpus_by_health", ("Healthy",))] == 0
    assert samples[("gpu_agent_gpu_health_transitions_total", ("Lost",))] == 1
    assert samples[("gpu_agent_gpu_health_events_total", ("xid_ignored",))] == 1
    assert samples[("gpu_agent_gpu_health_events_total", ("ecc_double",))] == 0  # every label there from the start


def messages(stream, containing=""):
    return [line.split("] ", 1)[1] for line in stream.getvalue().splitlines() if containing in line]


def test_each_change_is_handed_on_with_both_states_both_reasons_and_the_class_of_the_error_behind_it():
    changes = []
    t, clock, _ = tracker(recovery=60, on_change=changes.append)
    health(t, A)
    t.event(A, XID, 79)
    health(t, A, conditions={A: (LOST, LOST_REASON)})
    clock.advance_blocking(20)
    assert health(t, A)[A] == (UNHEALTHY, f"answering again; {describe_xid(79)} 20s ago (recovery 60s)")
    clock.advance_blocking(40)
    assert health(t, A)[A] == (HEALTHY, "")
    again = f"answering again; {describe_xid(79)} 20s ago (recovery 60s)"
    assert changes == [
        HealthChange(A, 0, HEALTHY, UNHEALTHY, describe_xid(79), "critical Xid", "", 60),
        HealthChange(A, 0, UNHEALTHY, LOST, LOST_REASON, "GPU lost", describe_xid(79), 60),  # lost: not the Xid's class
        HealthChange(A, 0, LOST, UNHEALTHY, again, "critical Xid", LOST_REASON, 60),  # back: the Xid's, still
        HealthChange(A, 0, UNHEALTHY, HEALTHY, "answering normally with no critical event for 60s", "", again, 60)]


def test_the_event_of_a_recovery_says_what_it_was_and_a_window_under_a_second_is_still_a_window():
    back = HealthChange(A, 2, LOST, HEALTHY, "answering normally", "", "", 0.5)
    assert health_event(back) == ("Normal", "GPUHealthy", f"GPU 2 ({A}) Healthy again (was Lost): answering normally")
    bad = HealthChange(A, 2, HEALTHY, UNHEALTHY, describe_xid(48), "critical Xid", "", 0.5)
    assert health_event(bad)[2].endswith(
        "out of service until it counts again after answering normally with no new critical event for 0.5s")


def test_what_the_tracker_logs_of_the_events_it_does_not_act_on_and_of_a_new_reason_to_stay_unhealthy():
    stream = io.StringIO()
    klog.setup(1, stream)
    t, _, _ = tracker()
    health(t, A)
    t.event(B, ECC_DOUBLE)  # B and C are not listed
    t.event(B, XID, 48)  # logged once per GPU
    t.event("GPU-c", XID, 48)
    t.event(A, ECC_SINGLE)  # -v 2
    t.event(A, XID, 13)
    t.event(A, XID, 48)
    t.event(A, XID, 94)
    assert messages(stream) == [
        f"GPU event ecc-double ECC error for GPU {B}, which the nvml source does not list: ignored (logged once)",
        f"GPU event {describe_xid(48)} for GPU GPU-c, which the nvml source does not list: ignored (logged once)",
        f"GPU {A}: {describe_xid(13)} ignored (gpuHealthIgnoredXids: an application error, the GPU is fine)",
        f"GPU {A} (index 0) Healthy -> Unhealthy: {describe_xid(48)}",
        f"GPU {A} stays Unhealthy: {describe_xid(94)} (was: {describe_xid(48)})"]
    stream = io.StringIO()
    klog.setup(2, stream)
    t.event(A, ECC_SINGLE)
    assert messages(stream) == [f"GPU {A}: single-bit ECC error (corrected; counted, not acted on)"]


def test_events_for_gpus_not_listed_are_logged_for_a_bounded_number_of_them(log):
    t, _, _ = tracker()
    for i in range(MAX_UNLISTED + 6):
        t.event(f"GPU-{i:08x}-0000-0000-0000-000000000000", ECC_DOUBLE)
    assert len(messages(log)) == MAX_UNLISTED


def test_unhealthy_gpus_no_longer_listed_are_remembered_up_to_a_bound_the_oldest_forgotten_first():
    t, _, _ = tracker()
    uuids = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(MAX_UNLISTED + 6)]
    health(t, *uuids, conditions=dict.fromkeys(uuids, (LOST, LOST_REASON)))
    assert {t.health_of(u) for u in uuids} == {LOST}  # the bound is on those not listed: every listed one is kept
    health(t)
    assert [t.health_of(u) for u in uuids] == [None] * 6 + [LOST] * MAX_UNLISTED


def test_a_hook_that_fails_is_logged_once_at_v0_and_after_that_at_v2():
    stream = io.StringIO()
    klog.setup(2, stream)

    def broken(change):
        raise RuntimeError("recorder broken")

    t, _, _ = tracker(on_change=broken)
    health(t, A, B)
    t.event(A, XID, 48)
    t.event(B, XID, 48)
    assert messages(stream, "reporting") == [
        f"reporting GPU {A}'s health change failed (later failures at -v 2): recorder broken",
        f"reporting GPU {B}'s health change failed: recorder broken"]


# ---- a read that hangs (issue 49) -----------------------------------------------------------------------------

async def test_a_source_read_that_hangs_turns_the_gpus_not_ready_saying_so_and_its_late_answer_recovers():
    import asyncio
    import threading

    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.foundations.gpus import GPU, Inventory
    from gpu_agent.foundations.health import HealthRegistry
    from gpu_agent.mechanisms.inventory.monitor import InventoryMonitor
    from gpu_agent.mechanisms.inventory.source import Reading

    class WedgedDriver:
        """Answers at once until `wedge` is set; then its read blocks until `unwedge` is set. Counts its reads."""
        name = "nvml"

        def __init__(self):
            self.wedged, self.unwedge, self.reads = threading.Event(), threading.Event(), 0

        def read(self):
            self.reads += 1
            if self.wedged.is_set():
                assert self.unwedge.wait(10), "the test never let the read answer"
            return Reading(Inventory((GPU("GPU-00000000-0000-0000-0000-000000000001", "H200", 1 << 30, index=0),)))

        def close(self):
            pass

    clock = ManualClock()
    health = HealthRegistry(clock, ["gpus"])
    events = []

    async def changed(event):
        events.append(event)

    driver = WedgedDriver()
    monitor = InventoryMonitor(driver, clock=clock, health=health, poll_interval=1.0, on_change=changed, read_timeout=5.0)
    await monitor.poll_once()
    assert health.get("gpus").ready and driver.reads == 1
    driver.wedged.set()
    polls = [asyncio.ensure_future(monitor.poll_once())]
    for _ in range(200):  # poll to a deadline: the read reaches the driver on its thread
        if driver.reads == 2:
            break
        await asyncio.sleep(0.005)
    await clock.advance(5.0)
    await asyncio.wait_for(polls[0], 5)
    entry = health.get("gpus")
    assert not entry.ready and entry.reason == "GPU source nvml has not answered a read for 5s (a hung driver); waiting for it"
    polls.append(asyncio.ensure_future(monitor.poll_once()))  # the next poll waits for the same read
    await clock.advance(5.0)
    await asyncio.wait_for(polls[1], 5)
    assert driver.reads == 2, "a second read started beside the hung one"
    assert "has not answered a read for 10s" in health.get("gpus").reason
    driver.unwedge.set()
    await asyncio.wait_for(monitor.poll_once(), 5)  # the late answer is the next reading
    assert health.get("gpus").ready and driver.reads == 2
