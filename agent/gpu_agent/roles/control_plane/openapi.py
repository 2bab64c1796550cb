"""The control plane's OpenAPI document (served at /openapi.json)."""

from __future__ import annotations

from typing import Any

from gpu_agent import __version__


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_ERROR = _json(_obj(["error"], error=_STR))
_CREDENTIAL = _obj(["token", "expiresInSeconds"], token=_STR, expiresInSeconds=_NUM, expiresAt=_NUM)
_GPU = _obj(["uuid", "name", "memoryTotalBytes"], uuid={"type": "string", "pattern": "^GPU-"}, name=_STR,
            memoryTotalBytes=_INT, migMode={"type": "boolean"}, index=_INT)
_ITEM = _obj(["id", "idempotencyKey", "payload", "leaseId", "deliveries"], id=_INT, idempotencyKey=_STR,
             payload={"type": "object"}, leaseId=_STR, deliveries=_INT, leaseExpiresInSeconds=_NUM)
_LEASE_REF = _json(_obj(["leaseId"], leaseId=_STR))


def _op(summary: str, ok: dict[str, Any], body: dict[str, Any] | None = None, secured: bool = True,
        extra: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {**ok, "400": {"description": "bad request", **_ERROR},
                                                            "401": {"description": "missing, unknown or expired token", **_ERROR}}}
    if extra:
        op["responses"].update(extra)
    if body is not None:
        op["requestBody"] = {"required": True, **_json(body)}
    if not secured:
        op["security"] = []
        del op["responses"]["401"]
    return op


def document() -> dict[str, Any]:
    item_param = [{"name": "itemId", "in": "path", "required": True, "schema": _INT}]
    return {
        "openapi": "3.0.3",
        "info": {"title": "gpu-agent reference control plane", "version": __version__},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/healthz": {"get": _op("Liveness of the control plane", {"200": {"description": "ok"}}, secured=False)},
            "/v1/register": {"post": _op(
                "Register the cluster's GPU inventory (registration token); returns a credential",
                {"200": {"description": "registered", **_json(_obj(["registrationId", "credential", "reregisterAfterSeconds"],
                                                                   registrationId=_STR, credential=_CREDENTIAL,
                                                                   reregisterAfterSeconds=_NUM))}},
                _obj(["clusterId", "generation", "gpus"], clusterId=_STR, generation=_INT, gpus={"type": "array", "items": _GPU}))},
            "/v1/deregister": {"post": _op(
                "Forget the cluster's registration and credentials (registration token)",
                {"200": {"description": "deregistered", **_json(_obj(["deregistered"], deregistered={"type": "boolean"}))}},
                _obj(["clusterId"], clusterId=_STR))},
            "/v1/credentials/renew": {"post": _op(
                "Exchange a valid credential for a fresh one",
                {"200": {"description": "renewed", **_json(_obj(["credential"], credential=_CREDENTIAL))}})},
            "/v1/queue/items": {"get": _op(
                "The newest 200 items, oldest first (admin token)",
                {"200": {"description": "items", **_json(_obj(["items"], items={"type": "array", "items": _obj(
                    ["id", "idempotencyKey", "state", "deliveries", "createdAt"], id=_INT, idempotencyKey=_STR,
                    state={"type": "string", "enum": ["queued", "leased", "done"]}, deliveries=_INT, createdAt=_NUM,
                    ackedAt=_NUM)}))}}), "post": _op(
                "Enqueue a work item (admin token); idempotent on idempotencyKey",
                {"201": {"description": "created", **_json(_obj(["id"], id=_INT, created={"type": "boolean"}))},
                 "200": {"description": "already present", **_json(_obj(["id"], id=_INT, created={"type": "boolean"}))}},
                _obj(["idempotencyKey", "payload"], idempotencyKey=_STR, payload={"type": "object"}))},
            "/v1/queue/lease": {"post": _op(
                "Lease the next item (credential); waitSeconds > 0 long-polls for one",
                {"200": {"description": "leased", **_json(_ITEM)}, "204": {"description": "queue empty"}},
                _obj([], leaseSeconds=_NUM, waitSeconds={"type": "number", "minimum": 0, "maximum": 30}))},
            "/v1/queue/items/{itemId}/ack": {"post": {**_op(
                "Acknowledge a leased item", {"200": {"description": "acknowledged"}}, _LEASE_REF["content"]["application/json"]["schema"],
                extra={"409": {"description": "lease is stale", **_ERROR}, "404": {"description": "unknown item", **_ERROR}}),
                "parameters": item_param}},
            "/v1/queue/items/{itemId}/release": {"post": {**_op(
                "Give a leased item back for immediate redelivery", {"200": {"description": "released"}},
                _LEASE_REF["content"]["application/json"]["schema"], extra={"409": {"description": "lease is stale", **_ERROR}}),
                "parameters": item_param}},
            "/v1/status": {"get": _op("Queue counts and registrations (admin token or credential)",
                                      {"200": {"description": "status", **_json({"type": "object"})}})},
            "/admin/faults": {
                "post": _op("Inject a fault into the next calls (admin token)", {"200": {"description": "armed"}},
                            _obj(["mode"], mode={"type": "string", "enum": ["status", "delay", "drop", "malformed"]},
                                 count={"type": "integer", "minimum": 1}, status={"type": "integer", "minimum": 400, "maximum": 599},
                                 delaySeconds={"type": "number", "minimum": 0, "maximum": 60}, path=_STR,
                                 retryAfterSeconds=_INT)),
                "delete": _op("Clear every armed fault (admin token)", {"200": {"description": "cleared"}}),
            },
            "/openapi.json": {"get": _op("This document (any valid token)", {"200": {"description": "OpenAPI 3"}})},
        },
    }
