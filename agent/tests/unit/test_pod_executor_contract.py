"""What the Pod executor (mechanisms/queues/pod_executor.py) sends the API server and says back, word for word
(issue 49): the Pod's name, the request timeout and namespace of every call, the creates tried and given up, the
messages of an attempt that fails, the Pod's default command and what the path check's dry runs carry, how a work
Pod is deleted, and the helpers that read a Pod (its GPUs, whether it is unschedulable or ever started). The API
server is test_pod_executor.py's ScriptedCore; time is a ManualClock."""

import asyncio
import hashlib
import json
from types import SimpleNamespace as NS  # noqa: N814 - short: it stands in for API objects below

import pytest

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.kube import REQUEST_TIMEOUT
from gpu_agent.mechanisms.queues.executor import AttemptNotMade
from gpu_agent.mechanisms.queues.pod_executor import (
    PodExecutor,
    fencing_refusal,
    gpus_asked,
    never_started,
    pod_name,
    refusal_text,
    unschedulable,
    work_pod_selector,
)

from .test_pod_executor import ScriptedCore


class Answered(Exception):
    """An API error as a fake of it may come: a status and a body, no reason."""

    def __init__(self, status, message=""):
        super().__init__(message)
        self.status, self.body = status, json.dumps({"message": message})


class Recording(ScriptedCore):
    """ScriptedCore that also records every call's name, positional arguments and keywords."""

    def __init__(self, phases, node_gpus):
        super().__init__(phases, node_gpus)
        self.calls = []
        self.patch_faults = []
        self.dry_bodies = []
        for name in ("create_namespaced_pod", "read_namespaced_pod", "list_node", "patch_namespaced_pod",
                     "delete_namespaced_pod"):
            setattr(self, name, self._recorded(name, getattr(self, name)))

    def _recorded(self, name, fn):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "patch_namespaced_pod" and self.patch_faults:
                raise self.patch_faults.pop(0)
            if name == "create_namespaced_pod" and kwargs.get("dry_run"):
                self.dry_bodies.append(args[1])
            return fn(*args, **kwargs)
        return call


async def inline(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def run(core, item, leader=None, *, steps=3000, **kwargs):
    """`execute` on a ManualClock, advanced by 0.5 s until it ends; (its outcome or exception, the seconds it took)."""
    clock = ManualClock()
    kwargs.setdefault("poll_seconds", 0.5)
    ex = PodExecutor(core, "work", "img", clock=clock, run_blocking=inline, **kwargs)

    async def drive():
        task = asyncio.ensure_future(ex.execute(item, leader))
        start = clock.monotonic()
        for _ in range(steps):
            if task.done():
                break
            await clock.advance(0.5)
        if not task.done():
            task.cancel()
            return None, clock.monotonic() - start
        try:
            return await task, clock.monotonic() - start
        except Exception as e:  # noqa: BLE001 - handed to the test
            return e, clock.monotonic() - start
    return asyncio.run(drive())


# --- the helpers -----------------------------------------------------------------------------------------------------

def test_a_pods_name_is_a_clean_slug_of_its_key_at_most_thirty_characters_and_a_hash_of_the_whole_key():
    def digest(key):
        return hashlib.sha256(key.encode()).hexdigest()[:10]

    assert pod_name("My Job/42") == f"gpu-work-my-job-42-{digest('My Job/42')}"
    assert pod_name("--x--") == f"gpu-work-x-{digest('--x--')}"
    assert pod_name("__a b__") == f"gpu-work-a-b-{digest('__a b__')}"
    long = "a" * 40
    assert pod_name(long) == f"gpu-work-{'a' * 30}-{digest(long)}"
    cut = "a" * 29 + "-b" + "c" * 10  # the thirty characters end with "-": stripped
    led = "-----" + "a" * 30  # the leading dashes go before the thirty are counted
    assert pod_name(led) == f"gpu-work-{'a' * 30}-{digest(led)}"
    assert pod_name(cut) == f"gpu-work-{'a' * 29}-{digest(cut)}"


def test_the_policys_refusals_are_told_by_their_words_in_the_reason_or_the_body():
    assert fencing_refusal(NS(status=403, reason="work pod fenced: created under x")) == "fenced"  # no body
    assert fencing_refusal(Answered(422, "no params found for policy binding")) == "no fence"
    assert fencing_refusal(Answered(403, "exceeded quota")) == ""
    leader = LeaderToken("agent-a", "uid-1234567", 3)
    no_fence = Answered(422, "no params found for policy binding")
    assert refusal_text(no_fence, leader, fencing_refusal(no_fence)) == (
        f"the admission policy fencing work Pods found no WorkFence, though this agent leads under {leader} (it writes "
        "its token there before its first item): no params found for policy binding")
    assert refusal_text(Answered(403, "exceeded quota"), leader, "") == "403 : exceeded quota"
    assert refusal_text(NS(status=403, reason="Forbidden", body=json.dumps({"message": "m"})), leader, "") == \
        "403 Forbidden: m"
    assert work_pod_selector("") == "gpu-agent.io/work-item=true"


def pod_of(limits=None, annotations=None, resources=True, conditions=(), statuses=()):
    containers = [NS(resources=NS(limits=limits) if resources else None)]
    return NS(metadata=NS(annotations=annotations), spec=NS(containers=containers),
              status=NS(conditions=list(conditions), container_statuses=list(statuses)))


def test_the_gpus_a_pod_asks_are_its_limits_or_with_dra_its_annotation():
    both = pod_of(limits={"nvidia.com/gpu": "2"}, annotations={"gpu-agent.io/gpus": "3"})
    assert gpus_asked(both) == 2 and gpus_asked(both, dra=True) == 3
    assert gpus_asked(pod_of(annotations=None), dra=True) == 0
    assert gpus_asked(pod_of(annotations={"gpu-agent.io/gpus": "x"}), dra=True) == 0
    assert gpus_asked(pod_of(resources=False)) == 0 and gpus_asked(pod_of(limits={"memory": "1Gi"})) == 0


def test_only_the_schedulers_unschedulable_condition_counts_and_a_waiting_container_never_started():
    assert not unschedulable(pod_of(conditions=[NS(type="Ready", status="True", reason="Unschedulable")]))
    assert not unschedulable(pod_of(conditions=[NS(type="PodScheduled", status="True", reason="Scheduled")]))
    assert unschedulable(pod_of(conditions=[NS(type="PodScheduled", status="False", reason="Unschedulable")]))
    waiting = NS(state=NS(running=None, terminated=None, waiting=NS(reason="ContainerCreating")), last_state=None)
    assert never_started(pod_of(statuses=[waiting]))
    running = NS(state=NS(running=NS(started_at="t"), terminated=None), last_state=None)
    assert not never_started(pod_of(statuses=[running]))


# --- what it sends -----------------------------------------------------------------------------------------------------

def test_every_call_names_the_namespace_and_the_pod_and_carries_the_request_timeout():
    core = Recording(["Pending", "Succeeded"], node_gpus=[8])
    outcome, _ = run(core, WorkItem(1, "job", {}, "l", 1))
    assert outcome == "executed"
    name = pod_name("job")
    assert core.calls[0][0] == "create_namespaced_pod" and core.calls[0][1][0] == "work"
    assert ("read_namespaced_pod", (name, "work"), {"_request_timeout": REQUEST_TIMEOUT}) in core.calls
    assert all(kwargs.get("_request_timeout") == REQUEST_TIMEOUT for _, _, kwargs in core.calls)
    assert ("list_node", (), {"_request_timeout": REQUEST_TIMEOUT}) in core.calls  # no selector without one
    container = core.body["spec"]["containers"][0]
    assert container["command"] == ["fake-gpu", "smi", "-L"] and container["resources"] == {
        "limits": {"nvidia.com/gpu": "1"}}  # no gpus in the payload: one


def test_a_create_without_an_answer_is_tried_three_times_then_the_attempt_is_not_made():
    from urllib3.exceptions import ReadTimeoutError

    core = Recording(["Succeeded"], node_gpus=[8])
    core.create_faults = [ReadTimeoutError(None, "/api/v1/pods", "timed out")] * 5
    error, _ = run(core, WorkItem(1, "slow", {"gpus": 1}, "l", 1))
    assert isinstance(error, AttemptNotMade) and len(core.created) == 3
    assert str(error) == f"creating pod work/{pod_name('slow')} got no answer 3 times"


def test_without_a_leader_a_fencing_refusal_is_no_reason_to_wait_and_an_items_refusal_names_the_api_servers_words():
    core = Recording(["Succeeded"], node_gpus=[8])
    core.create_faults = [Answered(403, "work pod fenced: created under leadership x")] * 4
    error, _ = run(core, WorkItem(1, "any", {"gpus": 1}, "l", 1))  # no leader: not a fencing of this agent
    assert isinstance(error, RuntimeError) and not isinstance(error, AttemptNotMade) and len(core.created) == 1
    assert str(error) == f"creating pod work/{pod_name('any')} failed: 403 : work pod fenced: created under leadership x"

    core = Recording(["Succeeded"], node_gpus=[8])
    invalid = Answered(422, "limits must be >= 0")
    invalid.reason = "Unprocessable Entity"
    core.create_faults = [invalid]
    error, _ = run(core, WorkItem(1, "bad", {"gpus": 1}, "l", 1))
    assert str(error) == f"creating pod work/{pod_name('bad')} failed: 422 Unprocessable Entity: limits must be >= 0"


def test_a_fenced_create_under_a_leader_names_the_leadership_refused():
    core = Recording(["Succeeded"], node_gpus=[8])
    core.create_faults = [Answered(403, "work pod fenced: created under leadership x")] * 4
    leader = LeaderToken("agent-a", "uid-1234567", 3)
    error, _ = run(core, WorkItem(1, "stale", {"gpus": 1}, "l", 1), leader)
    assert f"this agent's leadership ({leader}) is not the WorkFence's" in str(error)


def test_a_pod_running_past_the_timeout_fails_the_attempt_after_the_timeout_not_at_it():
    core = Recording(["Running"], node_gpus=[8])
    error, took = run(core, WorkItem(1, "long", {"gpus": 1}, "l", 1))
    assert str(error) == f"pod work/{pod_name('long')} did not finish within 600s"
    assert took == 600.5  # read at 600.0 (not past it yet), then once more


def test_a_pending_pod_that_fits_has_the_nodes_counted_every_fifteen_seconds():
    core = Recording(["Pending"], node_gpus=[8])
    run(core, WorkItem(1, "waits", {"gpus": 1}, "l", 1), steps=60)  # 30 s of the clock
    assert core.node_lists == 3  # at 0, 15 and 30 s


def test_a_pod_no_node_can_hold_names_the_count_and_a_cluster_without_nodes_holds_none():
    core = Recording(["Pending"], node_gpus=[])
    error, _ = run(core, WorkItem(1, "any", {"gpus": 1}, "l", 1))
    assert str(error) == (f"the item asks for 1 nvidia.com/gpu and no node has that many (the most on one node: 0); its "
                          f"pod work/{pod_name('any')} can never be scheduled and was deleted")


def test_the_messages_of_a_pod_that_never_started_and_of_one_deleted_by_someone_else():
    core = Recording(["Unknown"], node_gpus=[8])
    core.deleting = "2026-12-01T10:00:00Z"
    error, _ = run(core, WorkItem(1, "lost", {"gpus": 1}, "l", 1))
    assert str(error) == f"work pod work/{pod_name('lost')} was deleted before any container started; deleted, to be " \
                         "tried again"
    assert core.deleted == [pod_name("lost")]

    core = Recording(["Failed"], node_gpus=[8])
    core.reason = None
    read = core.read_namespaced_pod

    def no_message(*args, **kwargs):
        pod = read(*args, **kwargs)
        pod.status.message = None
        return pod
    core.read_namespaced_pod = no_message
    error, _ = run(core, WorkItem(1, "refused", {"gpus": 1}, "l", 1))
    assert str(error) == f"work pod work/{pod_name('refused')} failed before any container started (no reason given: " \
                         "); deleted, to be tried again"

    from kubernetes import client

    core = Recording(["Running"], node_gpus=[8])
    core.read_faults = [client.ApiException(status=404, reason="Not Found")]
    error, _ = run(core, WorkItem(1, "gone", {"gpus": 1}, "l", 1))
    assert str(error) == f"work pod work/{pod_name('gone')} was deleted by someone else (its finalizer removed) before " \
                         "it finished"


def test_a_delete_drops_the_finalizer_then_deletes_at_once_and_a_pod_already_gone_needs_no_delete():
    core = Recording(["Succeeded"], node_gpus=[8])
    ex = PodExecutor(core, "work", "img", clock=ManualClock(), run_blocking=inline)
    asyncio.run(ex._delete("p"))
    assert ("delete_namespaced_pod", ("p", "work"), {"grace_period_seconds": 0, "_request_timeout": REQUEST_TIMEOUT}) \
        in core.calls
    core = Recording(["Succeeded"], node_gpus=[8])
    core.patch_faults = [Answered(404, "not found")]
    asyncio.run(PodExecutor(core, "work", "img", clock=ManualClock(), run_blocking=inline)._delete("p"))
    assert core.deleted == []  # gone already
    core = Recording(["Succeeded"], node_gpus=[8])
    core.patch_faults = [Answered(500, "etcd")]
    asyncio.run(PodExecutor(core, "work", "img", clock=ManualClock(), run_blocking=inline)._delete("p"))
    assert core.deleted == ["p"]  # the patch failed: the delete is still sent


def test_a_long_key_is_cut_in_its_annotation_and_a_pod_without_a_release_has_no_instance_label():
    core = Recording(["Succeeded"], node_gpus=[8])
    key = "k" * 300
    run(core, WorkItem(12, key, {"gpus": 1}, "l", 1))
    meta = core.body["metadata"]
    assert meta["annotations"]["gpu-agent.io/idempotency-key"] == "k" * 250
    assert "app.kubernetes.io/instance" not in meta["labels"] and "serviceAccountName" not in core.body["spec"]


def test_the_default_poll_reads_a_pod_twice_a_second():
    core = Recording(["Running", "Running", "Running", "Running", "Succeeded"], node_gpus=[8])
    clock = ManualClock()
    ex = PodExecutor(core, "work", "img", clock=clock, run_blocking=inline)

    async def drive():
        task = asyncio.ensure_future(ex.execute(WorkItem(1, "p", {"gpus": 1}, "l", 1)))
        await clock.advance(2.0)  # read at 0, 0.5, 1.0, 1.5 and 2.0: Succeeded
        if not task.done():
            task.cancel()
            return "still running"
        return await task
    assert asyncio.run(drive()) == "executed"


# --- the path check ----------------------------------------------------------------------------------------------------

def test_the_path_checks_dry_runs_carry_a_one_gpu_pod_of_item_zero_with_a_generated_name():
    core = Recording(["Succeeded"], node_gpus=[8])
    leader = LeaderToken("agent-a", "uid", 3)
    ex = PodExecutor(core, "work", "img", clock=ManualClock(), run_blocking=inline, fencing=True)

    def admit_own(namespace, body, _request_timeout, dry_run=None):
        core.calls.append(("create_namespaced_pod", (namespace, body), {"dry_run": dry_run}))
        core.dry_bodies.append(body)
        if body["metadata"]["annotations"]["gpu-agent.io/leader"] != "agent-a":
            raise Answered(403, "work pod fenced: created under leadership x")
    core.create_namespaced_pod = admit_own
    assert asyncio.run(ex.probe(leader)) == ""
    assert [c[1][0] for c in core.calls] == ["work", "work"]
    for body in core.dry_bodies:
        meta = body["metadata"]
        assert meta["generateName"] == "gpu-work-path-check-" and "name" not in meta
        assert meta["annotations"]["gpu-agent.io/item-id"] == "0"
        assert meta["annotations"]["gpu-agent.io/idempotency-key"] == "work-path-check"
        assert body["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}


def test_the_path_checks_answers_word_for_word():
    from urllib3.exceptions import ReadTimeoutError

    leader = LeaderToken("agent-a", "uid", 3)

    def probe_with(admit, fencing=True, claims=None):
        core = Recording(["Succeeded"], node_gpus=[8])

        def create(namespace, body, _request_timeout, dry_run=None):
            verdict = admit(body["metadata"]["annotations"]["gpu-agent.io/leader"])
            if verdict is not None:
                raise verdict
        core.create_namespaced_pod = create
        ex = PodExecutor(core, "work", "img", clock=ManualClock(), run_blocking=inline, fencing=fencing, claims=claims)
        return asyncio.run(ex.probe(leader))

    assert probe_with(lambda holder: None) == (
        "fencing is not enforced: a dry-run work pod under a token that is not the WorkFence's was admitted "
        "(the ValidatingAdmissionPolicy or its binding missing, or not active yet); a deposed leader's late "
        "create could run an item twice. Reinstall the chart's policy, or set clusterAgent.workPodFencing=false")
    timeout = ReadTimeoutError(None, "/api/v1/pods", "timed out")
    assert probe_with(lambda holder: timeout) == "a dry-run create of a work pod got no answer (ReadTimeoutError)"
    assert probe_with(lambda holder: Answered(403, "exceeded quota")) == \
        "a dry-run create of a work pod under this agent's own token was refused: 403 : exceeded quota"

    class Claims:
        def __init__(self):
            self.counts = []

        async def ensure(self, gpus, api):
            self.counts.append(gpus)

        def pod_parts(self, gpus):
            return {}, {}

    claims = Claims()
    assert probe_with(lambda holder: None, fencing=False, claims=claims) == "" and claims.counts == [1]


def test_a_dry_run_refused_for_want_of_a_fence_the_policy_has_not_seen_yet_is_tried_again():
    leader = LeaderToken("agent-a", "uid", 3)
    core = Recording(["Succeeded"], node_gpus=[8])
    answers = [Answered(422, "failed to configure binding: no params found for policy binding with Deny")]

    def create(namespace, body, _request_timeout, dry_run=None):
        if answers:
            raise answers.pop(0)
    core.create_namespaced_pod = create
    clock = ManualClock()
    ex = PodExecutor(core, "work", "img", clock=clock, run_blocking=inline)

    async def drive():
        task = asyncio.ensure_future(ex.probe(leader))
        for _ in range(10):
            if task.done():
                break
            await clock.advance(0.5)
        return await task
    assert asyncio.run(drive()) == ""


def test_an_item_without_a_gpu_count_makes_and_claims_a_one_gpu_template():
    class Claims:
        def __init__(self):
            self.counts, self.device_class = [], "gpu.example.com"

        async def ensure(self, gpus, api):
            self.counts.append(gpus)

        def pod_parts(self, gpus):
            return {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": f"t-{gpus}"}]}, {}

    core, claims = Recording(["Succeeded"], node_gpus=[8]), Claims()
    outcome, _ = run(core, WorkItem(1, "job", {}, "l", 1), claims=claims)
    assert outcome == "executed" and claims.counts == [1]
    assert core.body["spec"]["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": "t-1"}]


def test_the_sweep_deletes_a_finished_items_pod_listed_after_a_running_one_and_a_failed_list_sweeps_nothing():
    core = Recording(["Succeeded"], node_gpus=[8])

    def pod(name, item_id):
        return NS(metadata=NS(name=name, annotations={"gpu-agent.io/item-id": item_id}))

    core.list_namespaced_pod = lambda namespace, label_selector, _request_timeout: NS(
        items=[pod("running", "3"), pod("done", "1")])
    states = {1: "done", 3: "leased"}

    async def item_state(item_id):
        return states[item_id]

    ex = PodExecutor(core, "work", "img", clock=ManualClock(), run_blocking=inline)
    assert asyncio.run(ex.sweep(item_state)) == 1 and core.deleted == ["done"]

    def failing(namespace, label_selector, _request_timeout):
        raise Answered(500, "etcd")
    core.list_namespaced_pod = failing
    assert asyncio.run(ex.sweep(item_state)) == 0


@pytest.mark.parametrize("release", ["", "r1"])
def test_the_sweep_lists_the_releases_work_pods(release):
    core = Recording(["Succeeded"], node_gpus=[8])
    listed = []

    def list_namespaced_pod(namespace, label_selector, _request_timeout):
        listed.append((namespace, label_selector))
        return NS(items=[])
    core.list_namespaced_pod = list_namespaced_pod
    ex = PodExecutor(core, "work", "img", release=release, clock=ManualClock(), run_blocking=inline)

    async def never(item_id):
        raise AssertionError("no pod to ask about")
    assert asyncio.run(ex.sweep(never)) == 0
    assert listed == [("work", work_pod_selector(release))]
