"""Slots: a count of interchangeable units (places for items in flight, GPUs) that tasks take and give back.

`take(n)` waits until `n` are free, without polling: a waiter is woken by every give-back and every
change of the total, and looks again. Waiters are served first fit, not first come: one that needs
more than is free waits while a later one that fits goes ahead (what keeps a 4-GPU item from holding
up the 1-GPU items behind it; a caller that must not starve the big one stops adding small ones, as
mechanisms/queues/consumer.py does).

Several Slots may share one `asyncio.Condition` (`changed`), so a caller can wait for a predicate over
all of them at once (`wait_until`): "a place in flight and a GPU free" is one wait, not two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Slots:
    def __init__(self, total: int, changed: asyncio.Condition | None = None) -> None:
        self._total = max(0, total)
        self._held = 0
        self.changed = changed or asyncio.Condition()

    @property
    def total(self) -> int:
        return self._total

    @property
    def held(self) -> int:
        return self._held

    @property
    def free(self) -> int:
        """Can be negative for a while after the total shrank below what is held."""
        return self._total - self._held

    def try_take(self, n: int) -> bool:
        """Take `n` now if they are free (no waiting); whether it did. Wakes no one: what others wait
        for only gets rarer."""
        if n > self.free:
            return False
        self._held += n
        return True

    async def take(self, n: int) -> None:
        """Wait until `n` are free, then take them."""
        async with self.changed:
            await self.changed.wait_for(lambda: n <= self.free)
            self._held += n
            self.changed.notify_all()  # a waiter for a predicate over these (see wait_until) looks again

    async def give(self, n: int) -> None:
        async with self.changed:
            self._held = max(0, self._held - n)
            self.changed.notify_all()

    async def resize(self, total: int) -> None:
        async with self.changed:
            self._total = max(0, total)
            self.changed.notify_all()

    async def wait_until(self, ready: Callable[[], bool]) -> None:
        """Wait until `ready()` holds, looked at after each change of any Slots sharing this condition."""
        async with self.changed:
            await self.changed.wait_for(ready)

    async def poke(self) -> None:
        """Make waiters look again (something their predicates read changed outside the Slots)."""
        async with self.changed:
            self.changed.notify_all()
