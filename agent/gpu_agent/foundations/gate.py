"""A one-holder gate that records who held it and for how long.

Registration after GPU arrival, periodic re-registration and credential renewal all pass
through one gate, from capturing the inventory to applying the response, so they never
interleave. A waiter whose cancellation or timeout fires while waiting leaves the queue
and runs nothing (asyncio.Lock already removes a cancelled waiter and hands the lock on).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gpu_agent.foundations.clock import Clock


@dataclass(frozen=True)
class GateEvent:
    purpose: str
    event: str  # "acquired" | "released" | "abandoned"
    at: float
    waited: float  # seconds spent waiting for the gate (for "released": seconds it was held)


class Gate:
    def __init__(self, clock: Clock, observer: Callable[[GateEvent], None] | None = None) -> None:
        self._lock = asyncio.Lock()
        self._clock = clock
        self._observer = observer
        self.holder: str | None = None

    @contextlib.asynccontextmanager
    # `timeout` is measured on the injected clock, which asyncio.timeout cannot use.
    async def hold(self, purpose: str, timeout: float | None = None) -> AsyncIterator[None]:  # noqa: ASYNC109 - see above
        started = self._clock.monotonic()
        try:
            if timeout is None:
                await self._lock.acquire()
            else:
                async with asyncio.timeout(timeout):
                    await self._lock.acquire()
        except (asyncio.CancelledError, TimeoutError):
            self._notify(purpose, "abandoned", started)
            raise
        self.holder = purpose
        self._notify(purpose, "acquired", started)
        acquired = self._clock.monotonic()
        try:
            yield
        finally:
            self.holder = None
            self._notify(purpose, "released", acquired)
            self._lock.release()

    def _notify(self, purpose: str, event: str, started: float) -> None:
        if self._observer is not None:
            now = self._clock.monotonic()
            self._observer(GateEvent(purpose, event, now, now - started))
