"""How the watch of work Pods (mechanisms/queues/pod_changes.py) is wired (issue 49): what it hands
foundations/kube.py's list_then_watch (its namespace, selector, pauses and clock), the thread it runs on (named, and
a watch that ends unasked is that thread's death), that it starts down, and that a failed watch wakes every item
and turns waits back to polling."""

import asyncio

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.threads import CURRENT, StopEvent, Threads
from gpu_agent.mechanisms.queues import pod_changes
from gpu_agent.mechanisms.queues.pod_changes import PodChanges


def test_the_watch_is_handed_its_namespace_selector_pauses_and_clock_and_starts_down(monkeypatch):
    seen = []
    monkeypatch.setattr(pod_changes, "list_then_watch", lambda *args, **kwargs: seen.append((args, kwargs)))
    clock = ManualClock()
    list_pods = object()
    changes = PodChanges(list_pods, "work", "gpu-agent.io/work-item=true", clock=clock, retry_seconds=3.0)
    assert changes.watching is False
    stop = StopEvent()
    changes._run(stop)
    ((args, kwargs),) = seen
    assert args == (list_pods, "work") and kwargs["label_selector"] == "gpu-agent.io/work-item=true"
    assert kwargs["stop"] is stop and kwargs["retry_seconds"] == 3.0 and kwargs["resync_seconds"] == 240
    assert kwargs["clock"] is clock
    assert (kwargs["on_list"], kwargs["on_event"], kwargs["on_error"]) == (changes._listed, changes._event,
                                                                          changes._failed)


def test_a_watch_that_ends_unasked_is_the_death_of_its_named_thread(monkeypatch):
    monkeypatch.setattr(pod_changes, "list_then_watch", lambda *args, **kwargs: None)  # returns at once
    health = HealthRegistry(ManualClock(), [])
    owner = Threads(health)

    async def scenario():
        CURRENT.set(owner)
        changes = PodChanges(lambda *a, **k: None, "work", "sel", clock=ManualClock())
        changes.start()
        await asyncio.to_thread(changes._thread.join, 5)
        return changes._thread.name
    name = asyncio.run(scenario())
    assert name == "work-pod-watch" and owner.died == {"work-pod-watch": "it returned while it should still run"}


def test_a_failed_watch_wakes_every_item_and_turns_the_waits_back_to_polling():
    async def scenario():
        changes = PodChanges(lambda *a, **k: None, "work", "sel", clock=ManualClock())
        changes._loop = asyncio.get_running_loop()
        changes.watching = True
        with changes.interest("a") as a, changes.interest("b") as b:
            changes._failed(RuntimeError("watch broke"))
            await asyncio.sleep(0)
            return a.is_set(), b.is_set(), changes.watching
    assert asyncio.run(scenario()) == (True, True, False)
