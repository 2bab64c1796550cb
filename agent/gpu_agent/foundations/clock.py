"""Time and randomness as injected dependencies.

Every loop in the agent reads time and sleeps through the one `Clock` it was given, and draws
jitter from a `random.Random` it was given, so unit tests drive time by hand (`ManualClock`) and
fix the random source: backoff sequences and jitter are then tested exactly, with no real sleeping.

Coroutines wait with `sleep`. The few loops that live on threads (the watches of
foundations/kube.py and what they feed: the domain writers and the aggregator, whose API calls
block) wait with `sleep_blocking` and `wait_blocking` on the same clock, so a ManualClock moves
them too.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Awaitable
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def sleep_blocking(self, seconds: float) -> None:
        """Block this thread for `seconds` (threads only; never on the event loop)."""
        ...

    def wait_blocking(self, event: threading.Event, seconds: float) -> bool:
        """Block until `event` is set (True) or `seconds` pass (False) (threads only)."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def sleep_blocking(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def wait_blocking(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(0.0, seconds))


async def sleep_or(clock: Clock, seconds: float, wake: Awaitable[object]) -> None:
    """Sleep on `clock` for `seconds`, cut short as soon as `wake` completes (an event set, a
    toggle flipped). Both waits are cancelled on the way out."""
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    waker = asyncio.ensure_future(wake)
    try:
        await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        waker.cancel()


class ManualClock:
    """A clock that only moves when a test calls `advance()`.

    Sleepers are woken in deadline order; `advance()` yields to the event loop after
    each wake so the woken coroutines run before time moves on (like kopf's looptime,
    but explicit).
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._moved = threading.Condition()
        self.blocked = 0  # threads waiting on this clock now
        self._deadlines: dict[object, float] = {}  # of the blocking waits in progress

    def sleep_blocking(self, seconds: float) -> None:
        self.wait_blocking(threading.Event(), seconds)

    def wait_blocking(self, event: threading.Event, seconds: float) -> bool:
        """Until `event` is set or the clock has been advanced `seconds` past now. (An event set by another
        thread does not notify the condition: it is looked at every few milliseconds of real time.)"""
        deadline = self._now + max(0.0, seconds)
        me = object()
        with self._moved:
            self.blocked += 1
            self._deadlines[me] = deadline
            try:
                while not event.is_set() and self._now < deadline:
                    self._moved.wait(0.005)
            finally:
                self.blocked -= 1
                del self._deadlines[me]
        return event.is_set()

    def _moved_to(self, now: float) -> None:
        with self._moved:
            self._now = now
            self._moved.notify_all()

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + max(0.0, seconds), next(self._seq), fut))
        await fut

    @property
    def sleepers(self) -> list[float]:
        """Deadlines (relative to now) of everyone currently asleep, soonest first."""
        return sorted(d - self._now for d, _, f in self._sleepers if not f.done())

    async def settle(self) -> None:
        for _ in range(50):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        target = self._now + seconds
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._sleepers)
            if fut.done():
                continue
            self._moved_to(max(self._now, deadline))
            fut.set_result(None)
            await self.settle()
        self._moved_to(target)
        await self.settle()

    def advance_blocking(self, seconds: float) -> None:
        """Move the clock for threads only (a test with no event loop)."""
        self._moved_to(self._now + seconds)

    def step_thread(self, seconds: float, real_timeout: float = 5.0) -> None:
        """Advance by `seconds`, then return once the threads have caught up: some thread waits on the
        clock and every wait in progress ends later than now (whatever the time allowed has been done).
        For tests driving threads."""
        self.advance_blocking(seconds)
        deadline = time.monotonic() + real_timeout
        while time.monotonic() < deadline:
            with self._moved:
                if self._deadlines and min(self._deadlines.values()) > self._now:
                    return
            time.sleep(0.001)
