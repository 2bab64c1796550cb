"""Running a blocking call off the event loop on a daemon thread.

`asyncio.to_thread` uses the loop's executor, whose threads are joined at exit; a long-polled
HTTP call there would hold a SIGTERM'd agent up for the whole poll. A daemon thread is left
behind instead, so shutdown stays prompt (which a Recreate rollout waits on).

This is the one way the agent's coroutines make a blocking call (`RunBlocking`): each mechanism
takes it as a parameter, so the deterministic simulation (agent/tests/sim) hands them its network
instead, which delays, drops, duplicates and hangs calls on virtual time. The calls themselves carry
their timeouts (`_request_timeout` on the API server, the control-plane client's own).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
RunBlocking = Callable[..., Awaitable[Any]]


async def in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            if not loop.is_closed():
                loop.call_soon_threadsafe(deliver, False, e)
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(deliver, True, result)

    threading.Thread(target=run, name=getattr(fn, "__name__", "call"), daemon=True).start()
    return await fut
