"""Writing one node's entry into the shared GPUDomain: optimistic concurrency with backoff.

Synchronous on purpose (the Kubernetes client is): the node agent runs it off its event
loop, the domain benchmark runs hundreds of them on threads. Each attempt starts from the
last object this writer knows (its own last successful write, or a fresh read after a
conflict: the "mutation cache"), changes only this node's entry and replaces the status with
that resourceVersion. A 409 means someone wrote first: read again and retry after a backoff.
A 429 waits at least its Retry-After. `superseded()` ends a retry loop as soon as a newer
event has made its goal stale, and "my entry is missing" is never reported as success.
`cancelled` (an Event the owner sets on leave or shutdown) cuts a backoff short and ends the
loop: no attempt follows once it is set (the owner checks it before the first), so a removal
that waits for the loop to end (reconciler.py) is never followed by a late re-add. A `deadline` bounds the
loop and each call in it (a call's timeout is what is left of it, at most REQUEST_TIMEOUT).

Strategies (`domainWriteStrategy`), chosen by measurement (make bench-domain):
  dra         NVIDIA DRA driver's: 5 ms doubling to a 6 s cap, x U[0.75, 1.25)
  fulljitter  ours: 5 ms doubling, full jitter U[0, d), cap = expected nodes / write rate
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import cast

from kubernetes import client

from gpu_agent.foundations.backoff import Backoff
from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT
from gpu_agent.mechanisms.domain.entries import OCC_STRATEGIES, Entry, GPUDomain, with_entry, without_entry

log = get_logger(__name__)
# The version every agent (and hook) reads and writes: the one the previous release serves, one release
# behind as the CRDs' storage is. An object written through a version records it in its managedFields,
# and once a downgrade removes that version from the CRD, server-side apply of the object fails ("request
# to convert CR to an invalid group/version"). Move to v1beta1 in the release that stores it.
GROUP, VERSION, PLURAL = "gpu-agent.io", "v1alpha1", "gpudomains"
STRATEGIES = OCC_STRATEGIES


def request_timeout(clock: Clock, deadline: float | None) -> float:
    """One API call's timeout: REQUEST_TIMEOUT, cut to what is left before `deadline` (shutdownTimeout bounds
    the removal as a whole, not each of its calls)."""
    if deadline is None:
        return REQUEST_TIMEOUT
    return max(0.05, min(REQUEST_TIMEOUT, deadline - clock.monotonic()))


def back_off(clock: Clock, delay: float, cancelled: threading.Event | None) -> bool:
    """Wait out a retry's `delay`; False when `cancelled` is set (the loop's goal is gone: no attempt follows)."""
    if cancelled is None:
        clock.sleep_blocking(delay)
        return True
    return not clock.wait_blocking(cancelled, delay)


def make_backoff(strategy: str, expected_nodes: int, write_rate: float, rng: random.Random) -> Backoff:
    if strategy == "dra":
        return Backoff(0.005, 6.0, 2.0, 0.25, rng, mode="symmetric")
    if strategy == "fulljitter":
        return Backoff(0.005, max(0.05, expected_nodes / write_rate), 2.0, 0.0, rng, mode="full")
    raise ValueError(f"unknown domain write strategy {strategy!r}; known: {', '.join(STRATEGIES)}")


def _rv(obj: GPUDomain | None) -> int:
    try:
        return int((obj or {}).get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


@dataclass
class WriteStats:
    calls: int = 0
    conflicts: int = 0
    throttled: int = 0
    errors: int = 0
    writes: int = 0


class DomainView:
    """What both writers share: the domain they write, and their newest view of it (a watch's
    older view never replaces their own newer write: the mutation cache)."""

    namespace: str
    name: str
    cached: GPUDomain | None

    @property
    def where(self) -> str:
        return f"GPUDomain {self.namespace}/{self.name}"

    def observe(self, obj: GPUDomain) -> None:
        if _rv(obj) >= _rv(self.cached):
            self.cached = obj


@dataclass
class DomainWriter(DomainView):
    api: client.ApiClient
    namespace: str
    name: str
    strategy: str = "fulljitter"
    write_rate: float = 25.0
    rng: random.Random = field(default_factory=random.Random)
    clock: Clock = field(default_factory=SystemClock)  # its retries wait on it
    stats: WriteStats = field(default_factory=WriteStats)
    cached: GPUDomain | None = None
    custom_api: InitVar[client.CustomObjectsApi | None] = None  # the API client's unless handed one (tests)

    def __post_init__(self, custom_api: client.CustomObjectsApi | None) -> None:
        self.custom = custom_api if custom_api is not None else client.CustomObjectsApi(self.api)

    def read(self, deadline: float | None = None) -> GPUDomain:
        self.stats.calls += 1
        obj = cast(GPUDomain, self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name, _request_timeout=request_timeout(self.clock, deadline)))
        self.observe(obj)
        return obj

    def update(self, change: Callable[[GPUDomain], GPUDomain | None], what: str,
               superseded: Callable[[], bool], deadline: float | None,
               cancelled: threading.Event | None = None) -> bool:
        obj = self.cached if self.cached is not None else None
        attempt = 0
        backoff: Backoff | None = None
        while True:
            attempt += 1
            delay = 0.0
            try:
                if obj is None:
                    obj = self.read(deadline)
                new = change(obj)
                if new is None:
                    return True  # already so in the newest view we have
                self.stats.calls += 1
                written = cast(GPUDomain, self.custom.replace_namespaced_custom_object_status(
                    GROUP, VERSION, self.namespace, PLURAL, self.name, dict(new),
                    _request_timeout=request_timeout(self.clock, deadline)))
                self.stats.writes += 1
                self.cached = written
                log.v(3, "domain update: %s in %s (attempt %d)", what, self.where, attempt)
                return True
            except client.ApiException as e:
                if backoff is None:
                    expected = int(((obj or {}).get("spec") or {}).get("expectedNodes") or 1)
                    backoff = make_backoff(self.strategy, max(expected, 1), self.write_rate, self.rng)
                delay = backoff.next_delay()
                if e.status == 409:
                    self.stats.conflicts += 1
                    log.v(4, "domain update: failed to %s in %s: conflict (attempt %d)", what, self.where, attempt)
                elif e.status == 429:
                    self.stats.throttled += 1
                    retry_after = (e.headers or {}).get("Retry-After", "1")
                    delay = max(delay, float(retry_after) if retry_after.replace(".", "", 1).isdigit() else 1.0)
                    log.warning("domain update: failed to %s in %s: 429 throttled, retrying after %.1fs (attempt %d)",
                                what, self.where, delay, attempt)
                else:
                    self.stats.errors += 1
                    log.warning("domain update: failed to %s in %s: %s %s (attempt %d)", what, self.where, e.status,
                                e.reason, attempt)
                obj = None  # read again: our view is stale
            except Exception as e:  # noqa: BLE001 - connection trouble: same backoff
                self.stats.errors += 1
                if backoff is None:
                    backoff = make_backoff(self.strategy, 1, self.write_rate, self.rng)
                delay = backoff.next_delay()
                log.warning("domain update: failed to %s in %s: %s (attempt %d)", what, self.where, e, attempt)
                obj = None
            if superseded():
                log.v(3, "domain update: %s in %s superseded by a newer event", what, self.where)
                return False
            if deadline is not None and self.clock.monotonic() + delay > deadline:
                log.warning("domain update: gave up trying to %s in %s before the deadline (attempt %d)",
                            what, self.where, attempt)
                return False
            if not back_off(self.clock, delay, cancelled):
                return False

    def ensure(self, entry: Entry, superseded: Callable[[], bool] = lambda: False, deadline: float | None = None,
               cancelled: threading.Event | None = None) -> bool:
        what = f"set node {entry.name} status {'Ready' if entry.ready else 'NotReady'}"
        return self.update(lambda obj: with_entry(obj, entry), what, superseded, deadline, cancelled)


    def needs_reapply(self, obj: GPUDomain, entry: Entry) -> bool:
        """Whether an observed domain object means this node's entry must be written again."""
        return with_entry(obj, entry) is not None

    def remove(self, name: str, deadline: float | None = None) -> bool:
        return self.update(lambda obj: without_entry(obj, name), f"remove node {name}", lambda: False, deadline)
