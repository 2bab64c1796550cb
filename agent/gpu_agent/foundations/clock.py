"""Time and randomness as injected dependencies.

Every loop in the agent sleeps through a `Clock` and draws jitter from a `random.Random`
it was given, so unit tests drive time by hand (`ManualClock`) and fix the random
source: backoff sequences and jitter are then tested exactly, with no real sleeping.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


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
            self._now = max(self._now, deadline)
            fut.set_result(None)
            await self.settle()
        self._now = target
        await self.settle()
