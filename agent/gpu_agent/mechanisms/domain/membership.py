"""Which GPUDomains this node belongs to, and one reconciler per domain it joined.

    GPUDomains of the namespace (watch) --+
                                          +--> domains wanted --> {domain: DomainReconciler}
    this node's labels (watch) -----------+                         ^ GPUs fan out to each

A node belongs to the domain it is told to join (`domainName`, the chart's) and, with
`joinMatchingDomains`, to every GPUDomain of its namespace whose `spec.nodeSelector` matches the
node's labels (an empty selector matches every node, as a Pod's does). Users create such domains at
run time; a domain that stops matching (its selector or the node's labels changed, or it was
deleted) is left: its reconciler stops and this node's entry is taken out.

Writing GPUDomainMembers (the aggregate strategy), a node never joins a domain whose name is not a
DNS label (one created before the CRD refused such names): its members' names `<domain>.<node>`
would not be unique, and the chart's admission policy refuses them. It says so once per domain.

Each reconciler is what one domain always had (reconciler.py): its own writer, its own peers file
(the named domain's at `peersFile`, another's at `peersFile.<domain>`), its own retry loop.

The third way in is a channel claim (the DRA driver's, mechanisms/dra/channels.py; the ComputeDomain way):
preparing it joins the claim's domain (`join`), and the node stays a member while any prepared claim holds
it (`release` at unprepare). `wait_ready` blocks the prepare until the domain's folded status shows this
node Ready (the cluster agent folds it), and names what is missing otherwise. Each joined domain's peer list
is also kept at `<view_root>/<domain>/peers`, the host folder a channel's CDI spec mounts into the workload.

    claims (join/release, prepare threads) ──> domains wanted ──> reconciler ──watch──> views (Condition)
                                                                                          └──> wait_ready
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client

from gpu_agent.foundations.domain_view import DomainNotReady, MemberView
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import core_v1_list, items_of, list_then_watch
from gpu_agent.foundations.threads import StopEvent, in_daemon_thread, start_thread
from gpu_agent.mechanisms.domain.entries import GPUDomain, nodes_of, status_of
from gpu_agent.mechanisms.domain.members import domain_name_problem
from gpu_agent.mechanisms.domain.reconciler import DomainReconciler
from gpu_agent.mechanisms.domain.writer import GROUP, PLURAL, VERSION

log = get_logger(__name__)


def selector_matches(selector: Any, labels: dict[str, str]) -> bool:
    """A GPUDomain's nodeSelector (label -> value, all must match); empty or absent matches every node."""
    if not isinstance(selector, dict):
        return not selector
    return all(labels.get(str(k)) == str(v) for k, v in selector.items())


def wanted_domains(named: str, join_matching: bool, domains: dict[str, Any], labels: dict[str, str] | None,
                   claimed: Any = ()) -> set[str]:
    """The domains this node belongs to: the named one, those whose selector matches (once its labels are known),
    and those a prepared channel claim holds."""
    out = {named} if named else set()
    if join_matching and labels is not None:
        out |= {name for name, selector in domains.items() if selector_matches(selector, labels)}
    return out | set(claimed)


def why_not_ready(namespace: str, domain: str, node: str, obj: GPUDomain | None) -> str | None:
    """None when `obj`'s folded status shows `node` Ready; else what a waiting pod's event should say."""
    where = f"GPUDomain {namespace}/{domain}"
    if obj is None:
        return f"node {node} not Ready in {where}: the domain is not there (yet); create it, or fix the claim's template"
    for n in nodes_of(obj):
        if n.get("name") == node:
            if n.get("status") == "Ready":
                return None
            return f"node {node} not Ready in {where}: its member is NotReady (does it have a healthy GPU?)"
    for clique in status_of(obj).get("cliques") or []:
        if node in (clique.get("waiting") or []):
            return (f"node {node} not Ready in {where}: clique {clique.get('id')!r} is full (spec.maxNodesPerClique); "
                    f"it waits for a place")
    return f"node {node} not Ready in {where}: waiting for its member to be folded into the domain's status"


def view_of(namespace: str, domain: str, node: str, obj: GPUDomain) -> tuple[str, int, str]:
    """(uid, index, clique) of this node in a domain that shows it Ready."""
    entry = next(n for n in nodes_of(obj) if n.get("name") == node)
    return (str((obj.get("metadata") or {}).get("uid") or ""), int(entry.get("index") or 0), entry.get("clique") or "")


class DomainMembership:
    def __init__(self, api: client.ApiClient | None, namespace: str, node: str, *, named: str, join_matching: bool,
                 make_reconciler: Callable[[str], DomainReconciler], leave_timeout: float = 10.0,
                 writes_members: bool = True, view_root: Path | None = None) -> None:
        self.api = api
        self.namespace = namespace
        self.node = node
        self.named = named
        self.join_matching = join_matching
        self.make_reconciler = make_reconciler
        self.leave_timeout = leave_timeout
        self.writes_members = writes_members
        self.refused: set[str] = set()  # domains this node cannot join, said once each
        self.domains: dict[str, Any] = {}  # name -> spec.nodeSelector, as watched
        self.labels: dict[str, str] | None = None  # this node's, once seen
        self.joined: dict[str, tuple[DomainReconciler, asyncio.Task[None]]] = {}
        self.gpus: tuple[list[str], bool, str, int | None, str] = ([], False, "", None, "")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._stop = StopEvent()  # its set also shuts the watches' connections (foundations/threads.py)
        self._lock = threading.Lock()
        self.view_root = view_root
        self.claims: dict[str, set[str]] = {}  # domain -> the channel claims (UIDs) that hold it, under _lock
        # domain -> its object as its reconciler last saw it (None: seen absent); wait_ready waits on the condition
        self.views: dict[str, GPUDomain | None] = {}
        self._views = threading.Condition()

    # ---- channel claims (the DRA driver's prepare threads) -----------------------------------------
    def join(self, domain: str, claim: str) -> None:
        with self._lock:
            self.claims.setdefault(domain, set()).add(claim)
        self._poke()

    def release(self, domain: str, claim: str) -> None:
        with self._lock:
            holders = self.claims.get(domain, set())
            holders.discard(claim)
            if not holders:
                self.claims.pop(domain, None)
        self._poke()

    def view_dir(self, domain: str) -> Path:
        assert self.view_root is not None
        return self.view_root / domain

    def wait_ready(self, domain: str, timeout: float) -> MemberView:
        """This node's MemberView once the domain shows it Ready; DomainNotReady naming what is missing after `timeout`."""
        with self._views:
            ready = self._views.wait_for(
                lambda: why_not_ready(self.namespace, domain, self.node, self.views.get(domain)) is None, timeout=timeout)
            obj = self.views.get(domain)
            if not ready or obj is None:
                raise DomainNotReady(why_not_ready(self.namespace, domain, self.node, obj) or "not Ready")
            uid, index, clique = view_of(self.namespace, domain, self.node, obj)
        return MemberView(self.namespace, domain, uid, index, clique, self.view_dir(domain))

    def _observed(self, domain: str, obj: GPUDomain | None) -> None:
        """A reconciler's watch saw its domain (its thread)."""
        with self._views:
            self.views[domain] = obj
            self._views.notify_all()

    # ---- what the watches see (their threads) ----------------------------------------------------
    def _poke(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._changed.set)

    def _domains_listed(self, listed: Any) -> None:
        with self._lock:
            self.domains = {d["metadata"]["name"]: (d.get("spec") or {}).get("nodeSelector") for d in items_of(listed)}
        self._poke()

    def _domain_event(self, kind: str, obj: dict[str, Any]) -> None:
        with self._lock:
            if kind == "DELETED":
                self.domains.pop(obj["metadata"]["name"], None)
            else:
                self.domains[obj["metadata"]["name"]] = (obj.get("spec") or {}).get("nodeSelector")
        self._poke()

    def _node_seen(self, node: dict[str, Any]) -> None:
        with self._lock:
            self.labels = dict((node.get("metadata") or {}).get("labels") or {})
        self._poke()

    def _nodes_listed(self, listed: Any) -> None:
        for node in items_of(listed):
            self._node_seen(node)

    def _watch_domains(self) -> None:
        list_then_watch(client.CustomObjectsApi(self.api).list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                        PLURAL, on_list=self._domains_listed, on_event=self._domain_event, stop=self._stop,
                        on_error=lambda e: log.warning("watching GPUDomains of %s failed: %s", self.namespace, e),
                        retry_seconds=2.0)

    def _watch_node(self) -> None:
        list_then_watch(core_v1_list(self.api, "nodes"), field_selector=f"metadata.name={self.node}",
                        on_list=self._nodes_listed,
                        on_event=lambda kind, n: self._node_seen(n) if kind != "DELETED" else None, stop=self._stop,
                        on_error=lambda e: log.warning("watching node %s failed: %s", self.node, e), retry_seconds=2.0)

    # ---- the loop (asyncio) ------------------------------------------------------------------------
    def set_gpus(self, uuids: list[str], ready: bool, clique: str = "", healthy: int | None = None,
                 message: str = "") -> None:
        """This node's GPUs for every domain it joined: all its UUIDs, whether it is Ready (it has a
        healthy GPU), how many are healthy and why it is NotReady or some are not."""
        self.gpus = (uuids, ready, clique, healthy, message)
        for reconciler, _ in self.joined.values():
            reconciler.set_gpus(uuids, ready, clique, healthy, message)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.join_matching:
            start_thread("domains-watch", self._watch_domains, self._stop)
            start_thread("node-watch", self._watch_node, self._stop)
        self._changed.set()
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                with self._lock:
                    wanted = wanted_domains(self.named, self.join_matching, self.domains, self.labels, self.claims)
                wanted = {name for name in wanted if self._joinable(name)}
                for name in sorted(wanted - set(self.joined)):
                    reconciler = self.make_reconciler(name)
                    reconciler.on_observed = functools.partial(self._observed, name)
                    if self.view_root is not None:
                        reconciler.view_file = self.view_dir(name) / "peers"
                    reconciler.set_gpus(*self.gpus)
                    self.joined[name] = (reconciler, asyncio.create_task(reconciler.run(), name=f"domain-{name}"))
                    log.info("joined GPUDomain %s/%s%s", self.namespace, name,
                             "" if name == self.named else " (a channel claim prepared here holds it)"
                             if name in self.claims else " (its nodeSelector matches this node)")
                for name in sorted(set(self.joined) - wanted):
                    await self._leave(name, "it no longer matches this node")
        finally:
            self._stop.set()
            tasks = [task for _, task in self.joined.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _joinable(self, name: str) -> bool:
        why = domain_name_problem(name) if self.writes_members else None
        if why is not None and name not in self.refused:
            self.refused.add(name)
            log.warning("not joining GPUDomain %s/%s: %s", self.namespace, name, why)
        return why is None

    async def _leave(self, name: str, why: str) -> None:
        reconciler, task = self.joined.pop(name)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        removed = await in_daemon_thread(reconciler.remove_entry, reconciler.clock.monotonic() + self.leave_timeout)
        with self._views:
            self.views.pop(name, None)
        if self.view_root is not None:
            shutil.rmtree(self.view_dir(name), ignore_errors=True)  # no claim mounts it any more
        log.info("left GPUDomain %s/%s (%s)%s", self.namespace, name, why, "" if removed else ": entry NOT removed")

    async def remove_entries(self, seconds: float) -> None:
        """On shutdown (after the loop stopped): take this node's entry out of every domain joined, side by side
        and by one deadline, so that `seconds` (shutdownTimeout, inside the kubelet's grace period) bounds the
        whole removal however many domains were joined, not each in turn."""
        reconcilers = [reconciler for _, (reconciler, _) in sorted(self.joined.items())]
        await asyncio.gather(*(in_daemon_thread(r.remove_entry, r.clock.monotonic() + seconds) for r in reconcilers))

