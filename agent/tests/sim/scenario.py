"""One seeded run: agents, faults, work, then the invariants, checked against the fakes' histories.

A run has two phases. For FAULT_SECONDS the world draws faults (each seed picks its own levels):
slow, lost and duplicated requests and answers, partitions of one agent from the API server, the
control plane or both, a process paused past its lease and resumed, killed and restarted, shut
down gracefully, kubelet refusals, containers that fail, Pods deleted by hand, credentials
refused, poison payloads. Then the world heals and runs until every item has settled or
SETTLE_BOUND seconds have passed.

The invariants (see `check`) read the API server's history (Pods created, started, ended; the
Lease's writes) and the control plane's store, never an agent's journal.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Any

from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.mechanisms.leadership.elector import ElectionSettings, LeaderElector
from gpu_agent.mechanisms.queues.consumer import QueueConsumer
from gpu_agent.mechanisms.queues.pod_executor import PodExecutor
from tests.sim.world import FakeCore, FakeLease, Proc, SimulationStuck, SimWorkFence, VirtualTimeLoop, World

FAULT_SECONDS = 150.0
# After the heal every item is done or failed within SETTLE_BASE + SETTLE_PER_ITEM per item not yet
# settled at the heal: the bound holds with one item at a time (a seed may draw max_in_flight 1), the
# longest work is 45 s, and a poison item's five attempts take about 15 s of backoff.
SETTLE_BASE = 120.0
SETTLE_PER_ITEM = 60.0
SAMPLE_EVERY = 0.25
SETTINGS = ElectionSettings()  # the chart's: 15 s lease, 10 s renew deadline, 2 s retry
LEASE_SECONDS = 30.0
POLL = 1.0
MAX_NODE_GPUS = 4


class SimAgent:
    """A cluster agent's work path: the real elector, consumer, Pod executor and WorkFence writer, wired as
    roles/cluster_agent.py wires them (leading opens the queues under a new term with the Lease's
    token, which the consumer writes into the WorkFence and proves with dry runs before its first
    lease; a refused credential closes them until it is registered again)."""

    def __init__(self, world: World, name: str, metrics: AgentMetrics, max_in_flight: int = 1) -> None:
        self.world, self.name, self.metrics = world, name, metrics
        self.max_in_flight = max_in_flight
        self.proc: Proc | None = None
        self.elector: LeaderElector | None = None
        self.consumer: QueueConsumer | None = None
        self.incarnations = 0

    def start(self) -> None:
        """Start a new process for this agent, unless one runs: a Pod runs one agent process at a time (its
        name, the identity, is never shared), and overlapping faults may both try to bring it back."""
        if self.up:
            return
        w = self.world
        self.incarnations += 1
        proc = self.proc = Proc(self.name)
        clock = proc.clock

        async def run_blocking(fn: Any, *args: Any, **kwargs: Any) -> Any:
            return await w.net.call(proc, fn, *args, **kwargs)

        # The chart's policy expected (w.api.fencing): the probe checks that it refuses a token never the fence's.
        executor = PodExecutor(FakeCore(w.api), "work", "img", release="sim", clock=clock, run_blocking=run_blocking,
                               fencing=w.api.fencing)
        fence = SimWorkFence(w.api)
        self.registered, self.leading = True, False
        elector = self.elector = LeaderElector(
            FakeLease(w.api), identity=self.name, settings=SETTINGS, clock=clock, rng=random.Random(w.rng.random()),
            on_started_leading=self._started_leading, on_stopped_leading=self._stopped_leading,
            on_new_leader=self._new_leader, run_blocking=run_blocking)

        async def check_path(leader: LeaderToken | None) -> str:
            """roles/cluster_agent.py's _check_work_path: the token written into the WorkFence, then the dry runs."""
            if leader is not None:
                try:
                    await fence.publish(leader, lambda: elector.holds_lease() and elector.token == leader, run_blocking)
                except Exception as e:  # noqa: BLE001 - as the agent does: the path's problem
                    return f"the fencing token could not be written: {e}"
            return await executor.probe(leader)

        consumer = self.consumer = QueueConsumer(
            w.control_plane, lambda: Secret("sim-credential-0123456789"), executor, clock=clock,
            health=HealthRegistry(clock, ["queues"]), metrics=self.metrics, lease_seconds=LEASE_SECONDS,
            poll_interval=POLL, on_refused=self._refused, long_poll=0.0, identity=self.name, run_blocking=run_blocking,
            still_leading=elector.holds_lease, max_in_flight=self.max_in_flight,  # as roles/cluster_agent.py wires it
            check_path=check_path)

        async def consume() -> None:
            await consumer.set_gpus(sum(w.api.node_gpus))  # the inventory's first event, in the agent
            await consumer.run()
        proc.spawn(elector.run(), "elector")
        proc.spawn(consume(), "consumer")
        w.note(f"{self.name}: started (incarnation {self.incarnations})")

    async def _open(self, reason: str) -> None:
        assert self.consumer is not None
        await self.consumer.set_open(self.leading and self.registered, reason, standby=self.registered and not self.leading)

    # The elector's callbacks, as roles/cluster_agent.py takes them.
    async def _started_leading(self) -> None:
        assert self.consumer is not None and self.elector is not None
        self.consumer.new_term(self.elector.token)
        await self._leadership(True, f"leader: {self.name}")

    async def _stopped_leading(self, why: str) -> None:
        await self._leadership(False, f"standby: lost the lease ({why})")

    async def _new_leader(self, identity: str) -> None:
        await self._leadership(False, f"standby: the leader is {identity or '(nobody yet)'}")

    async def _leadership(self, leading: bool, reason: str) -> None:
        self.leading = leading
        self.world.note(f"{self.name}: {reason}")
        await self._open(reason)

    async def _refused(self) -> None:
        """The control plane refused the credential: register again (a moment), then reopen."""
        assert self.proc is not None
        if not self.registered:
            return
        self.registered = False
        await self._open("credentials refused: registering again")

        async def register_again() -> None:
            assert self.proc is not None
            while self.world.control_plane.refuse_until > self.world.now:
                await self.proc.clock.sleep(1.0)
            self.registered = True
            await self._open("registered again")
        self.proc.spawn(register_again(), "registration")

    def kill(self) -> None:
        if self.proc is not None and self.proc.alive:
            self.world.note(f"{self.name}: killed")
            self.proc.kill()

    async def shut_down(self) -> None:
        """SIGTERM: pause the queues, then stop (the elector releases the Lease), as ClusterAgent.run does."""
        proc = self.proc
        if proc is None or not proc.alive:
            return
        self.world.note(f"{self.name}: shutting down")
        assert self.consumer is not None
        await self.consumer.set_open(False, "shutting down")
        tasks = list(proc.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        proc.alive = False

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.alive

    def believes_it_leads(self) -> bool:
        return self.up and self.elector is not None and self.elector.leading


@dataclass
class Outcome:
    seed: int
    violations: list[str] = field(default_factory=list)
    items: int = 0
    poison: int = 0
    pods_created: int = 0
    refused_creates: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    max_in_flight: int = 1  # the setting this seed drew
    most_in_flight: int = 0  # the most items one agent had in flight at a sample
    virtual_seconds: float = 0.0
    trace: list[tuple[float, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


class Run:
    def __init__(self, seed: int, fencing: bool = True) -> None:
        self.world = World(seed)
        self.fencing = fencing
        self.outcome = Outcome(seed)
        self.metrics = AgentMetrics()  # shared by the run's agents: nothing here reads it
        # Items in flight per agent, drawn per seed from its own source (the world's draws stay as they were).
        self.max_in_flight = self.outcome.max_in_flight = random.Random(seed * 7919 + 25).randint(1, 4)
        self.agents = [SimAgent(self.world, f"agent-{n}", self.metrics, self.max_in_flight)
                       for n in range(self.world.rng.choice((2, 2, 3)))]
        self.items: dict[str, dict[str, Any]] = {}  # key -> payload
        self.bound = 0.0

    # world events ---------------------------------------------------------------------------------
    def count(self, kind: str) -> None:
        self.outcome.faults[kind] = self.outcome.faults.get(kind, 0) + 1

    def enqueue(self, n: int) -> None:
        w = self.world
        poison = w.rng.random() < 0.12
        key = f"item-{n}"
        payload = {"gpus": w.rng.choice((MAX_NODE_GPUS * 16, -1))} if poison else {"gpus": w.rng.choice((0, 1, 1, 2))}
        self.items[key] = payload
        w.control_plane.store.enqueue(key, payload)
        w.note(f"enqueued {key} {payload}")

    async def fault(self) -> None:
        w, rng = self.world, self.world.rng
        agent = rng.choice(self.agents)
        kind = rng.choice(("partition", "partition", "pause", "kill", "shutdown", "delete-pod", "credentials",
                           "cp-outage", "nothing"))
        self.count(kind)
        if kind == "partition" and agent.up:
            sides = rng.choice((("api",), ("cp",), ("api", "cp")))
            for side in sides:
                w.faults.cut.add((agent.name, side))
            w.note(f"{agent.name}: partitioned from {'+'.join(sides)}")
            await asyncio.sleep(rng.uniform(2.0, 40.0))
            for side in sides:
                w.faults.cut.discard((agent.name, side))
            w.note(f"{agent.name}: partition healed")
        elif kind == "pause" and agent.up:
            assert agent.proc is not None
            proc = agent.proc
            proc.pause()
            w.note(f"{agent.name}: paused")
            await asyncio.sleep(rng.uniform(1.0, 40.0))
            if proc.alive:
                proc.resume()
                w.note(f"{agent.name}: resumed")
        elif kind == "kill" and agent.up:
            agent.kill()
            await asyncio.sleep(rng.uniform(0.5, 20.0))
            agent.start()
        elif kind == "shutdown" and agent.up:
            await agent.shut_down()
            await asyncio.sleep(rng.uniform(0.5, 10.0))
            agent.start()
        elif kind == "delete-pod":
            live = [p for p in w.api.pods.values() if p.deletion is None]
            pod = rng.choice(live) if live else None
            if pod is not None and (pod.started or w.spend_item_fault(pod.key)):  # before it started: costs an attempt
                w.note(f"pod {pod.name} ({pod.key}, {pod.phase}) deleted by hand")
                w.api.delete_pod(pod.name)
        elif kind == "credentials":
            w.control_plane.refuse_until = w.now + rng.uniform(0.5, 5.0)
            w.note("credentials refused for a moment (a renewal in flight)")
        elif kind == "cp-outage":
            for a in self.agents:
                w.faults.cut.add((a.name, "cp"))
            w.note("control plane restarting")
            await asyncio.sleep(rng.uniform(1.0, 15.0))
            for a in self.agents:
                w.faults.cut.discard((a.name, "cp"))
            w.note("control plane back")

    async def sampler(self) -> None:
        """Leadership as the agents believe it, sampled; checked against the Lease's writes."""
        w = self.world
        while True:
            await asyncio.sleep(SAMPLE_EVERY)
            self.outcome.samples += 1
            now = w.now
            leaders = []
            for a in self.agents:
                if a.consumer is not None:
                    self.outcome.most_in_flight = max(self.outcome.most_in_flight, a.consumer.in_flight.held)
                if not a.believes_it_leads():
                    continue
                assert a.proc is not None
                if not a.proc.running.is_set() or now - a.proc.resumed_at < 0.5:
                    continue  # a stopped process believes nothing; one just resumed is catching up
                leaders.append(a.name)
                last_write = w.api.last_write_by.get(a.name)
                if last_write is None or now - last_write > SETTINGS.renew_deadline + 0.05:
                    self.violate(f"{a.name} believes it leads at {now:.2f}s, but its last write of the Lease was at "
                                 f"{last_write}: more than the renew deadline ({SETTINGS.renew_deadline:g}s) ago")
            if len(leaders) > 1:
                self.violate(f"two agents believe they lead at {now:.2f}s: {leaders}")

    def violate(self, text: str) -> None:
        if text not in self.outcome.violations and len(self.outcome.violations) < 20:
            self.outcome.violations.append(text)
            self.world.note("VIOLATION: " + text)

    async def main(self) -> None:
        w, rng = self.world, self.world.rng
        w.rates = {"admission": rng.choice((0, 0.03, 0.1)), "crash": rng.choice((0, 0.05))}
        w.faults.drop_request = rng.choice((0, 0.01, 0.05))
        w.faults.drop_answer = rng.choice((0, 0.01, 0.05))
        w.faults.duplicate = rng.choice((0, 0.02))
        w.faults.stall = rng.choice((0, 0.01, 0.05))
        w.api.fencing = self.fencing
        for a in self.agents:
            a.start()
        sampler = asyncio.ensure_future(self.sampler())
        faults: list[asyncio.Task[Any]] = []
        n, next_item, next_fault = 0, rng.uniform(0, 5), rng.uniform(5, 20)
        while w.now < FAULT_SECONDS:
            step = min(next_item, next_fault)
            await asyncio.sleep(max(0.0, step - w.now))
            if w.now >= next_item:
                self.enqueue(n)
                n += 1
                next_item = w.now + rng.expovariate(1 / 6.0)
            if w.now >= next_fault:
                faults.append(asyncio.ensure_future(self.fault()))
                next_fault = w.now + rng.expovariate(1 / 12.0)
        for t in faults:
            t.cancel()
        await asyncio.gather(*faults, return_exceptions=True)
        self.heal()
        healed_at = w.now
        backlog = sum(1 for i in self.states().values() if i["state"] not in ("done", "failed"))
        self.bound = SETTLE_BASE + SETTLE_PER_ITEM * backlog
        while w.now < healed_at + self.bound and not self.settled():  # noqa: ASYNC110 - virtual time: each sleep advances the world
            await asyncio.sleep(1.0)
        # What finished items left behind is swept by the leader within a sweep period.
        swept_by = w.now + QueueConsumer.SWEEP_SECONDS + 15.0
        while w.now < swept_by and any(self.states().get(p.key, {}).get("state") in ("done", "failed")  # noqa: ASYNC110 - as above
                                       for p in w.api.pods.values()):
            await asyncio.sleep(1.0)
        self.outcome.virtual_seconds = w.now
        self.check(healed_at)
        sampler.cancel()
        for a in self.agents:
            a.kill()

    def heal(self) -> None:
        w = self.world
        w.faults = w.faults.healed()
        w.rates = {}
        w.control_plane.refuse_until = float("-inf")
        for a in self.agents:
            if a.proc is not None and a.proc.alive and not a.proc.running.is_set():
                a.proc.resume()
            if not a.up:
                a.start()
        w.note("healed: no more faults")

    def states(self) -> dict[str, dict[str, Any]]:
        return {i["idempotencyKey"]: i for i in self.world.control_plane.store.list_items(100000)}

    def settled(self) -> bool:
        return all(i["state"] in ("done", "failed") for i in self.states().values())

    # invariants -----------------------------------------------------------------------------------
    def check(self, healed_at: float) -> None:
        w, out = self.world, self.outcome
        states = self.states()
        out.items, out.pods_created, out.refused_creates = len(self.items), len(w.api.created), len(w.api.refused)
        runs: dict[str, list[Any]] = {}
        for pod in w.api.created:
            if pod.started:
                runs.setdefault(pod.key, []).append(pod)
        for key, payload in self.items.items():
            poison = payload["gpus"] > MAX_NODE_GPUS or payload["gpus"] < 0
            out.poison += poison
            state = states[key]
            ran = runs.get(key, [])
            if len(ran) > 1:
                self.violate(f"{key} ran {len(ran)} times: Pods {[(p.uid, p.creator, round(p.created_at, 2)) for p in ran]}")
            if state["state"] == "done" and len(ran) != 1:
                self.violate(f"{key} is done at the control plane but ran {len(ran)} times")
            if poison and state["state"] != "failed":
                self.violate(f"{key} (payload {payload}) cannot run but is {state['state']}, not failed, "
                             f"{w.now - healed_at:.0f}s after the heal")
            if poison and state["state"] == "failed" and not state.get("lastError"):
                self.violate(f"{key} failed without a reason")
            if not poison and state["state"] != "done":
                self.violate(f"{key} can run but is {state['state']} ({state.get('failedAttempts')} failed attempts, "
                             f"last error {state.get('lastError')!r}) {w.now - healed_at:.0f}s after the heal")
        for pod in w.api.pods.values():
            if states.get(pod.key, {}).get("state") in ("done", "failed"):
                self.violate(f"pod {pod.name} of {pod.key} ({states[pod.key]['state']}) is left behind")
        if out.samples < FAULT_SECONDS / SAMPLE_EVERY * 0.9:
            self.violate(f"the leadership sampler took only {out.samples} samples")
        out.trace = w.trace


class _TraceHandler(logging.Handler):
    """The agents' own log lines, in the trace at their virtual time (replays only: it costs time)."""

    def __init__(self, world: World) -> None:
        super().__init__(logging.INFO)
        self.world = world

    def emit(self, record: logging.LogRecord) -> None:
        task = asyncio.current_task()
        name = task.get_name() if task else ""
        who = name.split(":")[0] if ":" in name else "world"  # asyncio's own names count tasks process-wide
        self.world.note(f"  [{who}] {record.levelname.lower()}: {record.getMessage()}")


def run_seed(seed: int, fencing: bool = True, verbose: bool = False) -> Outcome:
    """Run one seed to its end on a fresh virtual-time loop; `verbose`: the agents' log lines in the trace."""
    agent_log = logging.getLogger("gpu_agent")
    run = Run(seed, fencing)
    handler = _TraceHandler(run.world)
    agent_log.setLevel(logging.INFO if verbose else logging.CRITICAL)
    agent_log.propagate = not verbose
    if verbose:
        agent_log.addHandler(handler)
    loop = VirtualTimeLoop()
    loop.set_exception_handler(lambda _loop, _context: None)  # what a killed process left unfinished
    try:
        loop.run_until_complete(run.main())
    except SimulationStuck as e:
        run.violate(f"the simulation got stuck at {loop.time():.2f}s: {e}")
        run.outcome.trace = run.world.trace
    finally:
        for _ in range(5):  # cancelled tasks may await more on their way out
            tasks = asyncio.all_tasks(loop)
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()
        agent_log.removeHandler(handler)
        agent_log.propagate = True
    return run.outcome
