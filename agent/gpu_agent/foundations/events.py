"""Kubernetes Events (events.k8s.io/v1) about our objects, recorded the way client-go's recorder does.

What a person reads with `kubectl describe` or `kubectl events --for gpudomain/NAME`. The rules, as
client-go's events broadcaster and its spam filter have them (k8s.io/client-go/tools/events and
tools/record), on the injected clock:

- Series. An event isomorphic to one recorded less than SERIES_WINDOW (6 min) before (same object,
  type, reason, action and note) is not a new Event: the second occurrence patches the first into a
  series (count 2, lastObservedTime), later ones only count locally, and pending counts are patched
  every SERIES_FLUSH seconds (client-go waits 30 min; we flush sooner so `kubectl events` shows a
  flapping node's count while it flaps). A series quiet for SERIES_WINDOW ends: the next occurrence
  starts a new Event.
- Spam filter. Each object has a token bucket of SPAM_BURST calls refilled at one per SPAM_REFILL
  seconds (client-go: 25, one per 5 min); an event that would need a call when the bucket is empty is
  dropped, counted in `dropped` and logged at -v 2. Counting into a series costs no call and is never
  dropped.
- Off the caller's path. `record` only queues (at most QUEUE_LIMIT; beyond that the newest is
  dropped, as client-go's full channel does); `run` on its own thread makes the calls, each with the
  request timeout, and a failed call is logged and forgotten (events are best effort: never retried
  into a storm, never a reason to stop folding).

Notes are capped at 1 KiB (the API's limit) and must never carry a secret: they name nodes and counts.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import itertools
import threading
from typing import Any

from kubernetes import client

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT

log = get_logger(__name__)

SERIES_WINDOW = 360.0
SERIES_FLUSH = 30.0
SPAM_BURST = 25
SPAM_REFILL = 300.0
QUEUE_LIMIT = 1000
NOTE_LIMIT = 1024


def micro_time(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def reference(obj: dict[str, Any]) -> dict[str, str]:
    """The `regarding` reference of an object as read from the API server."""
    meta = obj.get("metadata") or {}
    ref = {"apiVersion": str(obj.get("apiVersion", "")), "kind": str(obj.get("kind", "")),
           "name": str(meta.get("name", "")), "namespace": str(meta.get("namespace", ""))}
    if meta.get("uid"):
        ref["uid"] = str(meta["uid"])
    return ref


@dataclasses.dataclass
class _Series:
    name: str  # the Event object's
    namespace: str
    count: int
    first: float  # monotonic
    last: float
    last_wall: float
    flushed: int  # the count the API server has
    flushed_at: float  # monotonic


@dataclasses.dataclass
class _Bucket:
    tokens: float
    at: float


class EventRecorder:
    def __init__(self, api: client.ApiClient | None, *, controller: str, instance: str, clock: Clock | None = None,
                 events_api: Any = None) -> None:
        """`events_api`: an EventsV1Api (the API client's unless handed one: unit tests hand in fakes)."""
        self.events: Any = events_api if events_api is not None else client.EventsV1Api(api)
        self.controller = controller
        self.instance = instance[:128]
        self.clock = clock or SystemClock()
        self.dropped = 0
        self.created = 0
        self.patched = 0
        self._queue: collections.deque[tuple[dict[str, str], str, str, str, str, float, float]] = collections.deque()
        self._series: dict[tuple[str, ...], _Series] = {}
        self._buckets: dict[tuple[str, str, str], _Bucket] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._names = itertools.count()

    def record(self, regarding: dict[str, str], type_: str, reason: str, action: str, note: str) -> None:
        """Queue one event about `regarding` (see reference()); type_ is Normal or Warning."""
        with self._lock:
            if len(self._queue) >= QUEUE_LIMIT:
                self.dropped += 1
                log.v(2, "event %s about %s/%s dropped: %d events already queued", reason, regarding.get("kind"),
                      regarding.get("name"), QUEUE_LIMIT)
                return
            self._queue.append((regarding, type_, reason, action, note, self.clock.monotonic(), self.clock.wall()))
        self._wake.set()

    def run(self) -> None:
        while not self._stop.is_set():
            self.clock.wait_blocking(self._wake, SERIES_FLUSH)
            self._wake.clear()
            self.drain()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def drain(self) -> None:
        """Send what is queued, then any series count due; the run loop calls it (tests call it directly)."""
        while True:
            with self._lock:
                if not self._queue:
                    break
                item = self._queue.popleft()
            self._send(*item)
        self._flush_series()

    def _key(self, regarding: dict[str, str], type_: str, reason: str, action: str, note: str) -> tuple[str, ...]:
        return (regarding.get("kind", ""), regarding.get("namespace", ""), regarding.get("name", ""),
                regarding.get("uid", ""), type_, reason, action, note)

    def _allowed(self, regarding: dict[str, str], now: float) -> bool:
        key = (regarding.get("kind", ""), regarding.get("namespace", ""), regarding.get("name", ""))
        bucket = self._buckets.setdefault(key, _Bucket(float(SPAM_BURST), now))
        bucket.tokens = min(float(SPAM_BURST), bucket.tokens + (now - bucket.at) / SPAM_REFILL)
        bucket.at = now
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def _send(self, regarding: dict[str, str], type_: str, reason: str, action: str, note: str,
              at: float, wall: float) -> None:
        note = note if len(note.encode()) <= NOTE_LIMIT else note.encode()[:NOTE_LIMIT - 3].decode(errors="ignore") + "..."
        key = self._key(regarding, type_, reason, action, note)
        series = self._series.get(key)
        if series is not None and at - series.last < SERIES_WINDOW:
            series.count += 1
            series.last, series.last_wall = at, wall
            if series.flushed == 1:  # the second occurrence turns the event into a series at once
                self._patch_series(series, regarding, reason)
            return
        if not self._allowed(regarding, at):
            self.dropped += 1
            log.v(2, "event %s about %s %s dropped by the spam filter (%d per object, one more per %.0f s)",
                  reason, regarding.get("kind"), regarding.get("name"), SPAM_BURST, SPAM_REFILL)
            return
        name = f"{regarding.get('name', 'object')[:200]}.{int(wall * 1e9):x}{next(self._names):x}"
        namespace = regarding.get("namespace") or "default"
        body: dict[str, Any] = {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": {"name": name, "namespace": namespace},
                "eventTime": micro_time(wall), "reportingController": self.controller,
                "reportingInstance": self.instance, "action": action, "reason": reason, "note": note,
                "type": type_, "regarding": regarding}
        try:
            self.events.create_namespaced_event(namespace, body, _request_timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - events are best effort: logged, never retried
            log.warning("recording event %s about %s %s failed: %s", reason, regarding.get("kind"),
                        regarding.get("name"), getattr(e, "reason", None) or e)
            return
        self.created += 1
        self._series[key] = _Series(name, namespace, 1, at, at, wall, 1, at)

    def _patch_series(self, series: _Series, regarding: dict[str, str], reason: str) -> None:
        if not self._allowed(regarding, series.last):
            return  # counted; a later flush tells the API server
        patch = {"series": {"count": series.count, "lastObservedTime": micro_time(series.last_wall)}}
        try:
            self.events.patch_namespaced_event(series.name, series.namespace, patch,
                                               _content_type="application/merge-patch+json",
                                               _request_timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - events are best effort
            log.warning("updating the series of event %s (%s) failed: %s", series.name, reason,
                        getattr(e, "reason", None) or e)
            return
        self.patched += 1
        series.flushed, series.flushed_at = series.count, self.clock.monotonic()

    def _flush_series(self) -> None:
        now = self.clock.monotonic()
        for key, series in list(self._series.items()):
            if now - series.last >= SERIES_WINDOW:
                if series.count > series.flushed:
                    self._patch_series(series, {"kind": key[0], "namespace": key[1], "name": key[2]}, key[5])
                del self._series[key]  # the series ended; the next occurrence is a new Event
            elif series.count > series.flushed and now - series.flushed_at >= SERIES_FLUSH:
                self._patch_series(series, {"kind": key[0], "namespace": key[1], "name": key[2]}, key[5])
