"""Threads: the long-lived ones an agent runs (each started through `start_thread`, watched for its death), and
running a blocking call off the event loop on a daemon thread (`in_daemon_thread`).

Long-lived threads (the watches, the domain aggregator, the event recorder, the HTTP server) start in one
place, `start_thread`, on the `Threads` of the agent that starts them: the one its role made current
(`CURRENT`, a context variable, so a thread, a task or a thread started from one inherits its agent's,
and two agents in one process keep theirs apart). A thread that ends by an exception, or returns while
its `stop` is not set, is dead: the log says so with its traceback, and the agent's `threads` entry in
/healthz turns NotReady naming it and why, and stays so (a thread that died of a bug would die again;
the process is broken and its readiness says it, as controller-runtime's manager fails when a runnable
does). Nothing restarts it.

A thread's `stop` is a `StopEvent` where the thread may block in a read that only its peer would end (a watch on a
quiet stream): setting it also runs what the thread registered with `on_set` (the shutdown of that connection), so
the thread ends at once, not at its next event or its server's timeout.

Blocking calls:

`asyncio.to_thread` uses the loop's executor, whose threads are joined at exit; a long-polled
HTTP call there would hold a SIGTERM'd agent up for the whole poll. A daemon thread is left
behind instead, so shutdown stays prompt (which a Recreate rollout waits on).

At most MAX_BLOCKING_CALLS of them run at once per event loop; the next waits on the loop for a place, so a
control plane or API server that hangs every call holds a bounded number of threads, not one more per retry.
Each call runs in a copy of the caller's context, as `asyncio.to_thread`'s does.

This is the one way the agent's coroutines make a blocking call (`RunBlocking`): each mechanism
takes it as a parameter, so the deterministic simulation (agent/tests/sim) hands them its network
instead, which delays, drops, duplicates and hangs calls on virtual time. The calls themselves carry
their timeouts (`_request_timeout` on the API server, the control-plane client's own).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import traceback
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger

T = TypeVar("T")
RunBlocking = Callable[..., Awaitable[Any]]
log = get_logger(__name__)
COMPONENT = "threads"


class Threads:
    """The long-lived threads of one agent: which run, and which died and why (reported into `health`)."""

    def __init__(self, health: HealthRegistry | None = None) -> None:
        self._health = health
        self._lock = threading.Lock()
        self.running: dict[str, int] = {}  # name -> how many run now
        self.died: dict[str, str] = {}  # name -> why the first of that name died
        self._report()

    def start(self, name: str, target: Callable[[], object], stop: threading.Event | None = None) -> threading.Thread:
        """Start `target` on a daemon thread named `name`; `stop`: set when it is meant to end (a return
        before it is set is a death). The thread runs in a copy of the caller's context: what it starts is
        this agent's too."""
        context = contextvars.copy_context()

        def run() -> None:
            why, trace = "", ""
            try:
                context.run(target)
                if stop is not None and not stop.is_set():
                    why = "it returned while it should still run"
            except BaseException as e:  # noqa: BLE001 - a thread's death is reported, never lost
                why = f"{type(e).__name__}: {e}"[:300]
                trace = "\n" + "".join(traceback.format_exception(e)).rstrip()
            finally:
                with self._lock:
                    self.running[name] -= 1
                    if not self.running[name]:
                        del self.running[name]
                    if why:
                        self.died.setdefault(name, why)
                if why:
                    log.error("thread %s died (%s): this agent is NotReady from now on%s", name, why, trace)
                self._report()


        with self._lock:
            self.running[name] = self.running.get(name, 0) + 1
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._report()
        return thread

    def _report(self) -> None:
        if self._health is None:
            return
        with self._lock:
            died, running = dict(self.died), dict(self.running)
        if died:
            reason = "; ".join(f"thread {name} died: {why}" for name, why in sorted(died.items()))
        else:
            reason = "every thread runs"
        self._health.set(COMPONENT, not died, reason, running=sum(running.values()), died=sorted(died))


class StopEvent(threading.Event):
    """A threading.Event (what a long-lived thread's `stop` is) that also runs, in the thread that sets it, each call
    registered with `on_set` (once). Why: a thread checks its stop only between the reads it blocks in, and a watch
    on a quiet stream (no events; a bookmark about once a minute) blocks for minutes, so its owner's stop would
    leave it running until the next event or the server's timeout. The watch registers the shutdown of its
    connection here (foundations/kube.py's `list_then_watch`): the stop ends its read. A registered call must be
    quick and must not block (it runs in the stopper's thread, maybe the event loop's); one that fails is logged."""

    def __init__(self) -> None:
        super().__init__()
        self._calls_lock = threading.Lock()
        self._calls: dict[object, Callable[[], object]] = {}

    def set(self) -> None:
        with self._calls_lock:  # set and take the calls at once: one registered meanwhile sees it set, and runs now
            super().set()
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            _run_stop_call(call)

    def on_set(self, call: Callable[[], object]) -> Callable[[], None]:
        """Run `call` when this is set (now, if it is set already); returns how to take it back (when what it
        would end has ended by itself)."""
        key = object()
        with self._calls_lock:
            if not self.is_set():
                self._calls[key] = call

                def take_back() -> None:
                    with self._calls_lock:
                        self._calls.pop(key, None)
                return take_back
        _run_stop_call(call)
        return lambda: None


def _run_stop_call(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the stop itself stands; the thread then ends as it would without this
        log.warning("running %r on a stop failed: %s", call, e)


# The agent whose threads start now: each role sets its own (in its constructor and at the start of its run).
CURRENT: contextvars.ContextVar[Threads | None] = contextvars.ContextVar("gpu_agent_threads", default=None)
UNOWNED = Threads()  # threads started outside any agent (a benchmark, a test): their deaths are logged only


def start_thread(name: str, target: Callable[[], object], stop: threading.Event | None = None) -> threading.Thread:
    """Start a long-lived thread on the current agent's `Threads` (the one way to start one)."""
    return (CURRENT.get() or UNOWNED).start(name, target, stop)



MAX_BLOCKING_CALLS = 64
# One limit per loop: an asyncio.Semaphore belongs to the loop it was first awaited on.
_places: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def blocking_calls_limit(loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
    places = _places.get(loop)
    if places is None:
        places = _places[loop] = asyncio.Semaphore(MAX_BLOCKING_CALLS)
    return places


async def in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a daemon thread, once one of the loop's MAX_BLOCKING_CALLS places is free; its place
    is held until `fn` returns, also when the awaiting coroutine was cancelled (the thread cannot be)."""
    loop = asyncio.get_running_loop()
    places = blocking_calls_limit(loop)
    await places.acquire()
    fut: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def deliver(ok: bool, value: Any) -> None:
        places.release()
        if fut.done():  # the waiter was cancelled
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        ok: bool = True
        value: Any = None
        try:
            value = context.run(fn, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(deliver, ok, value)
        except RuntimeError:
            pass  # the loop closed: nobody waits, and its places went with it

    try:
        threading.Thread(target=run, name=getattr(fn, "__name__", "call"), daemon=True).start()
    except BaseException:
        places.release()
        raise
    return await fut
