"""A node's entry after it leaves (issue 49): no write lands after the removal, and shutdownTimeout bounds the
whole removal. The node agent's real reconciler and member writer against a scripted API server; time is a
ManualClock the writer's thread waits on, so the test decides when a backoff ends and when an apply answers."""

import asyncio
import random
import threading
import time

import pytest
from kubernetes import client

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.mechanisms.domain.aggregate import MemberWriter
from gpu_agent.mechanisms.domain.entries import Entry, with_entry
from gpu_agent.mechanisms.domain.membership import DomainMembership
from gpu_agent.mechanisms.domain.reconciler import DomainReconciler
from gpu_agent.mechanisms.domain.writer import DomainWriter

MEMBER = "train.n1"


class ScriptedMembers:
    """An API server's GPUDomainMembers. Applies answer as `script` says, in turn ("409", "500", "slow": held until
    `answer` is set, then applied; anything after the script: applied); deletes as `deletes` says. Every call is
    recorded in order, with what the object store held after it."""

    def __init__(self, script=(), deletes=(), clock=None):
        self.script, self.deletes = list(script), list(deletes)
        self.objects: dict[str, dict] = {}
        self.calls: list[tuple] = []
        self.answer = threading.Event()
        self.in_slow_apply = threading.Event()
        self.clock = clock
        self.timeouts: list[float] = []

    def patch_namespaced_custom_object(self, g, v, ns, plural, name, body, **kw):
        step = self.script.pop(0) if self.script else "ok"
        if step in ("409", "500"):
            self.calls.append(("apply", step))
            raise client.ApiException(status=int(step), reason="scripted")
        if step == "slow":
            self.in_slow_apply.set()
            assert self.answer.wait(5), "the test never let the slow apply answer"
        self.objects[name] = body
        self.calls.append(("apply", "landed"))
        return body

    def get_namespaced_custom_object(self, g, v, ns, plural, name, _request_timeout=None):
        raise client.ApiException(status=404, reason="Not Found")  # no member under 0.1's name

    def delete_namespaced_custom_object(self, g, v, ns, plural, name, _request_timeout=None, body=None):
        self.timeouts.append(_request_timeout)
        step = self.deletes.pop(0) if self.deletes else "ok"
        if step == "hang":  # the server never answers: the client gives up after its timeout
            self.clock.advance_blocking(_request_timeout)
            self.calls.append(("delete", "timed out"))
            raise TimeoutError("read timed out")
        if step == "500":
            self.calls.append(("delete", "500"))
            raise client.ApiException(status=500, reason="scripted")
        if isinstance(step, threading.Barrier):
            try:
                step.wait()  # both domains' removals are in their calls at once, or this breaks after its timeout
            except threading.BrokenBarrierError:
                self.objects.pop(name, None)
                self.calls.append(("delete", "alone"))
                return
        self.objects.pop(name, None)
        self.calls.append(("delete", "done"))


class ScriptedDomain(ScriptedMembers):
    """The same script for the status-entry strategy: one GPUDomain whose status.nodes the writer replaces."""

    def __init__(self, script=(), clock=None):
        super().__init__(script, clock=clock)
        self.domain = {"metadata": {"name": "train", "resourceVersion": "1"}, "spec": {"expectedNodes": 1},
                       "status": {"nodes": []}}

    def get_namespaced_custom_object(self, g, v, ns, plural, name, _request_timeout=None):
        return {**self.domain, "metadata": dict(self.domain["metadata"])}

    def replace_namespaced_custom_object_status(self, g, v, ns, plural, name, body, _request_timeout=None):
        if self.script and self.script[0] in ("409", "slow"):
            kind = "apply" if any(n.get("name") == "n1" for n in body["status"]["nodes"]) else "delete"
            if kind == "apply":
                self.patch_namespaced_custom_object(g, v, ns, plural, name, body)
        else:
            kind = "apply" if any(n.get("name") == "n1" for n in body["status"]["nodes"]) else "delete"
            self.calls.append((kind, "landed" if kind == "apply" else "done"))
        rv = str(int(self.domain["metadata"]["resourceVersion"]) + 1)
        self.domain = {**body, "metadata": {**body["metadata"], "resourceVersion": rv}}
        self.objects = {MEMBER: {}} if any(n.get("name") == "n1" for n in body["status"]["nodes"]) else {}
        return self.domain


def until(predicate, what, seconds=5.0):
    """Poll to a deadline (real time: the writer's thread is real)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def reconciler_on(fake, clock, domain="train"):
    if isinstance(fake, ScriptedDomain):
        writer = DomainWriter(client.ApiClient(), "ns", domain, "fulljitter", 25.0, random.Random(7), clock,
                              custom_api=fake)
    else:
        writer = MemberWriter(client.ApiClient(), "ns", domain, custom_api=fake, clock=clock, rng=random.Random(7))
    reconciler = DomainReconciler(writer, HealthRegistry(clock, []), node="n1", ip="10.0.0.1", peers_file=None,
                                  health_component=None, clock=clock)
    reconciler._watch = lambda: None  # no watch thread: nothing here reads the domain back
    returned = threading.Event()  # set when the writer's loop (on its thread) has returned, whatever it did
    ensure = writer.ensure

    def recorded_ensure(*args, **kwargs):
        try:
            return ensure(*args, **kwargs)
        finally:
            returned.set()

    writer.ensure = recorded_ensure
    return reconciler, returned


@pytest.mark.parametrize("strategy", ["members", "status entries"])
@pytest.mark.parametrize("when", ["in backoff after a 409", "with an apply in flight"])
async def test_a_node_that_leaves_while_its_apply_retries_is_never_re_added_after_the_removal(when, strategy):
    clock = ManualClock()
    fake = (ScriptedMembers if strategy == "members" else ScriptedDomain)(["409", "slow"], clock=clock)
    reconciler, returned = reconciler_on(fake, clock)
    reconciler.set_gpus(["GPU-1"], True)
    task = asyncio.create_task(reconciler.run())
    try:
        await leave_while_retrying(when, clock, fake, reconciler, returned, task)
    finally:  # whatever failed, no thread of the test is left waiting on the clock or the fake
        fake.answer.set()
        for _ in range(5):
            clock.advance_blocking(100.0)


async def leave_while_retrying(when, clock, fake, reconciler, returned, task):

    await asyncio.to_thread(until, lambda: fake.calls == [("apply", "409")] and clock.blocked == 1,
                            "the first apply refused and the writer in its backoff")
    if when == "with an apply in flight":
        clock.advance_blocking(10.0)  # the backoff ends: the second apply reaches the server and waits there
        await asyncio.to_thread(until, fake.in_slow_apply.is_set, "the second apply at the server")
    task.cancel()  # the node leaves (membership._leave): the reconciler's task first, then the removal
    await asyncio.gather(task, return_exceptions=True)
    removal = asyncio.ensure_future(asyncio.to_thread(reconciler.remove_entry, clock.monotonic() + 10.0))
    if when == "with an apply in flight":
        # the removal has decided (deleted at once, or waits on the clock for the write in flight); then the apply answers
        await asyncio.to_thread(until, lambda: ("delete", "done") in fake.calls or clock.blocked >= 1,
                                "the removal under way")
        fake.answer.set()
    removed = await asyncio.wait_for(removal, 5)
    removal_done = len(fake.calls)
    fake.answer.set()
    for _ in range(3):  # any backoff the writer may still be in ends: a write it had left would land now
        clock.advance_blocking(10.0)
    await asyncio.to_thread(until, returned.is_set, "the writer's loop to return")
    assert removed
    assert ("apply", "landed") not in fake.calls[removal_done:], f"a write landed after the removal: {fake.calls}"
    assert MEMBER not in fake.objects, f"the entry is back: {fake.calls}"



async def test_shutdown_removes_the_entry_of_every_joined_domain_side_by_side_within_one_timeout():
    """Two joined domains, an API server that answers each deletion only once both are asked: removed side by
    side, by one deadline (before, each domain got the whole shutdownTimeout in turn)."""
    clock = ManualClock()
    both = threading.Barrier(2, timeout=5)
    fakes = [ScriptedMembers(deletes=[both], clock=clock) for _ in range(2)]
    membership = DomainMembership(None, "ns", "n1", named="a", join_matching=False, make_reconciler=None)
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    for name, fake in zip(("a", "b"), fakes, strict=True):
        membership.joined[name] = (reconciler_on(fake, clock, domain=name)[0], done)
    started = clock.monotonic()
    await asyncio.wait_for(membership.remove_entries(10.0), 10)
    assert [f.calls for f in fakes] == [[("delete", "done")]] * 2
    assert all(t <= 10.0 for f in fakes for t in f.timeouts) and clock.monotonic() - started <= 10.0


def test_a_removal_against_a_hung_api_server_ends_by_its_deadline_not_a_request_timeout_later():
    clock = ManualClock()
    fake = ScriptedMembers(deletes=["hang", "hang"], clock=clock)
    writer = MemberWriter(client.ApiClient(), "ns", "train", custom_api=fake, clock=clock, rng=random.Random(7))
    started = clock.monotonic()
    assert writer.remove("n1", deadline=started + 3.0) is False
    assert clock.monotonic() - started <= 3.0, f"the removal took {clock.monotonic() - started:.1f}s of a 3s bound"
    assert fake.timeouts == [3.0]


def test_a_removal_the_api_server_fails_is_tried_again_until_it_lands_within_the_deadline():
    clock = ManualClock()
    fake = ScriptedMembers(deletes=["500", "500"], clock=clock)
    writer = MemberWriter(client.ApiClient(), "ns", "train", custom_api=fake, clock=clock, rng=random.Random(7))
    fake.objects[MEMBER] = {}
    removal = threading.Thread(target=lambda: setattr(writer, "removed", writer.remove("n1", deadline=1003.0)))
    removal.start()
    for failures in (1, 2):  # each failure backs off on the clock
        until(lambda failures=failures: len(fake.calls) == failures and clock.blocked == 1, f"the writer in its backoff #{failures}")
        clock.advance_blocking(0.5)  # past its delay (0.05 s doubling, at most 0.2 s by the second)
    removal.join(5)

    assert writer.removed is True and fake.calls == [("delete", "500"), ("delete", "500"), ("delete", "done")]
    assert MEMBER not in fake.objects and clock.monotonic() - 1000.0 <= 3.0



def test_a_write_whose_thread_starts_only_after_the_removal_makes_no_call():
    """The loop handed a write to a worker thread, then was cancelled, and the thread ran only after the removal
    (a busy pool): it must not apply."""
    clock = ManualClock()
    fake = ScriptedMembers(clock=clock)
    reconciler, _ = reconciler_on(fake, clock)
    assert reconciler.remove_entry(clock.monotonic() + 10.0)
    assert reconciler._ensure(reconciler.entry, reconciler.generation) is False
    assert fake.calls == [("delete", "done")] and MEMBER not in fake.objects


# ---- two of the mutants that survived the unit suite (issue 49) -------------------------------------------------

class RecordedBodies(ScriptedMembers):
    """Also keeps the GPUs of every apply that reached the server, in order, landed or not."""

    def __init__(self, script):
        super().__init__(script)
        self.applied: list[tuple[str, ...]] = []

    def patch_namespaced_custom_object(self, g, v, ns, plural, name, body, **kw):
        self.applied.append(tuple(body["spec"]["gpuUUIDs"]))
        return super().patch_namespaced_custom_object(g, v, ns, plural, name, body, **kw)


async def test_a_newer_event_ends_the_retry_loop_of_an_older_one_so_the_stale_entry_is_not_applied_again():
    """GPUs change while the writer retries the old entry: its next failure ends that loop (superseded), and the new
    entry is applied next, not the old one once more (the mutant that made `superseded` always False applied it)."""
    clock = ManualClock()
    fake = RecordedBodies(["500", "500"])
    reconciler, _ = reconciler_on(fake, clock)
    reconciler.set_gpus(["GPU-old"], True)
    task = asyncio.create_task(reconciler.run())
    try:
        await asyncio.to_thread(until, lambda: len(fake.applied) == 1 and clock.blocked == 1, "the first failure's backoff")
        reconciler.set_gpus(["GPU-new"], True)
        for applied in (2, 3):
            clock.advance_blocking(10.0)
            await asyncio.to_thread(until, lambda applied=applied: len(fake.applied) >= applied, f"apply #{applied}")
        await asyncio.sleep(0)
        assert fake.applied[:3] == [("GPU-old",), ("GPU-old",), ("GPU-new",)]
        assert fake.objects[MEMBER]["spec"]["gpuUUIDs"] == ["GPU-new"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(3):
            clock.advance_blocking(100.0)


async def test_a_write_that_succeeds_without_the_domain_showing_the_entry_is_not_ready():
    """"My entry is missing" is never success: the apply answered, but the domain as watched lacks the entry (the
    aggregator has not folded it, or removed it), so the domain health stays NotReady (the mutant that dropped the
    has_entry check reported Ready)."""
    clock = ManualClock()
    health = HealthRegistry(clock, ["domain"])

    class Writer:  # the writer's face, answering success while its view of the domain lacks this node
        where, namespace, name = "GPUDomain ns/train", "ns", "train"
        stats = type("Stats", (), {})()

        def __init__(self):
            self.cached = {"metadata": {"name": "train", "resourceVersion": "5"}, "status": {"nodes": []}}

        def ensure(self, entry, superseded, cancelled=None):
            return True

        def observe(self, obj):
            pass

        def needs_reapply(self, obj, entry):
            return False

    writer = Writer()
    reconciler = DomainReconciler(writer, health, node="n1", ip="10.0.0.1", peers_file=None, clock=clock)
    reconciler._watch = lambda: None
    reconciler.set_gpus(["GPU-1"], True)
    task = asyncio.create_task(reconciler.run())
    try:
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not health.get("domain").ready and health.get("domain").reason.startswith("joining")
        writer.cached = with_entry(writer.cached, reconciler.entry)  # the domain now shows it

        reconciler.trigger("resync")
        for _ in range(20):
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert health.get("domain").ready, health.get("domain")


class NoWaitClock(ManualClock):
    """Backoffs end at once (a synchronous writer test has no one to move the clock)."""

    def wait_blocking(self, event, seconds):
        return event.is_set()


def test_the_writers_warnings_name_the_entry_the_domain_the_error_and_the_attempt(caplog):
    import logging

    from gpu_agent.mechanisms.domain import aggregate as aggregate_module
    from gpu_agent.mechanisms.domain import writer as writer_module

    clock = NoWaitClock()
    members = ScriptedMembers(["500"])
    domain = ScriptedDomain([])
    domain.replace_namespaced_custom_object_status = _fail_once(domain.replace_namespaced_custom_object_status)
    with caplog.at_level(logging.WARNING, logger=aggregate_module.log._log.name), \
            caplog.at_level(logging.WARNING, logger=writer_module.log._log.name):
        assert reconciler_on(members, clock)[0].writer.ensure(Entry("n1", "", ("GPU-1",), True))
        assert DomainWriter(client.ApiClient(), "ns", "train", "fulljitter", 25.0, random.Random(7), clock,
                            custom_api=domain).ensure(Entry("n1", "", ("GPU-1",), True))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2, said
    assert said[0].startswith("domain update: failed to apply member n1 of GPUDomain ns/train: (500)")
    assert said[0].endswith("(attempt 1)")
    assert said[1] == "domain update: failed to set node n1 status Ready in GPUDomain ns/train: 500 scripted (attempt 1)"


def _fail_once(call):
    failed = []

    def once(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise client.ApiException(status=500, reason="scripted")
        return call(*args, **kwargs)
    return once


def test_the_peer_list_is_logged_at_level_3_only_and_its_count_at_level_0(caplog):
    import logging

    from gpu_agent.mechanisms.domain import reconciler as reconciler_module

    clock = ManualClock()
    reconciler, _ = reconciler_on(ScriptedMembers(), clock)
    domain = {"metadata": {"name": "train"}, "status": {"nodes": [
        {"name": "n1", "index": 0, "ip": "10.0.0.1", "status": "Ready"},
        {"name": "n2", "index": 1, "ip": "10.0.0.2", "status": "Ready"}]}}
    name = reconciler_module.log._log.name

    def logged_at(verbosity):  # what an agent run with -v <verbosity> logs (klog: V(n) is INFO - n)
        caplog.clear()
        reconciler._peer_count = -1  # the count is logged when it changes: make it a change each time
        with caplog.at_level(logging.INFO - verbosity, logger=name):
            reconciler._write_peers(domain)
        return [r.getMessage() for r in caplog.records]

    said = {verbosity: logged_at(verbosity) for verbosity in (0, 2, 3)}
    count = "domain GPUDomain ns/train has 2 peer(s)"
    assert said == {0: [count], 2: [count], 3: [count, "domain peers: 0=n1, 1=n2"]}  # no node name below -v 3
