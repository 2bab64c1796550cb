"""The node agent's "ensure my entry" reconciler, on a one-key work queue.

Every event (GPUs changed, the domain object changed, a periodic resync) bumps a generation
and wakes the loop; a retry loop in flight sees the newer generation and stops (a newer event
supersedes the retry loop of an older one), and the loop starts over with the newest state.
A watch on the domain object feeds the writer's cache and notices when this node's entry is
missing or stale. The peers file lists this node's NVLink clique only (the nodes it can be a peer
of), sorted by index, and is written only when that list changes.

The writes block (the Kubernetes client does), so each runs on a worker thread, which cancelling
the loop's task does not stop. Leaving the domain or shutting down therefore goes in this order:
set `_stop` (no write of this reconciler starts after it, and a write in backoff gives up at
once), wait for the write still in flight to return (its call is bounded by the removal's
deadline), then remove the entry. So no apply lands after the removal and re-adds the node.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
from kubernetes import client

from gpu_agent.foundations.clock import Clock, SystemClock, sleep_or
from gpu_agent.foundations.files import write_atomic
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import items_of, list_then_watch
from gpu_agent.foundations.threads import StopEvent, in_daemon_thread, start_thread
from gpu_agent.mechanisms.domain.aggregate import MemberWriter
from gpu_agent.mechanisms.domain.entries import Entry, GPUDomain, has_entry, in_clique, nodes_of
from gpu_agent.mechanisms.domain.writer import GROUP, PLURAL, VERSION, DomainWriter

log = get_logger(__name__)

PEERS_TEMPLATE = jinja2.Environment(autoescape=False, keep_trailing_newline=True).from_string(
    "# GPUDomain {{ namespace }}/{{ name }}{% if clique %}, clique {{ clique }}{% endif %}: "
    "{{ nodes | length }} node(s), sorted by index\n"
    "{% for n in nodes %}{{ n.index }} {{ n.name }} {{ n.ip or '-' }} {{ n.status }}\n{% endfor %}")


def render_peers(namespace: str, name: str, obj: GPUDomain, clique: str = "") -> str:
    """The peers of one clique (a node's own): the only nodes the fabric lets it reach."""
    nodes = sorted(in_clique(nodes_of(obj), clique), key=lambda n: (n.get("index", 0), n.get("name", "")))
    return PEERS_TEMPLATE.render(namespace=namespace, name=name, nodes=nodes, clique=clique)


class DomainReconciler:
    def __init__(self, writer: DomainWriter | MemberWriter, health: HealthRegistry, *, node: str, ip: str, peers_file: Path | None,
                 resync_seconds: float = 60.0, health_component: str | None = "domain", clock: Clock | None = None) -> None:
        self.writer = writer
        self.clock = clock or SystemClock()
        self._registry = health
        self.health_component = health_component  # None: a domain joined by its selector, reported in the log only
        self.node = node
        self.ip = ip
        self.peers_file = peers_file
        self.resync_seconds = resync_seconds
        self.entry = Entry(node, ip, (), False)
        self.generation = 0
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set once the loop ended (leave, shutdown): the watch and the writes stop. `_idle` is clear while a
        # write runs on its thread; `_writes` makes "not stopped, so this write starts" one step. A StopEvent: its set
        # also shuts down the watch's connection (foundations/threads.py), so a stopped watch ends at once.
        self._stop = StopEvent()
        self._idle = threading.Event()
        self._idle.set()
        self._writes = threading.Lock()
        self._peers_text = ""
        self._peer_count = -1
        # Set by the membership before run: the domain's view folder's peer list (channel claims mount it) and who
        # hears of each domain object the watch sees (None: the domain is not there)
        self.view_file: Path | None = None
        self.on_observed: Callable[[GPUDomain | None], None] = lambda obj: None
        self._health(False, f"joining {writer.where}")

    def _entry_shown(self, entry: Entry) -> str:
        why = f" ({entry.message})" if entry.message and not entry.ready else ""
        return f"entry {entry.name} {'Ready' if entry.ready else 'NotReady'}{why} in {self.writer.where}"

    def _health(self, ready: bool, reason: str, **details: object) -> None:
        if self.health_component is not None:
            self._registry.set(self.health_component, ready, reason, **details)

    # ---- events ---------------------------------------------------------------------------------
    def trigger(self, why: str) -> None:
        self.generation += 1
        log.v(4, "domain reconcile requested: %s (generation %d)", why, self.generation)
        self._wake.set()

    def set_gpus(self, uuids: list[str], ready: bool, clique: str = "", healthy: int | None = None,
                 message: str = "") -> None:
        entry = Entry(self.node, self.ip, tuple(sorted(uuids)), ready, clique, healthy, message)
        if entry != self.entry:
            self.entry = entry
            self.trigger("GPUs changed")

    def _observed(self, obj: GPUDomain) -> None:
        """Called on the watch thread."""
        self.writer.observe(obj)
        self._write_peers(obj)
        present = has_entry(obj, self.entry)
        if present:
            self._health(True, self._entry_shown(self.entry), **self.writer.stats.__dict__)
        if self.writer.needs_reapply(obj, self.entry) and self._loop is not None:
            self._loop.call_soon_threadsafe(self.trigger, "entry missing or stale in the domain")
        self.on_observed(obj)  # after the peer list is written: a channel prepared on this news finds it

    # ---- peers file ----------------------------------------------------------------------------
    def _write_peers(self, obj: GPUDomain) -> None:
        nodes = in_clique(nodes_of(obj), self.entry.clique)
        if len(nodes) != self._peer_count:
            self._peer_count = len(nodes)
            log.info("domain %s has %d peer(s)%s", self.writer.where, len(nodes),
                     f" in clique {self.entry.clique}" if self.entry.clique else "")
        if log.enabled(3):
            log.v(3, "domain peers: %s", ", ".join(f"{n.get('index')}={n.get('name')}"
                                                   for n in sorted(nodes, key=lambda n: n.get("index", 0))))
        if self.peers_file is None and self.view_file is None:
            return
        text = render_peers(self.writer.namespace, self.writer.name, obj, self.entry.clique)
        if text != self._peers_text:
            for path in (self.peers_file, self.view_file):
                if path is not None:
                    write_atomic(path, text)
            self._peers_text = text

    # ---- loops ---------------------------------------------------------------------------------
    def _listed_domain(self, listed: Any) -> None:
        items = items_of(listed)
        if items:
            self._observed(items[0])
        else:  # the watch reports it when it is created
            self._health(False, f"{self.writer.where} does not exist")
            self.on_observed(None)

    def _watch(self) -> None:
        list_then_watch(
            client.CustomObjectsApi(self.writer.api).list_namespaced_custom_object, GROUP, VERSION, self.writer.namespace,
            PLURAL, field_selector=f"metadata.name={self.writer.name}", on_list=self._listed_domain,
            on_event=lambda kind, obj: self._observed(obj) if kind in ("ADDED", "MODIFIED") else
            self.on_observed(None) if kind == "DELETED" else None,
            on_error=lambda e: self._health(False, f"cannot watch {self.writer.where}: {str(e)[:160]}"),
            stop=self._stop, retry_seconds=2.0, clock=self.clock)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        start_thread("domain-watch", self._watch, self._stop)
        self.trigger("start")
        try:
            while True:
                await sleep_or(self.clock, self.resync_seconds, self._wake.wait())
                if not self._wake.is_set():
                    self.trigger("resync")
                self._wake.clear()
                generation, entry = self.generation, self.entry
                ok = await in_daemon_thread(self._ensure, entry, generation)
                # "my entry is missing" is never success: ready only once the domain shows it
                if ok and self.writer.cached is not None and has_entry(self.writer.cached, entry):
                    self._health(True, self._entry_shown(entry), **self.writer.stats.__dict__)
                    if self.writer.cached is not None:
                        self._write_peers(self.writer.cached)
        finally:
            with self._writes:
                self._stop.set()

    def _ensure(self, entry: Entry, generation: int) -> bool:
        """One write loop, on a worker thread; none starts once the reconciler stopped."""
        with self._writes:
            if self._stop.is_set():
                return False
            self._idle.clear()
        try:
            return self.writer.ensure(entry, lambda: self.generation != generation, cancelled=self._stop)
        finally:
            self._idle.set()

    def remove_entry(self, deadline: float) -> bool:
        """On leave or shutdown: stop the writes, wait for the one in flight, then take this node's entry out,
        all by `deadline` (on this reconciler's clock)."""
        started = self.clock.monotonic()
        with self._writes:
            self._stop.set()
        if not self.clock.wait_blocking(self._idle, deadline - started):
            log.warning("a write of %s's entry in %s was still in flight at the deadline; removing the entry anyway",
                        self.node, self.writer.where)
        ok = self.writer.remove(self.node, deadline=deadline)
        log.info("domain entry of %s %s in %.2fs", self.node, "removed" if ok else "NOT removed", self.clock.monotonic() - started)
        return ok

