"""The "aggregate" write strategy: no two writers ever contend on one object.

Each node agent applies its own GPUDomainMember (server-side apply, one call, no read, no
conflict: it is the object's only writer). One aggregator per domain watches the members and
folds them into the GPUDomain's status: existing indices kept, new members given the lowest
free index, departed members removed. A node whose member left lately (its node agent's Pod deleted, the
member with it, and a new Pod's member back) gets the index it had again, if nobody took it: the aggregator
holds a departed node's index for REJOIN_GRACE, and newcomers meanwhile take others. A workload's rank is its
node's index (GPU_AGENT_DOMAIN_NODE_INDEX, set at prepare), and the node agents of a whole domain restarted
at once (the IMEX daemons force-deleted) would otherwise come back numbered in the order they happened to
rejoin. It writes a change a reader waits for at once (the domain
turns Ready or loses readiness) and coalesces the rest until the arrivals pause or a bound passes
(WriteSchedule), so the shared object takes about one write per state change instead of one per
node (and its retries). As the only status writer it meets a conflict only if some
other client (the cleanup hook, a user) wrote meanwhile: then it reads again and retries.

This is what reaches the ideal N / R where optimistic concurrency alone cannot (see
make bench-domain): N writers on one object cost the API server a full decode and admission
per conflicting attempt.

Members tell the truth when their agent dies: each is owned by its node agent's Pod (the
garbage collector deletes it with the Pod) and carries a heartbeat the agent renews every
`heartbeatIntervalSeconds`. The aggregator marks a member NotReady once it has not seen the
heartbeat change for its TTL (default three intervals), measured on its own monotonic clock
from the moment it saw the last change (never by comparing the written timestamp with its own
clock, so node clock skew does not matter), and the domain NotReady when fewer than expected
members are Ready. A hung (SIGSTOPped) or killed agent therefore turns its member NotReady within
the TTL, and a returning one Ready at its next heartbeat.

Members are also checked against what their node agent cannot write (trust.py, the cluster agent's folder):
a member whose address or node is not its owner Pod's, whose owner Pod is gone, or that lists more GPUs than its
Node reports, is folded NotReady with the reason, and its address is left out of the status.
"""

from __future__ import annotations

import collections
import datetime as dt
import functools
import math
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from kubernetes import client

from gpu_agent.foundations.backoff import Backoff
from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.events import EventRecorder, reference
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import core_v1_list, items_of, list_then_watch
from gpu_agent.foundations.threads import StopEvent, start_thread
from gpu_agent.mechanisms.domain.conditions import find, generation_of, timestamp
from gpu_agent.mechanisms.domain.entries import (
    DomainClique,
    DomainNode,
    DomainStatus,
    Entry,
    GPUDomain,
    MemberSpec,
    has_entry,
    in_clique,
    lowest_free_index,
    nodes_of,
    overall,
    spec_of,
    status_entry,
    status_of,
    with_ready_condition,
)
from gpu_agent.mechanisms.domain.members import DOMAIN_LABEL, MemberIndex, legacy_member_name, member_name
from gpu_agent.mechanisms.domain.transitions import transitions
from gpu_agent.mechanisms.domain.trust import MemberTrust, NodeAgentPods
from gpu_agent.mechanisms.domain.writer import (
    GROUP,
    PLURAL,
    VERSION,
    DomainView,
    DomainWriter,
    WriteStats,
    back_off,
    request_timeout,
)

log = get_logger(__name__)
MEMBERS = "gpudomainmembers"
PREFERRED_VERSION = "v1beta1"  # the CRDs' preferred served version (the highest: kube orders versions by stability)
FIELD_MANAGER = "gpu-agent-node"
MAX_MESSAGE = 1024  # a member's spec.message, as the CRD bounds it: a longer one is cut, never refused
# The open connections the folder's API client keeps: its watches, and a burst of domains turning Ready
# written at once. A smaller pool closes each connection it cannot keep and the next write pays a new TLS
# handshake: measured with make bench-domain (64 domains) at 10 (the client's default on 2 CPUs), about
# half of the folder's time in its status writes.
FOLDER_CONNECTIONS = 128
# Seconds a departed member's index stays held for its node (fold's `rejoining`): the kubelet's longest crash-loop
# back-off, so that a node agent that crashes, or whose Pod is deleted, and comes back finds its index. Held in the
# aggregator's memory: a cluster agent that restarts (or hands over) meanwhile holds none.
REJOIN_GRACE = 300.0


class MemberWriter(DomainView):
    """A node agent's side: its own member object, applied in one call. It offers the same
    face as DomainWriter (ensure, remove, observe, cached), so the reconciler needs no mode."""

    # Every status the aggregator writes holds each member it has seen; an entry still missing from
    # one this long after our apply means something removed it, and the member is applied again.
    REAPPLY_AFTER = 5.0

    def __init__(self, api: client.ApiClient, namespace: str, domain: str, *, rng: random.Random | None = None,
                 clock: Clock | None = None, owner: dict[str, str] | None = None, heartbeat_interval: float = 0.0,
                 custom_api: client.CustomObjectsApi | None = None) -> None:
        """`custom_api`: the API client's unless handed one (unit tests hand in fakes)."""
        self.custom = custom_api if custom_api is not None else client.CustomObjectsApi(api)
        self.legacy_done = False  # 0.1's member of this node (legacy name) seen gone or deleted
        self.applies = 0  # successful applies of this writer
        self.owner = owner  # {"name", "uid"} of this agent's Pod: the member is deleted with it
        self.heartbeat_interval = heartbeat_interval  # 0: no heartbeat
        self.api = api
        self.namespace = namespace
        self.domain = domain
        self.name = domain
        self.stats = WriteStats()
        self.cached: GPUDomain | None = None
        self.applied_at = float("-inf")
        self.rng = rng or random.Random()
        self.clock = clock or SystemClock()

    def needs_reapply(self, obj: GPUDomain, entry: Entry) -> bool:
        return not has_entry(obj, entry) and self.clock.monotonic() - self.applied_at > self.REAPPLY_AFTER

    def ensure(self, entry: Entry, superseded: Any = lambda: False, deadline: float | None = None,
               cancelled: threading.Event | None = None) -> bool:
        """Apply this node's member until it lands; False when superseded, cancelled (it ends the backoff: no
        attempt follows once set) or past `deadline` (writer.py)."""
        backoff = Backoff(0.05, 5.0, 2.0, 0.5, self.rng)
        attempt = 0
        while True:
            attempt += 1

            try:
                self._apply(entry, deadline)
                self.applied_at = self.clock.monotonic()
                self.applies += 1
                # Not at the join: a forming domain waits on that first apply, and the lookup doubled its
                # calls. The next apply (the first heartbeat, or a resync) looks; so does removal.
                if not self.legacy_done and self.applies > 1:
                    self.legacy_done = self._remove_legacy(entry.name)
                return True
            except Exception as e:  # noqa: BLE001 - API trouble: back off and try again
                self.stats.errors += 1
                delay = backoff.next_delay()
                log.warning("domain update: failed to apply member %s of %s: %s (attempt %d)",
                            entry.name, self.where, e, attempt)
            if superseded() or (deadline is not None and self.clock.monotonic() + delay > deadline):
                return False
            if not back_off(self.clock, delay, cancelled):
                return False

    def _apply(self, entry: Entry, deadline: float | None = None) -> None:
        body: dict[str, Any] = {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomainMember",
            "metadata": {"name": member_name(self.domain, entry.name), "labels": {DOMAIN_LABEL: self.domain}},
            "spec": {"domain": self.domain, "node": entry.name, "ip": entry.ip, "ready": entry.ready,
                     "gpuUUIDs": list(entry.gpu_uuids)}}
        if entry.clique:  # left out when none: server-side apply then removes a clique the node no longer has
            body["spec"]["clique"] = entry.clique
        if entry.healthy_gpus is not None:
            body["spec"]["healthyGPUs"] = entry.healthy_gpus
        if entry.message:  # left out when all is well: server-side apply then removes the last one
            body["spec"]["message"] = entry.message[:MAX_MESSAGE]
        if self.owner:
            body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": self.owner["name"],
                                                    "uid": self.owner["uid"]}]
        if self.heartbeat_interval > 0:
            body["spec"]["heartbeat"] = dt.datetime.fromtimestamp(self.clock.wall(), dt.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ")
            body["spec"]["heartbeatIntervalSeconds"] = self.heartbeat_interval
        self.stats.calls += 1
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, MEMBERS, body["metadata"]["name"], body,
                                                   field_manager=FIELD_MANAGER, force=True,
                                                   _content_type="application/apply-patch+yaml",
                                                   _request_timeout=request_timeout(self.clock, deadline))
        self.stats.writes += 1

    def _remove_legacy(self, node: str, deadline: float | None = None) -> bool:
        """After an upgrade from 0.1: delete this node's member under 0.1's name, if it is this node's member of
        this domain (that name is not unique: another pair's may have it). True once it is gone or not ours."""
        name = legacy_member_name(self.domain, node)
        self.stats.calls += 1
        try:
            old = cast("dict[str, Any]", self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, MEMBERS, name, _request_timeout=request_timeout(self.clock, deadline)))
            spec = old.get("spec") or {}
            if (spec.get("node"), spec.get("domain")) != (node, self.domain):
                return True
            # Preconditions: only the object read, not one another writer put under the name since.
            self.stats.calls += 1
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, MEMBERS, name, _request_timeout=request_timeout(self.clock, deadline),
                body=client.V1DeleteOptions(preconditions=client.V1Preconditions(
                    uid=old["metadata"]["uid"], resource_version=old["metadata"]["resourceVersion"])))
            log.info("deleted %s, this node's member of %s under its 0.1 name", name, self.where)
        except client.ApiException as e:
            if e.status not in (404, 409):  # gone, or changed since the read: the next apply looks again
                log.warning("deleting %s, this node's 0.1 member of %s, failed: %s", name, self.where, e.reason)
            return bool(e.status == 404)
        except Exception as e:  # noqa: BLE001 - API trouble: the next apply looks again
            log.warning("deleting %s, this node's 0.1 member of %s, failed: %s", name, self.where, e)
            return False
        return True

    def remove(self, node: str, deadline: float | None = None) -> bool:
        """Delete this node's member; without a deadline one try, with one tried again after a failure (API
        trouble) until it is gone or the deadline comes, each call's timeout cut to what is left of it."""
        backoff = Backoff(0.05, 2.0, 2.0, 0.5, self.rng)
        attempt = 0
        while True:
            attempt += 1
            self.stats.calls += 1
            try:
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, MEMBERS,
                                                            member_name(self.domain, node),
                                                            _request_timeout=request_timeout(self.clock, deadline))
                break
            except client.ApiException as e:
                if e.status == 404:
                    break
                why: object = e.reason
            except Exception as e:  # noqa: BLE001 - connection trouble, a timeout: the same retry
                why = e
            self.stats.errors += 1
            delay = backoff.next_delay()
            log.warning("removing member %s of %s failed: %s (attempt %d)", node, self.where, why, attempt)
            if deadline is None or self.clock.monotonic() + delay > deadline:
                return False
            self.clock.sleep_blocking(delay)
        if not self.legacy_done:  # a 0.1 member this agent never got to delete would keep the node in the domain
            self.legacy_done = self._remove_legacy(node, deadline)
        return self.legacy_done



def _same_but_heartbeat(before: dict[str, Any] | None, after: dict[str, Any]) -> bool:
    """Whether a member's new version differs from the one before only in its heartbeat (a renewal, no arrival)."""
    def rest(obj: dict[str, Any]) -> Any:
        spec = obj.get("spec") or {}
        return {k: v for k, v in spec.items() if k != "heartbeat"} if isinstance(spec, dict) else spec
    return before is not None and rest(before) == rest(after)


def _clique_of(spec: MemberSpec) -> str:
    return str(spec.get("clique") or "")


def fold(obj: GPUDomain, members: dict[str, MemberSpec], silent: frozenset[str] = frozenset(), *,
         now: str | None = None, rejoining: Mapping[str, tuple[str, int]] | None = None,
         doubted: Mapping[str, str] | None = None) -> GPUDomain | None:
    """The domain object with its status rebuilt from `members` (node -> member spec), or None if unchanged.

    The status carries the Ready condition (conditions.py) and the generation it answers; `now` is the
    lastTransitionTime of a condition whose status moves (the caller's wall clock).

    Members in `silent` (heartbeat not renewed within its TTL) are NotReady whatever they say; so are those
    `doubted` (node -> why: trust.py), whose address is withheld too (it reaches every peer list). Indices
    are per clique: a member keeps its index while it stays in its clique, a new one (or one that
    moved to another clique) gets the lowest free index of its clique, and a clique that already holds
    `spec.maxNodesPerClique` nodes admits no more: the rest wait, named in `status.cliques`, until a
    place frees. `rejoining` (node -> (clique, index) of members that left lately): such a node, back in the same
    clique, gets that index again if nobody uses it, and newcomers take other indices meanwhile."""
    doubted = {n: why for n, why in (doubted or {}).items() if n in members}
    members = {n: ({**m, "ready": False, "ip": ""} if n in doubted else {**m, "ready": False} if n in silent else m)
               for n, m in members.items()}
    domain_spec = spec_of(obj)
    limit = domain_spec.get("maxNodesPerClique")
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
    old_nodes = nodes_of(obj)
    kept = [n for n in old_nodes if n.get("name") in members and (n.get("clique") or "") == _clique_of(members[n["name"]])]
    nodes: list[DomainNode] = []
    for n in kept:
        spec = members[n["name"]]
        nodes.append(status_entry(n["name"], spec.get("ip", ""), n["index"], bool(spec.get("ready")),
                                  spec.get("gpuUUIDs") or [], _clique_of(spec)))
    waiting: dict[str, list[str]] = {}
    for name in sorted(set(members) - {n["name"] for n in kept}):
        spec = members[name]
        peers = in_clique(nodes, _clique_of(spec))
        if limit is not None and len(peers) >= limit:
            waiting.setdefault(_clique_of(spec), []).append(name)
            continue
        held = {node: index for node, (clique, index) in (rejoining or {}).items() if clique == _clique_of(spec)}
        nodes.append(status_entry(name, spec.get("ip", ""), lowest_free_index(peers, name, held),
                                  bool(spec.get("ready")), spec.get("gpuUUIDs") or [], _clique_of(spec)))
    nodes.sort(key=lambda n: (n.get("clique") or "", n["index"]))
    expected = int(domain_spec.get("expectedNodes") or 0)
    status, ready = overall(nodes, expected)
    new_status: DomainStatus = {**status_of(obj), "nodes": nodes, "status": status, "readyNodes": ready}
    cliques = cliques_of(nodes, waiting)
    if cliques:
        new_status["cliques"] = cliques
    else:
        new_status.pop("cliques", None)
    new_status = with_ready_condition(obj, new_status, now, waiting=waiting, silent=silent & set(members), limit=limit,
                                      doubted=doubted)
    if new_status == status_of(obj):
        return None
    return {**obj, "status": new_status}


def cliques_of(nodes: list[DomainNode], waiting: dict[str, list[str]]) -> list[DomainClique]:
    """Each clique's size and readiness (and who waits for a place); empty when no node has a clique."""
    ids = sorted({n.get("clique") or "" for n in nodes} | set(waiting))
    if ids in ([], [""]) and not waiting:
        return []
    out = []
    for clique in ids:
        members = in_clique(nodes, clique)
        row: DomainClique = {"id": clique, "nodes": len(members),
                               "readyNodes": sum(1 for n in members if n.get("status") == "Ready")}
        if waiting.get(clique):
            row["waiting"] = waiting[clique]
        out.append(row)
    return out


class HeartbeatTracker:
    """When each member's heartbeat was last seen to change, on the aggregator's own clock."""

    def __init__(self, ttl_intervals: float, monotonic: Callable[[], float]) -> None:
        self.ttl_intervals = ttl_intervals
        self.monotonic = monotonic
        self.seen: dict[str, tuple[str, float]] = {}

    def saw(self, node: str, spec: MemberSpec) -> None:
        beat = str(spec.get("heartbeat") or "")
        if node not in self.seen or self.seen[node][0] != beat:  # the same beat seen again (a relist) is no heartbeat
            self.seen[node] = (beat, self.monotonic())

    def forget(self, node: str) -> None:
        self.seen.pop(node, None)

    def silent(self, members: dict[str, MemberSpec]) -> frozenset[str]:
        now = self.monotonic()
        out = set()
        for node, spec in members.items():
            interval = spec.get("heartbeatIntervalSeconds")
            if not isinstance(interval, (int, float)) or interval <= 0 or node not in self.seen:
                continue  # a 0.1 agent (no heartbeat): trusted as before
            if now - self.seen[node][1] > self.ttl_intervals * interval:
                out.add(node)
        return frozenset(out)


def readiness_moved(old: GPUDomain, new: GPUDomain) -> bool:
    """Whether a status change is one a reader waits for: the domain turns Ready, loses readiness, or
    changes while Ready (a member's IP, GPUs or index, which its peers act on); the first status
    of a domain never folded before, so its readers see it NotReady from the start; and the answer to
    a new spec (observedGeneration), which kstatus and `kubectl wait` wait for."""
    before, after = status_of(old).get("status"), status_of(new).get("status")
    return (before != after or after == "Ready"
            or status_of(old).get("observedGeneration") != status_of(new).get("observedGeneration"))


@dataclass
class Arrivals:
    """When a member last arrived or changed anywhere in a folder's view (monotonic seconds; a heartbeat
    alone is no arrival), shared by the aggregators of one EveryDomainAggregator."""

    last: float = -math.inf

    def saw(self, now: float) -> None:
        self.last = max(self.last, now)  # one float, written by the members' watch thread, read by the folders


@dataclass
class WriteSchedule:
    """When a domain's pending status change is written; the timing rules, on the caller's clock:

    - a prompt change (see readiness_moved) is written at once;
    - any other change waits until no member has changed for `quiet` seconds (the arrivals paused),
      or until `bound` seconds have passed since the first unwritten change, whichever comes first.
      With `shared` arrivals (one folder of many domains) the pause is the namespace's: every domain's
      writes land on one API server, so while members still stream into any domain, a write nobody waits
      for waits (for the bound at most).

    So a domain forming while its members stream in takes about one write when it turns Ready (plus
    one per `bound` of a long formation) instead of one per batch, and a lone change (one node
    joining, one leaving a NotReady domain) is written `quiet` seconds after it. Every write holds
    every member seen so far, so a member waiting for one is never taken for removed (a node agent
    re-applies only when a written status lacks it, MemberWriter.REAPPLY_AFTER after its apply)."""

    quiet: float
    bound: float
    first: float | None = None  # monotonic time of the first unwritten change
    last: float = 0.0  # ... and of the latest
    shared: Arrivals | None = None

    def _paused_since(self) -> float:
        return self.last if self.shared is None else max(self.last, self.shared.last)

    @property
    def waiting(self) -> bool:
        return self.first is not None

    def changed(self, now: float) -> None:
        if self.first is None:
            self.first = now
        self.last = now

    def due(self, now: float, *, prompt: bool) -> bool:
        return self.why_due(now, prompt=prompt) is not None

    def why_due(self, now: float, *, prompt: bool) -> str | None:
        """Which rule makes the pending change due ("prompt", "quiet", "bound"), or None while it waits."""
        if self.first is None:
            return None
        if prompt:
            return "prompt"
        if now - self._paused_since() >= self.quiet:
            return "quiet"
        return "bound" if now - self.first >= self.bound else None

    def wait(self, now: float) -> float:
        """Seconds until the pending change is due if nothing else arrives (inf when none is pending)."""
        if self.first is None:
            return math.inf
        return max(0.0, min(self._paused_since() + self.quiet, self.first + self.bound) - now)

    def written(self) -> None:
        self.first = None


class Aggregator:
    """Folds a domain's members into its status; one per domain (the cluster agent runs it)."""

    COALESCE_BOUND = 5.0  # seconds; see WriteSchedule

    def __init__(self, api: client.ApiClient, namespace: str, domain: str, *, interval: float = 0.1,
                 heartbeat_ttl_intervals: float = 3.0, clock: Clock | None = None,
                 rng: random.Random | None = None, custom_api: client.CustomObjectsApi | None = None,
                 recorder: EventRecorder | None = None, watch_domain: bool = True, watch_members: bool = True,
                 arrivals: Arrivals | None = None, bound: float = COALESCE_BOUND, check_members: bool = False,
                 pods: NodeAgentPods | None = None, gpu_capacity: Callable[[str], int | None] | None = None) -> None:
        """`custom_api`: the API client's unless handed one (unit tests hand in fakes). `recorder`: where
        the Events of each written change go (none: not told). `watch_domain`: watch the GPUDomain itself,
        so a spec change (expectedNodes, maxNodesPerClique) is folded at once; `watch_members`: watch its
        members (listed_members, member_event). Either False when the caller forwards them
        (EveryDomainAggregator watches them all, one watch of each kind for the namespace). `arrivals`: the
        namespace's, when the caller folds many domains, with its `bound` (see WriteSchedule).
        `check_members`: check each member against its owner Pod (trust.py) through a watch of the namespace's
        node agent Pods of its own, or through `pods`, the caller's shared one (then not watched here);
        `gpu_capacity` (node -> its Node's GPU capacity, None when not reported): check its GPUs too."""
        self.api = api
        self.recorder = recorder
        self.watch_domain = watch_domain
        self.watch_members = watch_members
        self.folded_generation: int | None = None
        self.clock = clock or SystemClock()
        self.heartbeats = HeartbeatTracker(heartbeat_ttl_intervals, self.clock.monotonic)
        self.custom = custom_api if custom_api is not None else client.CustomObjectsApi(api)
        self.namespace = namespace
        self.domain = domain
        self.members: dict[str, MemberSpec] = {}  # node -> spec: the index's members() after each change
        # node -> (clique, index, when it left on the monotonic clock): indices held for REJOIN_GRACE (see fold)
        self.departed: dict[str, tuple[str, int, float]] = {}
        # No fold before the members' first list: a domain event (the watch of the domain itself) can wake the
        # loop first, and folding no members would empty the status a previous leader wrote, indices and all.
        self.members_listed = False
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = StopEvent()  # its set also shuts the watches' connections (foundations/threads.py)
        self.writer = DomainWriter(api, namespace, domain, "fulljitter", 25.0, rng or random.Random(), self.clock,
                                   custom_api=custom_api)
        self.index = MemberIndex(domain, self.writer.where)
        self.writes = 0
        self.write_reasons: collections.Counter[str] = collections.Counter()  # prompt, quiet, bound
        self.pending = WriteSchedule(quiet=interval, bound=bound, shared=arrivals)
        self.watch_pods = pods is None and check_members
        if self.watch_pods:
            pods = NodeAgentPods(core_v1_list(api, "pods"), namespace, clock=self.clock)
        self.pods = pods
        self.trust = MemberTrust(pods, gpu_capacity, monotonic=self.clock.monotonic) if pods is not None else None
        self.told_doubts: dict[str, str] = {}  # node -> the doubt the last Events told (transitions.py)

    def listed_members(self, listed: Any) -> None:
        with self._lock:
            self.index.replace(items_of(listed))
            members = self.index.members()
            for node in set(self.members) - set(members):
                self.heartbeats.forget(node)
            for node, spec in members.items():
                self.heartbeats.saw(node, spec)
            self.members = members
            self.members_listed = True
        self._changed.set()

    def member_event(self, kind: str, member: dict[str, Any]) -> None:
        """Only the nodes the event touched are looked at again (the index keys objects by name: a node's
        0.1 member deleted while its new one stands leaves the node as it was)."""
        with self._lock:
            for node in self.index.event(kind, member):
                spec = self.index.member(node)
                if spec is None:
                    self.members.pop(node, None)
                    self.heartbeats.forget(node)
                else:
                    self.members[node] = spec
                    self.heartbeats.saw(node, spec)
        self._changed.set()

    def _watch(self) -> None:
        list_then_watch(self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, MEMBERS,
                        label_selector=f"gpu-agent.io/domain={self.domain}", on_list=self.listed_members,
                        on_event=self.member_event, stop=self._stop, clock=self.clock,
                        on_error=lambda e: log.warning("watching members of %s failed: %s", self.writer.where, e))

    def domain_seen(self, obj: GPUDomain) -> None:
        """The GPUDomain as a watch delivered it: kept as the newest view unless ours is newer, and folded
        again when its spec changed (its generation moved) since the last fold."""
        self.writer.observe(obj)
        if generation_of(obj) != self.folded_generation:
            self._changed.set()

    def _watch_own_domain(self) -> None:
        def listed(objs: Any) -> None:
            for obj in items_of(objs):
                self.domain_seen(obj)

        def event(kind: str, obj: Any) -> None:
            if kind != "DELETED":
                self.domain_seen(obj)

        list_then_watch(self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                        field_selector=f"metadata.name={self.domain}", on_list=listed, on_event=event, stop=self._stop,
                        clock=self.clock, retry_seconds=2.0,
                        on_error=lambda e: log.warning("watching %s failed: %s", self.writer.where, e))

    def _doubts(self) -> dict[str, str]:
        """node -> why its member is not trusted (trust.py; {} without checks). Under the lock."""
        if self.trust is None:
            return {}
        return self.trust.doubts(self.members, {node: self.index.owner(node) for node in self.members},
                                 frozenset(node for node in self.members if self.index.is_legacy(node)))

    def _tell(self, before: GPUDomain | None, after: GPUDomain | None, silent: frozenset[str],
              doubted: Mapping[str, str]) -> None:
        """The Events of a written change (transitions.py)."""
        if self.recorder is None or after is None:
            return
        now = self.clock.monotonic()
        with self._lock:
            silent_for = {n: now - self.heartbeats.seen[n][1] for n in silent if n in self.heartbeats.seen}
        # The version `kubectl events --for gpudomain/NAME` resolves the kind to (the preferred one), not the one
        # this writer reads at: kubectl selects events by involvedObject.apiVersion as well.
        regarding = reference({**after, "apiVersion": f"{GROUP}/{PREFERRED_VERSION}", "kind": "GPUDomain"})
        for t in transitions(before, after, silent_for, doubted, self.told_doubts):
            self.recorder.record(regarding, t.type, t.reason, "Fold", t.note)
        present = {n.get("name") for n in nodes_of(after)}
        self.told_doubts = {n: why for n, why in doubted.items() if n in present}

    def run(self) -> None:
        if self.watch_members:
            start_thread("members-watch", self._watch, self._stop)
        if self.watch_domain:
            start_thread("domain-watch", self._watch_own_domain, self._stop)
        if self.watch_pods and self.pods is not None:
            start_thread("node-agent-pods-watch", self.pods.run, self.pods.stop_event)
        silent: frozenset[str] = frozenset()
        doubted: dict[str, str] = {}
        while not self._stop.is_set():
            # 0.5 s at most: also the step at which silent members are noticed
            if self.clock.wait_blocking(self._changed, min(0.5, self.pending.wait(self.clock.monotonic()))):
                self._changed.clear()
                if self.members_listed:  # before the members' first list there is nothing to fold (see __init__)
                    self.pending.changed(self.clock.monotonic())
            with self._lock:
                now_silent = self.heartbeats.silent(self.members)
                now_doubted = self._doubts()  # checked at the same step: a Pod or Node change is seen within it
            if now_doubted != doubted:
                for node, doubt in sorted(now_doubted.items()):
                    if doubted.get(node) != doubt:
                        log.warning("member %s of %s not trusted, marking it NotReady: %s", node, self.writer.where, doubt)
                for node in sorted(set(doubted) - set(now_doubted)):
                    if node in self.members:
                        log.info("member %s of %s trusted again", node, self.writer.where)
                doubted = now_doubted
                self.pending.changed(self.clock.monotonic())
            if now_silent != silent:
                for node in sorted(now_silent - silent):
                    log.warning("member %s of %s: no heartbeat for its TTL; marking it NotReady", node, self.writer.where)
                for node in sorted(silent - now_silent):
                    log.info("member %s of %s: heartbeat again", node, self.writer.where)
                silent = now_silent
                self.pending.changed(self.clock.monotonic())
            if not self.pending.waiting:
                continue
            with self._lock:
                members = dict(self.members)
            current = self._current()
            stamp = timestamp(self.clock.wall())
            rejoining = self._rejoining(self.clock.monotonic())
            new = (fold(current, members, silent, now=stamp, rejoining=rejoining, doubted=doubted)
                   if current is not None else None)
            if current is not None and new is None:
                self.pending.written()  # the status already says so
                self.folded_generation = generation_of(current)
                continue
            # The domain turns Ready, loses readiness or changes while Ready: written at once, as is
            # anything while the domain cannot be read (the writer's retries take over). Members still
            # arriving at a NotReady domain: coalesced.
            prompt = current is None or new is None or readiness_moved(current, new)
            now = self.clock.monotonic()
            why = self.pending.why_due(now, prompt=prompt)
            if why is None:
                continue
            self.pending.written()
            # Stopped (no longer leading, the domain gone): the retries end with it.
            change = functools.partial(fold, members=members, silent=silent, now=stamp, rejoining=rejoining,
                                       doubted=doubted)
            if self.writer.update(change, f"fold {len(members)} members ({why})", self._stop.is_set, None):
                self.writes += 1
                self.write_reasons[why] += 1
                self.folded_generation = generation_of(self.writer.cached or {})
                self._departures(current, self.writer.cached, self.clock.monotonic())
                self._tell(current, self.writer.cached, silent, doubted)

    def readiness(self) -> dict[str, tuple[bool, str]]:
        """{domain: (Ready, the Ready condition's reason)} as the newest view holds it; {} before one has it."""
        ready = find(status_of(self.writer.cached or {}).get("conditions"))
        if ready is None:
            return {}
        return {self.domain: (ready.get("status") == "True", str(ready.get("reason") or ""))}

    def _rejoining(self, now: float) -> dict[str, tuple[str, int]]:
        """The indices still held for nodes that left lately; those held past REJOIN_GRACE are let go."""
        self.departed = {n: d for n, d in self.departed.items() if now - d[2] < REJOIN_GRACE}
        return {n: (clique, index) for n, (clique, index, _) in self.departed.items()}

    def _departures(self, before: GPUDomain | None, after: GPUDomain | None, now: float) -> None:
        """Records the nodes a write took out of the status, with their clique and index; a node back is no longer
        departed."""
        present = {n.get("name") for n in nodes_of(after or {})}
        for n in nodes_of(before or {}):
            if n.get("name") not in present and isinstance(n.get("index"), int):
                self.departed[str(n["name"])] = (str(n.get("clique") or ""), int(n["index"]), now)
        for name in present:
            self.departed.pop(str(name), None)

    def _current(self) -> GPUDomain | None:
        """The newest view of the domain: the writer's own last write, or a read the first time."""
        if self.writer.cached is None:
            try:
                self.writer.read()
            except Exception as e:  # noqa: BLE001 - the write that follows retries and logs
                log.v(2, "reading %s before folding failed: %s", self.writer.where, e)
        return self.writer.cached

    def stop(self) -> None:
        self._stop.set()
        if self.watch_pods and self.pods is not None:
            self.pods.stop()


class EveryDomainAggregator:
    """One Aggregator per GPUDomain of a namespace, started and stopped as domains come and go
    (users create them at run time; node agents with joinMatchingDomains write their members).
    Only for the aggregate strategy: a domain whose entries are written into its status directly
    (dra, fulljitter) has no members, and folding it would empty its status.

    The quiet period follows the number of domains: every status write of every domain lands on the
    same API server, so each aggregator waits for its members' arrivals to pause for `interval` x
    domains^(2/3) (at most MAX_INTERVAL) before a write nobody waits for (see WriteSchedule; a domain
    turning Ready or losing readiness is written at once whatever the count). Measured with make
    bench-domain, 64 domains x 18 members formed at once: with writes every 0.1 to 1 s whatever
    changed, 200 to 600 status writes and 1.4 to 2.7 times the floor of the member applies alone; with
    prompt writes and a per-domain quiet period of 0.8 to 1.6 s, 1.3 to 2 writes per domain.

    One watch of every member of the namespace feeds them all (each member goes to the aggregator of the
    domain its label names), not one watch per domain: a thousand domains would otherwise hold a thousand
    connections and reader threads, and the API server would test every member event against each of
    their selectors. It keeps every member by domain, so an aggregator started for a new domain begins
    with the members that arrived before it (node agents may apply theirs first). Measured with make
    bench-domain (64 x 18, five runs): one watch per domain, median 1.21 to 1.44 times the floor, the
    folder seeing a domain's last member 0.2 to 0.5 s after its apply; one watch, 0.92 to 1.32, and
    before the node agent's own apply call has returned.

    Its aggregators share the namespace's Arrivals (a write nobody waits for waits until members stop
    arriving anywhere) and a bound that grows with the domains (see bound()): 64 domains formed at once
    then cost exactly one status write each, the one that turns it Ready (1.3 to 2.0 before). What is
    left is that write: 11.7 ms of API server CPU for a domain of 18 (4.7 ms for 1, 37.5 ms for 72;
    a merge patch costs more), all 64 landing as the last members do.

    With `check_members`, one watch of the namespace's node agent Pods (trust.py) serves every aggregator's checks
    the same way, and `gpu_capacity` (the caller's Node watch) their GPU check.
    """

    MAX_INTERVAL = 2.0

    def __init__(self, api: client.ApiClient, namespace: str, *, heartbeat_ttl_intervals: float = 3.0,
                 interval: float = 0.1, clock: Clock | None = None, rng: random.Random | None = None,
                 recorder: EventRecorder | None = None, check_members: bool = False,
                 gpu_capacity: Callable[[str], int | None] | None = None) -> None:
        self.api = api
        self.recorder = recorder
        self._seed = (rng or random.Random()).getrandbits(64)  # each domain's writer draws from its own source
        self.clock = clock or SystemClock()
        self.namespace = namespace
        self.heartbeat_ttl_intervals = heartbeat_ttl_intervals
        self.interval = interval
        self.aggregators: dict[str, Aggregator] = {}
        # Every labelled member of the namespace, by domain and object name (None until the first list): what a
        # new domain's aggregator begins with.
        self.members: dict[str, dict[str, Any]] | None = None
        self._domain_of: dict[str, str] = {}  # member object name -> the domain its label named when last seen
        self.arrivals = Arrivals()
        self._lock = threading.Lock()
        self._stop = StopEvent()  # its set also shuts the watches' connections (foundations/threads.py)
        self.pods = NodeAgentPods(core_v1_list(api, "pods"), namespace, clock=self.clock) if check_members else None
        self.gpu_capacity = gpu_capacity

    def window(self, domains: int) -> float:
        return min(self.MAX_INTERVAL, self.interval * max(1.0, math.pow(domains, 2 / 3)))

    def bound(self, domains: int) -> float:
        """How long a write nobody waits for may wait while members keep arriving: the single domain's 5 s,
        longer as domains come (ten quiet periods, 16 s for 64, 20 s at most), since a namespace forming many
        domains at once would otherwise write each one's progress while every member still streams in."""
        return max(Aggregator.COALESCE_BOUND, 10 * self.window(domains))

    def _sync(self, names: set[str]) -> None:
        with self._lock:
            interval, bound = self.window(len(names)), self.bound(len(names))
            for agg in self.aggregators.values():
                agg.pending.quiet = interval  # each aggregator's quiet period widens as domains come
                agg.pending.bound = bound
            for name in sorted(names - set(self.aggregators)):
                agg = Aggregator(self.api, self.namespace, name, interval=interval,
                                 heartbeat_ttl_intervals=self.heartbeat_ttl_intervals, clock=self.clock,
                                 rng=random.Random(f"{self._seed}/{name}"), recorder=self.recorder, watch_domain=False,
                                 watch_members=False, arrivals=self.arrivals, bound=bound, pods=self.pods,
                                 gpu_capacity=self.gpu_capacity)
                if self.members is not None:  # before the members' first list it is handed them with the rest
                    agg.listed_members({"items": list(self.members.get(name, {}).values())})
                start_thread(f"aggregator-{name}", agg.run, agg._stop)
                self.aggregators[name] = agg
                log.info("folding GPUDomainMembers into GPUDomain %s/%s", self.namespace, name)
            for name in sorted(set(self.aggregators) - names):
                self.aggregators.pop(name).stop()
                log.info("stopped folding GPUDomain %s/%s (deleted)", self.namespace, name)

    def readiness(self) -> dict[str, tuple[bool, str]]:
        """Each folded domain's (Ready, reason), as Aggregator.readiness."""
        with self._lock:
            aggregators = list(self.aggregators.values())
        return {name: ready for agg in aggregators for name, ready in agg.readiness().items()}

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        with self._lock:
            names = set(self.aggregators)
        self._sync(names - {name} if kind == "DELETED" else names | {name})
        self._forward([obj] if kind != "DELETED" else [])

    def _forward(self, objs: list[Any]) -> None:
        """Each domain as the watch delivered it, to its aggregator (a spec change is folded at once)."""
        with self._lock:
            targets = [(self.aggregators.get(o["metadata"]["name"]), o) for o in objs]
        for agg, obj in targets:
            if agg is not None:
                agg.domain_seen(obj)

    def _listed(self, listed: Any) -> None:
        self._sync({d["metadata"]["name"] for d in items_of(listed)})
        self._forward(items_of(listed))

    def _listed_members(self, listed: Any) -> None:
        """A (re)list of the namespace's members: each aggregator is handed all its domain has now."""
        with self._lock:
            self.members, self._domain_of = {}, {}
            for obj in items_of(listed):
                name, domain = self._member_key(obj)
                self.members.setdefault(domain, {})[name] = obj
                self._domain_of[name] = domain
            for domain, agg in self.aggregators.items():
                agg.listed_members({"items": list(self.members.get(domain, {}).values())})

    def _member_event(self, kind: str, obj: dict[str, Any]) -> None:
        """Forwarded to the aggregator of the member's domain; a member whose label moved to another domain
        leaves the one it was in (as a deletion there)."""
        with self._lock:
            if self.members is None:  # an event before any list cannot be: list_then_watch lists first
                return
            name, domain = self._member_key(obj)
            before = self._domain_of.pop(name, None)
            if kind == "DELETED" or not _same_but_heartbeat(self.members.get(domain, {}).get(name), obj):
                self.arrivals.saw(self.clock.monotonic())
            if before is not None and (before != domain or kind == "DELETED"):
                self.members.get(before, {}).pop(name, None)
                if before != domain and before in self.aggregators:
                    self.aggregators[before].member_event("DELETED", obj)
            if kind != "DELETED":
                self.members.setdefault(domain, {})[name] = obj
                self._domain_of[name] = domain
            if domain in self.aggregators:
                self.aggregators[domain].member_event(kind, obj)

    @staticmethod
    def _member_key(obj: dict[str, Any]) -> tuple[str, str]:
        metadata = obj.get("metadata") or {}
        return str(metadata.get("name") or ""), str((metadata.get("labels") or {}).get(DOMAIN_LABEL) or "")

    def _watch_members(self) -> None:
        custom = client.CustomObjectsApi(self.api)
        list_then_watch(custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, MEMBERS,
                        label_selector=DOMAIN_LABEL, on_list=self._listed_members, on_event=self._member_event,
                        stop=self._stop, clock=self.clock,
                        on_error=lambda e: log.warning("watching GPUDomainMembers of %s failed: %s", self.namespace, e))

    def run(self) -> None:
        start_thread("members-watch", self._watch_members, self._stop)
        if self.pods is not None:
            start_thread("node-agent-pods-watch", self.pods.run, self.pods.stop_event)
        custom = client.CustomObjectsApi(self.api)
        list_then_watch(custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                        on_list=self._listed,
                        on_event=self._event, stop=self._stop, retry_seconds=2.0, clock=self.clock,
                        on_error=lambda e: log.warning("watching GPUDomains of %s failed: %s", self.namespace, e))

    def stop(self) -> None:
        self._stop.set()
        if self.pods is not None:
            self.pods.stop()
        with self._lock:
            for agg in self.aggregators.values():
                agg.stop()
            self.aggregators.clear()
