"""The client-side rate limit's token bucket (foundations/ratelimit.py), on an injected clock: a burst admitted at
once, then one request per 1/qps; an idle bucket refilled up to its burst and no more; qps <= 0 no limit; a wait
longer than the request's bound refused at once, naming the limit, taking nothing; threads sharing one bucket
taking exactly the turns the clock allows; what it tells its observer and its log."""

import logging
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.metrics import NodeMetrics
from gpu_agent.foundations.ratelimit import ApiLimit, RateLimited, TokenBucket


class SleepingClock(ManualClock):
    """A manual clock whose blocking sleep moves it (one thread, no one else to wake it): each sleep recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.slept: list[float] = []

    def sleep_blocking(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance_blocking(seconds)


def test_a_full_bucket_admits_its_burst_at_once_then_one_request_per_interval():
    clock = SleepingClock()
    bucket = TokenBucket(2, 3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0, 0, 0] and clock.slept == []
    assert [bucket.take() for _ in range(4)] == [0.5, 0.5, 0.5, 0.5]
    assert clock.monotonic() == 1002.0  # 7 requests: 3 at once, 4 more at 2 a second


def test_an_idle_bucket_refills_up_to_its_burst_and_no_more():
    clock = SleepingClock()
    bucket = TokenBucket(4, 3, clock=clock)
    for _ in range(3):
        bucket.take()
    clock.advance_blocking(0.5)  # two tokens back
    assert [bucket.take() for _ in range(3)] == [0, 0, 0.25]
    clock.advance_blocking(3600)  # an hour idle: a full bucket (3), not 14,400 tokens
    assert [bucket.take() for _ in range(4)] == [0, 0, 0, 0.25]


@pytest.mark.parametrize("qps", [0, -1])
def test_qps_zero_or_less_is_no_limit(qps):
    clock = SleepingClock()
    bucket = TokenBucket(qps, 1, clock=clock)
    assert all(bucket.take(bound=0) == 0 for _ in range(10_000)) and clock.slept == []
    assert ApiLimit(qps, 1).bucket() is None  # and api_client then builds a client with no limiter


def test_a_wait_longer_than_the_bound_is_refused_at_once_naming_the_limit_and_takes_nothing():
    clock = SleepingClock()
    bucket = TokenBucket(0.5, 2, clock=clock, client="work")
    bucket.take(), bucket.take()
    with pytest.raises(RateLimited) as refused:
        bucket.take(bound=1.5, what="GET /api/v1/namespaces/ns/pods/p")  # its turn is 2 s away
    assert str(refused.value) == ("client-side rate limit of the Kubernetes API client work (kubeApiQps 0.5, kubeApiBurst "
                                  "2): GET /api/v1/namespaces/ns/pods/p would wait 2s for its turn, longer than its 1.5s "
                                  "timeout; not sent")
    assert clock.slept == [], "the refused request did not wait"
    # It reserved no turn: the next request has the turn it would have had (2 s, not 4), and a wait as long as
    # the bound is waited.
    assert bucket.take(bound=2.0) == 2.0


class ContendedClock(ManualClock):
    """A manual clock slow to read (5 ms of real time), that counts the threads reading it at once: the bucket
    reads it inside its reservation, so more than one at once means two reservations overlapped."""

    def __init__(self) -> None:
        super().__init__(start=0.0)
        self.inside = self.most_inside = 0
        self._count = threading.Lock()

    def monotonic(self) -> float:
        with self._count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        time.sleep(0.005)
        with self._count:
            self.inside -= 1
        return super().monotonic()


def test_threads_sharing_a_bucket_take_exactly_the_turns_the_clock_allows():
    clock = ContendedClock()
    bucket = TokenBucket(2, 2, clock=clock)
    done: list[tuple[float, float]] = []  # (clock time when let through, seconds it waited)
    lock = threading.Lock()
    start = threading.Barrier(8)

    def request() -> None:
        start.wait()  # all eight ask at once
        waited = bucket.take()
        with lock:
            done.append((clock.wall(), waited))  # the manual clock's time, read without counting

    def settled(finished: int) -> None:
        """`finished` requests through and every other one asleep on the clock (bounded in real time)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with lock:
                if len(done) == finished and clock.blocked == 8 - finished:
                    return
            time.sleep(0.001)
        raise AssertionError(f"{len(done)} through, {clock.blocked} waiting; expected {finished} through")

    threads = [threading.Thread(target=request, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    settled(2)  # the burst, at once; the other six reserved turns 0.5 s apart and sleep
    assert clock.most_inside == 1, "two threads reserved at once (the bucket's lock)"
    for step in range(1, 7):
        clock.advance_blocking(0.375)  # (binary-exact steps: the turns fall exactly on 0.5 k)
        time.sleep(0.02)  # time for a thread woken too early to get through (none may)
        settled(1 + step)
        clock.advance_blocking(0.125)
        settled(2 + step)  # exactly one more per 1/qps
    for t in threads:
        t.join(5)
    assert sorted(done) == [(0.0, 0.0), (0.0, 0.0)] + [(0.5 * k, 0.5 * k) for k in range(1, 7)]


def test_waits_and_refusals_reach_the_metrics_and_a_wait_over_a_second_the_log_at_v2(caplog):
    clock = SleepingClock()
    metrics = NodeMetrics()
    limit = ApiLimit(1, 1, clock=clock, observer=metrics)
    work = limit.named("work").bucket()
    dra = ApiLimit(0.5, 1, clock=clock, observer=metrics).named("dra").bucket()
    assert work is not None and dra is not None and work.client == "work"
    caplog.set_level(1, logger="gpu_agent")
    assert work.take() == 0  # the burst: nothing told
    assert work.take() == 1.0  # counted; a wait of 1 s is not logged
    with pytest.raises(RateLimited):
        work.take(bound=0.5)
    assert dra.take() == 0 and dra.take() == 2.0  # logged
    waits = [r for r in caplog.records if "for its turn" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in waits] == [
        (logging.INFO - 2, "Kubernetes API client dra: a request waited 2.00s for its turn (kubeApiQps 0.5, kubeApiBurst 1)")]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("gpu_agent_kube_api_throttled_total", (("client", "work"), ("outcome", "waited")))] == 1
    assert samples[("gpu_agent_kube_api_throttled_total", (("client", "work"), ("outcome", "refused")))] == 1
    assert samples[("gpu_agent_kube_api_throttled_total", (("client", "dra"), ("outcome", "waited")))] == 1
    assert samples[("gpu_agent_kube_api_throttle_wait_seconds_count", (("client", "work"),))] == 1
    assert samples[("gpu_agent_kube_api_throttle_wait_seconds_sum", (("client", "work"),))] == 1.0
    assert samples[("gpu_agent_kube_api_throttle_wait_seconds_sum", (("client", "dra"),))] == 2.0
