"""The reference control plane's HTTP/JSON server: api.ROUTES served by waitress (foundations/http).

A request passes these steps in order, and each can only answer with a documented error:

    route (404, 405 with Allow) -> token (401, 403) -> fault injection (/admin/faults: 404 while
    off) -> body: type (415), JSON (400), model (422) -> handler (register, deregister: may this
    token act for the body's clusterId, 403) -> response model

The token is checked before the body is read, so an unauthenticated client never gets its body
parsed. Every token is compared in constant time; credentials and clusters' own tokens are looked up by hash.
The registration and admin tokens may come from files, read again when they change (a rotated Secret needs no
restart); the token a change replaced is still accepted for tokenOverlap, then refused as any wrong token
(foundations/token_file.py).

Cluster identity: a registration token either is the shared one (`registrationToken`) or belongs to one cluster
(issued through POST /admin/clusters/{clusterId}/token). Once a cluster's own token is used, only it registers or
deregisters that cluster; the shared token may still act for clusters without one, and one cluster's token never
for another (403, naming the fix). Why not bind a clusterId to its first registrant's credential instead: an agent
keeps its credential in memory only, so a restarted agent, a second replica, the new pod of a rolling update and the
chart's uninstall hook all come with the registration token alone, and with a shared token nothing tells them from
another cluster's agent. A token of the cluster's own, in the Secret those already read, does (store.py).

A long-polled lease call holds a worker for its wait, so at most api.MAX_LONG_POLLS wait at once, and at
most api.MAX_LONG_POLLS_PER_CREDENTIAL for one credential; one more is answered 429 with Retry-After
at once (16 long-polls from one credential took every worker: /healthz went unanswered, issue 48).

Fault injection is a test facility, off unless the control plane runs with faultInjection
(`--fault-injection=true`; the chart's controlPlane.faultInjection): without it /admin/faults
answers 404 naming the setting. Faults armed through /admin/faults apply to the next matching
calls that passed the token check (never to /healthz or /admin): answer with a 5xx status, delay,
drop the connection mid-response, return a malformed body, or hang (hold the call unanswered
until DELETE /admin/faults clears the faults, then answer it late: a wedged control plane). A call its token would have refused
gets its 401 or 403, never an injected answer, and does not use up a fault.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

from pydantic import ValidationError

from gpu_agent.foundations import http, malloc
from gpu_agent.foundations.klog import get_logger, quote
from gpu_agent.foundations.secrets import Secret
from gpu_agent.foundations.token_file import TokenSource, as_source
from gpu_agent.roles.control_plane import api
from gpu_agent.roles.control_plane.store import Fenced, Store

log = get_logger(__name__)

LIST_LIMIT = 200  # GET /v1/queue/items shows the newest items only
CONNECTION_LIMIT = 512  # connections open at once: a few per cluster (agents, hooks, `gpu-agent queue`)


@dataclass
class Fault:
    mode: str
    remaining: int
    status: int = 503
    delay: float = 0.0
    path: str = ""
    retry_after: int | None = None


class Faults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[Fault] = []
        self._release = threading.Event()  # set by clear(): ends every hang
        self._hung = 0

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self._armed.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()
            self._release.set()  # every hung call goes on; a hang armed later waits on a new event
            self._release = threading.Event()

    def hang(self, fault: Fault) -> bool:
        """Hold a call until the faults are cleared (or the fault's delay, or the limit, passes); False, at once,
        if MAX_HUNG_CALLS already hang: the caller drops that call instead, so that a worker stays free."""
        with self._lock:
            if self._hung >= api.MAX_HUNG_CALLS:
                return False
            self._hung += 1
            release = self._release
        try:
            release.wait(fault.delay or api.HANG_LIMIT_SECONDS)
        finally:
            with self._lock:
                self._hung -= 1
        return True

    def take(self, path: str) -> Fault | None:
        with self._lock:
            for f in self._armed:
                if f.remaining > 0 and path.startswith(f.path):
                    f.remaining -= 1
                    if f.remaining == 0:
                        self._armed.remove(f)
                    return f
        return None


class LongPolls:
    """How many long-polled calls wait, per credential (by its hash) and in all; `hold` refuses one past either bound."""

    def __init__(self, total: int = api.MAX_LONG_POLLS, per_credential: int = api.MAX_LONG_POLLS_PER_CREDENTIAL) -> None:
        self.total, self.per_credential = total, per_credential
        self._lock = threading.Lock()
        self._held: dict[bytes, int] = {}
        self._count = 0

    @property
    def waiting(self) -> int:
        return self._count

    @contextmanager
    def hold(self, token: str) -> Iterator[None]:
        key = hashlib.sha256(token.encode()).digest()
        with self._lock:
            mine = self._held.get(key, 0)
            if mine >= self.per_credential or self._count >= self.total:
                whose = (f"{mine} long-polled lease calls already wait for this credential (at most {self.per_credential})"
                         if mine >= self.per_credential else
                         f"{self._count} long-polled lease calls already wait (at most {self.total} at once)")
                raise Refused(429, f"{whose}: call again after Retry-After, or lease with waitSeconds 0",
                              [("Retry-After", str(api.LONG_POLL_RETRY_AFTER_SECONDS))])
            self._held[key] = mine + 1
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
                if self._held[key] <= 1:
                    del self._held[key]
                else:
                    self._held[key] -= 1


@dataclass(frozen=True)
class ServerSettings:
    # Each a token, or a token file read again when it changes, whose previous token is accepted for its overlap
    # (foundations/token_file.py): a rotated Secret needs no restart, and no client is refused while it moves over.
    registration_token: Secret | TokenSource
    admin_token: Secret | TokenSource
    credential_ttl: float
    max_lease_seconds: float
    reregister_after: float
    max_lease_wait: float = 30.0  # longest a lease call is held (tests shorten it)
    fault_injection: bool = False  # /admin/faults arms faults (a test facility); off: it answers 404
    credential_overlap: float = 60.0  # how long an agent's previous credential keeps working beside its successor


class Refused(Exception):
    """An answer other than the handler's success: a status and a message for the client."""

    def __init__(self, status: int, message: str, headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or []


def _depth(doc: Any) -> int:
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(value, dict):
            stack.extend((v, d + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, d + 1) for v in value)
    return deepest


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_body(environ: dict[str, Any], model: type[api.Model]) -> api.Model:
    content_type = environ.get("CONTENT_TYPE", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise Refused(415, f"the body must be application/json (got {content_type or 'no Content-Type'})")
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise Refused(400, "Content-Length is not a number") from None
    raw = environ["wsgi.input"].read(length) if length > 0 else b""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise Refused(400, "the body is not UTF-8") from None
    except RecursionError:
        raise Refused(400, "the body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, integers over Python's digit limit
        raise Refused(400, f"the body is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(doc, dict):
        raise Refused(422, "the body must be a JSON object")
    if _depth(doc) > api.MAX_PAYLOAD_DEPTH + 2:
        raise Refused(422, f"the body is nested more than {api.MAX_PAYLOAD_DEPTH} deep")
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "too_long" and "ctx" in first:  # a list over its limit: say by how much and what to send
            limit, hint = first["ctx"]["max_length"], api.LIST_LIMIT_HINTS.get(where)
            raise Refused(422, f"field {where!r}: {first['ctx'].get('actual_length', 'too many')} items, more than the "
                               f"{limit} one request may hold" + (f"; {hint}" if hint else "")) from None
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise Refused(422, f"field {where!r}: {first['msg']}{more}") from None


class ControlPlane:
    """The API's behaviour, one method per route name; the WSGI app around it is `__call__`."""

    def __init__(self, store: Store, settings: ServerSettings) -> None:
        self.store = store
        self.settings = settings
        self.faults = Faults()
        self.long_polls = LongPolls()
        self.admin_tokens = as_source(settings.admin_token)
        self.registration_tokens = as_source(settings.registration_token)

    # ---- authorization -----------------------------------------------------------------------

    @staticmethod
    def _matches(presented: str, expected: TokenSource) -> str | None:
        """Whether `presented` is the current token ("current"), or the one it replaced, still within its overlap
        ("previous"); None when neither. Every accepted token is compared, in constant time."""
        found = None
        for which, accepted in zip(("current", "previous"), expected.accepted(), strict=False):
            if accepted and hmac.compare_digest(presented.encode(), accepted.reveal().encode()):
                found = found or which
        return found

    def _token_is(self, presented: str, expected: TokenSource) -> bool:
        return self._matches(presented, expected) is not None

    def authorize(self, token: str, allowed: frozenset[str]) -> str | None:
        """The cluster id a credential belongs to (None for the other tokens); raises Refused."""
        if not token:
            raise Refused(401, "missing bearer token", [("WWW-Authenticate", "Bearer")])
        kinds = []
        if self._token_is(token, self.admin_tokens):
            kinds.append("admin")
        if self._token_is(token, self.registration_tokens):
            kinds.append("registration")
        cluster_id, state = (None, "unknown") if kinds else self.store.credential_status(token)
        if state == "valid":
            kinds.append("credential")
        elif state == "unknown" and not kinds and self.store.cluster_of_token(token) is not None:
            kinds.append("registration")  # a cluster's own: which cluster it may act for is checked with the body
        if allowed.intersection(kinds):
            return cluster_id
        if kinds:
            raise Refused(403, f"this endpoint takes a {' or '.join(sorted(allowed))} token, not a {kinds[0]} token")
        if state == "expired":
            raise Refused(401, "credential expired: renew before expiry or register again", [("WWW-Authenticate", "Bearer")])
        raise Refused(401, "token not accepted", [("WWW-Authenticate", "Bearer")])

    # ---- handlers: (status, response model or None) -----------------------------------------

    def healthz(self, **_: Any) -> tuple[int, api.Model]:
        return 200, api.Healthy(status="ok")

    def openapi(self, **_: Any) -> tuple[int, dict[str, Any]]:
        return 200, api.document()

    def _admit(self, token: str, cluster_id: str, what: str) -> None:
        """Refused (403) unless `token` may register or deregister `cluster_id` (see the module's docstring)."""
        refusal = self.store.admit(cluster_id, token, self._token_is(token, self.registration_tokens))
        if refusal is None:
            return
        why, owner = refusal
        if why == "other-cluster":
            raise Refused(403, f"this registration token belongs to cluster {owner!r}, not to {cluster_id!r}: a "
                               f"cluster's own token may {what} that cluster only; to {what} {cluster_id!r}, use its "
                               "own token")
        raise Refused(403, f"cluster {cluster_id!r} has a registration token of its own, and this is not it: {what} "
                           "it with that token (the Secret its agent and cleanup hook read); an operator who lost it "
                           f"issues a new one with POST /admin/clusters/{cluster_id}/token, or lets the shared token "
                           f"act for it again with DELETE /admin/clusters/{cluster_id}/token (both with the admin token)")

    def register(self, body: api.RegisterRequest, token: str, **_: Any) -> tuple[int, api.Model]:
        self._admit(token, body.clusterId, "register")
        listed = len(body.gpus)
        # Straight to JSON, not through a dict per GPU: 16,384 of them would double the request's peak memory.
        registration_id = self.store.register(body.clusterId, body.generation, api.GPU_LIST.dump_json(body.gpus).decode(),
                                              body.gpu_count)
        credential, expires_at = self.store.issue_credential(body.clusterId, self.settings.credential_ttl, body.holder,
                                                             self.settings.credential_overlap)
        listed_note = f" ({listed} listed)" if body.gpu_count > listed else ""
        # Who still uses the token a rotation replaced: the operator sees which agents have yet to move over.
        previous = (", with the previous registration token, accepted until its overlap ends: this agent has not "
                    "read the new one yet" if self._matches(token, self.registration_tokens) == "previous" else "")
        log.info("cluster %s registered %d GPUs%s (generation %d)%s", quote(body.clusterId), body.gpu_count,
                 listed_note, body.generation, previous)
        return 200, api.RegisterResponse(registrationId=registration_id, reregisterAfterSeconds=self.settings.reregister_after,
                                         credential=api.Credential(token=credential,
                                                                   expiresInSeconds=self.settings.credential_ttl,
                                                                   expiresAt=expires_at))

    def deregister(self, body: api.DeregisterRequest, token: str, **_: Any) -> tuple[int, api.Model]:
        self._admit(token, body.clusterId, "deregister")
        found = self.store.deregister(body.clusterId)
        log.info("cluster %s deregistered%s", quote(body.clusterId), "" if found else " (was not registered)")
        return 200, api.DeregisterResponse(deregistered=found)

    def renew(self, token: str, **_: Any) -> tuple[int, api.Model]:
        # The old credential is not revoked at once: calls already under way with it (a lease renewal, an ack)
        # still land, and an agent whose answer was lost can renew again with it, for credential_overlap.
        try:
            cluster_id, fresh, expires_at = self.store.renew_credential(token, self.settings.credential_ttl,
                                                                        self.settings.credential_overlap)
        except KeyError:  # deregistered between the token check and here
            raise Refused(401, "token not accepted", [("WWW-Authenticate", "Bearer")]) from None
        log.v(1, "cluster %s renewed its credential", quote(cluster_id))
        return 200, api.RenewResponse(credential=api.Credential(token=fresh, expiresInSeconds=self.settings.credential_ttl,
                                                                expiresAt=expires_at))

    def list_items(self, **_: Any) -> tuple[int, api.Model]:
        return 200, api.ItemList(items=[api.ItemSummary(**i) for i in self.store.list_items(LIST_LIMIT)])

    def enqueue(self, body: api.EnqueueRequest, **_: Any) -> tuple[int, api.Model]:
        item_id, created = self.store.enqueue(body.idempotencyKey, body.payload.model_dump(exclude_unset=True))
        return (201 if created else 200), api.EnqueueResponse(id=item_id, created=created)

    def start_term(self, body: api.TermRequest, **_: Any) -> tuple[int, api.Model]:
        term, handed_back = self.store.start_term(body.holder)
        log.info("term %d started by %s; %d lease(s) of older terms handed back", term, quote(body.holder), handed_back)
        return 200, api.TermStarted(term=term, handedBack=handed_back)

    def deliveries(self, **_: Any) -> tuple[int, api.Model]:
        return 200, api.DeliveryLog(deliveries=[api.Delivery(**d) for d in self.store.delivery_log(1000)])

    @staticmethod
    def _fenced(call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except Fenced as e:
            raise Refused(409, str(e)) from None

    def lease(self, body: api.LeaseRequest, token: str, **_: Any) -> tuple[int, api.Model | None]:
        s = self.settings
        seconds = min(body.leaseSeconds or s.max_lease_seconds, s.max_lease_seconds)
        wait = min(body.waitSeconds, s.max_lease_wait)
        if wait > 0:
            with self.long_polls.hold(token):
                items = self._fenced(self.store.lease_waiting, seconds, wait, body.holder, body.term, body.maxItems)
        else:
            items = self._fenced(self.store.lease_waiting, seconds, 0.0, body.holder, body.term, body.maxItems)
        if not items:
            return 204, None
        more = [api.OneLeasedItem(**item) for item in items[1:]]
        return 200, api.LeasedItem(**items[0], more=more or None)

    def _item(self, params: dict[str, str], body: api.LeaseRef, call: Any, *more: Any) -> str:
        """`call` (the store's ack or release) on the item the path names, its refusals as HTTP errors."""
        item_id = int(params["itemId"])
        result = "unknown" if item_id > api.INT64_MAX else self._fenced(call, item_id, body.leaseId, body.term, *more)
        if result == "unknown":
            raise Refused(404, f"no item {item_id}")
        if result == "stale-lease":
            raise Refused(409, f"that lease is no longer the current lease of item {item_id}")
        return result

    def ack(self, params: dict[str, str], body: api.LeaseRef, **_: Any) -> tuple[int, api.Model]:
        return 200, api.ItemResult(result=cast(api.ItemOutcome, self._item(params, body, self.store.ack)))

    def release(self, params: dict[str, str], body: api.ReleaseRequest, **_: Any) -> tuple[int, api.Model]:
        result = self._item(params, body, self.store.release, body.error)
        if result in ("retrying", "failed"):
            log.warning("item %s: an attempt failed (%s)%s", params["itemId"], quote(body.error or ""),
                        "; no attempt left: the item is failed" if result == "failed" else "; retried after a backoff")
        return 200, api.ItemResult(result=cast(api.ItemOutcome, result))

    def renew_lease(self, params: dict[str, str], body: api.LeaseRenewal, **_: Any) -> tuple[int, api.Model]:
        item_id = int(params["itemId"])
        seconds = min(body.leaseSeconds or self.settings.max_lease_seconds, self.settings.max_lease_seconds)
        result = "unknown" if item_id > api.INT64_MAX else self._fenced(self.store.renew, item_id, body.leaseId, seconds,
                                                                         body.term)
        if result == "unknown":
            raise Refused(404, f"no item {item_id}")
        if result == "stale-lease":
            raise Refused(409, f"that lease of item {item_id} expired or is no longer its current lease")
        return 200, api.RenewedLease(result="renewed", leaseExpiresInSeconds=seconds)

    def item_state(self, params: dict[str, str], **_: Any) -> tuple[int, api.Model]:
        item_id = int(params["itemId"])
        state = None if item_id > api.INT64_MAX else self.store.item_state(item_id)
        if state is None:
            raise Refused(404, f"no item {item_id}")
        return 200, api.ItemState(id=item_id, state=cast(api.ItemStateName, state))

    def status(self, **_: Any) -> tuple[int, api.Model]:
        return 200, api.StatusResponse.model_validate(self.store.status())

    @staticmethod
    def _cluster_param(params: dict[str, str]) -> str:
        cluster_id = params["clusterId"]
        if not api.CLUSTER_ID_PATTERN.fullmatch(cluster_id):
            raise Refused(422, "path parameter 'clusterId': " + api.CLUSTER_ID_RULE)
        return cluster_id

    def issue_cluster_token(self, params: dict[str, str], **_: Any) -> tuple[int, api.Model]:
        cluster_id = self._cluster_param(params)
        token, replaced = self.store.issue_cluster_token(cluster_id)
        log.info("cluster %s was given a registration token of its own%s; it takes over at its first use",
                 quote(cluster_id), " (replacing the one it had)" if replaced else "")
        return 200, api.ClusterToken(clusterId=cluster_id, registrationToken=token, replaced=replaced)

    def reset_cluster_token(self, params: dict[str, str], **_: Any) -> tuple[int, api.Model]:
        cluster_id = self._cluster_param(params)
        found = self.store.reset_cluster_token(cluster_id)
        log.info("cluster %s: %s", quote(cluster_id), "its own registration token forgotten: the shared token acts for "
                 "it again" if found else "had no registration token of its own")
        return 200, api.ClusterTokenReset(clusterId=cluster_id, reset=found)

    def arm_fault(self, body: api.FaultRequest, **_: Any) -> tuple[int, api.Model]:
        self.faults.arm(Fault(body.mode, body.count, body.status, body.delaySeconds, body.path, body.retryAfterSeconds))
        log.info("fault armed: %s x%d on %s", body.mode, body.count, quote(body.path) if body.path else "every path")
        return 200, api.Armed(armed=True)

    def clear_faults(self, **_: Any) -> tuple[int, api.Model]:
        self.faults.clear()
        return 200, api.Cleared(cleared=True)

    # ---- the WSGI app ------------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: http.StartResponse) -> list[bytes]:
        started = time.monotonic()
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        status = 500
        try:
            status, out = self._answer(environ, start_response, method, path)
            return out
        except Refused as e:
            status = e.status
            return http.error(start_response, e.status, str(e), e.headers)
        except Exception:  # a bug, not the client's doing: logged, answered 500
            log.error("%s %s failed", method, quote(path), exc_info=True)
            return http.error(start_response, 500, "internal error")
        finally:
            log.v(6, "%s %s -> %d (%.1f ms)", method, quote(path), status, (time.monotonic() - started) * 1000)

    def _answer(self, environ: dict[str, Any], start_response: http.StartResponse, method: str,
                path: str) -> tuple[int, list[bytes]]:
        route, params, allowed = api.match(method, path)
        if route is None:
            if allowed:
                raise Refused(405, f"{method} is not allowed on {path}; use {', '.join(allowed)}",
                              [("Allow", ", ".join(allowed))])
            raise Refused(404, f"no endpoint {path}")
        # The token first: a call it refuses gets its 401 or 403, never an injected fault.
        auth = environ.get("HTTP_AUTHORIZATION", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        cluster_id = self.authorize(token, route.tokens) if route.tokens else None
        if route.name in ("arm_fault", "clear_faults") and not self.settings.fault_injection:
            raise Refused(404, api.FAULT_INJECTION_OFF)
        fault = None
        if self.settings.fault_injection and route.name != "healthz" and not path.startswith("/admin/"):
            fault = self.faults.take(path)
        if fault is not None:
            log.v(2, "injecting fault %s into %s %s", fault.mode, method, path)
            if fault.mode == "status":
                retry = [("Retry-After", str(fault.retry_after))] if fault.retry_after is not None else []
                raise Refused(fault.status, "injected fault", retry)
            if fault.mode == "hang" and not self.faults.hang(fault):
                log.warning("%s %s dropped: %d calls hang already", method, quote(path), api.MAX_HUNG_CALLS)
                start_response("200 OK", [("Content-Length", "64"), ("Content-Type", "application/json")])
                return 200, []
            if fault.mode == "drop":  # headers promise a body that never comes: the connection closes
                start_response("200 OK", [("Content-Length", "64"), ("Content-Type", "application/json")])
                return 200, []
            if fault.mode == "delay":
                time.sleep(fault.delay)
        body = parse_body(environ, route.request) if route.request is not None else None
        code, model = getattr(self, route.name)(body=body, params=params, token=token, cluster_id=cluster_id)
        if fault is not None and fault.mode == "malformed":
            return 200, http.json_response(start_response, 200, None, body=b'{"registrationId": ')
        doc = model.model_dump(mode="json", exclude_none=True) if isinstance(model, api.Model) else model
        return code, http.json_response(start_response, code, doc)


class ControlPlaneServer:
    """The API on its own threads; `start()` returns once it is listening.

    Per connection (foundations/http): idle for `timeout` or a request not whole `read_timeout` after its first
    byte (a registration of MAX_BODY bytes takes a slow link a while) closes it, and past CONNECTION_LIMIT
    connections a new one closes the one longest without progress; /healthz (both of the chart's probes) is
    served before every call waiting for a worker. With `tls` it serves HTTPS, the files reloaded when they change.
    """

    def __init__(self, cp: ControlPlane, host: str, port: int, threads: int = 16, timeout: float = 10.0,
                 read_timeout: float = 30.0, tls: http.TLSFiles | None = None) -> None:
        self.cp = cp
        # Before the workers start: a registration of up to MAX_BODY would otherwise leave its peak in each
        # worker's own arena (foundations/malloc).
        malloc.limit_arenas(1)
        # Each long-polled lease holds a thread for up to max_lease_wait: at most api.MAX_LONG_POLLS of them.
        self.listener = http.Listener(cp, host, port, "control-plane", threads=threads, timeout=timeout,
                                      read_timeout=read_timeout, max_body=api.MAX_BODY, body_hint=api.BODY_LIMIT_HINT,
                                      connection_limit=CONNECTION_LIMIT, priority_paths=("/healthz",), tls=tls)

    @property
    def url(self) -> str:
        return self.listener.url

    def start(self) -> None:
        self.listener.start()

    def stop(self) -> None:
        self.cp.store.release_waiters()  # a long-polled lease would otherwise hold a worker for its wait
        self.cp.faults.clear()  # and so would a hung call, for its hang
        self.listener.stop()
        self.cp.store.close()
