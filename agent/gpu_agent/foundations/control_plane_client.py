"""The one small client the agents use to talk to the control plane.

Blocking (requests) by design: the agents call it through `asyncio.to_thread`, so one
implementation serves async roles, tests and the fake-gpu command alike. Every response
is validated field by field; a bad one raises `ProtocolError` naming the field, never echoing
a body that might hold a token.

Every failure is a `ControlPlaneError`; its subclass decides what the caller does (its `kind`
is the reason label of the failure metrics):
  Unavailable   connection refused/dropped, timeout, 5xx, 429  -> retry with backoff (recoverable)
    TlsFailed   the TLS handshake failed: the certificate not      -> retry with backoff (recoverable: a CA file
                verified against the CA file (controlPlaneCaFile)     replaced in place is read at the next
                or the default trusted CAs, or no TLS spoken          connection); its message names the fix
  Unauthorized  401/403                                         -> credentials are bad: register again
  ProtocolError the body is not what the API promises           -> retry with backoff (recoverable)
  Fenced        409 naming a newer term                         -> this agent's term is over: stop, start a new one
                                                                   only when it leads again
  Rejected      any other 4xx                                   -> a bug or bad input: report, retry slowly
    TooLarge    413, or a registration's GPU list refused       -> the request is over the control plane's size
                for its length                                     limit, which its message names: report, retry slowly

Transport: every client of the control plane (the cluster agent, `gpu-agent queue`, `gpu-agent chart-test`, the
chart's cleanup hook) takes controlPlaneCaFile and controlPlaneAllowInsecure (TRANSPORT_SETTINGS) and starts by
`check_transport`: https:// is verified against the CA file when one is named, else the default trusted CAs;
http:// is refused unless its host is loopback or controlPlaneAllowInsecure is true, since the registration token
and the credentials would otherwise cross the network in clear.
"""

from __future__ import annotations

import ipaddress
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, TypeVar, overload
from urllib.parse import urlparse

import requests

from gpu_agent.foundations.config import ConfigError, Setting
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.secrets import Secret

log = get_logger(__name__)

# The most GPUs one registration lists (the reference control plane's api.MAX_GPUS is this constant); the
# registration manager lists the first this many of a larger cluster and gives the whole count in gpuCount.
MAX_REGISTERED_GPUS = 16384


class ControlPlaneError(Exception):
    """A call that did not succeed; `status` is the HTTP status when there was an answer."""

    kind: ClassVar[str]
    recoverable: ClassVar[bool] = False  # no answer or a garbled one: the same call may succeed later

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Unavailable(ControlPlaneError):
    kind = "unavailable"
    recoverable = True


class TlsFailed(Unavailable):
    """The TLS handshake failed; the message says what to fix (most often controlPlaneCaFile). Retried as any
    unanswered call is: the CA file is read again at each new connection, so a CA rotated in place recovers."""
    kind = "tls"


class ProtocolError(ControlPlaneError):
    kind = "protocol"
    recoverable = True


class Unauthorized(ControlPlaneError):
    kind = "unauthorized"


class Fenced(ControlPlaneError):
    kind = "fenced"


class Rejected(ControlPlaneError):
    kind = "rejected"


class TooLarge(Rejected):
    """Refused for its size: the message names the request's size and the control plane's limit."""
    kind = "too-large"


@dataclass(frozen=True)
class Credential:
    token: Secret
    expires_in: float  # seconds from the moment the response arrived


@dataclass(frozen=True)
class Registration:
    registration_id: str
    credential: Credential
    reregister_after: float


@dataclass(frozen=True)
class Fence:
    """Who leases, and under which term (POST /v1/queue/terms): named on every queue call."""
    holder: str
    term: int


@dataclass(frozen=True)
class WorkItem:
    item_id: int
    idempotency_key: str
    payload: dict[str, Any]
    lease_id: str
    deliveries: int
    fence: Fence | None = None  # the term it was leased under; its ack, renewal and release name it


class Released(StrEnum):
    """What releasing an item did."""
    RELEASED = "released"
    RETRYING = "retrying"  # an attempt failed: the item comes back after a backoff
    FAILED = "failed"  # its last attempt failed: failed for good


class ItemState(StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"


_T = TypeVar("_T")
_E = TypeVar("_E", bound=StrEnum)


def _one_of(kind: type[_E], value: str, name: str, where: str) -> _E:
    try:
        return kind(value)
    except ValueError:
        raise ProtocolError(f"{where}: field {name!r} is not one of {', '.join(kind)}") from None


@overload
def _field(doc: object, name: str, kind: type[_T], where: str) -> _T: ...
@overload
def _field(doc: object, name: str, kind: tuple[type[int], type[float]], where: str) -> float: ...
def _field(doc: object, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(doc, dict):
        raise ProtocolError(f"{where}: response body is not a JSON object")
    value = doc.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProtocolError(f"{where}: field {name!r} missing or not {names}")
    return value


URL_SETTING = "controlPlaneUrl"
CA_FILE_SETTING = "controlPlaneCaFile"
ALLOW_INSECURE_SETTING = "controlPlaneAllowInsecure"

# What every client of the control plane takes: where it is, and how it is trusted (see check_transport).
TRANSPORT_SETTINGS = [
    Setting(URL_SETTING, "url", "http://127.0.0.1:8700", "control plane base URL: https://, or http:// to a loopback "
            "host (else see controlPlaneAllowInsecure)"),
    Setting(CA_FILE_SETTING, "path", "", "PEM bundle of the CA(s) that signed the control plane's certificate, which "
            "an https:// controlPlaneUrl is verified against (read again at each new connection: a CA replaced in "
            "place is picked up without a restart); empty: the default trusted CAs (requests': certifi's bundle, or "
            "REQUESTS_CA_BUNDLE)", optional=True),
    Setting(ALLOW_INSECURE_SETTING, "bool", False, "accept an http:// controlPlaneUrl whose host is not loopback: "
            "the registration token and credentials then cross the network in clear (a warning says so at start); "
            "false: https://, or http:// to 127.0.0.0/8, ::1 or localhost only"),
]


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: only "localhost" is known to stay on this machine
        return False


def check_transport(url: str, ca_file: str = "", allow_insecure: bool = False) -> str:
    """The rule every client of the control plane holds its settings to before its first call: https:// always;
    http:// only to a loopback host (127.0.0.0/8, ::1, localhost: nothing crosses the network) or with
    controlPlaneAllowInsecure, whose warning to log at start is returned (""; nothing to warn of). A refused URL,
    or a CA file that holds no certificate, is a ConfigError naming the setting and the fix. The URL is shown
    without its user part, which could hold a password."""
    parts = urlparse(url)
    host = parts.hostname or ""
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # not a number, or past 65535
        port = ":?"
    shown = f"{parts.scheme}://{f'[{host}]' if ':' in host else host}{port}"
    if ca_file:
        try:
            ssl.create_default_context(cafile=ca_file)
        except OSError as e:  # ssl.SSLError is one: a file that holds no PEM certificate
            reason = (e.reason if isinstance(e, ssl.SSLError) else e.strerror) or type(e).__name__
            raise ConfigError(f"{CA_FILE_SETTING} {ca_file} cannot be used as a CA bundle ({reason}); point it at "
                              "the PEM file of the CA that signed the control plane's certificate") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ConfigError(f"{URL_SETTING} {shown} is not an http:// or https:// URL with a host")
    if parts.scheme == "https" or _is_loopback(host):
        return ""
    if allow_insecure:
        return (f"{URL_SETTING} {shown} is plain HTTP to a host beyond this machine and {ALLOW_INSECURE_SETTING} is "
                "true: the registration token and credentials cross the network in clear")
    raise ConfigError(f"{URL_SETTING} {shown} is plain HTTP to a host beyond this machine: the registration token "
                      f"and credentials would cross the network in clear; use its https:// URL (with "
                      f"{CA_FILE_SETTING} naming the CA that signed its certificate), or set {ALLOW_INSECURE_SETTING}"
                      "=true (--control-plane-allow-insecure=true) to accept that")


def _ssl_error_in(error: BaseException) -> ssl.SSLError | None:
    """The ssl error behind `error` (requests wraps urllib3's, which wraps ssl's), None when there is none."""
    seen: set[int] = set()
    pending: list[object] = [error]
    while pending:
        e = pending.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ssl.SSLError):
            return e
        pending += [e.__cause__, e.__context__, getattr(e, "reason", None), *e.args]
    return None


def tls_failure(error: BaseException, ca_file: str) -> tuple[str, str] | None:
    """(what failed, how to fix it) when `error` is a failed TLS handshake with the control plane; None when it is
    not. Only ssl's short reason is kept: never a URL's query or anything the request carried."""
    cause = _ssl_error_in(error)
    if cause is None:
        return None
    if isinstance(cause, ssl.SSLCertVerificationError):
        why = cause.verify_message or "not verified"
        if cause.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
            return (f"TLS: the control plane's certificate does not name the host of {URL_SETTING} ({why})",
                    f"use in {URL_SETTING} a host name its certificate names")
        trusted = f"{CA_FILE_SETTING} {ca_file}" if ca_file else "the default trusted CAs"
        return (f"TLS: the control plane's certificate is not verified against {trusted} ({why})",
                f"{f'point {CA_FILE_SETTING} at' if ca_file else f'set {CA_FILE_SETTING} to'} the PEM bundle of "
                "the CA that signed it")
    why = str(cause.reason or type(cause).__name__)
    return (f"TLS handshake failed ({why})" + (f" with {CA_FILE_SETTING} {ca_file}" if ca_file else ""),
            f"check that {URL_SETTING} names the control plane's HTTPS port"
            + (f" and that {CA_FILE_SETTING} holds PEM certificates" if ca_file else ""))


class ControlPlaneClient:
    def __init__(self, base_url: str, timeout: float = 10.0, session: requests.Session | None = None,
                 ca_file: str = "", on_call: Callable[[str], None] | None = None) -> None:
        """`on_call`: told each call's outcome, "ok" or the failure's `kind` (the cluster agent's metric
        gpu_agent_control_plane_requests, on which the alert that the control plane is unreachable stands)."""
        self.base_url = base_url.rstrip("/")
        self.on_call = on_call
        self.timeout = timeout
        self._session = session or requests.Session()
        self.ca_file = ca_file
        # Passed with each request, never set on the session: requests lets REQUESTS_CA_BUNDLE override a session's
        # verify (and verify=True), but not a path given to the request itself. The path, not its contents: urllib3
        # loads it at each new connection, so a CA file replaced in place is verified against from then on.
        self._verify: str | bool = ca_file or True

    def close(self) -> None:
        self._session.close()

    def _call(self, method: str, path: str, token: Secret | None, body: Any = None,
              extra_timeout: float = 0.0) -> tuple[int, Any]:
        if self.on_call is None:
            return self._send(method, path, token, body, extra_timeout)
        try:
            answer = self._send(method, path, token, body, extra_timeout)
        except ControlPlaneError as e:
            self.on_call(e.kind)
            raise
        self.on_call("ok")
        return answer

    def _send(self, method: str, path: str, token: Secret | None, body: Any = None,
              extra_timeout: float = 0.0) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        if token is not None:
            headers["Authorization"] = "Bearer " + token.reveal()
        # Encoded here, as requests' json= would, so that a refusal for size can name the size sent.
        data = None if body is None else json.dumps(body, allow_nan=False).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        where = f"{method} {path}"
        started = time.monotonic()
        try:
            resp = self._session.request(method, self.base_url + path, data=data, headers=headers,
                                         timeout=self.timeout + extra_timeout, verify=self._verify)
        except requests.Timeout:
            log.v(6, "control plane: %s -> timed out (%.1f ms)", where, (time.monotonic() - started) * 1000)
            raise Unavailable(f"{where}: timed out after {self.timeout:g}s") from None
        except requests.exceptions.SSLError as e:
            log.v(6, "control plane: %s -> %s (%.1f ms)", where, type(e).__name__, (time.monotonic() - started) * 1000)
            failed, fix = tls_failure(e, self.ca_file) or ("TLS handshake failed", f"check {CA_FILE_SETTING}")
            raise TlsFailed(f"{where}: {failed}; {fix}") from None
        except requests.ConnectionError as e:
            log.v(6, "control plane: %s -> %s (%.1f ms)", where, type(e).__name__, (time.monotonic() - started) * 1000)
            raise Unavailable(f"{where}: connection failed ({type(e).__name__})") from None
        except requests.RequestException as e:  # e.g. the connection dropped mid-response
            log.v(6, "control plane: %s -> %s (%.1f ms)", where, type(e).__name__, (time.monotonic() - started) * 1000)
            raise Unavailable(f"{where}: response broken off ({type(e).__name__})") from None
        except OSError:
            if not self.ca_file:
                raise
            # requests looks for the CA file before it connects: gone since the start (a mount being replaced?)
            raise TlsFailed(f"{where}: {CA_FILE_SETTING} {self.ca_file} is not there; point {CA_FILE_SETTING} at the "
                            "PEM bundle of the CA that signed the control plane's certificate") from None
        status = resp.status_code
        log.v(6, "control plane: %s -> %d (%.1f ms)", where, status, (time.monotonic() - started) * 1000)
        if status in (401, 403):
            raise Unauthorized(f"{where}: {status} {_reason(resp)}", status)
        if status == 429 or status >= 500:
            raise Unavailable(f"{where}: {status} {_reason(resp)}", status)
        if status == 409 and _reason(resp).startswith("fenced"):
            raise Fenced(f"{where}: {status} {_reason(resp)}", status)
        if status == 413:
            raise TooLarge(f"{where}: {status} {_reason(resp)} (this request: {len(data or b'')} bytes)", status)
        if status >= 400:
            raise Rejected(f"{where}: {status} {_reason(resp)}", status)
        if status == 204 or not resp.content:
            return status, None
        try:
            return status, resp.json()
        except (ValueError, json.JSONDecodeError):
            raise ProtocolError(f"{where}: {status} response body is not valid JSON", status) from None

    @staticmethod
    def _credential(doc: Any, where: str) -> Credential:
        cred = _field(doc, "credential", dict, where)
        token = _field(cred, "token", str, where + " credential")
        expires_in = _field(cred, "expiresInSeconds", (int, float), where + " credential")
        if not token or expires_in <= 0:
            raise ProtocolError(f"{where}: credential token empty or expiresInSeconds <= 0")
        return Credential(Secret(token, float(expires_in)), float(expires_in))

    def register(self, token: Secret, cluster_id: str, generation: int, inventory: Inventory,
                 gpu_count: int | None = None, holder: str | None = None) -> Registration:
        """Tell the control plane of the GPUs in `inventory`, all of them: the caller decides which count
        (the registration manager passes the healthy ones; health is not part of the wire format).
        `gpu_count`: the cluster's whole count, when `inventory` lists only the first of its GPUs (the
        field is left out otherwise, so a small registration reads as it always did). `holder`: the agent's
        identity, whose earlier credentials the control plane then retires (a control plane of before holders
        ignores the field)."""
        where = "POST /v1/register"
        body: dict[str, Any] = {"clusterId": cluster_id, "generation": generation, "gpus": inventory.to_json()}
        if gpu_count is not None and gpu_count > inventory.count:
            body["gpuCount"] = gpu_count
        if holder is not None:
            body["holder"] = holder
        try:
            _, doc = self._call("POST", "/v1/register", token, body)
        except Rejected as e:
            # The reference control plane answers a list over its length limit with 422 naming field 'gpus'
            # (the list's only other rule is its type); any control plane answers a body over its limit with 413.
            if isinstance(e, TooLarge) or (e.status == 422 and str(e).startswith(f"{where}: 422 field 'gpus':")):
                raise TooLarge(f"{where}: refused for its size, {inventory.count} GPUs listed: "
                               f"{str(e).removeprefix(where + ': ')}", e.status) from None
            raise
        return Registration(
            registration_id=_field(doc, "registrationId", str, where),
            credential=self._credential(doc, where),
            reregister_after=float(_field(doc, "reregisterAfterSeconds", (int, float), where)),
        )

    def deregister(self, token: Secret, cluster_id: str) -> None:
        self._call("POST", "/v1/deregister", token, {"clusterId": cluster_id})

    def renew(self, credential: Secret) -> Credential:
        _, doc = self._call("POST", "/v1/credentials/renew", credential, {})
        return self._credential(doc, "POST /v1/credentials/renew")

    def start_term(self, credential: Secret, holder: str) -> Fence:
        where = "POST /v1/queue/terms"
        _, doc = self._call("POST", "/v1/queue/terms", credential, {"holder": holder})
        term = _field(doc, "term", int, where)
        log.v(2, "%s: term %d started; %d lease(s) of older terms handed back", where, term,
              _field(doc, "handedBack", int, where))
        return Fence(holder, term)

    def lease(self, credential: Secret, lease_seconds: float, wait_seconds: float = 0.0,
              fence: Fence | None = None) -> WorkItem | None:
        items = self.lease_many(credential, lease_seconds, wait_seconds, fence, 1)
        return items[0] if items else None

    def lease_many(self, credential: Secret, lease_seconds: float, wait_seconds: float = 0.0,
                   fence: Fence | None = None, max_items: int = 1) -> list[WorkItem]:
        """Up to `max_items` items, each under its own lease (empty: none came within `wait_seconds`)."""
        where = "POST /v1/queue/lease"
        body: dict[str, Any] = {"leaseSeconds": lease_seconds, "waitSeconds": wait_seconds}
        if max_items != 1:  # a control plane of before maxItems (0.1.x) ignores the field and answers one item
            body["maxItems"] = max_items
        if fence is not None:
            body.update(holder=fence.holder, term=fence.term)
        status, doc = self._call("POST", "/v1/queue/lease", credential, body, extra_timeout=wait_seconds)
        if status == 204:
            return []
        more = doc.get("more") if isinstance(doc, dict) else None
        if more is not None and not isinstance(more, list):
            raise ProtocolError(f"{where}: field 'more' is not a list")
        return [self._leased(d, where, fence) for d in [doc, *(more or [])]]

    @staticmethod
    def _leased(doc: Any, where: str, fence: Fence | None) -> WorkItem:
        return WorkItem(
            item_id=_field(doc, "id", int, where),
            idempotency_key=_field(doc, "idempotencyKey", str, where),
            payload=_field(doc, "payload", dict, where),
            lease_id=_field(doc, "leaseId", str, where),
            deliveries=_field(doc, "deliveries", int, where),
            fence=fence,
        )

    @staticmethod
    def _lease_ref(item: WorkItem, **more: Any) -> dict[str, Any]:
        return {"leaseId": item.lease_id, **({"term": item.fence.term} if item.fence else {}), **more}

    def ack(self, credential: Secret, item: WorkItem) -> None:
        self._call("POST", f"/v1/queue/items/{item.item_id}/ack", credential, self._lease_ref(item))

    def renew_lease(self, credential: Secret, item: WorkItem, lease_seconds: float) -> None:
        self._call("POST", f"/v1/queue/items/{item.item_id}/renew", credential,
                   self._lease_ref(item, leaseSeconds=lease_seconds))

    def release(self, credential: Secret, item: WorkItem, error: str | None = None) -> Released:
        """Give the item back; with `error` (why its execution failed) the control plane counts a failed
        attempt and holds the item back for a backoff, or fails it after its last attempt. The answer:
        RELEASED, RETRYING or FAILED (no attempt left: the item is failed for good)."""
        where = f"POST /v1/queue/items/{item.item_id}/release"
        extra = {"error": error[:4000]} if error else {}
        _, doc = self._call("POST", f"/v1/queue/items/{item.item_id}/release", credential, self._lease_ref(item, **extra))
        return _one_of(Released, _field(doc, "result", str, where), "result", where)

    def item_state(self, credential: Secret, item_id: int) -> ItemState:
        """The item's state (Rejected, status 404: no such item)."""
        where = f"GET /v1/queue/items/{item_id}"
        _, doc = self._call("GET", f"/v1/queue/items/{item_id}", credential)
        return _one_of(ItemState, _field(doc, "state", str, where), "state", where)

    def deliveries(self, admin_token: Secret) -> list[dict[str, Any]]:
        return self._objects("/v1/queue/deliveries", "deliveries", admin_token)

    def _objects(self, path: str, name: str, token: Secret) -> list[dict[str, Any]]:
        """GET a list of JSON objects held in field `name`."""
        _, doc = self._call("GET", path, token)
        found: list[object] = _field(doc, name, list, f"GET {path}")
        objects = [o for o in found if isinstance(o, dict)]
        if len(objects) != len(found):
            raise ProtocolError(f"GET {path}: field {name!r} holds a non-object")
        return objects

    def enqueue(self, admin_token: Secret, idempotency_key: str, payload: dict[str, Any]) -> int:
        _, doc = self._call("POST", "/v1/queue/items", admin_token, {"idempotencyKey": idempotency_key, "payload": payload})
        return _field(doc, "id", int, "POST /v1/queue/items")

    def list_items(self, admin_token: Secret) -> list[dict[str, Any]]:
        return self._objects("/v1/queue/items", "items", admin_token)

    def status(self, token: Secret) -> dict[str, Any]:
        _, doc = self._call("GET", "/v1/status", token)
        if not isinstance(doc, dict):
            raise ProtocolError("GET /v1/status: response body is not a JSON object")
        return doc

    def set_fault(self, admin_token: Secret, **fault: Any) -> None:
        self._call("POST", "/admin/faults", admin_token, fault)

    def clear_faults(self, admin_token: Secret) -> None:
        self._call("DELETE", "/admin/faults", admin_token)

    def issue_cluster_token(self, admin_token: Secret, cluster_id: str) -> Secret:
        """A registration token of the cluster's own (POST /admin/clusters/{clusterId}/token)."""
        where = f"POST /admin/clusters/{cluster_id}/token"
        _, doc = self._call("POST", f"/admin/clusters/{cluster_id}/token", admin_token)
        token = _field(doc, "registrationToken", str, where)
        if not token:
            raise ProtocolError(f"{where}: field 'registrationToken' is empty")
        return Secret(token)

    def reset_cluster_token(self, admin_token: Secret, cluster_id: str) -> bool:
        """Forget the cluster's own registration token; whether it had one."""
        _, doc = self._call("DELETE", f"/admin/clusters/{cluster_id}/token", admin_token)
        return bool(_field(doc, "reset", bool, f"DELETE /admin/clusters/{cluster_id}/token"))


def _reason(resp: requests.Response) -> str:
    # Only the server's short error string is kept (long enough for one that names its fix); bodies are never
    # echoed whole.
    try:
        doc = resp.json()
        if isinstance(doc, dict) and isinstance(error := doc.get("error"), str):
            return error[:500]
    except ValueError:
        pass
    return resp.reason or ""
