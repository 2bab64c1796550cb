"""A client-side limit on API server calls: client-go's token bucket (QPS and burst), one per API client.

Why: client-go limits every client's requests (5 per second, bursts of 10, by default; controllers raise
it: kube-controller-manager's 20/30). Without a limit a bug or a storm (every item in flight reading its
Pod at once, every domain member retrying) sends the API server whatever the threads can send.

The rules, as client-go's (flowcontrol.NewTokenBucketRateLimiter over golang.org/x/time/rate):

- The bucket holds at most `burst` tokens and gains `qps` a second; each request takes one. A full bucket
  admits `burst` requests at once, then one every 1/qps seconds; an idle one fills up to `burst`, no more.
- A request whose token is not there yet waits for it. It reserves its turn under the bucket's lock (the
  bucket may go into debt: tokens below zero), then sleeps on the injected clock until that turn, outside the
  lock: threads sharing one bucket (many share one ApiClient) get turns 1/qps apart, in the order they asked.
- A wait is bounded by the request's own timeout: a request whose turn is further away than that fails at
  once with `RateLimited`, naming the client, the limit and the wait, and takes no token (the turn goes to the
  next). client-go bounds the wait by the caller's context: `Wait(ctx)` fails at once ("would exceed context
  deadline") when the deadline would pass before the token. Its client-wide timeout is set up only after the
  first throttle ("we don't want a throttled client to return timeouts to callers before it makes a single
  request"), so the call still gets its whole timeout once let through, as here. The Python client has no
  context: each call's `_request_timeout`, which every caller here names for what it holds (an item's lease, a
  Lease renewal, a shutdown), is the only bound a caller gives, so it plays the deadline's part. Why not wait
  anyway: a request sent after that is one its caller has stopped waiting for, and the error says why at once
  where a slow call would only time out; the callers already treat a call that got no answer as one to try
  again. A let-through call's timeout is not shortened by its wait (client-go's is not either): a watch's
  timeout is its read timeout, set past the server's own end of the watch, and a shorter one would cut healthy
  watches. So a call takes at most its timeout waiting plus its timeout on the wire. With the agents' defaults
  a refusal needs a storm: a burst and ten seconds' worth of requests already queued on one client.
- A watch takes one token when its request starts, as client-go's does; the events it streams take none.
- qps <= 0: no limit at all (client-go: a negative QPS, no rate limiter; its 0 means its default, 5).

Each API client gets its own bucket (foundations/kube.py's `api_client`), as each client-go client built
from a rest config does (kube-controller-manager gives each controller its own client, its leader election
one more): the work Pods' calls never hold up the leader's Lease renewal.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import Protocol

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.config import Setting
from gpu_agent.foundations.klog import get_logger

log = get_logger(__name__)

SLOW_WAIT = 1.0  # a wait longer than this is logged at V(2)


def kube_api_settings(qps: float, burst: int) -> list[Setting]:
    """The two settings of an agent's limit, with that agent's defaults."""
    return [
        Setting("kubeApiQps", "number", qps, "client-side limit on Kubernetes API calls: requests per second of each of "
                "this agent's API clients, as client-go's QPS (a request that would wait for its turn longer than "
                "its timeout fails at once; a watch counts once, when it starts); 0 or less: no limit", -1, 10000),
        Setting("kubeApiBurst", "int", burst, "requests each API client may send at once above kubeApiQps, as "
                "client-go's Burst (the token bucket's size)", 1, 100000),
    ]


class RateLimited(Exception):
    """A request refused by the client-side limit: its turn was further away than its timeout. Not sent."""


class LimiterObserver(Protocol):
    """Where a bucket reports (foundations.metrics.NodeMetrics implements it)."""

    def kube_api_waited(self, client: str, seconds: float) -> None: ...

    def kube_api_refused(self, client: str) -> None: ...


class TokenBucket:
    """The limit of one API client (see the module docstring). `client` names it in errors, logs and metrics."""

    def __init__(self, qps: float, burst: int, *, clock: Clock | None = None, client: str = "",
                 observer: LimiterObserver | None = None) -> None:
        if qps > 0 and burst < 1:
            raise ValueError(f"a burst below 1 ({burst}) admits nothing; the limit needs at least 1")
        self.qps, self.burst = qps, burst
        self.clock = clock or SystemClock()
        self.client = client
        self.observer = observer
        self._lock = threading.Lock()
        self._tokens = float(burst)  # full at the start, as client-go's; below 0: turns reserved ahead
        self._at = self.clock.monotonic()  # when _tokens was last brought up to date

    def describe(self) -> str:
        return f"kubeApiQps {self.qps:g}, kubeApiBurst {self.burst}"

    def _reserve(self, bound: float, what: str) -> float:
        """Take a token now or reserve the next free turn: the seconds until it. RateLimited, taking nothing,
        when that is longer than `bound`."""
        with self._lock:
            now = self.clock.monotonic()
            self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.qps)
            self._at = now
            wait = max(0.0, (1.0 - self._tokens) / self.qps)
            if wait > bound:
                raise RateLimited(
                    f"client-side rate limit of the Kubernetes API client{' ' + self.client if self.client else ''} "
                    f"({self.describe()}): {what} would wait {wait:.3g}s for its turn, longer than its {bound:g}s "
                    "timeout; not sent")
            self._tokens -= 1.0
            return wait

    def take(self, bound: float = math.inf, what: str = "a request") -> float:
        """Block until this request's turn (at most `bound` seconds; RateLimited beyond it, at once): the
        seconds waited. No limit (qps <= 0): returns 0 at once."""
        if self.qps <= 0:
            return 0.0
        try:
            wait = self._reserve(bound, what)
        except RateLimited:
            if self.observer is not None:
                self.observer.kube_api_refused(self.client)
            raise
        if wait > 0:
            self.clock.sleep_blocking(wait)
            if self.observer is not None:
                self.observer.kube_api_waited(self.client, wait)
            if wait > SLOW_WAIT:
                log.v(2, "Kubernetes API client %s: %s waited %.2fs for its turn (%s)", self.client or "(unnamed)",
                      what, wait, self.describe())
        return wait


@dataclass(frozen=True)
class ApiLimit:
    """The limit an agent puts on each API client it builds (`api_client(..., limit=)` makes one bucket per
    client from it). `client`: the client's name in errors, logs and metrics (work, leader, domains, gpus, dra)."""
    qps: float
    burst: int
    clock: Clock | None = None
    observer: LimiterObserver | None = None
    client: str = ""

    def named(self, client: str) -> ApiLimit:
        return replace(self, client=client)

    def bucket(self) -> TokenBucket | None:
        """A new bucket; None for no limit (qps <= 0)."""
        if self.qps <= 0:
            return None
        return TokenBucket(self.qps, self.burst, clock=self.clock, client=self.client, observer=self.observer)
