"""Each GPU's health, as a state machine fed by what the source sees.

A source tells the tracker two kinds of things: events (a critical Xid or an ECC error, from
NVML's event thread, at any time) and, at each read, the GPUs it lists with any condition that
holds now (NVML answering GPU_IS_LOST; a fault the fake state file carries). The tracker turns them
into each GPU's `health`:

    Healthy ──(critical Xid, double-bit ECC, a fault the fake carries)──────────> Unhealthy
    Healthy | Unhealthy ──(GPU_IS_LOST on a call, or the fake says Lost)────────> Lost
    Unhealthy ──(answering normally, no critical event for `recovery` seconds)──> Healthy
    Lost ──(listed and answering again)──> Healthy (Unhealthy until `recovery` seconds after a critical event)

A GPU leaves a state only after one read has reported it, so with a window of 0 s (the fake's) an
event still shows in one reading. Nothing here restarts anything: a GPU that recovers (after a reset: the same UUID answering with
no new critical event for `recovery` seconds) counts again, which the device plugin's users ask
for (k8s-device-plugin 234, 1014). Ignored Xids (application errors) and single-bit ECC errors
change nothing; they are counted. An event for a GPU the source does not list is logged once and
ignored. Time is the injected clock's: recovery on the monotonic clock, `health_since` on the wall.

Each transition is one log line at -v 0 and counts in the metrics (by target state; the gauge of
GPUs by health); no label carries a UUID, so the label sets stay bounded. It is also handed to
`on_change`, if given, as a HealthChange, and so is a critical event NVML delivers again for a GPU
already Unhealthy (a repeat: the node agent's Event counts it into its series) or a new reason it
stays Unhealthy for (a fault a read reports holds: told once, not at each read). The hook runs
under the tracker's lock on the caller's thread, so it must only queue (the node agent's
EventRecorder does); one that raises is logged and the state machine goes on. `health_event` is
the Event a change is on the GPU's Node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from gpu_agent.foundations.clock import Clock
from gpu_agent.foundations.gpus import GPU, HEALTH_STATES, HEALTHY, LOST, UNHEALTHY
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.xids import DEFAULT_IGNORED_XIDS, ECC_DOUBLE_REASON, describe_xid, reason_class, xid_acts

log = get_logger(__name__)

# Event kinds, as NVML delivers them (and as the events metric labels them).
XID = "xid"
ECC_SINGLE = "ecc_single"
ECC_DOUBLE = "ecc_double"

# GPUs the tracker remembers while the source does not list them (a Lost GPU may come back listed);
# a handful per node, bounded so that a fake cycling through new UUIDs cannot grow it.
MAX_UNLISTED = 64

# The reasons of the Events a node agent records on its Node for its GPUs' health (health_event).
GPU_UNHEALTHY = "GPUUnhealthy"
GPU_LOST = "GPULost"
GPU_HEALTHY = "GPUHealthy"


class HealthMetrics(Protocol):
    """Where the tracker reports (foundations.metrics.NodeMetrics implements it)."""

    def gpu_health_transition(self, to: str) -> None: ...

    def gpu_health_counts(self, counts: Mapping[str, int]) -> None: ...

    def gpu_health_event(self, kind: str) -> None: ...


class NoHealthMetrics:
    def gpu_health_transition(self, to: str) -> None:
        return None

    def gpu_health_counts(self, counts: Mapping[str, int]) -> None:
        return None

    def gpu_health_event(self, kind: str) -> None:
        return None


@dataclass(frozen=True)
class HealthChange:
    """A GPU's health changing from `before` to `health`, or (before == health == Unhealthy) a critical event
    delivered again for a GPU already Unhealthy, or a new reason it stays Unhealthy for."""
    uuid: str
    index: int
    before: str
    health: str
    reason: str  # why it is `health` now; for Healthy, how it recovered
    error_class: str  # reason_class of the error behind it ("" for Healthy)
    was: str  # the reason it had before ("" when it was Healthy)
    recovery: float  # the tracker's recovery window, seconds


def health_event(change: HealthChange) -> tuple[str, str, str]:
    """(type, reason, note) of the Event a change is on the GPU's Node. The note names the GPU, the error and its
    class, and no time or count: a repeat of the same error is the same note, which the recorder counts into the
    first Event's series."""
    gpu = f"GPU {change.index} ({change.uuid})"
    if change.health == HEALTHY:
        was = f" (was {change.before}: {change.was})" if change.was else f" (was {change.before})"
        return "Normal", GPU_HEALTHY, f"{gpu} Healthy again{was}: {change.reason}"
    if change.health == LOST:
        return ("Warning", GPU_LOST,
                f"{gpu} Lost: {change.reason} [{change.error_class}]; out of service until it answers again")
    back = (f"after answering normally with no new critical event for {change.recovery:g}s" if change.recovery > 0
            else "once it answers normally")
    return ("Warning", GPU_UNHEALTHY,
            f"{gpu} Unhealthy: {change.reason} [{change.error_class}]; out of service until it counts again {back}")


@dataclass
class _Track:
    health: str = HEALTHY
    reason: str = ""
    since: float = 0.0  # wall clock of the last transition; 0 while never changed
    last_critical: float | None = None  # monotonic time of the last critical event or fault seen
    critical_reason: str = ""
    index: int = 0
    reported: bool = True  # a read has handed out the current health (so a window of 0 s still shows an event)


class HealthTracker:
    def __init__(self, *, clock: Clock, recovery: float, ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
                 source: str = "", metrics: HealthMetrics | None = None,
                 on_change: Callable[[HealthChange], None] | None = None) -> None:
        """`on_change`: handed each transition and each repeated critical event (see the module's docstring)."""
        self.clock = clock
        self.recovery = recovery
        self.ignored_xids = frozenset(ignored_xids)
        self.source = source
        self.metrics: HealthMetrics = metrics or NoHealthMetrics()
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._listed: frozenset[str] = frozenset()
        self._unknown_logged: set[str] = set()
        self.on_change = on_change
        self._hook_failed = False

    # -- events (any thread) ------------------------------------------------------------------------------------

    def event(self, uuid: str, kind: str, xid: int = 0) -> None:
        """A critical-Xid or ECC event NVML delivered for `uuid`."""
        with self._lock:
            if kind == XID:
                self.metrics.gpu_health_event("xid_critical" if xid_acts(xid, self.ignored_xids) else "xid_ignored")
            else:
                self.metrics.gpu_health_event(kind)
            what = describe_xid(xid) if kind == XID else kind.replace("_", "-") + " ECC error"
            if uuid not in self._listed:
                if uuid not in self._unknown_logged and len(self._unknown_logged) < MAX_UNLISTED:
                    self._unknown_logged.add(uuid)
                    log.warning("GPU event %s for GPU %s, which the %s source does not list: ignored (logged once)",
                                what, uuid, self.source)
                return
            if kind == ECC_SINGLE:
                log.v(2, "GPU %s: single-bit ECC error (corrected; counted, not acted on)", uuid)
                return
            if kind == XID and not xid_acts(xid, self.ignored_xids):
                log.v(1, "GPU %s: %s ignored (gpuHealthIgnoredXids: an application error, the GPU is fine)", uuid, what)
                return
            self._critical(uuid, self._tracks[uuid], describe_xid(xid) if kind == XID else ECC_DOUBLE_REASON,
                           delivered=True)

    def _critical(self, uuid: str, track: _Track, reason: str, delivered: bool = False) -> None:
        """A critical event (`delivered`: by NVML, each one an occurrence) or a fault a read reports (it holds
        while the source says so: not an occurrence at each read)."""
        track.last_critical = self.clock.monotonic()
        track.critical_reason = reason
        if track.health == HEALTHY:
            self._move(uuid, track, UNHEALTHY, reason)
        elif track.health == UNHEALTHY:
            was = track.reason
            if was != reason:
                log.v(1, "GPU %s stays Unhealthy: %s (was: %s)", uuid, reason, was)
                track.reason = reason
            if delivered or was != reason:  # a fault that holds at each read is told once, an event each time
                self._tell(HealthChange(uuid, track.index, UNHEALTHY, UNHEALTHY, reason, reason_class(reason), was,
                                        self.recovery))

    # -- reads (the source's thread) ----------------------------------------------------------------------------

    def observe(self, gpus: Iterable[GPU], conditions: Mapping[str, tuple[str, str]] | None = None) -> tuple[GPU, ...]:
        """The GPUs a read lists (as read: their own health fields are ignored), with the conditions that hold
        now by UUID: (LOST, reason) for a GPU not answering, (UNHEALTHY, reason) for a fault that persists.
        Returns them carrying their health."""
        conditions = conditions or {}
        out = []
        with self._lock:
            now = self.clock.monotonic()
            for g in gpus:
                track = self._tracks.get(g.uuid)
                if track is None:
                    track = self._tracks[g.uuid] = _Track()
                track.index = g.index
                health, reason = conditions.get(g.uuid, (HEALTHY, ""))
                if health == LOST:
                    if track.health != LOST:
                        self._move(g.uuid, track, LOST, reason)
                elif health == UNHEALTHY:
                    self._critical(g.uuid, track, reason)
                    if track.health == LOST:  # answering again, and faulty
                        self._move(g.uuid, track, UNHEALTHY, reason)
                elif track.health != HEALTHY:
                    quiet = track.reported and (track.last_critical is None or now - track.last_critical >= self.recovery)
                    if quiet:
                        self._move(g.uuid, track, HEALTHY, "answering normally" + (
                            f" with no critical event for {self.recovery:g}s" if track.last_critical is not None else ""))
                    elif track.health == LOST:
                        self._move(g.uuid, track, UNHEALTHY, f"answering again; {track.critical_reason} "
                                   f"{now - track.last_critical:.0f}s ago (recovery {self.recovery:g}s)"
                                   if track.last_critical is not None else track.critical_reason)
                track.reported = True
                out.append(replace(g, health=track.health, health_reason=track.reason, health_since=track.since))
            self._listed = frozenset(g.uuid for g in out)
            self._forget_unlisted()
            counts = dict.fromkeys(HEALTH_STATES, 0)
            for g in out:
                counts[g.health] += 1
            self.metrics.gpu_health_counts(counts)
        return tuple(out)

    def _forget_unlisted(self) -> None:
        """A healthy GPU that left has nothing to remember; an unhealthy or lost one is kept (bounded), so that
        coming back listed is judged against what it was."""
        unlisted = [u for u in self._tracks if u not in self._listed]
        for uuid in unlisted:
            if self._tracks[uuid].health == HEALTHY:
                del self._tracks[uuid]
        kept = [u for u in self._tracks if u not in self._listed]
        for uuid in kept[:max(0, len(kept) - MAX_UNLISTED)]:  # oldest first (dicts keep insertion order)
            del self._tracks[uuid]

    def health_of(self, uuid: str) -> str | None:
        with self._lock:
            track = self._tracks.get(uuid)
            return track.health if track else None

    def _tell(self, change: HealthChange) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(change)
        except Exception as e:  # noqa: BLE001 - the hook only reports: the state machine goes on without it
            if not self._hook_failed:
                log.warning("reporting GPU %s's health change failed (later failures at -v 2): %s", change.uuid, e)
            else:
                log.v(2, "reporting GPU %s's health change failed: %s", change.uuid, e)
            self._hook_failed = True

    def _move(self, uuid: str, track: _Track, to: str, reason: str) -> None:
        before, was = track.health, track.reason
        track.health = to
        track.reason = "" if to == HEALTHY else reason
        track.since = self.clock.wall()
        track.reported = False
        self.metrics.gpu_health_transition(to)
        if to == HEALTHY:
            log.info("GPU %s (index %d) %s -> Healthy: %s", uuid, track.index, before, reason)
        else:
            log.warning("GPU %s (index %d) %s -> %s: %s", uuid, track.index, before, to, reason)
        # The class of the error behind it: back from Lost to Unhealthy, the critical event's, not "answering again".
        cls = "" if to == HEALTHY else reason_class(
            track.critical_reason if to == UNHEALTHY and track.critical_reason else reason)
        self._tell(HealthChange(uuid, track.index, before, to, reason, cls, was, self.recovery))
