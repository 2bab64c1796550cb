"""When to read a work Pod again: one watch of every work Pod of the release wakes the item waiting on it.

Why: each item in flight follows its Pod to the end. Polling each Pod every half second costs two GETs a
second per item in flight, whatever the Pod is doing: with `queue.maxInFlight` at the GPUs registered, a
cluster of 500 GPUs would send the API server 1,000 GETs a second to learn that long Pods are still
Running. A watch tells when a Pod changed; the item then reads it.

The watch only says *when* to read, never *what*: the executor still reads its Pod with a GET and decides
on that answer alone, so a lagging, restarted or broken watch can delay a read but never changes a
decision (a Pod missing from the watch is not taken for deleted, as a 404 is). Two rules bound the delay:
- While the watch is up (listed, no error since), an item reads its Pod when the watch shows it changed,
  and at the latest every `fallback_seconds` (a lost event costs that much, no more).
- While it is down (not started, failing, between a failure and the next list), items poll every
  `poll_seconds` as they did without it. A list after an outage wakes every item, since events may have
  been missed.

An item registers its interest before it reads (`interest`), so a change that lands between the read and
the wait is not lost: the wait returns at once.

Threads: the watch runs on a daemon thread (foundations/kube.py's `list_then_watch`, its pauses on the
injected clock) and hands each change to the event loop with `call_soon_threadsafe`; the waits are
coroutines on the injected clock. The deterministic simulation gives the executor no watch (`Polling`), so
it polls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpu_agent.foundations.clock import Clock, SystemClock, sleep_or
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import list_then_watch
from gpu_agent.foundations.threads import StopEvent, start_thread

log = get_logger(__name__)
FALLBACK_SECONDS = 5.0  # the longest an item waits for its Pod's change while the watch is up
RETRY_SECONDS = 2.0  # after a failed list or watch


class Polling:
    """No watch (the deterministic simulation, unit tests): an item reads its Pod every `poll_seconds`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    @contextmanager
    def interest(self, name: str) -> Iterator[asyncio.Event]:
        yield asyncio.Event()  # never set: nothing watches

    async def wait(self, changed: asyncio.Event, poll_seconds: float) -> None:
        await self.clock.sleep(poll_seconds)


class PodChanges:
    def __init__(self, list_pods: Callable[..., Any], namespace: str, label_selector: str, *,
                 clock: Clock | None = None, fallback_seconds: float = FALLBACK_SECONDS,
                 retry_seconds: float = RETRY_SECONDS, resync_seconds: int = 240) -> None:
        self.list_pods = list_pods  # a list call list_then_watch can watch (foundations/kube.py's core_v1_list)
        self.namespace = namespace
        self.label_selector = label_selector
        self.clock = clock or SystemClock()
        self.fallback_seconds = fallback_seconds
        self.retry_seconds = retry_seconds
        self.resync_seconds = resync_seconds
        self.watching = False  # listed, and no error since: only then do waits stretch to fallback_seconds
        self._interested: dict[str, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = StopEvent()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the watch unless it runs (later calls do nothing until `stop`). Called from the event loop its
        wake-ups go to."""
        if self._thread is not None and not self._stop.is_set():
            return
        self._loop = asyncio.get_running_loop()
        # this watch's own: a stopped one never resumes; a StopEvent: its stop also shuts the watch's connection
        self._stop = stop = StopEvent()
        self._thread = start_thread("work-pod-watch", lambda: self._run(stop), stop)

    def stop(self) -> None:
        """Stop the watch (leadership lost, shutdown): waits fall back to polling; the next `start` watches anew."""
        self._stop.set()
        self.watching = False

    @contextmanager
    def interest(self, name: str) -> Iterator[asyncio.Event]:
        """An event set whenever the watch shows Pod `name` changed, for as long as the block runs.
        Clear it before each read and wait on it (`wait`) after: a change in between is kept."""
        changed = asyncio.Event()
        self._interested.setdefault(name, set()).add(changed)
        try:
            yield changed
        finally:
            waiting = self._interested.get(name)
            if waiting is not None:
                waiting.discard(changed)
                if not waiting:
                    del self._interested[name]

    async def wait(self, changed: asyncio.Event, poll_seconds: float) -> None:
        """Until the Pod changed (as the watch shows) or, while the watch is up, `fallback_seconds`; while it
        is down, `poll_seconds`."""
        if changed.is_set():
            return
        await sleep_or(self.clock, self.fallback_seconds if self.watching else poll_seconds, changed.wait())

    # The watch's thread: everything below hands over to the event loop.

    def _run(self, stop: threading.Event) -> None:
        list_then_watch(self.list_pods, self.namespace, label_selector=self.label_selector, on_list=self._listed,
                        on_event=self._event, on_error=self._failed, stop=stop, retry_seconds=self.retry_seconds,
                        resync_seconds=self.resync_seconds, clock=self.clock)


    def _listed(self, listed: Any) -> None:
        self._to_loop(self._wake_all, True)

    def _event(self, kind: str, obj: dict[str, Any]) -> None:  # core_v1_list's plain dicts
        name = obj.get("metadata", {}).get("name")
        if isinstance(name, str):
            self._to_loop(self._wake, name)

    def _failed(self, e: Exception) -> None:
        self._to_loop(self._wake_all, False)  # through the loop, so that it lands after the list's wake-up before it
        log.warning("watching work pods in %s failed (%s); polling each pod every few tenths of a second until the "
                    "watch is back, in %.0fs", self.namespace, type(e).__name__, self.retry_seconds)

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

    # On the event loop.

    def _wake(self, name: str) -> None:
        for changed in self._interested.get(name, ()):
            changed.set()

    def _wake_all(self, up: bool) -> None:
        """The watch is up (a list) or down (a failure): every item reads its Pod now, since changes may have
        been missed, and then waits as the new state says."""
        self.watching = up and not self._stop.is_set()
        for waiting in self._interested.values():
            for changed in waiting:
                changed.set()
