"""The cluster agent as a real process against the real control plane, GPUs moved by the real
fake-gpu command. Timings are polled to deadlines; nothing sleeps a fixed time to "let it settle"."""

import itertools
import os
import signal
import threading
import time

import pytest

from gpu_agent.foundations.control_plane_client import Fence
from gpu_agent.foundations.gpus import Inventory
from tests.integration.harness import free_port, klog_time, wait_until

pytestmark = pytest.mark.integration


class Sampler:
    """Calls `probe` every `interval` seconds on a thread until stopped; `stop()` returns what it answered."""

    def __init__(self, probe, interval):
        self.probe, self.interval, self.samples, self._stop = probe, interval, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self.probe())
            self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        self._t.join()
        return self.samples


def _gate_intervals(agent):
    """(purpose, acquired, released) for each hold of the registration gate, asserting none overlaps another."""
    intervals, open_ = [], {}
    for line in agent.grep(r"gate (acquired|released) by"):
        purpose = line.split(" by ")[1].split()[0]
        if " acquired " in line:
            assert not open_, f"{purpose} acquired the gate while {open_} held it"
            open_[purpose] = klog_time(line)
        else:
            intervals.append((purpose, open_.pop(purpose), klog_time(line)))
    return intervals


def test_gpus_0_4_0_three_cycles_flip_readiness_and_liveness_holds(rig):
    rig.start_control_plane()
    rig.set_gpus(0)
    agent = rig.start_agent()
    pid = agent.pid
    sampler = Sampler(rig.livez, 0.02)
    # /livez answers before the GPU monitor's first reading; until then each component says "starting"
    wait_until(lambda: rig.healthz()[1]["components"]["gpus"]["reason"] != "starting", 5, "the first GPU reading")
    code, doc = rig.healthz()
    assert code == 503
    assert doc["components"]["gpus"]["reason"].startswith("no GPUs available")
    assert doc["components"]["registration"]["reason"].startswith("no GPUs available in cluster")
    assert doc["components"]["queues"]["reason"].startswith("paused")
    for _ in range(3):
        rig.set_gpus(4)
        assert rig.wait_health(200, 2.0) <= 2.0
        rig.set_gpus(0)
        assert rig.wait_health(503, 2.0) <= 2.0
    codes = sampler.stop()
    assert len(codes) >= 10 and set(codes) == {200}
    assert agent.alive() and agent.pid == pid
    assert len(agent.grep("cluster agent Ready")) == 3
    assert len(agent.grep("cluster agent NotReady")) == 4
    assert "gpu_agent_gpus 0.0" in rig.metrics() and "gpu_agent_queue_paused 1.0" in rig.metrics()


def test_registration_outage_backs_off_then_recovers_within_cap_plus_one_second(rig):
    cp = rig.start_control_plane(faults=True)
    cp.set_fault(rig.admin_token, mode="status", status=503, count=5, path="/v1/register")
    rig.set_gpus(2)
    agent = rig.start_agent("--registration-retry-initial", "0.2", "--registration-retry-max", "1.0",
                            "--registration-retry-jitter", "0")
    ready_after = rig.wait_health(200, 15)
    assert ready_after > 2.0  # 0.2 + 0.4 + 0.8 + 1.0 + 1.0 of backoff before the sixth attempt
    failures = agent.grep(r"registration attempt \d+ failed")
    assert len(failures) == 5
    assert "503" in failures[0]  # the original error is kept
    times = [klog_time(line) for line in failures]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == pytest.approx([0.2, 0.4, 0.8, 1.0], abs=0.15)  # capped at 1.0
    ready_at = klog_time(agent.grep("cluster agent Ready")[0])
    assert ready_at - times[-1] <= 1.0 + 1.0  # cap + 1 s after the last failure
    assert 'gpu_agent_registration_failures_total{kind="initial",reason="unavailable"} 5.0' in rig.metrics()


def test_renewal_in_flight_when_gpus_arrive_never_overlaps_and_both_complete(rig):
    cp = rig.start_control_plane("--credential-ttl", "2", faults=True)
    rig.set_gpus(2)
    agent = rig.start_agent()
    rig.wait_health(200, 5)
    cp.set_fault(rig.admin_token, mode="delay", delaySeconds=1.0, count=1, path="/v1/credentials/renew")
    wait_until(lambda: agent.grep("gate acquired by renew"), 5, "a renewal to hold the gate")
    rig.set_gpus(4)  # GPUs change while the renewal holds the gate
    wait_until(lambda: agent.grep(r"registered 4 GPUs .*recovery"), 10, "registration of the new GPUs")
    rig.wait_health(200, 5)
    intervals = _gate_intervals(agent)
    purposes = [p for p, _, _ in intervals]
    assert "renew" in purposes and purposes.count("initial") == 1 and purposes.count("recovery") >= 1
    for (_, _, end), (_, start, _) in itertools.pairwise(intervals):
        assert start >= end
    # the delayed renewal finished before the recovery registration for 4 GPUs began
    slow_renew = max((i for i in intervals if i[0] == "renew"), key=lambda i: i[2] - i[1])
    assert slow_renew[2] - slow_renew[1] >= 0.9
    recovery_after = [i for i in intervals if i[0] == "recovery" and i[1] >= slow_renew[1]]
    assert recovery_after and recovery_after[0][1] >= slow_renew[2]
    assert not agent.grep("renewal attempt .* failed")


def test_gpus_removed_while_registration_is_in_flight_discards_the_response(rig):
    cp = rig.start_control_plane(faults=True)
    cp.set_fault(rig.admin_token, mode="delay", delaySeconds=1.5, count=1, path="/v1/register")
    rig.set_gpus(0)
    agent = rig.start_agent()
    rig.set_gpus(4)
    wait_until(lambda: agent.grep("registering 4 GPUs"), 5, "the registration call to start")
    rig.set_gpus(0)
    wait_until(lambda: agent.grep("discarding registration response"), 5, "the stale response to be discarded")
    code, doc = rig.healthz()
    assert code == 503 and not doc["components"]["registration"]["ready"]
    assert not agent.grep("work queues resumed") and not agent.grep("cluster agent Ready")
    assert "gpu_agent_registration_discarded_total 1.0" in rig.metrics()


def test_100_items_killed_mid_run_and_restarted_are_each_executed_exactly_once(rig):
    cp = rig.start_control_plane()
    rig.set_gpus(0)
    flags = ("--lease-seconds", "1", "--executor-work-seconds", "0.02")
    agent = rig.start_agent(*flags)
    keys = [f"item-{n:03d}" for n in range(100)]
    for k in keys:
        cp.enqueue(rig.admin_token, k, {"n": k})
    assert cp.status(rig.admin_token)["items"]["queued"] == 100
    assert rig.executed_keys() == []  # paused: nothing leased without GPUs
    rig.set_gpus(4)
    wait_until(lambda: len(rig.executed_keys()) >= 30, 20, "30 items executed")
    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
    done_at_kill = len(rig.executed_keys())
    assert done_at_kill < 100
    restarted = rig.start_agent(*flags)
    wait_until(lambda: cp.status(rig.admin_token)["items"]["done"] == 100, 60, "all 100 items acknowledged")
    executed = rig.executed_keys()
    assert sorted(executed) == keys  # every item, none twice
    status = cp.status(rig.admin_token)
    assert status["items"] == {"queued": 0, "leased": 0, "done": 100, "failed": 0}
    assert restarted.alive()


def most_at_once(intervals):
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("flags,expected", [((), 4), (("--queue-max-in-flight", "2"), 2)])
def test_items_run_side_by_side_up_to_the_gpus_registered_or_the_setting(rig, flags, expected):
    """Issue 25. Evidence from the control plane's own records: each item's delivery time and ack time
    bound its run, and at most `expected` of those intervals overlap, and at some moment that many do."""
    cp = rig.start_control_plane()
    rig.set_gpus(4)
    rig.start_agent("--executor-work-seconds", "1.5", *flags)
    rig.wait_health(200, 10)
    keys = [f"side-{n}" for n in range(8)]
    for k in keys:
        cp.enqueue(rig.admin_token, k, {})
    wait_until(lambda: cp.status(rig.admin_token)["items"]["done"] == 8, 30, "all 8 items acknowledged")
    deliveries = cp.deliveries(rig.admin_token)
    delivered = {d["itemId"]: d["at"] for d in deliveries}
    acked = {i["id"]: i["ackedAt"] for i in cp.list_items(rig.admin_token)}
    assert len(deliveries) == len(delivered) == 8 and sorted(rig.executed_keys()) == sorted(keys)  # leased once, run once
    assert most_at_once([(delivered[i], acked[i]) for i in acked]) == expected
    assert rig.healthz()[1]["components"]["queues"]["details"]["maxInFlight"] == expected


def test_an_item_longer_than_three_leases_runs_once_while_a_second_consumer_polls_for_work(rig):
    """Evidence from the control plane's delivery log and a second consumer of the same term (a
    thread of this test polling the queue), not from the agent that ran the item."""
    cp = rig.start_control_plane()
    rig.set_gpus(4)
    rig.start_agent("--lease-seconds", "1", "--executor-work-seconds", "3.5")
    rig.wait_health(200, 15)
    cp.enqueue(rig.admin_token, "long-item", {})
    wait_until(lambda: cp.status(rig.admin_token)["items"]["leased"] == 1, 10, "the agent to lease the item")
    term = cp.status(rig.admin_token)["term"]
    credential = cp.register(rig.registration_token, "second", 1, Inventory(())).credential.token
    second_got, stop = [], threading.Event()

    def poll() -> None:  # records; the test asserts
        while not stop.is_set():
            item = cp.lease(credential, 1, 0.2, Fence("second-consumer", term["term"]))
            if item is not None:
                second_got.append(item.idempotency_key)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        wait_until(lambda: cp.status(rig.admin_token)["items"]["done"] == 1, 20, "the item done")
    finally:
        stop.set()
        poller.join(5)
    (item,) = cp.list_items(rig.admin_token)
    assert item["deliveries"] == 1, item
    assert [d["holder"] for d in cp.deliveries(rig.admin_token)] == [term["holder"]]
    assert second_got == []


def test_a_second_agent_fences_the_first_which_stops_leasing_and_says_so(rig):
    """Two agents without leader election on one queue: the one that started the newer term leases;
    the other's calls are refused and it reports it. The delivery log shows one holder after the switch."""
    cp = rig.start_control_plane()
    rig.set_gpus(2)
    first = rig.start_agent("--identity", "agent-one", "--lease-seconds", "5", "--executor-work-seconds", "1.5")
    rig.wait_health(200, 15)
    cp.enqueue(rig.admin_token, "before", {})
    wait_until(lambda: cp.status(rig.admin_token)["items"]["done"] == 1, 10, "the first item done by agent-one")
    port = free_port()
    second = rig.start_agent("--identity", "agent-two", "--cluster-id", "second", "--listen-address", f"127.0.0.1:{port}",
                             "--executor-journal", str(rig.root / "second-executions.sqlite"))
    wait_until(lambda: cp.status(rig.admin_token).get("term", {}).get("holder") == "agent-two", 15, "agent-two's term")
    for i in range(4):
        cp.enqueue(rig.admin_token, f"after-{i}", {})
    wait_until(lambda: cp.status(rig.admin_token)["items"]["done"] == 5, 20, "the items after the switch done")
    holders = [d["holder"] for d in cp.deliveries(rig.admin_token)]
    assert holders[0] == "agent-one" and set(holders[1:]) == {"agent-two"}, holders
    wait_until(lambda: "fenced" in rig.healthz()[1]["components"]["queues"]["reason"], 10, "agent-one to report it")
    assert rig.healthz()[0] == 503 and first.alive() and second.alive()
    assert first.grep("this agent's term is over")


def test_malformed_fake_gpu_file_is_reported_and_the_agent_stays_live(rig):
    rig.start_control_plane()
    rig.set_gpus(2)
    agent = rig.start_agent()
    rig.wait_health(200, 5)
    rig.fake_file.write_text('{"apiVersion": "fake-gpu.gpu-agent.io/v1", "gpus": [{"uuid": 7}]}')
    rig.wait_health(503, 3)
    _code, doc = rig.healthz()
    assert "gpus[0].uuid" in doc["components"]["gpus"]["reason"]
    assert agent.grep("cannot be read: .*gpus\\[0\\].uuid")
    assert rig.livez() == 200
    rig.fake_file.unlink()
    wait_until(lambda: "does not exist" in rig.healthz()[1]["components"]["gpus"]["reason"], 3, "missing-file reason")
    rig.set_gpus(3)
    rig.wait_health(200, 3)
    assert agent.alive()


def test_malformed_control_plane_body_is_retried_and_the_agent_stays_live(rig):
    cp = rig.start_control_plane(faults=True)
    cp.set_fault(rig.admin_token, mode="malformed", count=2, path="/v1/register")
    rig.set_gpus(1)
    agent = rig.start_agent("--registration-retry-initial", "0.1", "--registration-retry-max", "0.5")
    rig.wait_health(200, 10)
    failures = agent.grep("registration attempt .* failed")
    assert len(failures) == 2 and all("not valid JSON" in f for f in failures)
    assert agent.alive()


def test_expired_credential_pauses_queues_then_recovers(rig):
    cp = rig.start_control_plane("--credential-ttl", "1.5", faults=True)
    rig.set_gpus(1)
    agent = rig.start_agent("--registration-retry-initial", "0.2", "--registration-retry-max", "0.4")
    rig.wait_health(200, 5)
    cp.set_fault(rig.admin_token, mode="status", status=503, count=6, path="/v1/credentials/renew")
    wait_until(lambda: "credential expired" in rig.healthz()[1]["components"]["credentials"]["reason"], 5,
               "the credential to expire")
    assert rig.healthz()[0] == 503
    assert rig.healthz()[1]["components"]["queues"]["reason"].startswith("paused")
    assert rig.livez() == 200
    # The expired credential is refused (401 before any fault: the ones left are not used up); it registers again.
    wait_until(lambda: agent.grep("credential renewal refused .*expired"), 10, "the expired credential refused")
    cp.clear_faults(rig.admin_token)  # before the new credential's first renewal (1.2 s on), which they would fail
    rig.wait_health(200, 10)
    assert len(agent.grep("registered 1 GPUs")) == 2
    assert agent.alive()


@pytest.mark.parametrize("argv,fragment", [
    (["--registration-retry-max", "-5"], "registrationRetryMax"),
    (["-v", "8"], "verbosity"),
    (["--gpu-source", "tpu"], "gpuSource"),
    (["--control-plane-url", "not a url"], "controlPlaneUrl"),
    (["--lease-seconds", "0"], "leaseSeconds"),
])
def test_bad_flags_exit_2_naming_the_setting(rig, argv, fragment):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "gpu_agent", "cluster-agent", *argv], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and fragment in r.stderr and "must be" in r.stderr


def test_sigterm_while_a_lease_is_long_polling_exits_promptly(rig):
    rig.start_control_plane()
    rig.set_gpus(1)
    agent = rig.start_agent("--queue-long-poll", "20")
    rig.wait_health(200, 5)
    started = time.monotonic()
    assert agent.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 3.0
    assert agent.grep("shutting down")


def _probes(rig):
    """(wall time, /healthz code, /livez code); 0 for a probe that got no answer."""
    try:
        code = rig.healthz()[0]
    except Exception:  # noqa: BLE001 - an unanswered probe is a sample too, and a failing one
        code = 0
    return time.time(), code, rig.livez()


def test_a_hung_control_plane_spaces_attempts_by_timeout_plus_backoff_and_ready_follows_one_attempt_after(rig):
    """NVCA's outage: the control plane's calls hang (they are not refused). Each registration attempt lasts the
    request timeout, the next starts a backoff later; readiness stays 503 and liveness 200 throughout; once the
    control plane answers again the agent is Ready within one attempt. Then a renewal that hangs while the GPUs
    change: the renewal and the recovery registration never hold the gate together."""
    timeout, backoff = 1.0, 0.5
    cp = rig.start_control_plane("--credential-ttl", "3", faults=True)
    cp.set_fault(rig.admin_token, mode="hang", count=1000, path="/v1/")
    rig.set_gpus(2)
    agent = rig.start_agent("--request-timeout", str(timeout), "--registration-retry-initial", str(backoff),
                            "--registration-retry-max", str(backoff), "--registration-retry-jitter", "0")
    sampler = Sampler(lambda: _probes(rig), 0.05)
    wait_until(lambda: len(agent.grep(r"registration attempt \d+ failed")) >= 4, 20, "four hung attempts")
    answering_at = time.time()
    cp.clear_faults(rig.admin_token)
    rig.wait_health(200, 10)
    ready_at = klog_time(agent.grep("cluster agent Ready")[0])
    samples = sampler.stop()

    starts = [klog_time(line) for line in agent.grep(r"registering 2 GPUs")]
    failures = agent.grep(r"registration attempt \d+ failed")
    assert all("timed out" in f for f in failures), failures
    gaps = [b - a for a, b in itertools.pairwise(starts[:len(failures) + 1])]
    assert len(gaps) >= 4 and gaps == pytest.approx([timeout + backoff] * len(gaps), abs=0.3), gaps
    during = [s for s in samples if s[0] < answering_at]
    print(f"hung control plane: attempt starts {[round(t - starts[0], 2) for t in starts]} s; {len(during)} "
          f"probe samples during the outage; Ready {ready_at - answering_at:.2f} s after it answered")
    assert len(during) >= 20, "the sampler took too few samples to say anything"
    assert {s[1] for s in during} == {503} and {s[2] for s in samples} == {200}
    assert ready_at - answering_at <= timeout + backoff + 0.5  # within one attempt

    # A renewal hangs (at 80 % of the 3 s credential); the GPUs change while it holds the gate.
    cp.set_fault(rig.admin_token, mode="hang", count=1000, path="/v1/credentials/renew")
    wait_until(lambda: agent.grep("credential renewal attempt 1 failed"), 10, "a hung renewal to time out")
    rig.set_gpus(4)
    wait_until(lambda: agent.grep(r"registered 4 GPUs .*recovery"), 10, "the recovery registration of 4 GPUs")
    cp.clear_faults(rig.admin_token)
    rig.wait_health(200, 10)
    intervals = _gate_intervals(agent)
    purposes = [p for p, _, _ in intervals]
    assert "renew" in purposes and "recovery" in purposes
    for (_, _, end), (_, start, _) in itertools.pairwise(intervals):
        assert start >= end
    hung_renewals = [i for i in intervals if i[0] == "renew" and i[2] - i[1] >= timeout - 0.1]
    assert hung_renewals, intervals  # a renewal held the gate through its whole timeout
    assert agent.alive() and rig.livez() == 200


def test_plain_http_to_a_host_beyond_loopback_exits_2_its_last_line_naming_controlplaneurl_and_the_fix(rig):
    import subprocess
    import sys

    token = f"reg-{time.monotonic_ns()}"
    rig.set_gpus(0)  # were it to start after all, it would leave at once by itself (exit 3: no GPUs at start)
    r = subprocess.run([sys.executable, "-m", "gpu_agent", "cluster-agent", "--fake-gpu-state-file", str(rig.fake_file),
                        "--listen-address", "127.0.0.1:0", "--executor-journal", str(rig.root / "executions.sqlite"),
                        "--control-plane-url", "http://10.0.0.1:8700"],
                       capture_output=True, text=True, timeout=30, env={**os.environ, "GPU_AGENT_CONTROL_PLANE_TOKEN": token})
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2, r.stderr[-2000:]
    assert last.startswith("gpu-agent cluster-agent: error: controlPlaneUrl http://10.0.0.1:8700 is plain HTTP"), last
    assert "use its https:// URL" in last and "controlPlaneAllowInsecure=true" in last
    assert token not in r.stderr + r.stdout


def test_plain_http_beyond_loopback_allowed_starts_the_agent_with_a_warning_at_verbosity_0(rig):
    """With no GPUs (graceful) the agent never calls the control plane: it only has to start and say it."""
    rig.set_gpus(0)
    agent = rig.start_agent("--control-plane-url", "http://10.0.0.1:8700", "--control-plane-allow-insecure", "true",
                            verbosity=0)
    [warning] = agent.grep("plain HTTP")
    assert warning.startswith("W") and warning.endswith(
        "controlPlaneUrl http://10.0.0.1:8700 is plain HTTP to a host beyond this machine and controlPlaneAllowInsecure "
        "is true: the registration token and credentials cross the network in clear"), warning
    assert agent.alive()
