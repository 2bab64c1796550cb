import asyncio
import inspect
import os

import pytest


class Tasks:
    """The background tasks one test starts (an elector's loop, a consumer's): cancelled and awaited when
    the test ends, passed or failed, on the test's own event loop."""

    def __init__(self):
        self._tasks = []

    def start(self, coroutine):
        task = asyncio.ensure_future(coroutine)
        self._tasks.append(task)
        return task

    async def stop(self):
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture
def tasks():
    """Start a test's background tasks with tasks.start(coroutine); they are stopped at its end."""
    return Tasks()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests on a fresh event loop (no pytest-asyncio needed); the tasks the `tasks`
    fixture started are stopped before the loop closes. A test that runs longer than 30 s of wall time
    (GPU_AGENT_TEST_TIMEOUT seconds where set: `make mutate` sets more, its tests run at the lowest priority beside
    other work and mutmut bounds each mutant's run itself) fails with TimeoutError."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}

        async def run():
            try:
                await pyfuncitem.obj(**kwargs)
            finally:
                started = pyfuncitem.funcargs.get("tasks")
                if isinstance(started, Tasks):
                    await started.stop()
        asyncio.run(asyncio.wait_for(run(), timeout=float(os.environ.get("GPU_AGENT_TEST_TIMEOUT") or 30)))
        return True
    return None
