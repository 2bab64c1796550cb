"""The registration manager on a hand-driven clock with scripted control-plane answers."""

import asyncio
import inspect
import itertools
import logging

import pytest

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.foundations.control_plane_client import (
    MAX_REGISTERED_GPUS,
    Credential,
    Registration,
    TooLarge,
    Unauthorized,
    Unavailable,
)
from gpu_agent.foundations.gate import Gate
from gpu_agent.foundations.gpus import GPU, LOST, UNHEALTHY, Inventory
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.mechanisms.registration.manager import RegistrationManager, RegistrationSettings

UNAVAILABLE = Unavailable("POST /v1/register: 503 injected fault", 503)


def inventory(n, tag="a", broken=None):
    """`n` GPUs; those in `broken` (index -> (health, reason)) not healthy."""
    broken = broken or {}
    return Inventory(tuple(GPU(f"GPU-{tag}{i:07d}-0000-0000-0000-000000000000", "fake", 1 << 30, index=i,
                               **({"health": broken[i][0], "health_reason": broken[i][1]} if i in broken else {}))
                           for i in range(n)))


XID79 = "Xid 79 (GPU has fallen off the bus)"
XID48 = "Xid 48 (double-bit ECC error)"


class ScriptedControlPlane:
    """Answers from a script; records every call with the clock time; can hold a call in flight."""

    def __init__(self, clock, ttl=3600.0):
        self.clock = clock
        self.ttl = ttl
        self.calls = []
        self.register_script = []
        self.renew_script = []
        self.hold_register = None
        self.hold_renew = None
        self.inside = 0
        self.max_inside = 0
        self.issued = 0
        self.registered = []  # (generation, the UUIDs the agent told of) per register call
        self.counts = []  # the whole count (gpuCount) each register call gave
        self.identities = []  # (token, cluster id, holder, clique, fabric) per register call
        self.renewed = []  # the credential each renew call presented

    def _credential(self):
        self.issued += 1
        return Credential(Secret(f"credential-{self.issued:04d}-secret"), self.ttl)

    async def _enter(self, name, hold):
        self.calls.append((name, self.clock.monotonic()))
        self.inside += 1
        self.max_inside = max(self.max_inside, self.inside)
        try:
            if hold is not None:
                await hold.wait()
        finally:
            self.inside -= 1

    async def register(self, token, cluster_id, generation, inv, gpu_count=None, holder=None):
        self.registered.append((generation, [g.uuid for g in inv.gpus]))
        self.counts.append(gpu_count)
        self.identities.append((token, cluster_id, holder, inv.clique, inv.fabric))
        await self._enter("register", self.hold_register)
        outcome = self.register_script.pop(0) if self.register_script else "ok"
        if isinstance(outcome, Exception):
            raise outcome
        return Registration(f"reg-{generation}", self._credential(), 60.0)

    async def renew(self, credential):
        self.renewed.append(credential)
        await self._enter("renew", self.hold_renew)
        outcome = self.renew_script.pop(0) if self.renew_script else "ok"
        if isinstance(outcome, Exception):
            raise outcome
        return self._credential()

    def times(self, name):
        return [t - 1000.0 for n, t in self.calls if n == name]


async def inline(fn, *args):
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


class Harness:
    def __init__(self, *, rng, initial=1.0, cap=8.0, jitter=0.0, ttl=3600.0, renew=2700.0, reregister=10_000.0,
                 holder=None):
        self.clock = ManualClock(start=1000.0)
        self.cp = ScriptedControlPlane(self.clock, ttl)
        self.health = HealthRegistry(self.clock, ["gpus", "registration", "credentials", "queues"])
        self.metrics = AgentMetrics()
        self.transitions = []
        self.gate_holders = []  # the purpose of each hold of the gate, in the order it was acquired
        self.manager = RegistrationManager(
            self.cp, Secret("registration-token-xyz"),
            settings=RegistrationSettings("c1", initial, cap, jitter, reregister, renew, holder),
            clock=self.clock, rng=rng, health=self.health, metrics=self.metrics,
            gate=Gate(self.clock, observer=self._gate_event), on_readiness=self._on_ready, offload=inline)

    def _gate_event(self, event):
        if event.event == "acquired":
            self.gate_holders.append(event.purpose)

    async def _on_ready(self, ready, reason):
        self.transitions.append((self.clock.monotonic() - 1000.0, ready, reason))

    @property
    def ready(self):
        return bool(self.transitions) and self.transitions[-1][1]

    async def __aenter__(self):
        self.task = asyncio.create_task(self.manager.run())
        await self.clock.settle()
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task



@pytest.fixture
def harness(fixed_random):
    """harness(**settings): a Harness whose random source, unless one is given, has nothing to draw."""
    def make(*, rng=None, **settings):
        return Harness(rng=rng or fixed_random([]), **settings)
    return make


async def test_starts_not_ready_and_does_not_register_without_gpus(harness):
    async with harness() as h:
        await h.clock.advance(100)
        assert h.cp.calls == []
        assert h.transitions[0][1] is False
        assert "no GPUs available" in h.transitions[0][2]


async def test_failed_registrations_back_off_exponentially_to_the_cap_then_succeed(harness):
    async with harness(initial=1, cap=8, jitter=0) as h:
        h.cp.register_script = [UNAVAILABLE] * 6
        await h.manager.gpus_changed(1, inventory(4))
        await h.clock.advance(100)
        assert h.cp.times("register") == [0, 1, 3, 7, 15, 23, 31]
        assert h.ready and h.transitions[-1][0] == 31
        assert h.manager.backoff.attempt == 0
        text = h.metrics.render().decode()
        assert "gpu_agent_registration_backoff_seconds 0.0" in text  # back at 0 once registered
        assert 'gpu_agent_registration_failures_total{kind="initial",reason="unavailable"} 6.0' in text


async def test_jitter_spaces_attempts_exactly_as_drawn(harness, fixed_random):
    rng = fixed_random([0.0, 0.5, 1.0, 0.25])
    async with harness(initial=2, cap=100, jitter=0.5, rng=rng) as h:
        h.cp.register_script = [UNAVAILABLE] * 4
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(100)
        # delays: 2*(1-0), 4*(1-.25), 8*(1-.5), 16*(1-.125)
        assert h.cp.times("register") == pytest.approx([0, 2, 5, 9, 23])


async def test_initial_interval_above_cap_is_kept(harness):
    async with harness(initial=30, cap=10, jitter=0) as h:
        h.cp.register_script = [UNAVAILABLE] * 3
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(200)
        assert h.cp.times("register") == [0, 30, 60, 90]


async def test_gpu_change_resets_backoff_and_cuts_the_pending_retry_short(harness):
    async with harness(initial=1, cap=64, jitter=0) as h:
        h.cp.register_script = [UNAVAILABLE] * 5
        await h.manager.gpus_changed(1, inventory(2))
        await h.clock.advance(4)  # attempts at 0, 1, 3; next would be at 7
        assert h.cp.times("register") == [0, 1, 3]
        assert "gpu_agent_registration_backoff_seconds 4.0" in h.metrics.render().decode()
        await h.manager.gpus_changed(2, inventory(3))
        assert "gpu_agent_registration_backoff_seconds 0.0" in h.metrics.render().decode()  # reset with the backoff
        await h.clock.advance(100)
        # at 4 at once, then 1 s after (backoff back at its initial value), then 2 s after that
        assert h.cp.times("register") == [0, 1, 3, 4, 5, 7]
        assert h.manager.registered_generation == 2


async def test_success_resets_backoff(harness):
    async with harness(initial=1, cap=64, jitter=0) as h:
        h.cp.register_script = [UNAVAILABLE, UNAVAILABLE, "ok"]
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(10)
        assert h.cp.times("register") == [0, 1, 3]
        h.cp.register_script = [UNAVAILABLE, "ok"]
        await h.manager.credential_refused()  # forces a new registration at t=10
        await h.clock.advance(10)
        assert h.cp.times("register")[3:] == [10, 11]


async def test_response_for_a_stale_generation_is_discarded_and_registration_runs_again(harness):
    async with harness() as h:
        h.cp.hold_register = asyncio.Event()
        await h.manager.gpus_changed(1, inventory(2))
        await h.clock.settle()
        assert h.cp.times("register") == [0]
        await h.manager.gpus_changed(2, inventory(4, tag="b"))  # GPUs change while the call is in flight
        h.cp.hold_register.set()
        await h.clock.advance(1)
        assert len(h.cp.times("register")) == 2
        assert h.manager.registered_generation == 2
        assert 'gpu_agent_registration_discarded_total 1.0' in h.metrics.render().decode()
        assert [t[1] for t in h.transitions] == [False, True]  # never Ready on the stale answer


async def test_gpus_removed_during_registration_stays_not_ready(harness):
    async with harness() as h:
        h.cp.hold_register = asyncio.Event()
        await h.manager.gpus_changed(1, inventory(2))
        await h.clock.settle()
        await h.manager.gpus_changed(2, Inventory())
        h.cp.hold_register.set()
        await h.clock.advance(30)
        assert len(h.cp.times("register")) == 1
        assert not h.ready
        assert h.manager.registered_generation is None
        assert not h.health.get("registration").ready


async def test_renewal_and_registration_never_overlap_and_both_complete(harness):
    async with harness(ttl=100, renew=10) as h:
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(1)
        h.cp.hold_renew = asyncio.Event()
        await h.clock.advance(10)  # renewal starts at t=10 and is held in flight
        assert h.cp.times("renew") == [10]
        await h.manager.gpus_changed(2, inventory(2))  # recovery registration must wait for the gate
        await h.clock.advance(2)
        assert h.cp.times("register") == [0]
        h.cp.hold_renew.set()
        await h.clock.advance(1)
        assert h.cp.times("register") == [0, 13]
        assert h.cp.max_inside == 1
        assert h.ready and h.manager.registered_generation == 2


async def test_expired_credential_pauses_until_renewed(harness):
    async with harness(initial=1, cap=4, jitter=0, ttl=10, renew=1000) as h:
        failing = Unavailable("POST /v1/credentials/renew: 503", 503)
        h.cp.renew_script = [failing] * 5
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(9.9)
        assert h.ready
        await h.clock.advance(0.2)  # credential lifetime ends at t=10
        assert not h.ready
        assert h.transitions[-1][2] == "credential expired: queues paused until it is renewed"
        await h.clock.advance(30)
        assert h.ready  # the sixth renewal succeeded
        renewals = h.cp.times("renew")
        assert renewals[0] == 8  # at 80 % of the lifetime
        assert renewals[1:6] == [9, 11, 15, 19, 23]
        assert renewals[6] == 31  # the fresh credential is renewed at 80 % of its own lifetime


async def test_refused_renewal_registers_again(harness):
    async with harness(ttl=10, renew=5) as h:
        h.cp.renew_script = [Unauthorized("401 credential expired", 401)]
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(6)
        assert h.cp.times("renew") == [5]
        assert h.cp.times("register") == [0, 5]
        assert h.ready


# ---- only healthy GPUs count ---------------------------------------------------------------------------------

async def test_only_the_healthy_gpus_are_registered(harness):
    async with harness() as h:
        await h.manager.gpus_changed(1, inventory(4, broken={1: (LOST, XID79)}))
        await h.clock.advance(1)
        assert h.cp.registered == [(1, [f"GPU-a{i:07d}-0000-0000-0000-000000000000" for i in (0, 2, 3)])]
        assert h.ready and h.health.get("registration").ready


async def test_a_health_change_registers_the_new_healthy_set_and_a_recovery_counts_again(harness):
    async with harness() as h:
        await h.manager.gpus_changed(1, inventory(4))
        await h.clock.advance(1)
        await h.manager.gpus_changed(2, inventory(4, broken={3: (UNHEALTHY, XID48)}))
        await h.clock.advance(1)
        await h.manager.gpus_changed(3, inventory(4))
        await h.clock.advance(1)
        assert [(g, len(uuids)) for g, uuids in h.cp.registered] == [(1, 4), (2, 3), (3, 4)]
        assert h.manager.registered_generation == 3 and h.ready


async def test_none_healthy_is_like_none_at_all_and_the_reason_names_each_gpu_and_its_error(harness):
    async with harness() as h:
        await h.manager.gpus_changed(1, inventory(2))
        await h.clock.advance(1)
        assert h.ready
        await h.manager.gpus_changed(2, inventory(2, broken={0: (LOST, XID79), 1: (UNHEALTHY, XID48)}))
        await h.clock.advance(60)
        assert len(h.cp.registered) == 1, "nothing is registered while no GPU is healthy"
        assert not h.ready and not h.manager.registered
        reason = h.transitions[-1][2]
        assert reason == (f"no healthy GPU: GPU-a0000000… Lost ({XID79}), GPU-a0000001… Unhealthy ({XID48}); "
                          "registration deferred until one is healthy")
        assert h.health.get("registration").reason == reason
        await h.manager.gpus_changed(3, inventory(2, broken={0: (LOST, XID79)}))  # one recovers
        await h.clock.advance(1)
        assert h.ready and h.cp.registered[-1] == (3, ["GPU-a0000001-0000-0000-0000-000000000000"])


async def test_the_reason_stays_one_bounded_line_however_many_gpus_are_unhealthy(harness):
    async with harness() as h:
        broken = {i: (UNHEALTHY, f"Xid {i} (a reason of its own)") for i in range(64)}
        await h.manager.gpus_changed(1, inventory(64, broken=broken))
        await h.clock.advance(1)
        reason = h.health.get("registration").reason  # NotReady from the start: no transition to read it from
        assert len(reason) < 520, len(reason)
        shown = reason.count("Unhealthy (Xid")
        assert 3 <= shown < 64 and f"and {64 - shown} more GPUs not healthy" in reason
        # GPUs that share a state and a reason are counted once, not listed
        same = {i: (UNHEALTHY, "node n1: 4 nvidia.com/gpu in capacity, 0 allocatable") for i in range(4)}
        await h.manager.gpus_changed(2, inventory(4, broken=same))
        await h.clock.advance(1)
        assert h.health.get("registration").reason.startswith("no healthy GPU: 4 GPUs Unhealthy (node n1: 4 nvidia.com/gpu in capacity")


# ---- mutants that survived the unit suite (issue 49) -----------------------------------------------------------

async def test_a_registered_agent_registers_again_every_reregistration_interval_and_keeps_its_gpus(harness):
    async with harness(reregister=100.0) as h:
        await h.manager.gpus_changed(1, inventory(2))
        await h.clock.advance(350)
        assert h.cp.times("register") == [0, 100, 200, 300]  # the initial one, then one per interval
        assert [gen for gen, _ in h.cp.registered] == [1, 1, 1, 1] and h.ready


async def test_a_renewal_answered_after_the_credential_was_refused_is_discarded_and_the_new_registration_wins(harness):
    """The queue is refused (401) while a renewal is at the server: the credential is dropped and a registration
    follows the renewal through the gate. The renewal's late answer must not be installed over that (the mutant
    that turned the stale check off installed it, then the registration's)."""
    async with harness(ttl=100, renew=10) as h:
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(1)
        h.cp.hold_renew = asyncio.Event()
        await h.clock.advance(10)  # the renewal is at the server, holding the gate
        await h.manager.credential_refused()
        assert h.manager.credential is None and not h.ready
        installed = []
        install = h.manager._install
        h.manager._install = lambda credential: (installed.append(credential.token), install(credential))
        h.cp.hold_renew.set()
        await h.clock.advance(0.5)
        assert h.cp.times("register") == [0, 11]  # registered again once the renewal let go of the gate
        assert installed == [Secret("credential-0003-secret")], installed  # the registration's; the renewal's (0002) not
        assert h.manager.credential == Secret("credential-0003-secret") and h.ready



async def test_a_failed_registration_attempt_is_a_warning_naming_the_attempt_and_the_next_retry(harness, caplog):
    from gpu_agent.mechanisms.registration import manager as manager_module

    async with harness(initial=1, cap=8, jitter=0) as h:
        h.cp.register_script = [Unavailable("POST /v1/registrations: connection failed", None)]
        with caplog.at_level(logging.INFO, logger=manager_module.log._log.name):
            await h.manager.gpus_changed(1, inventory(1))
            await h.clock.advance(2)
    retries = [r for r in caplog.records if "registration attempt" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in retries] == [
        ("WARNING", "registration attempt 1 failed: POST /v1/registrations: connection failed; retrying in 1.00s")]
    assert h.ready


# ---- large clusters (issue 45) -------------------------------------------------------------------

async def test_a_cluster_over_the_limit_lists_the_first_gpus_gives_the_whole_count_and_says_so(harness):
    async with harness() as h:
        await h.manager.gpus_changed(1, inventory(20_000, broken={3: (LOST, XID79)}))
        await h.clock.settle()
        assert h.ready
        listed = h.cp.registered[-1][1]
        healthy = [g.uuid for g in h.manager.inventory.healthy]
        assert len(listed) == MAX_REGISTERED_GPUS == 16384 and listed == healthy[:16384]
        assert h.cp.counts[-1] == 19_999  # every healthy GPU counted, the lost one not
        reason = h.health.get("registration").reason
        assert reason == "registered (generation 1; 19999 GPUs, the first 16384 listed: the most one registration lists)"


async def test_a_cluster_within_the_limit_lists_every_gpu(harness):
    async with harness() as h:
        await h.manager.gpus_changed(1, inventory(MAX_REGISTERED_GPUS))
        await h.clock.settle()
        assert len(h.cp.registered[-1][1]) == 16384 and h.cp.counts[-1] == 16384
        assert h.health.get("registration").reason == "registered (generation 1)"


async def test_a_registration_refused_for_its_size_says_so_and_backs_off_to_the_cap(harness):
    refused = TooLarge("POST /v1/register: refused for its size, 16384 GPUs listed: 413 the request body of 9000000 "
                       "bytes is over this server's limit of 4194304 bytes (this request: 9000000 bytes)", 413)
    async with harness(initial=1, cap=8, jitter=0) as h:
        h.cp.register_script = [refused] * 6
        await h.manager.gpus_changed(1, inventory(20_000))
        await h.clock.advance(100)
        assert h.cp.times("register") == [0, 1, 3, 7, 15, 23, 31]  # the capped backoff, never a hot loop
        text = h.metrics.render().decode()
        assert 'gpu_agent_registration_failures_total{kind="initial",reason="too-large"} 6.0' in text
        assert h.ready
    async with harness(initial=1, cap=8, jitter=0) as h:
        h.cp.register_script = [refused] * 1000
        await h.manager.gpus_changed(1, inventory(20_000))
        # 240 s: the interval reaches its cap at the 4th retry (t=15), then 28 more capped ones. (An hour here,
        # 450 registrations of 20,000 GPUs, took 14-18 s, more than half the 30 s a test may run on a loaded host:
        # it failed `make mutate`'s clean run.)
        await h.clock.advance(240)
        times = h.cp.times("register")
        assert times[:5] == [0, 1, 3, 7, 15] and all(b - a == 8 for a, b in itertools.pairwise(times[4:])), times
        assert len(times) == 5 + (240 - 15) // 8
        reason = h.health.get("registration").reason
        assert not h.health.get("registration").ready
        assert "refused for its size, 16384 GPUs listed" in reason and "limit of 4194304 bytes" in reason, reason
        assert "next attempt in 8.0s" in reason


# ---- mutants of the registration run that survived the suite (issue 49: make mutate MODULE=registration) --------

async def test_each_health_entry_says_exactly_where_registration_stands(harness):
    """The reasons and details /healthz shows, word for word, from no GPUs through a failed attempt to Ready."""
    async with harness(initial=1, cap=8, jitter=0) as h:
        registration, credentials = h.health.get("registration"), h.health.get("credentials")
        none = "no GPUs available in cluster: registration deferred until GPUs appear"
        assert (registration.ready, registration.reason, registration.details) == (False, none,
                                                                                  {"generation": 0, "attempt": 0})
        assert (credentials.ready, credentials.reason) == (False, "no credentials installed")
        assert h.transitions == [(0, False, none)]
        h.cp.hold_register = asyncio.Event()
        h.cp.register_script = [UNAVAILABLE]
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.settle()  # the first attempt is at the control plane: no error yet, no retry planned
        waiting = "waiting for successful registration after GPU discovery (generation 1)"
        assert h.health.get("registration").reason == waiting
        h.cp.hold_register.set()
        await h.clock.settle()
        assert h.health.get("registration").reason == (
            f"{waiting}; last attempt failed: POST /v1/register: 503 injected fault; next attempt in 1.0s")
        assert h.health.get("registration").details == {"generation": 1, "attempt": 1}
        await h.clock.advance(1)  # the retry succeeds
        assert h.health.get("registration").reason == "registered (generation 1)"
        assert (h.health.get("credentials").ready, h.health.get("credentials").reason) == (True, "credential valid for 3600s")
        assert h.transitions[-1] == (1, True, "ready")


async def test_the_control_plane_is_told_the_token_the_cluster_the_holder_and_the_clique(harness):
    async with harness(holder="gpu-agent-0") as h:
        gpus = inventory(2)
        await h.manager.gpus_changed(1, Inventory(gpus.gpus, "cluster-a.7", "fabric ok"))
        await h.clock.settle()
        assert h.cp.identities == [(Secret("registration-token-xyz"), "c1", "gpu-agent-0", "cluster-a.7", "fabric ok")]
        await h.manager.gpus_changed(2, Inventory(inventory(20_000).gpus, "cluster-b.1", "fabric ok"))
        await h.clock.settle()  # over the limit: the list is cut, the clique and the fabric kept
        assert h.cp.identities[-1][3:] == ("cluster-b.1", "fabric ok") and len(h.cp.registered[-1][1]) == 16384


async def test_a_renewal_presents_the_installed_credential_and_counts_its_failures(harness):
    async with harness(initial=1, cap=8, jitter=0, ttl=100, renew=10) as h:
        h.cp.renew_script = [Unavailable("POST /v1/credentials/renew: 503", 503)]
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(12)
        assert h.cp.renewed == [Secret("credential-0001-secret"), Secret("credential-0001-secret")]
        assert h.cp.times("renew") == [10, 11]
        text = h.metrics.render().decode()
        assert 'gpu_agent_credential_renewal_failures_total{reason="unavailable"} 1.0' in text


async def test_renewal_retries_draw_their_jitter_from_the_injected_random_source(harness, fixed_random):
    rng = fixed_random([0.5, 1.0])
    async with harness(initial=2, cap=100, jitter=0.5, ttl=100, renew=5, rng=rng) as h:
        h.cp.renew_script = [Unavailable("POST /v1/credentials/renew: 503", 503)] * 2
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(10)
        # delays: 2*(1-.5*.5), 4*(1-.5*1.0)
        assert h.cp.times("renew") == pytest.approx([5, 6.5, 8.5])
        assert rng.values == []


async def test_the_current_credential_is_handed_out_only_while_valid(harness):
    async with harness(ttl=10, renew=1000) as h:
        h.cp.renew_script = [Unavailable("POST /v1/credentials/renew: 503", 503)] * 10
        assert h.manager.current_credential() is None
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(9.9)
        assert h.manager.current_credential() == Secret("credential-0001-secret")
        await h.clock.advance(0.2)
        assert h.manager.credential is not None and h.manager.current_credential() is None


async def test_each_kind_of_registration_is_counted_and_holds_the_gate_under_its_own_name(harness):
    async with harness(ttl=100, renew=10, reregister=30) as h:
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(15)  # registered at 0, renewed at 10
        await h.manager.credential_refused()  # registers again at once: a recovery
        await h.clock.advance(20)  # the fresh credential renewed at 25, the periodic registration at 30
        assert h.cp.times("register") == [0, 15, 30] and h.cp.times("renew") == [10, 25]
        assert h.gate_holders == ["initial", "renew", "recovery", "renew", "periodic"]
        text = h.metrics.render().decode()
        for kind in ("initial", "recovery", "periodic"):
            assert f'gpu_agent_registration_attempts_total{{kind="{kind}"}} 1.0' in text


async def test_a_registration_token_refused_backs_off_before_the_next_attempt(harness):
    async with harness(initial=1, cap=8, jitter=0) as h:
        h.cp.register_script = [Unauthorized("POST /v1/register: 401 token refused", 401)]
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(5)
        assert h.cp.times("register") == [0, 1]  # after the backoff's first delay, not at once
        assert h.ready


async def test_periodic_registration_goes_on_after_a_tick_that_found_the_agent_unregistered(harness):
    async with harness(initial=60, cap=60, jitter=0, reregister=100) as h:
        h.cp.register_script = [UNAVAILABLE, UNAVAILABLE]  # registered only at 120: the tick at 100 finds nothing
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(350)
        assert h.cp.times("register") == [0, 60, 120, 200, 300]


async def test_a_registration_waiting_at_the_gate_while_the_gpus_leave_registers_nothing(harness):
    async with harness(ttl=100, renew=10) as h:
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(1)
        h.cp.hold_renew = asyncio.Event()
        await h.clock.advance(10)  # the renewal holds the gate
        await h.manager.gpus_changed(2, inventory(2))  # recovery waits at the gate...
        await h.clock.settle()
        await h.manager.gpus_changed(3, Inventory())  # ...while the GPUs leave
        h.cp.hold_renew.set()
        await h.clock.advance(30)
        assert h.cp.times("register") == [0] and h.cp.registered == [(1, [inventory(1).gpus[0].uuid])]


async def test_a_recovery_waiting_at_the_gate_is_skipped_when_a_periodic_registration_restored_the_registration(harness):
    async with harness(reregister=100) as h:
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(1)
        h.cp.hold_register = asyncio.Event()
        await h.clock.advance(100)  # the periodic registration is at the control plane, holding the gate
        await h.manager.credential_refused()  # recovery wants to register again and waits at the gate
        await h.clock.settle()
        h.cp.hold_register.set()  # the periodic one answers: registered again, same generation
        await h.clock.advance(50)
        assert h.cp.times("register") == [0, 100] and h.ready
        assert h.gate_holders == ["initial", "periodic", "recovery"]  # recovery held it, found it done, called nothing
