"""The Pod executor with a watch of the work Pods (mechanisms/queues/pod_changes.py), on a ManualClock: while
the watch is up an item reads its Pod when the watch shows it changed and at the latest every
`fallback_seconds`, not every `poll_seconds`; a change that lands during a read is not lost; while the watch is
down the item polls as before. The reads are counted by the scripted API server, not by the code under test."""

import asyncio

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.mechanisms.queues.pod_changes import PodChanges
from gpu_agent.mechanisms.queues.pod_executor import PodExecutor, pod_name

from .test_pod_executor import ScriptedCore, inline

RUNNING_SECONDS = 60.0


class Run:
    """One item whose Pod stays Running until `finish()`, the executor driven on a ManualClock with its calls
    made inline; the watch's thread is not started (its wake-ups are delivered by hand, as its thread would)."""

    def __init__(self, watch_up: bool):
        self.core = ScriptedCore(["Running"], node_gpus=[8])
        self.clock = ManualClock()
        self.changes = PodChanges(lambda *a, **k: None, "work", "sel", clock=self.clock, fallback_seconds=5.0)
        self.changes.start = lambda: None  # no thread: the test is the watch
        self.changes.watching = watch_up
        self.ex = PodExecutor(self.core, "work", "img", poll_seconds=0.5, clock=self.clock, run_blocking=inline,
                              pod_changes=self.changes)
        self.item = WorkItem(1, "long", {"gpus": 1}, "l", 1)
        self.name = pod_name("long")

    def reads(self):
        return self.core.reads

    def finish(self):
        self.core.phases = ["Succeeded"]


def count_reads(core):
    read = core.read_namespaced_pod
    core.reads = 0

    def counted(*args, **kwargs):
        core.reads += 1
        return read(*args, **kwargs)
    core.read_namespaced_pod = counted


def test_with_the_watch_up_a_running_pod_is_read_every_fallback_seconds_not_every_poll():
    async def scenario():
        run = Run(watch_up=True)
        count_reads(run.core)
        task = asyncio.ensure_future(run.ex.execute(run.item))
        await run.clock.advance(RUNNING_SECONDS)
        quiet = run.reads()
        run.finish()
        run.changes._wake(run.name)  # the watch shows the Pod Succeeded
        await run.clock.settle()
        assert task.done(), "the change did not end the wait: the item still waits for its fallback"
        return quiet, run.reads(), await task
    quiet, total, outcome = asyncio.run(scenario())
    # one read at the start, then one per 5 s of quiet: 13 (polling every 0.5 s would have read 121 times)
    assert quiet == 1 + int(RUNNING_SECONDS / 5.0), quiet
    assert total == quiet + 1 and outcome == "executed"


def test_a_change_during_a_read_ends_the_next_wait_at_once():
    async def scenario():
        run = Run(watch_up=True)
        count_reads(run.core)
        read = run.core.read_namespaced_pod
        first = []

        def read_then_change(*args, **kwargs):
            pod = read(*args, **kwargs)
            if not first:  # the Pod changes after the API server answered the first read, before the wait began
                first.append(True)
                run.finish()
                run.changes._wake(run.name)
            return pod
        run.core.read_namespaced_pod = read_then_change
        task = asyncio.ensure_future(run.ex.execute(run.item))
        await run.clock.settle()  # no time passes
        assert task.done(), f"the change was lost: {run.reads()} read(s), the item waits for its fallback"
        return run.reads(), await task
    reads, outcome = asyncio.run(scenario())
    assert reads == 2 and outcome == "executed"


def test_with_the_watch_down_the_item_polls_every_poll_seconds_and_a_list_stretches_the_wait_again():
    async def scenario():
        run = Run(watch_up=False)
        count_reads(run.core)
        task = asyncio.ensure_future(run.ex.execute(run.item))
        await run.clock.advance(10.0)
        polled = run.reads()
        run.changes._wake_all(True)  # the watch listed again: every item reads now, then waits for changes
        await run.clock.settle()
        after_list = run.reads()
        await run.clock.advance(10.0)
        watched = run.reads() - after_list
        run.changes._wake_all(False)  # failed again: back to polling
        await run.clock.advance(10.0)
        repolled = run.reads() - after_list - watched
        run.finish()
        await run.clock.advance(0.5)
        return polled, after_list - polled, watched, repolled, await task
    polled, on_list, watched, repolled, outcome = asyncio.run(scenario())
    assert polled == 21, polled  # at 0, 0.5, ..., 10.0
    assert on_list == 1 and watched == 2, (on_list, watched)  # the list's read, then at 5 and 10 s
    assert repolled >= 20, repolled
    assert outcome == "executed"


def test_interest_is_dropped_when_the_item_ends():
    async def scenario():
        run = Run(watch_up=True)
        run.finish()
        await run.ex.execute(run.item)
        return run.changes._interested
    assert asyncio.run(scenario()) == {}


def test_without_a_watch_the_executor_polls_as_the_simulation_runs_it():
    async def scenario():
        core = ScriptedCore(["Running"], node_gpus=[8])
        count_reads(core)
        clock = ManualClock()
        ex = PodExecutor(core, "work", "img", poll_seconds=0.5, clock=clock, run_blocking=inline)
        task = asyncio.ensure_future(ex.execute(WorkItem(1, "polled", {"gpus": 1}, "l", 1)))
        await clock.advance(5.0)
        core.phases = ["Succeeded"]
        await clock.advance(0.5)
        return core.reads, await task
    reads, outcome = asyncio.run(scenario())
    assert reads == 12 and outcome == "executed"


class WatchedPods:
    """A list call as core_v1_list makes it, for list_then_watch: a plain call lists; `watch=True` answers a
    stream that gives one event for `event_for` once `deliver` is set, then holds the watch open until `done`."""

    def __init__(self, event_for):
        import json
        import threading
        self.json, self.event_for = json, event_for
        self.deliver, self.done = threading.Event(), threading.Event()
        self.calls = []

    def __call__(self, namespace, *, label_selector=None, resource_version=None, watch=None, timeout_seconds=None,
                 _preload_content=True, _request_timeout=None, **_):
        self.calls.append((namespace, label_selector, resource_version, bool(watch)))
        if not watch:
            return {"metadata": {"resourceVersion": "41"}, "items": [{"metadata": {"name": "gpu-work-other"}}]}
        outer = self

        class Stream:
            def stream(self, amt=None, decode_content=False):
                if not outer.deliver.wait(5):
                    return
                event = {"type": "MODIFIED", "object": {"metadata": {"name": outer.event_for, "resourceVersion": "42"}}}
                yield (outer.json.dumps(event) + "\n").encode()
                outer.done.wait(5)

            def close(self):
                pass

            def release_conn(self):
                pass
        return Stream()


def test_the_watch_thread_lists_then_watches_the_release_work_pods_and_wakes_the_item_its_pod_changed():
    pods = WatchedPods(event_for="gpu-work-a")

    async def scenario():
        changes = PodChanges(pods, "work", "gpu-agent.io/work-item=true", clock=ManualClock())
        seen = []
        with changes.interest("gpu-work-a") as changed, changes.interest("gpu-work-b") as unchanged:
            changes.start()
            await asyncio.wait_for(changed.wait(), 5)  # the list wakes every item: it may have missed changes
            seen.append(("listed", changes.watching, unchanged.is_set()))
            changed.clear()
            unchanged.clear()
            pods.deliver.set()
            await asyncio.wait_for(changed.wait(), 5)
            await asyncio.sleep(0)
            seen.append(("event", changes.watching, unchanged.is_set()))
        changes.stop()
        pods.done.set()
        return seen
    seen = asyncio.run(scenario())
    assert seen == [("listed", True, True), ("event", True, False)]
    assert pods.calls[:2] == [("work", "gpu-agent.io/work-item=true", None, False),
                              ("work", "gpu-agent.io/work-item=true", "41", True)]


def test_a_stopped_watch_ends_its_thread_delivers_nothing_more_and_the_next_start_watches_anew():
    """Leadership lost: the executor's close stops the watch of the work Pods (before, it ran on for good); the next
    leadership's first item starts it again (issue 49)."""
    from gpu_agent.foundations.health import HealthRegistry
    from gpu_agent.foundations.threads import CURRENT, Threads

    pods = WatchedPods(event_for="gpu-work-a")
    clock = ManualClock()
    health = HealthRegistry(clock, [])
    owner = Threads(health)

    async def scenario():
        CURRENT.set(owner)
        changes = PodChanges(pods, "work", "gpu-agent.io/work-item=true", clock=clock)
        ex = PodExecutor(None, "work", "img", clock=clock, pod_changes=changes)
        with changes.interest("gpu-work-a") as changed:
            changes.start()
            await asyncio.wait_for(changed.wait(), 5)  # listed
            first = changes._thread
            changed.clear()
            ex.close()
            pods.deliver.set()  # the stream's event comes after the stop: not delivered
            await asyncio.to_thread(first.join, 5)
            await asyncio.sleep(0)
            stopped = (first.is_alive(), changed.is_set(), changes.watching)
            changes.start()
            await asyncio.wait_for(changed.wait(), 5)  # the new watch lists again
            again = changes._thread is not first and changes.watching
        changes.stop()
        pods.done.set()
        await asyncio.to_thread(changes._thread.join, 5)
        return stopped, again
    stopped, again = asyncio.run(scenario())
    assert stopped == (False, False, False) and again
    assert [c for c in pods.calls if not c[3]] == [("work", "gpu-agent.io/work-item=true", None, False)] * 2
    assert owner.died == {} and owner.running == {} and health.get("threads").ready
