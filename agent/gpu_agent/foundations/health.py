"""One registry every component reports its (ready, reason) into.

`/healthz` returns all entries and is 200 only when every entry is ready; `/livez` asks
only whether the event loop is still turning (its heartbeat is fresh). The HTTP server
reads from another thread, hence the lock.

Readiness answers Kubernetes' question, "does this replica do its job", so that a rolling update,
`helm --wait`, Argo CD and Flux can wait on it. A role may add top-level facts that are not
readiness (the cluster agent's `active`: its queues are open, it leads and leases work; a Ready hot
standby is not active) with `state()`; they appear next to `status` in the snapshot.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from gpu_agent.foundations.clock import Clock


@dataclass(frozen=True)
class ComponentHealth:
    ready: bool
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


class HealthRegistry:
    def __init__(self, clock: Clock, components: list[str], liveness_timeout: float = 30.0) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, ComponentHealth] = {
            name: ComponentHealth(False, "starting") for name in components
        }
        self._heartbeat = clock.monotonic()
        self._liveness_timeout = liveness_timeout
        self._facts: dict[str, Any] = {}

    def state(self, name: str, value: Any) -> None:
        """A top-level fact of the snapshot that is not part of readiness (e.g. `active`). A callable is
        asked at each snapshot: a fact that time can falsify (a lease past its deadline) is then never
        served stale, even by a process resumed after a SIGSTOP before its event loop has run."""
        with self._lock:
            self._facts[name] = value

    def set(self, component: str, ready: bool, reason: str, **details: Any) -> bool:
        """Record a component's state; True when it differs from the previous one."""
        entry = ComponentHealth(ready, reason, details)
        with self._lock:
            previous = self._entries.get(component)
            self._entries[component] = entry
        return previous is None or (previous.ready, previous.reason) != (ready, reason)

    def get(self, component: str) -> ComponentHealth:
        with self._lock:
            return self._entries[component]

    async def keep_beating(self, interval: float = 1.0) -> None:
        """The event loop's heartbeat: runs as a task; if the loop stalls, /livez sees it."""
        while True:
            self.beat()
            await self._clock.sleep(interval)

    def beat(self) -> None:
        with self._lock:
            self._heartbeat = self._clock.monotonic()

    def live(self) -> tuple[bool, float]:
        with self._lock:
            age = self._clock.monotonic() - self._heartbeat
        return age <= self._liveness_timeout, age

    def ready(self) -> bool:
        with self._lock:
            return all(e.ready for e in self._entries.values())

    def components_ready(self) -> dict[str, bool]:
        """component -> ready: what holds readiness down (the metric gpu_agent_component_ready)."""
        with self._lock:
            return {name: e.ready for name, e in self._entries.items()}

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            entries = dict(self._entries)
            facts = {name: value() if callable(value) else value for name, value in self._facts.items()}
        return {
            "status": "ready" if all(e.ready for e in entries.values()) else "notready",
            **facts,
            "components": {
                name: {"ready": e.ready, "reason": e.reason, **({"details": e.details} if e.details else {})}
                for name, e in sorted(entries.items())
            },
        }
