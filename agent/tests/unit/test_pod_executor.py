"""The Pod executor against a scripted API server: a Pod that asks for more GPUs than any node has
fails the attempt at once and is deleted; one that merely waits for GPUs in use keeps waiting."""

import asyncio
import json
from types import SimpleNamespace as NS  # noqa: N814 - short: it stands in for many API objects below

import pytest

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.mechanisms.queues.executor import AttemptNotMade, WorkPathRefused
from gpu_agent.mechanisms.queues.pod_executor import PodExecutor, pod_name


class ScriptedCore:
    def __init__(self, phases, node_gpus):
        self.phases = list(phases)  # one per read; the last repeats
        self.node_gpus = node_gpus
        self.created, self.deleted, self.node_lists = [], [], 0
        self.body = None
        self.reason, self.statuses = None, []
        self.create_faults, self.read_faults = [], []
        self.deleting = None
        self.patched = []
        self.node_selectors = []
        self.dry_runs, self.dry_run_faults = [], []

    def create_namespaced_pod(self, namespace, body, _request_timeout, dry_run=None):
        if dry_run:  # the executor's check of a Pod any item would make: refused while `dry_run_faults` says so
            self.dry_runs.append(body["metadata"]["annotations"].get("gpu-agent.io/leader"))
            if self.dry_run_faults:
                raise self.dry_run_faults.pop(0)
            return
        self.created.append(body["metadata"]["name"])
        self.body = body
        if self.create_faults:
            raise self.create_faults.pop(0)

    def read_namespaced_pod(self, name, namespace, _request_timeout):
        if self.read_faults:
            raise self.read_faults.pop(0)
        phase = self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]
        limits = self.body["spec"]["containers"][0]["resources"].get("limits", {})
        conditions = [NS(type="PodScheduled", status="False", reason="Unschedulable")] if phase == "Pending" else []
        return NS(status=NS(phase=phase, conditions=conditions, reason=self.reason, message="refused",
                            container_statuses=self.statuses),
                  metadata=NS(deletion_timestamp=self.deleting, finalizers=["gpu-agent.io/work-item"]),
                  spec=NS(containers=[NS(resources=NS(limits=limits))]))

    def list_node(self, _request_timeout, label_selector=None):
        self.node_lists += 1
        self.node_selectors.append(label_selector)
        # a selector is the API server's to apply: here it keeps the first node only
        gpus = self.node_gpus[:1] if label_selector else self.node_gpus
        return NS(items=[NS(status=NS(allocatable={"nvidia.com/gpu": str(n)})) for n in gpus])

    def patch_namespaced_pod(self, name, namespace, body, _request_timeout, _content_type):
        self.patched.append((name, body, _content_type))

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds, _request_timeout):
        self.deleted.append(name)


async def inline(fn, *args, **kwargs):
    return fn(*args, **kwargs)


class Executing:
    """The executor on a ManualClock, its calls made inline: `execute` runs to its end as the
    clock is advanced (every poll waits on that clock, none on wall time)."""

    def __init__(self, core, node_selector=""):
        self.clock = ManualClock()
        self.ex = PodExecutor(core, "work", "img", poll_seconds=0.5, clock=self.clock, run_blocking=inline,
                              node_selector=node_selector)

    def execute(self, item, leader=None):
        async def drive():
            task = asyncio.ensure_future(self.ex.execute(item, leader))
            for _ in range(2000):
                if task.done():
                    break
                await self.clock.advance(0.5)
            return await task
        return asyncio.run(drive())


def executor(core):
    return Executing(core)


def test_a_pod_asking_more_gpus_than_any_node_has_fails_at_once_and_is_deleted():
    core = ScriptedCore(["Pending"], node_gpus=[8, 4])
    with pytest.raises(RuntimeError) as e:
        executor(core).execute(WorkItem(1, "too-big", {"gpus": 64}, "l", 1))
    assert "asks for 64 nvidia.com/gpu" in str(e.value) and "the most on one node: 8" in str(e.value)
    assert core.deleted == [pod_name("too-big")] and core.node_lists == 1


def test_with_a_gpu_node_selector_the_pod_is_placed_on_those_nodes_and_only_their_gpus_bound_what_it_may_ask():
    core = ScriptedCore(["Pending"], node_gpus=[2, 8])
    with pytest.raises(RuntimeError) as e:
        Executing(core, node_selector="gpu-agent.io/pool=a,team=x").execute(WorkItem(1, "pooled", {"gpus": 4}, "l", 1))
    assert core.body["spec"]["nodeSelector"] == {"gpu-agent.io/pool": "a", "team": "x"}
    assert core.node_selectors == ["gpu-agent.io/pool=a,team=x"]
    assert "the most on one node: 2" in str(e.value)  # the 8-GPU node is another pool's


def test_without_a_gpu_node_selector_the_pod_has_none_and_every_node_counts():
    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    executor(core).execute(WorkItem(1, "anywhere", {"gpus": 1}, "l", 1))
    assert "nodeSelector" not in core.body["spec"]


def test_a_pod_waiting_for_gpus_in_use_keeps_waiting_until_it_runs():

    core = ScriptedCore(["Pending", "Pending", "Pending", "Running", "Succeeded"], node_gpus=[8])
    assert executor(core).execute(WorkItem(1, "fits", {"gpus": 8}, "l", 1)) == "executed"
    assert core.deleted == [] and core.node_lists == 1  # nodes looked at once, not on every poll


def test_a_pod_the_kubelet_refused_before_it_started_fails_the_attempt_and_is_deleted():
    core = ScriptedCore(["Pending", "Failed"], node_gpus=[8])
    core.reason = "UnexpectedAdmissionError"
    with pytest.raises(RuntimeError) as e:
        executor(core).execute(WorkItem(1, "refused", {"gpus": 1}, "l", 1))
    assert "failed before any container started (UnexpectedAdmissionError" in str(e.value)
    assert core.deleted == [pod_name("refused")]


def test_a_pod_whose_container_ran_and_failed_is_a_run_and_is_acknowledged():
    core = ScriptedCore(["Running", "Failed"], node_gpus=[8])
    ran = NS(state=NS(running=None, terminated=NS(started_at="2026-12-01T10:00:00Z", exit_code=1)), last_state=None)
    core.statuses = [ran]
    assert executor(core).execute(WorkItem(1, "ran", {"gpus": 1}, "l", 1)) == "executed"
    assert core.deleted == []


def test_a_create_without_an_answer_is_sent_again_and_its_own_conflict_is_the_execution():
    from kubernetes import client
    from urllib3.exceptions import ReadTimeoutError

    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    core.create_faults = [ReadTimeoutError(None, "/api/v1/pods", "timed out"), client.ApiException(status=409)]
    core.read_faults = [ReadTimeoutError(None, "/api/v1/pods", "timed out")]  # a read without an answer: read again
    assert executor(core).execute(WorkItem(1, "slow", {"gpus": 1}, "l", 1)) == "executed"
    assert core.created == [pod_name("slow")] * 2


def test_a_pod_deleted_by_someone_else_fails_the_attempt_naming_it():
    from kubernetes import client

    core = ScriptedCore(["Running"], node_gpus=[8])
    core.read_faults = [client.ApiException(status=404, reason="Not Found")]
    with pytest.raises(RuntimeError) as e:
        executor(core).execute(WorkItem(1, "gone", {"gpus": 1}, "l", 1))
    assert "was deleted by someone else" in str(e.value)


def test_the_pod_carries_the_leaders_fencing_token_and_the_finalizer_and_is_released_before_its_delete():
    from gpu_agent.foundations.fencing import LeaderToken

    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    run = executor(core)
    token = LeaderToken("agent-a", "0f1e2d3c-uid", 7)
    assert run.execute(WorkItem(1, "fenced", {"gpus": 1}, "l", 1), token) == "executed"
    meta = core.body["metadata"]
    assert meta["finalizers"] == ["gpu-agent.io/work-item"]
    assert {k: meta["annotations"][k] for k in ("gpu-agent.io/leader", "gpu-agent.io/lease-uid",
                                                "gpu-agent.io/lease-transitions")} == \
        {"gpu-agent.io/leader": "agent-a", "gpu-agent.io/lease-uid": "0f1e2d3c-uid", "gpu-agent.io/lease-transitions": "7"}
    assert token.admits(meta["annotations"]) and not LeaderToken("agent-a", "0f1e2d3c-uid", 8).admits(meta["annotations"])
    asyncio.run(run.ex.after_ack(WorkItem(1, "fenced", {"gpus": 1}, "l", 1)))
    name = pod_name("fenced")
    assert core.patched == [(name, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["gpu-agent.io/work-item"]}},
                             "application/strategic-merge-patch+json")]
    assert core.deleted == [name]


def test_a_succeeded_pod_someone_deleted_is_kept_by_its_finalizer_and_acknowledged_not_run_again():
    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    core.deleting = "2026-12-01T10:00:00Z"
    core.create_faults = [__import__("kubernetes").client.ApiException(status=409)]  # the redelivery finds it
    assert executor(core).execute(WorkItem(1, "done-before", {"gpus": 1}, "l", 2)) == "duplicate"
    assert core.deleted == []  # deleted only after the ack


def test_a_pod_deleted_before_it_started_is_released_and_the_attempt_fails():
    core = ScriptedCore(["Running"], node_gpus=[8])
    core.phases = ["Pending"]
    core.deleting = "2026-12-01T10:00:00Z"
    with pytest.raises(RuntimeError) as e:
        executor(core).execute(WorkItem(1, "deleted-early", {"gpus": 1}, "l", 1))
    assert "was deleted before any container started" in str(e.value)
    assert [p[0] for p in core.patched] == [pod_name("deleted-early")] and core.deleted == [pod_name("deleted-early")]


def test_a_create_the_admission_policy_refuses_fails_the_attempt_naming_the_fencing():
    from kubernetes import client

    from gpu_agent.foundations.fencing import LeaderToken

    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    fenced = client.ApiException(status=403, reason="Forbidden")
    fenced.body = '{"message": "admission webhook denied: work pod fenced: created under leadership agent-a"}'
    core.create_faults = [fenced] * 4  # refused, and after 3 waits
    with pytest.raises(WorkPathRefused) as e:  # not the item's fault: no attempt counted, the path proven again
        executor(core).execute(WorkItem(1, "stale", {"gpus": 1}, "l", 1), LeaderToken("agent-a", "uid", 3))
    assert "is not the WorkFence's (fenced by the admission policy)" in str(e.value) and len(core.created) == 4


def test_a_create_refused_while_the_policy_has_not_yet_seen_the_new_lease_is_tried_again():
    from kubernetes import client

    from gpu_agent.foundations.fencing import LeaderToken

    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    no_lease_yet = client.ApiException(status=422, reason="Unprocessable Entity")
    no_lease_yet.body = '{"message": "failed to configure binding: no params found for policy binding with Deny"}'
    core.create_faults = [no_lease_yet]
    assert executor(core).execute(WorkItem(1, "fresh", {"gpus": 1}, "l", 1), LeaderToken("a", "uid", 0)) == "executed"
    assert len(core.created) == 2


def test_a_create_refused_for_what_the_pod_asks_counts_an_attempt_even_under_a_leader():
    from kubernetes import client

    from gpu_agent.foundations.fencing import LeaderToken

    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    invalid = client.ApiException(status=422, reason="Unprocessable Entity")
    invalid.body = '{"message": "Pod is invalid: spec.containers[0].resources.limits: must be >= 0"}'
    core.create_faults = [invalid]
    with pytest.raises(RuntimeError) as e:
        executor(core).execute(WorkItem(1, "bad", {"gpus": -1}, "l", 1), LeaderToken("a", "uid", 0))
    assert not isinstance(e.value, AttemptNotMade) and "422" in str(e.value) and len(core.created) == 1


def test_the_sweep_deletes_the_pods_of_finished_items_and_leaves_the_others():
    core = ScriptedCore(["Succeeded"], node_gpus=[8])

    def pod(name, item_id):
        return NS(metadata=NS(name=name, annotations={"gpu-agent.io/item-id": item_id} if item_id else {}))

    listed = []

    def list_namespaced_pod(namespace, label_selector, _request_timeout):
        listed.append(label_selector)
        return NS(items=[pod("done", "1"), pod("failed", "2"), pod("running", "3"), pod("unknown", "4"),
                         pod("person's", None)])

    core.list_namespaced_pod = list_namespaced_pod
    states = {1: "done", 2: "failed", 3: "leased", 4: None}

    async def item_state(item_id):
        return states[item_id]

    run = executor(core)
    run.ex.release = "r1"
    assert asyncio.run(run.ex.sweep(item_state)) == 2
    assert listed == ["gpu-agent.io/work-item=true,app.kubernetes.io/instance=r1"]
    assert core.deleted == ["done", "failed"] and [p[0] for p in core.patched] == ["done", "failed"]


def refusal(status, message):
    from kubernetes import client

    e = client.ApiException(status=status, reason="Refused")
    e.body = json.dumps({"message": message})
    return e


@pytest.mark.parametrize("status,message", [
    (403, 'pods "x" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1'),
    (403, 'pods "x" is forbidden: error looking up service account work/default: serviceaccount "default" not found'),
    (400, 'admission webhook "deny.example.com" denied the request: no pods today'),
    (422, "pods is forbidden: ValidatingAdmissionPolicy 'deny' with binding 'deny' denied request: no pods today"),
    (500, 'Internal error occurred: failed calling webhook "w.example.com": connection refused'),
    (404, 'namespaces "work" not found'),
])
def test_a_create_refused_as_a_pod_any_item_would_make_is_a_refused_work_path_naming_the_api_servers_words(
        status, message):
    from gpu_agent.foundations.fencing import LeaderToken

    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    core.create_faults, core.dry_run_faults = [refusal(status, message)], [refusal(status, message)]
    with pytest.raises(WorkPathRefused) as e:  # no attempt counted, and the consumer proves the path before leasing
        executor(core).execute(WorkItem(1, "any", {"gpus": 1}, "l", 1), LeaderToken("a", "uid", 0))
    assert message[:60] in str(e.value) and str(status) in str(e.value) and len(core.created) == 1
    assert core.dry_runs == ["a"]  # told apart by one dry run under the same token


def test_a_create_refused_while_a_pod_any_item_would_make_is_admitted_is_the_items_doing_and_counts_an_attempt():
    """A policy that refuses only what this item asks (its command, its GPU count): the dry run of the default Pod is
    admitted, so the refusal is the item's: an attempt counted, and the item fails for good after its last one
    instead of being leased and refused forever."""
    from gpu_agent.foundations.fencing import LeaderToken

    core = ScriptedCore(["Succeeded"], node_gpus=[8])
    core.create_faults = [refusal(422, "ValidatingAdmissionPolicy 'no-sh' denied request: sh is not allowed")]
    with pytest.raises(RuntimeError) as e:
        executor(core).execute(WorkItem(1, "sh", {"gpus": 1, "command": ["sh"]}, "l", 1), LeaderToken("a", "uid", 0))
    assert not isinstance(e.value, AttemptNotMade) and "sh is not allowed" in str(e.value) and core.dry_runs == ["a"]


class DryRunCore(ScriptedCore):
    """Answers dry-run creates by the token on the Pod: `admit(annotations)` says whether the API server would."""

    def __init__(self, admit):
        super().__init__(["Succeeded"], node_gpus=[8])
        self.admit, self.dry_runs = admit, []

    def create_namespaced_pod(self, namespace, body, _request_timeout, dry_run=None):
        assert dry_run == "All" and "name" not in body["metadata"] and body["metadata"]["generateName"]
        self.dry_runs.append(body["metadata"]["annotations"].get("gpu-agent.io/leader"))
        verdict = self.admit(body["metadata"]["annotations"])
        if verdict is not True:
            raise verdict


def probe(core, leader, fencing=True):
    ex = PodExecutor(core, "work", "img", clock=ManualClock(), run_blocking=inline, fencing=fencing)
    return asyncio.run(ex.probe(leader))


def test_the_probe_proves_the_path_with_two_dry_runs_its_own_token_admitted_and_a_stale_one_fenced():
    from gpu_agent.foundations.fencing import LeaderToken

    me = LeaderToken("agent-a", "uid", 3)
    fenced = refusal(403, "ValidatingAdmissionPolicy denied request: work pod fenced: created under leadership x")
    policy = DryRunCore(lambda marks: True if marks["gpu-agent.io/leader"] == "agent-a" else fenced)
    assert probe(policy, me) == "" and policy.dry_runs == ["agent-a", "agent-a.work-path-check"]

    no_policy = DryRunCore(lambda marks: True)  # the policy missing: a stale token is admitted
    assert probe(no_policy, me).startswith("fencing is not enforced: a dry-run work pod under a token that is not")
    assert probe(DryRunCore(lambda marks: True), me, fencing=False) == ""  # no policy expected: one dry run

    quota = refusal(403, "pods is forbidden: exceeded quota: gpus")
    assert "under this agent's own token was refused: 403 Refused: pods is forbidden: exceeded quota: gpus" in \
        probe(DryRunCore(lambda marks: quota), me)
    other = DryRunCore(lambda marks: True if marks["gpu-agent.io/leader"] == "agent-a" else quota)
    assert "refused, but not by the fencing policy: 403" in probe(other, me)


def test_the_probe_waits_out_the_policys_copy_of_a_fence_just_written_and_a_claim_template_error_is_a_problem():
    from gpu_agent.foundations.fencing import LeaderToken

    me = LeaderToken("agent-a", "uid", 3)
    lag = [refusal(403, "work pod fenced: created under leadership agent-a; the fence now names agent-b")]
    fenced = refusal(403, "work pod fenced: created under leadership x")

    def admit(marks):
        if marks["gpu-agent.io/leader"] != "agent-a":
            return fenced
        return lag.pop(0) if lag else True

    core = DryRunCore(admit)
    ex = PodExecutor(core, "work", "img", clock=ManualClock(), run_blocking=inline, fencing=True)

    async def drive():
        task = asyncio.ensure_future(ex.probe(me))
        for _ in range(20):
            if task.done():
                break
            await ex.clock.advance(0.5)
        return await task

    assert asyncio.run(drive()) == "" and core.dry_runs == ["agent-a", "agent-a", "agent-a.work-path-check"]

    class Claims:
        async def ensure(self, gpus, api):
            raise RuntimeError("creating ResourceClaimTemplate work/x: 503 Service Unavailable")

    ex = PodExecutor(DryRunCore(lambda marks: True), "work", "img", clock=ManualClock(), run_blocking=inline,
                     claims=Claims())
    assert "could not be made: creating ResourceClaimTemplate work/x: 503" in asyncio.run(ex.probe(me))
