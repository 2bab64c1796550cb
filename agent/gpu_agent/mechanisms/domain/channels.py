"""Each GPUDomain's channel ResourceClaimTemplate, made and owned by the domain's controller (issue 47).

A GPUDomain may name one (`spec.channel.resourceClaimTemplate.name`): the template a workload's pods claim the
domain's channel with, one `channel-0` device of the node agents' DRA driver (class `channelDeviceClassName`)
whose opaque ChannelConfig names the domain, so that the node agent preparing the claim joins it first. As
NVIDIA's ComputeDomain controller makes its workload template, the active cluster agent (the one folding the
domain's members, while it leads) makes it, in the domain's namespace:

    GPUDomains (list_then_watch) ───────────────┐
    our templates (list_then_watch, any label  ─┼──> due domains: a new spec (generation) or domain, an event of
      gpu-agent.io/domain-uid)                  │    one of its templates, every RESYNC s, a retry after a failure
    resync, retries (injected clock) ───────────┘                 │
                                                                  v
        one list of the namespace's labelled templates (+ a get of a wanted name not among them)
                                                                  │
                                                                  v
        plan(domain, templates, settings), pure ──> create | delete | recreate (delete, create) | conflict | wait
                                                                  │
                                                                  v
        the calls (each with _request_timeout; a delete with the read object's UID as precondition); a failure
        retries that domain with backoff; a conflict is a warning log line and an Event, once per domain and name

What `plan` decides:
- The domain being deleted, or no DRA driver configured: nothing (the garbage collector deletes the templates of
  a deleted domain). spec.channel absent: no template (one made before is deleted, below).
- The wanted name held by this domain's template (a controller ownerReference with the domain's UID) that asks
  what the domain asks (request, class, driver, ChannelConfig, our labels): kept. Asking something else (another
  allocationMode, class or driver): deleted and made again, since a ResourceClaimTemplate's spec is immutable.
  Claims already made from it belong to their pods and are not touched.
- The wanted name held by a template that is not this domain's: left alone (never taken over or deleted); the
  domain has no channel template until one of them is renamed, and the cluster agent says so once (a warning and,
  with an EventRecorder, a Warning Event ChannelTemplateConflict on the GPUDomain).
- Templates labelled with the domain's UID under another name (spec.channel removed or renamed): deleted.
- The wanted name held by this domain's template that is being deleted: wait, then make it again.

Why an ownerReference and not a finalizer (what the issue first asked for): the template goes with its domain
through Kubernetes' garbage collector, which needs nothing of ours. A finalizer on the GPUDomain would need a
running cluster agent to take it off: after `helm uninstall` (the CRDs and the users' domains stay), with the
agents scaled to zero, or between two leaders, deleting a domain would hang in Terminating until someone
removed the finalizer by hand, and the uninstall hook would have to strip it from every domain. The reference
has no blockOwnerDeletion: setting that needs update rights on gpudomains/finalizers (the
OwnerReferencesPermissionEnforcement admission plugin), and a foreground deletion of the domain gains nothing by
waiting for its template. An owner reference cannot cross namespaces, hence the template in the domain's own
(which is also where the workload's pods claim from it). Its apiVersion is the one this agent reads domains
with (writer.py's VERSION), which every release that can run it serves.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any, cast

from kubernetes import client

from gpu_agent.foundations.backoff import Backoff
from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.events import EventRecorder, reference
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT, api_message, api_status, items_of, list_then_watch
from gpu_agent.foundations.threads import StopEvent, start_thread
from gpu_agent.mechanisms.domain.members import DOMAIN_LABEL
from gpu_agent.mechanisms.domain.writer import GROUP, PLURAL, VERSION

log = get_logger(__name__)

RESOURCE_GROUP, RESOURCE_VERSION, TEMPLATES = "resource.k8s.io", "v1", "resourceclaimtemplates"
DOMAIN_UID_LABEL = "gpu-agent.io/domain-uid"
MANAGED_BY = ("app.kubernetes.io/managed-by", "gpu-agent")
REQUEST = "channel"  # the claim's request name, which the ChannelConfig applies to
CONFIG_API_VERSION, CONFIG_KIND = "gpu.gpu-agent.io/v1alpha1", "ChannelConfig"
ALLOCATION_MODES = ("Single", "All")
PREFERRED_VERSION = "v1beta1"  # what `kubectl events --for gpudomain/NAME` resolves the kind to (aggregate.py's)
CONFLICT_REASON = "ChannelTemplateConflict"
EVENT_ACTION = "MakeChannelTemplate"

Obj = dict[str, Any]


@dataclass(frozen=True)
class ChannelSettings:
    driver: str  # the DRA driver whose channel devices the template asks for (draDriverName); "": no templates
    device_class: str  # the DeviceClass of those devices (channelDeviceClassName)


@dataclass(frozen=True)
class Action:
    """One step of a domain's reconcile: create `body`; delete the template `name` whose UID is `uid` (a
    precondition: never another object made under the name since it was read); conflict (`name` is not this
    domain's: left alone, told); wait (`name` is this domain's and being deleted: look again later)."""
    verb: str  # create | delete | conflict | wait
    name: str
    why: str
    body: Obj | None = None
    uid: str = ""


def _meta(obj: Obj) -> Obj:
    return cast(Obj, obj.get("metadata") or {})


def channel_of(domain: Obj) -> Obj:
    spec = domain.get("spec") or {}
    channel = spec.get("channel") if isinstance(spec, dict) else None
    return channel if isinstance(channel, dict) else {}


def wanted_name(domain: Obj) -> str:
    """The channel template's name the domain asks for; "" for none (no spec.channel)."""
    template = channel_of(domain).get("resourceClaimTemplate")
    name = template.get("name") if isinstance(template, dict) else None
    return name if isinstance(name, str) else ""


def allocation_mode(domain: Obj) -> str:
    mode = channel_of(domain).get("allocationMode")
    return mode if mode in ALLOCATION_MODES else "Single"  # the CRD's default (and all it admits)


def labels_for(domain: Obj) -> dict[str, str]:
    meta = _meta(domain)
    return {DOMAIN_LABEL: str(meta.get("name", "")), DOMAIN_UID_LABEL: str(meta.get("uid", "")),
            MANAGED_BY[0]: MANAGED_BY[1]}


def template_for(domain: Obj, settings: ChannelSettings) -> Obj:
    """The ResourceClaimTemplate the domain asks for (one with a spec.channel)."""
    meta = _meta(domain)
    name, uid = str(meta.get("name", "")), str(meta.get("uid", ""))
    api_version = str(domain.get("apiVersion") or "")
    if not api_version.startswith(f"{GROUP}/"):
        api_version = f"{GROUP}/{VERSION}"
    return {
        "apiVersion": f"{RESOURCE_GROUP}/{RESOURCE_VERSION}", "kind": "ResourceClaimTemplate",
        "metadata": {"name": wanted_name(domain), "namespace": str(meta.get("namespace", "")),
                     "labels": labels_for(domain),
                     # no blockOwnerDeletion: it would need update rights on gpudomains/finalizers (module docstring)
                     "ownerReferences": [{"apiVersion": api_version, "kind": "GPUDomain", "name": name, "uid": uid,
                                          "controller": True}]},
        "spec": {"spec": {"devices": {
            "requests": [{"name": REQUEST, "exactly": {"deviceClassName": settings.device_class,
                                                       "allocationMode": "ExactCount", "count": 1}}],
            "config": [{"requests": [REQUEST], "opaque": {"driver": settings.driver, "parameters": {
                "apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "domain": name, "domainUID": uid,
                "allocationMode": allocation_mode(domain)}}}]}}},
    }


def controller_of(template: Obj) -> Obj | None:
    """The template's controller ownerReference, if it has one."""
    for ref in _meta(template).get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller"):
            return ref
    return None


def is_domains(template: Obj, domain: Obj) -> bool:
    """Whether `template` is this domain's: its controller is a GPUDomain with the domain's UID."""
    ref = controller_of(template)
    uid = _meta(domain).get("uid")
    return bool(ref is not None and uid and ref.get("kind") == "GPUDomain" and ref.get("uid") == uid
                and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"))


def _asks(template: Obj) -> Any:
    """What a template asks for, as far as this module sets it: the request, class and count; each config's
    requests, driver and parameters; our labels. Fields the API server may default or add are left out, so a
    template read back compares equal to the one written."""
    devices = ((template.get("spec") or {}).get("spec") or {}).get("devices") or {}
    requests = []
    for r in devices.get("requests") or []:
        exactly = r.get("exactly") or {}
        requests.append((r.get("name"), exactly.get("deviceClassName"), exactly.get("allocationMode", "ExactCount"),
                         exactly.get("count", 1), sorted(k for k in r if k not in ("name", "exactly"))))
    configs = [(list(c.get("requests") or []), (c.get("opaque") or {}).get("driver"),
                (c.get("opaque") or {}).get("parameters")) for c in devices.get("config") or []]
    labels = _meta(template).get("labels") or {}
    ours = {k: labels.get(k) for k in (DOMAIN_LABEL, DOMAIN_UID_LABEL, MANAGED_BY[0])}
    return requests, configs, sorted(k for k in devices if k not in ("requests", "config")), ours


def describe_owner(template: Obj) -> str:
    ref = controller_of(template)
    if ref is None:
        return "it has no controller: someone else made it"
    return f"its controller is {ref.get('kind', '?')} {ref.get('name', '?')} (uid {ref.get('uid', '?')})"


def acts_on(domain: Obj, settings: ChannelSettings) -> bool:
    """Whether the domain's templates are this controller's to change: a DRA driver is configured, and the domain
    (with its UID) is not being deleted."""
    meta = _meta(domain)
    return bool(settings.driver and meta.get("uid") and not meta.get("deletionTimestamp"))


def plan(domain: Obj, templates: list[Obj], settings: ChannelSettings) -> list[Action]:
    """What to do about a domain's channel template, given the templates that bear on it: those labelled with its
    UID and the one of the wanted name, if any (the caller reads them). Deletions come first. Nothing for a domain
    being deleted (the garbage collector deletes its templates), or without a DRA driver to ask a channel of."""
    if not acts_on(domain, settings):
        return []
    uid = str(_meta(domain).get("uid"))
    wanted = wanted_name(domain)
    actions: list[Action] = []
    holder: Obj | None = None
    seen: set[str] = set()
    for t in templates:
        name = str(_meta(t).get("name") or "")
        if not name or name in seen:
            continue
        seen.add(name)
        if name == wanted:
            holder = t
        elif (_meta(t).get("labels") or {}).get(DOMAIN_UID_LABEL) == uid:
            why = "spec.channel removed" if not wanted else f"spec.channel now names {wanted}"
            actions.append(Action("delete", name, why, uid=str(_meta(t).get("uid") or "")))
    if not wanted:
        return actions
    body = template_for(domain, settings)
    if holder is None:
        actions.append(Action("create", wanted, "named by spec.channel", body=body))
    elif not is_domains(holder, domain):
        actions.append(Action("conflict", wanted, describe_owner(holder)))
    elif _meta(holder).get("deletionTimestamp"):
        actions.append(Action("wait", wanted, "being deleted"))
    elif _asks(holder) != _asks(body):
        why = "it asks for something else than the domain now does (a template's spec is immutable)"
        actions += [Action("delete", wanted, why, uid=str(_meta(holder).get("uid") or "")),
                    Action("create", wanted, "made again as the domain asks", body=body)]
    return actions


class NotYet(Exception):
    """A domain whose template cannot be made yet (its old one is still being deleted, one of its name was made
    meanwhile): looked at again after a backoff, without a warning."""


@dataclass
class _Domain:
    obj: Obj
    due: float | None = None  # monotonic time of its next reconcile; None: none pending
    tried: tuple[Any, Any] | None = None  # (uid, generation) of its last reconcile
    backoff: Backoff | None = None  # while its reconciles fail
    told: set[str] = field(default_factory=set)  # template names whose conflict was told (until it resolves)

    def soon(self, when: float) -> None:
        self.due = when if self.due is None else min(self.due, when)


def _key(domain: Obj) -> tuple[Any, Any]:
    return _meta(domain).get("uid"), _meta(domain).get("generation")


class ChannelTemplates:
    """The channel templates of a namespace's GPUDomains (or of one, `domain`), while it runs: started and stopped
    with the domain aggregator by the cluster agent (only while it leads)."""

    RESYNC = 60.0  # every domain is reconciled this often, whatever the watches say
    RETRY_INITIAL = 1.0

    def __init__(self, api: client.ApiClient | None, namespace: str, settings: ChannelSettings, *, domain: str = "",
                 clock: Clock | None = None, rng: random.Random | None = None, recorder: EventRecorder | None = None,
                 custom_api: Any = None, resync: float = RESYNC) -> None:
        """`domain`: only that GPUDomain ("": every one of the namespace). `custom_api`: the API client's
        CustomObjectsApi unless handed one (unit tests hand in fakes)."""
        self.custom: Any = custom_api if custom_api is not None else client.CustomObjectsApi(api)
        self.namespace = namespace
        self.settings = settings
        self.domain = domain
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.recorder = recorder
        self.resync = resync
        self.domains: dict[str, _Domain] = {}
        self.calls = 0  # API calls made by the reconciles (not the watches)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.stop_event = StopEvent()  # its set also shuts the watches' connections (foundations/threads.py)

    # -- what the watches deliver (their threads) --------------------------------------------------------------------

    def domains_listed(self, listed: Any) -> None:
        """A (re)list of the domains: every one is due (what happened meanwhile is unknown)."""
        now = self.clock.monotonic()
        objs = {str(_meta(o).get("name")): o for o in items_of(listed)}
        with self._lock:
            for name in set(self.domains) - set(objs):
                del self.domains[name]  # deleted meanwhile: the garbage collector deletes its templates
            for name, obj in objs.items():
                self._keep(name, obj).soon(now)
        self._wake.set()

    def domain_event(self, kind: str, obj: Obj) -> None:
        """A domain's change: due at once when it is new or its spec moved (its generation) since its last
        reconcile; a status write (the aggregator's folds) is not, nor does it cut short a failing one's backoff."""
        name = str(_meta(obj).get("name"))
        with self._lock:
            if kind == "DELETED":
                self.domains.pop(name, None)  # the garbage collector deletes its templates
                return
            d = self._keep(name, obj)
            if d.tried != _key(obj):
                d.soon(self.clock.monotonic())
        self._wake.set()

    def templates_listed(self, listed: Any) -> None:
        for t in items_of(listed):
            self.template_event("LISTED", t)

    def template_event(self, kind: str, template: Obj) -> None:
        """One of our templates changed or went (someone deleted it): its domain is looked at again."""
        uid = (_meta(template).get("labels") or {}).get(DOMAIN_UID_LABEL)
        with self._lock:
            for d in self.domains.values():
                if _meta(d.obj).get("uid") == uid and d.backoff is None:
                    d.soon(self.clock.monotonic())
        self._wake.set()

    def _keep(self, name: str, obj: Obj) -> _Domain:
        d = self.domains.get(name)
        if d is None or _meta(d.obj).get("uid") != _meta(obj).get("uid"):  # new, or deleted and made again
            d = self.domains[name] = _Domain(obj)
        d.obj = obj
        return d

    # -- the loop ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        start_thread("channel-domains-watch", self._watch_domains, self.stop_event)
        start_thread("channel-templates-watch", self._watch_templates, self.stop_event)
        next_resync = self.clock.monotonic() + self.resync
        while not self.stop_event.is_set():
            self._wake.clear()
            now = self.clock.monotonic()
            if now >= next_resync:
                with self._lock:
                    for d in self.domains.values():
                        d.soon(now)
                next_resync = now + self.resync
            names = self.take_due(now)
            if names:
                self.sync(names)
                continue
            with self._lock:
                soonest = min((d.due for d in self.domains.values() if d.due is not None), default=next_resync)
            self.clock.wait_blocking(self._wake, max(0.0, min(soonest, next_resync) - now))

    def stop(self) -> None:
        self.stop_event.set()
        self._wake.set()

    def take_due(self, now: float) -> list[str]:
        with self._lock:
            names = sorted(n for n, d in self.domains.items() if d.due is not None and d.due <= now)
            for n in names:
                self.domains[n].due = None
        return names

    def _watch_domains(self) -> None:
        selector: dict[str, Any] = {"field_selector": f"metadata.name={self.domain}"} if self.domain else {}
        list_then_watch(self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                        on_list=self.domains_listed, on_event=self.domain_event, stop=self.stop_event, clock=self.clock,
                        retry_seconds=2.0, **selector,
                        on_error=lambda e: log.warning(
                            "watching GPUDomains of %s for their channel templates failed: %s", self.namespace, e))

    def _watch_templates(self) -> None:
        list_then_watch(self.custom.list_namespaced_custom_object, RESOURCE_GROUP, RESOURCE_VERSION, self.namespace,
                        TEMPLATES, label_selector=DOMAIN_UID_LABEL, on_list=self.templates_listed,
                        on_event=self.template_event, stop=self.stop_event, clock=self.clock, retry_seconds=2.0,
                        on_error=lambda e: log.warning("watching the channel ResourceClaimTemplates of %s failed: %s",
                                                       self.namespace, e))

    # -- reconciling ------------------------------------------------------------------------------------------------

    def sync(self, names: list[str]) -> None:
        """Reconcile these domains: one list of the namespace's labelled templates, then each domain's plan."""
        try:
            self.calls += 1
            listed = self.custom.list_namespaced_custom_object(RESOURCE_GROUP, RESOURCE_VERSION, self.namespace,
                                                               TEMPLATES, label_selector=DOMAIN_UID_LABEL,
                                                               _request_timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - API trouble: each domain retries with its backoff
            log.warning("listing the channel ResourceClaimTemplates of %s failed: %s", self.namespace, _why(e))
            for name in names:
                self._failed(name)
            return
        by_uid: dict[str, list[Obj]] = {}
        for t in items_of(listed):
            by_uid.setdefault(str((_meta(t).get("labels") or {}).get(DOMAIN_UID_LABEL)), []).append(t)
        for name in names:
            with self._lock:
                d = self.domains.get(name)
                if d is None:
                    continue  # deleted meanwhile
                obj, d.tried = d.obj, _key(d.obj)
            try:
                self.reconcile(obj, by_uid.get(str(_meta(obj).get("uid")), []))
            except NotYet as e:
                log.v(2, "channel template of GPUDomain %s/%s: %s; looking again", self.namespace, name, e)
                self._failed(name)
            except Exception as e:  # noqa: BLE001 - API trouble: this domain retries with its backoff
                log.warning("channel template of GPUDomain %s/%s: %s", self.namespace, name, _why(e))
                self._failed(name)
            else:
                with self._lock:
                    if name in self.domains:
                        self.domains[name].backoff = None

    def _failed(self, name: str) -> None:
        with self._lock:
            d = self.domains.get(name)
            if d is None:
                return
            if d.backoff is None:
                d.backoff = Backoff(self.RETRY_INITIAL, self.resync, 2.0, 0.2, self.rng)
            d.soon(self.clock.monotonic() + d.backoff.next_delay())
        self._wake.set()

    def reconcile(self, domain: Obj, labelled: list[Obj]) -> list[Action]:
        """Plan the domain's templates from `labelled` (those carrying its UID) and the one of the wanted name (read
        here when it is not among them), then act; raises on a failed call. Returns what it did."""
        templates = list(labelled)
        wanted = wanted_name(domain) if acts_on(domain, self.settings) else ""
        if wanted and not any(_meta(t).get("name") == wanted for t in templates):
            there = self._get(wanted)
            if there is not None:
                templates.append(there)
        actions = plan(domain, templates, self.settings)
        where = f"{self.namespace}/{_meta(domain).get('name')}"
        conflicts = {a.name for a in actions if a.verb == "conflict"}
        with self._lock:
            d = self.domains.get(str(_meta(domain).get("name")))
            told = d.told if d is not None else set()
            told &= conflicts  # a conflict that resolved is told again should it come back
        for a in actions:
            if a.verb == "delete":
                self._delete(a.name, a.uid)
                log.info("deleted ResourceClaimTemplate %s/%s of GPUDomain %s: %s", self.namespace, a.name, where,
                         a.why)
            elif a.verb == "create":
                self._create(cast(Obj, a.body))
                log.info("made ResourceClaimTemplate %s/%s, the channel of GPUDomain %s (allocationMode %s)",
                         self.namespace, a.name, where, allocation_mode(domain))
            elif a.verb == "conflict" and a.name not in told:
                told.add(a.name)
                self._tell_conflict(domain, a)
            elif a.verb == "wait":
                raise NotYet(f"ResourceClaimTemplate {a.name} is {a.why}")
        return actions

    def _get(self, name: str) -> Obj | None:
        self.calls += 1
        try:
            return cast(Obj, self.custom.get_namespaced_custom_object(RESOURCE_GROUP, RESOURCE_VERSION, self.namespace,
                                                                     TEMPLATES, name, _request_timeout=REQUEST_TIMEOUT))
        except Exception as e:  # noqa: BLE001 - a 404 is an answer; anything else fails this reconcile
            if api_status(e) == 404:
                return None
            raise RuntimeError(f"reading ResourceClaimTemplate {self.namespace}/{name} failed: {_why(e)}") from None

    def _create(self, body: Obj) -> None:
        name = _meta(body).get("name")
        self.calls += 1
        try:
            self.custom.create_namespaced_custom_object(RESOURCE_GROUP, RESOURCE_VERSION, self.namespace, TEMPLATES,
                                                        body, _request_timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - a 409 is an answer; anything else fails this reconcile
            if api_status(e) == 409:  # made meanwhile (by someone, or the old one not gone yet): look at it again
                raise NotYet(f"ResourceClaimTemplate {name} already exists") from None
            raise RuntimeError(f"making ResourceClaimTemplate {self.namespace}/{name} failed: {_why(e)}") from None

    def _delete(self, name: str, uid: str) -> None:
        self.calls += 1
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)) if uid else None
        try:
            self.custom.delete_namespaced_custom_object(RESOURCE_GROUP, RESOURCE_VERSION, self.namespace, TEMPLATES,
                                                        name, body=options, _request_timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - a 404 or 409 is an answer; anything else fails this reconcile
            if api_status(e) == 404:
                return  # gone already
            if api_status(e) == 409:  # another object under the name since it was read: look again
                raise NotYet(f"ResourceClaimTemplate {name} changed since it was read") from None
            raise RuntimeError(f"deleting ResourceClaimTemplate {self.namespace}/{name} failed: {_why(e)}") from None

    def _tell_conflict(self, domain: Obj, a: Action) -> None:
        note = (f"ResourceClaimTemplate {self.namespace}/{a.name}, named by spec.channel.resourceClaimTemplate.name, "
                f"is not this GPUDomain's ({a.why}): it is left alone, and the domain has no channel template. "
                f"Rename one of them: the domain's spec.channel.resourceClaimTemplate.name, or the other template")
        log.warning("GPUDomain %s/%s: %s", self.namespace, _meta(domain).get("name"), note)
        if self.recorder is not None:
            regarding = reference({**domain, "apiVersion": f"{GROUP}/{PREFERRED_VERSION}", "kind": "GPUDomain"})
            self.recorder.record(regarding, "Warning", CONFLICT_REASON, EVENT_ACTION, note)


def _why(e: BaseException) -> str:
    status = api_status(e)
    if status is None:
        return str(e) or type(e).__name__
    return f"{status} {getattr(e, 'reason', '') or ''}: {api_message(e)}".rstrip(": ")
