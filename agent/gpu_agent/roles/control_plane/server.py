"""The reference control plane's HTTP/JSON server (stdlib `ThreadingHTTPServer`, HTTP/1.1).

Every endpoint but `/healthz` needs a bearer token:
  registration token  POST /v1/register, /v1/deregister
  credential          POST /v1/credentials/renew, /v1/queue/lease, .../ack, .../release
  admin token         POST /v1/queue/items, /admin/faults
  admin or credential GET /v1/status, /openapi.json
Faults armed through /admin/faults apply to the next matching calls (never to /healthz or
/admin): answer with a status, delay, drop the connection, or return a malformed body.
"""

from __future__ import annotations

import hmac
import json
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.secrets import Secret
from gpu_agent.roles.control_plane import openapi
from gpu_agent.roles.control_plane.store import Store

log = get_logger(__name__)

FAULT_MODES = ("status", "delay", "drop", "malformed")
ITEM_ACTION = re.compile(r"^/v1/queue/items/(\d+)/(ack|release)$")
MAX_BODY = 1 << 20
LIST_LIMIT = 200  # GET /v1/queue/items shows the newest items only

# Which token each endpoint takes (the item ack/release routes are matched by ITEM_ACTION).
ROUTES: dict[tuple[str, str], set[str]] = {
    ("POST", "/v1/register"): {"registration"},
    ("POST", "/v1/deregister"): {"registration"},
    ("POST", "/v1/credentials/renew"): {"credential"},
    ("POST", "/v1/queue/items"): {"admin"},
    ("GET", "/v1/queue/items"): {"admin"},
    ("POST", "/v1/queue/lease"): {"credential"},
    ("GET", "/v1/status"): {"admin", "credential"},
    ("POST", "/admin/faults"): {"admin"},
    ("DELETE", "/admin/faults"): {"admin"},
    ("GET", "/openapi.json"): {"admin", "credential", "registration"},
}


class BadRequest(Exception):
    pass


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

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self._armed.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def take(self, path: str) -> Fault | None:
        with self._lock:
            for f in self._armed:
                if f.remaining > 0 and path.startswith(f.path):
                    f.remaining -= 1
                    if f.remaining == 0:
                        self._armed.remove(f)
                    return f
        return None


@dataclass(frozen=True)
class ServerSettings:
    registration_token: Secret
    admin_token: Secret
    credential_ttl: float
    max_lease_seconds: float
    reregister_after: float


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise BadRequest(f"field {name!r} is required and must be {getattr(kind, '__name__', 'a number')}")
    return value


class ControlPlane:
    def __init__(self, store: Store, settings: ServerSettings) -> None:
        self.store = store
        self.settings = settings
        self.faults = Faults()

    def _token_is(self, presented: str, expected: Secret) -> bool:
        return bool(expected) and hmac.compare_digest(presented.encode(), expected.reveal().encode())

    def authorize(self, token: str, allowed: set[str]) -> tuple[int, str, str | None]:
        """(status, error, cluster_id): status 0 when allowed."""
        if not token:
            return 401, "missing bearer token", None
        if "admin" in allowed and self._token_is(token, self.settings.admin_token):
            return 0, "", None
        if "registration" in allowed and self._token_is(token, self.settings.registration_token):
            return 0, "", None
        if "credential" in allowed:
            cluster_id, state = self.store.credential_status(token)
            if state == "valid":
                return 0, "", cluster_id
            if state == "expired":
                return 401, "credential expired: renew before expiry or register again", None
        return 401, "token not accepted for this endpoint", None

    def handle(self, method: str, path: str, token: str, body: dict[str, Any]) -> tuple[int, Any]:
        s = self.settings
        if method == "GET" and path == "/healthz":
            return 200, {"status": "ok"}
        item_match = ITEM_ACTION.match(path)
        allowed = {"credential"} if (method == "POST" and item_match) else ROUTES.get((method, path))
        if allowed is None:
            return 404, {"error": f"no endpoint {method} {path}"}
        status, error, cluster_id = self.authorize(token, allowed)
        if status:
            return status, {"error": error}

        if path == "/openapi.json":
            return 200, openapi.document()
        if path == "/v1/register":
            cid = _field(body, "clusterId", str)
            generation = _field(body, "generation", int)
            gpus = _field(body, "gpus", list)
            for i, g in enumerate(gpus):
                if not isinstance(g, dict) or not str(g.get("uuid", "")).startswith("GPU-"):
                    raise BadRequest(f"field 'gpus[{i}].uuid' must be a string starting with GPU-")
            registration_id = self.store.register(cid, generation, gpus)
            token_value, expires_at = self.store.issue_credential(cid, s.credential_ttl)
            log.info("cluster %s registered %d GPUs (generation %d)", cid, len(gpus), generation)
            return 200, {"registrationId": registration_id, "reregisterAfterSeconds": s.reregister_after,
                         "credential": {"token": token_value, "expiresInSeconds": s.credential_ttl, "expiresAt": expires_at}}
        if path == "/v1/deregister":
            cid = _field(body, "clusterId", str)
            found = self.store.deregister(cid)
            log.info("cluster %s deregistered%s", cid, "" if found else " (was not registered)")
            return 200, {"deregistered": found}
        if path == "/v1/credentials/renew":
            token_value, expires_at = self.store.issue_credential(cluster_id or "", s.credential_ttl)
            self.store.revoke(token)
            log.v(1, "cluster %s renewed its credential", cluster_id)
            return 200, {"credential": {"token": token_value, "expiresInSeconds": s.credential_ttl, "expiresAt": expires_at}}
        if path == "/v1/queue/items" and method == "GET":
            return 200, {"items": self.store.list_items(LIST_LIMIT)}
        if path == "/v1/queue/items":
            key = _field(body, "idempotencyKey", str)
            if not key:
                raise BadRequest("field 'idempotencyKey' must not be empty")
            item_id, created = self.store.enqueue(key, _field(body, "payload", dict))
            return (201 if created else 200), {"id": item_id, "created": created}
        if path == "/v1/queue/lease":
            seconds = _field(body, "leaseSeconds", (int, float), required=False) or s.max_lease_seconds
            if seconds <= 0:
                raise BadRequest("field 'leaseSeconds' must be > 0")
            wait = _field(body, "waitSeconds", (int, float), required=False) or 0
            if not 0 <= wait <= 30:
                raise BadRequest("field 'waitSeconds' must be between 0 and 30")
            item = self.store.lease_waiting(min(float(seconds), s.max_lease_seconds), float(wait))
            return (204, None) if item is None else (200, item)
        if item_match:
            item_id, action = int(item_match.group(1)), item_match.group(2)
            lease_id = _field(body, "leaseId", str)
            result = self.store.ack(item_id, lease_id) if action == "ack" else self.store.release(item_id, lease_id)
            if result == "unknown":
                return 404, {"error": f"no item {item_id}"}
            if result == "stale-lease":
                return 409, {"error": f"lease {lease_id} is no longer the current lease of item {item_id}"}
            return 200, {"result": result}
        if path == "/v1/status":
            return 200, self.store.status()
        if path == "/admin/faults" and method == "DELETE":
            self.faults.clear()
            return 200, {"cleared": True}
        if path == "/admin/faults":
            mode = _field(body, "mode", str)
            if mode not in FAULT_MODES:
                raise BadRequest(f"field 'mode' must be one of {', '.join(FAULT_MODES)}")
            count = _field(body, "count", int, required=False) or 1
            status_code = _field(body, "status", int, required=False) or 503
            delay = _field(body, "delaySeconds", (int, float), required=False) or 0.0
            if count < 1 or not 400 <= status_code <= 599 or not 0 <= delay <= 60:
                raise BadRequest("fault needs count >= 1, status in 400..599 and delaySeconds in 0..60")
            self.faults.arm(Fault(mode, count, status_code, float(delay), _field(body, "path", str, required=False) or "",
                                  _field(body, "retryAfterSeconds", int, required=False)))
            log.info("fault armed: %s x%d on %r", mode, count, body.get("path") or "every path")
            return 200, {"armed": True}
        return 404, {"error": f"no endpoint {method} {path}"}


def make_handler(cp: ControlPlane) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "gpu-agent-control-plane"

        def log_message(self, fmt: str, *args: Any) -> None:  # the stdlib line would go to stderr unformatted
            return

        def _send(self, status: int, doc: Any, raw: bytes | None = None, headers: dict[str, str] | None = None) -> None:
            body = raw if raw is not None else (b"" if doc is None else json.dumps(doc).encode())
            self.send_response(status)
            if body:
                self.send_header("Content-Type", "application/json")
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body:
                self.wfile.write(body)

        def _dispatch(self, method: str) -> None:
            started = time.monotonic()
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(min(length, MAX_BODY)) if length else b""
            fault = None if path == "/healthz" or path.startswith("/admin/") else cp.faults.take(path)
            if fault is not None:
                log.v(2, "injecting fault %s into %s %s", fault.mode, method, path)
                if fault.mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if fault.mode == "status":
                    headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else None
                    self._send(fault.status, {"error": "injected fault"}, headers=headers)
                    return
                if fault.mode == "delay":
                    time.sleep(fault.delay)
            auth = self.headers.get("Authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            try:
                body = json.loads(raw) if raw else {}
                if not isinstance(body, dict):
                    raise BadRequest("request body must be a JSON object")
                status, doc = cp.handle(method, path, token, body)
            except json.JSONDecodeError:
                status, doc = 400, {"error": "request body is not valid JSON"}
            except BadRequest as e:
                status, doc = 400, {"error": str(e)}
            except Exception:  # noqa: BLE001 - the server answers 500 and stays up
                log.error("%s %s failed", method, path, exc_info=True)
                status, doc = 500, {"error": "internal error"}
            if fault is not None and fault.mode == "malformed":
                self._send(200, None, raw=b'{"registrationId": ')
            else:
                self._send(status, doc)
            log.v(6, "%s %s -> %d (%.1f ms)", method, path, status, (time.monotonic() - started) * 1000)

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_DELETE(self) -> None:
            self._dispatch("DELETE")

    return Handler


class ControlPlaneServer:
    """The server on its own threads; `start()` returns once it is listening."""

    def __init__(self, cp: ControlPlane, host: str, port: int) -> None:
        self.cp = cp
        self.httpd = ThreadingHTTPServer((host, port), make_handler(cp))
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.1,), name="control-plane-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.cp.store.close()
