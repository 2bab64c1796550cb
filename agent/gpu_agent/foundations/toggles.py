"""An awaitable on/off switch: "paused until" as a primitive (after kopf's aiotoggles)."""

from __future__ import annotations

import asyncio


class Toggle:
    def __init__(self, on: bool = False) -> None:
        self._on = on
        self._changed = asyncio.Condition()

    @property
    def is_on(self) -> bool:
        return self._on

    async def set(self, on: bool) -> None:
        async with self._changed:
            if self._on != on:
                self._on = on
                self._changed.notify_all()

    async def wait_for(self, on: bool) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._on == on)
