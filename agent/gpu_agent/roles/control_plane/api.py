"""The control plane's API as data: request and response models, routes, and the OpenAPI document.

Each `Route` names its method, path, the tokens it takes, its request model and its responses.
The server validates every request body with the route's model and builds every response body
from a model, and `document()` renders the OpenAPI document from the same routes and models:
the document cannot drift from the code. Models are strict (no "1" for 1, no NaN, bounded
numbers and strings), so what the document allows is exactly what the server accepts.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter

from gpu_agent import __version__
from gpu_agent.foundations.control_plane_client import MAX_REGISTERED_GPUS

INT64_MAX = 2**63 - 1
# The most GPUs one registration lists; an agent with more lists the first this many and gives the whole count
# in gpuCount (the agents read the limit from the same constant).
MAX_GPUS = MAX_REGISTERED_GPUS
MAX_CLUSTER_GPUS = 1 << 24  # gpuCount's bound: far beyond any cluster, bounded as every number here is
# The body limit, sized so that every registration of MAX_GPUS the models accept fits, not only realistic ones.
# Measured (requests' JSON, ", " and ": " separators), bytes per GPU in a registration of 16,384:
#   NVML, "GPU-<uuid4>" and "NVIDIA H100 80GB HBM3" ........................... 153
#   NVML, "NVIDIA RTX 6000 Ada Generation" (the longest common name) ........... 162
#   cluster source, "nvidia.com/gpu 1023 on gke-prod-...-pool-1a2b3c4d-xyz1" ... 197
#   every field as long as GPUModel allows (128-char uuid, 256-char name) ..... 487
# 16,384 x 487 = 7,979,008 bytes (+ about 100 for clusterId and generation) < 8 MiB = 8,388,608: a full
# registration fits even at the models' limits, and a realistic one (16,384 x 197 = 3.2 MB) 2.6 times over.
# Memory: waitress holds a body in memory while it arrives (foundations/http: never in a temporary file, the
# chart's pod has none). The control plane's peak RSS, measured over 60 realistic 16,384-GPU registrations:
# 89 MiB (47 idle); over 16 at the models' limits: 122 MiB; both inside the chart's 192 MiB (with one malloc
# arena, foundations/malloc: with glibc's default, realistic ones climbed to 179-220 MiB).
MAX_BODY = 8 << 20
# What a 413 for the body's size tells the client to do instead.
BODY_LIMIT_HINT = (f"a registration fits whole when it lists at most {MAX_GPUS} GPUs (a larger cluster lists the first "
                   f"{MAX_GPUS} and gives its whole count in gpuCount); send a smaller body")
# What a list over its maxItems is refused with (422, naming the field), by field.
LIST_LIMIT_HINTS = {"gpus": f"list the first {MAX_GPUS} GPUs and give the cluster's whole count in gpuCount"}
MAX_PAYLOAD_DEPTH = 32
MAX_LEASE_ITEMS = 64  # items one lease call may take (maxItems)

# What an ack or a release did to an item, and the states an item is in.
ItemOutcome = Literal["acked", "already-acked", "released", "retrying", "failed"]
ItemStateName = Literal["queued", "leased", "done", "failed"]


class Model(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


def _whole_float_to_int(value: Any) -> Any:
    # JSON Schema's "integer" includes 1.0; strict pydantic would refuse it.
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**63 else value


Int = Annotated[int, BeforeValidator(_whole_float_to_int)]


# ---- requests ----------------------------------------------------------------------------------

CLUSTER_ID_REGEX = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$"
CLUSTER_ID_PATTERN = re.compile(CLUSTER_ID_REGEX)
CLUSTER_ID_RULE = ("a cluster's name: 1 to 253 letters, digits, '.', '_' and '-', beginning and ending with a letter "
                   "or digit")
ClusterId = Field(min_length=1, max_length=253, pattern=CLUSTER_ID_REGEX,
                  description="the cluster's name: letters, digits, '.', '_', '-'")


class GPUModel(Model):
    uuid: str = Field(min_length=5, max_length=128, pattern=r"^GPU-[\x21-\x7e]+$")
    name: str = Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")
    memoryTotalBytes: Int = Field(ge=0, le=INT64_MAX)
    migMode: bool = False
    index: Int = Field(default=0, ge=0, le=1 << 20)


# Bounds on the integer itself, as with Term below.
GPUCount = Annotated[int, annotated_types.Ge(0), annotated_types.Le(MAX_CLUSTER_GPUS), BeforeValidator(_whole_float_to_int)]


class RegisterRequest(Model):
    clusterId: str = ClusterId
    generation: Int = Field(ge=0, le=INT64_MAX, description="the agent's GPU generation this inventory belongs to")
    gpus: list[GPUModel] = Field(max_length=MAX_GPUS, description=f"the cluster's GPUs, at most {MAX_GPUS}; a cluster "
                                 f"with more lists the first {MAX_GPUS} and gives the whole count in gpuCount")
    # Not refused below the list's length (a rule JSON Schema cannot state, so the document would promise what
    # the server refused): the registration then counts the GPUs listed.
    gpuCount: GPUCount | None = Field(default=None, description="how many GPUs the cluster has, when more than `gpus` "
                                      "lists (the list is then truncated); absent, or fewer than listed: as many as listed")
    holder: str | None = Field(default=None, min_length=1, max_length=253, pattern=r"^[\x21-\x7e]+$",
                               description="the registering agent's identity (its Pod's name): its earlier credentials "
                                           "of this cluster are retired, the newest after the control plane's "
                                           "credentialOverlap, the others at once; absent: none is")

    @property
    def gpu_count(self) -> int:
        return max(self.gpuCount or 0, len(self.gpus))


GPU_LIST = TypeAdapter(list[GPUModel])  # a registration's list, dumped to JSON for the store in one step


class DeregisterRequest(Model):
    clusterId: str = ClusterId


MAX_ITEM_GPUS = 1024


class WorkPayload(Model):
    """The fields the cluster agent's executors read are checked at enqueue, so that an item its
    executor could never turn into a Pod is refused then, naming the field, instead of failing on
    every delivery. Any other field is kept as given."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    gpus: Int = Field(default=1, ge=0, le=MAX_ITEM_GPUS, description="nvidia.com/gpu the item's Pod asks for (default 1)")
    command: list[Annotated[str, annotated_types.MaxLen(4096)]] | None = Field(
        default=None, min_length=1, max_length=256, description="the Pod's command; default: list the GPUs it was given")


class EnqueueRequest(Model):
    idempotencyKey: str = Field(min_length=1, max_length=253, pattern=r"^[^\x00-\x1f\x7f]+$",
                                description="items with the same key are one item")
    payload: WorkPayload = Field(description=f"a JSON object, nested at most {MAX_PAYLOAD_DEPTH} deep")


Holder = Field(min_length=1, max_length=253, pattern=r"^[\x21-\x7e]+$",
               description="the consumer's identity (the cluster agent's Pod name)")
# The bounds sit on the integer itself: on an Optional Annotated type pydantic would write them into the
# document as "ge"/"le", which JSON Schema does not know (schemathesis found it).
Term = Annotated[int, annotated_types.Ge(1), annotated_types.Le(INT64_MAX), BeforeValidator(_whole_float_to_int)]
TermNumber = Field(default=None,
                   description="the fencing term the consumer holds (POST /v1/queue/terms); refused once a newer term began")


class TermRequest(Model):
    holder: str = Holder


class LeaseRequest(Model):
    holder: str | None = Field(default=None, min_length=1, max_length=253, pattern=r"^[\x21-\x7e]+$",
                               description="the consumer's identity, recorded with the delivery")
    term: Term | None = TermNumber
    leaseSeconds: float | None = Field(default=None, gt=0, le=86400,
                                       description="lease length; capped by the server's maxLeaseSeconds")
    waitSeconds: float = Field(default=0.0, ge=0, le=30, description="long poll: wait this long for an item")
    maxItems: Int = Field(default=1, ge=1, le=MAX_LEASE_ITEMS,
                          description="lease up to this many items in one call (the first in the body, the rest in "
                                      "`more`); each has its own lease. The long poll waits for the first only")


class LeaseRef(Model):
    leaseId: str = Field(min_length=1, max_length=64)
    term: Term | None = TermNumber


class ReleaseRequest(LeaseRef):
    error: str | None = Field(default=None, min_length=1, max_length=4000,
                              description="why the execution failed: counts a failed attempt; the item comes back after "
                                          "a backoff, and is failed for good after the control plane's most attempts")


class LeaseRenewal(Model):
    leaseId: str = Field(min_length=1, max_length=64)
    term: Term | None = TermNumber
    leaseSeconds: float | None = Field(default=None, gt=0, le=86400,
                                       description="the lease's new length from now; capped by the server's maxLeaseSeconds")


FAULT_STATUSES = range(500, 600)
HANG_LIMIT_SECONDS = 300.0  # a hung call is answered after this long even if nobody clears the fault
MAX_HUNG_CALLS = 8  # of the 16 workers: /healthz and /admin/faults (to clear the fault) always find one free
# Long-polled lease calls held at once, each holding a worker for its wait: in all, and per credential (an agent
# holds one; a second covers a call whose client gave up while the server still holds it). With the hung calls
# above, 6 + 8 of the 16 workers: 2 are always free for /healthz and every other call.
MAX_LONG_POLLS = 6
MAX_LONG_POLLS_PER_CREDENTIAL = 2
LONG_POLL_RETRY_AFTER_SECONDS = 1


def _server_error(value: int) -> int:
    # The bounds are checked here rather than with ge/le so that the error gives the whole range.
    if value not in FAULT_STATUSES:
        raise ValueError(f"must be a server error status, {FAULT_STATUSES.start} to {FAULT_STATUSES.stop - 1}: "
                         "an injected fault stands for a failing control plane, never for a refused request")
    return value


class FaultRequest(Model):
    mode: Literal["status", "delay", "drop", "malformed", "hang"] = Field(
        description="status: answer `status`; delay: answer after delaySeconds; drop: close the connection mid-answer; "
                    "malformed: answer a body that is not JSON; hang: hold the call unanswered until DELETE /admin/faults "
                    f"(or delaySeconds, if set; at most {HANG_LIMIT_SECONDS:.0f} s), then answer it late, as a wedged "
                    f"control plane does; at most {MAX_HUNG_CALLS} calls hang at once, one more is dropped")
    count: Int = Field(default=1, ge=1, le=1000)
    status: Annotated[int, BeforeValidator(_whole_float_to_int), AfterValidator(_server_error)] = Field(
        default=503, json_schema_extra={"minimum": FAULT_STATUSES.start, "maximum": FAULT_STATUSES.stop - 1},
        description="the status the faulted calls answer with (mode status): a server error, 500 to 599")
    delaySeconds: float = Field(default=0.0, ge=0, le=60,
                                description="delay: the wait before the answer; hang: the longest hold (0: until cleared)")
    path: str = Field(default="", max_length=200, description="only calls whose path starts with this")
    retryAfterSeconds: Annotated[int, annotated_types.Ge(0), annotated_types.Le(3600),
                                 BeforeValidator(_whole_float_to_int)] | None = None


# ---- responses ---------------------------------------------------------------------------------

class ErrorBody(Model):
    error: str


class Credential(Model):
    token: str
    expiresInSeconds: float
    expiresAt: float


class RegisterResponse(Model):
    registrationId: str
    credential: Credential
    reregisterAfterSeconds: float


class DeregisterResponse(Model):
    deregistered: bool


class RenewResponse(Model):
    credential: Credential


class EnqueueResponse(Model):
    id: int
    created: bool


class OneLeasedItem(Model):
    id: int
    idempotencyKey: str
    payload: dict[str, Any]
    leaseId: str
    deliveries: int
    leaseExpiresInSeconds: float


class LeasedItem(OneLeasedItem):
    # The first item stays at the top level, so that a client of before maxItems reads the answer unchanged.
    more: list[OneLeasedItem] | None = Field(default=None, description="the further items leased by this call "
                                                                       "(maxItems > 1 and more than one was due)")


class ItemResult(Model):
    result: ItemOutcome


class RenewedLease(Model):
    result: Literal["renewed"]
    leaseExpiresInSeconds: float


class TermStarted(Model):
    term: int
    handedBack: int


class CurrentTerm(Model):
    term: int
    holder: str


class Delivery(Model):
    id: int
    itemId: int
    holder: str | None
    term: int | None
    at: float


class DeliveryLog(Model):
    deliveries: list[Delivery]


class ItemSummary(Model):
    id: int
    idempotencyKey: str
    state: ItemStateName
    deliveries: int
    createdAt: float
    ackedAt: float | None = None
    failedAttempts: int = 0
    lastError: str | None = None


class ItemList(Model):
    items: list[ItemSummary]


class ItemState(Model):
    id: int
    state: ItemStateName


class ItemCounts(Model):
    queued: int
    leased: int
    done: int
    failed: int = 0


class RegistrationSummary(Model):
    clusterId: str
    registrationId: str
    generation: int
    gpuCount: int = Field(description="the GPUs the cluster has (its gpuCount, or as many as it listed)")
    gpusListed: int = Field(description="of those, the GPUs its registration lists one by one (fewer than gpuCount: the "
                                        f"list was truncated at {MAX_GPUS})")
    registrations: int


class StatusResponse(Model):
    items: ItemCounts
    deliveries: int
    registrations: list[RegistrationSummary]
    term: CurrentTerm | None = None


class ClusterToken(Model):
    clusterId: str
    registrationToken: str = Field(description="the cluster's own registration token, shown this once (kept as a hash): "
                                               "put it where the cluster's agent reads its registration token")
    replaced: bool = Field(description="the cluster had one: the new one takes over at its first use")


class ClusterTokenReset(Model):
    clusterId: str
    reset: bool = Field(description="false: the cluster had no token of its own")


class Armed(Model):
    armed: bool


class Cleared(Model):
    cleared: bool


class Healthy(Model):
    status: Literal["ok"]


# ---- routes ------------------------------------------------------------------------------------

TOKENS = ("registration", "credential", "admin")


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI template, e.g. /v1/queue/items/{itemId}/ack
    name: str  # the handler's name and the operationId
    summary: str
    tokens: frozenset[str]  # empty: no token needed
    request: type[Model] | None = None
    responses: dict[int, tuple[str, type[Model] | None]] = field(default_factory=dict)

    @functools.cached_property
    def pattern(self) -> re.Pattern[str]:  # compiled once per route, not once per request
        return re.compile("^" + re.sub(r"\{(\w+)\}", lambda m: f"(?P<{m[1]}>{PATH_PARAMS[m[1]][0]})", self.path) + "$")


# Each path parameter: what the route matches, and its schema in the document. A clusterId is matched loosely and
# checked by its handler, so that a bad one is refused naming it (422) instead of being no endpoint (404).
PATH_PARAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "itemId": ("[0-9]{1,19}", {"type": "integer", "minimum": 0, "maximum": INT64_MAX}),
    "clusterId": ("[^/]{1,300}", {"type": "string", "minLength": 1, "maxLength": 253, "pattern": CLUSTER_ID_REGEX}),
}


ITEM_ERRORS = {404: ("no such item", ErrorBody),
               409: ("the lease is no longer the item's current lease, or its term is over (fenced)", ErrorBody)}

# What /admin/faults answers on a control plane that runs without faultInjection (the default).
FAULT_INJECTION_OFF = ("fault injection is off on this control plane: it is a test facility, enabled with "
                       "--fault-injection=true (GPU_AGENT_FAULT_INJECTION=true; chart: controlPlane.faultInjection=true)")
FAULTS_OFF: tuple[str, type[Model] | None] = (FAULT_INJECTION_OFF, ErrorBody)

# What a registration or deregistration refused for its clusterId is answered with.
NOT_THIS_CLUSTER: tuple[str, type[Model] | None] = (
    "a valid token of another kind, or a registration token that may not act for this clusterId: the cluster has a "
    "token of its own and this is not it, or this is another cluster's own token; the error says which and what to do",
    ErrorBody)

ROUTES = [
    Route("GET", "/healthz", "healthz", "Liveness of the control plane", frozenset(),
          responses={200: ("ok", Healthy)}),
    Route("POST", "/v1/register", "register", "Register the cluster's GPU inventory; returns a credential",
          frozenset({"registration"}), RegisterRequest, {200: ("registered", RegisterResponse), 403: NOT_THIS_CLUSTER}),
    Route("POST", "/v1/deregister", "deregister", "Forget the cluster's registration and credentials",
          frozenset({"registration"}), DeregisterRequest, {200: ("deregistered", DeregisterResponse),
                                                           403: NOT_THIS_CLUSTER}),
    Route("POST", "/v1/credentials/renew", "renew", "Exchange a valid credential for a fresh one (no body)",
          frozenset({"credential"}), None, {200: ("renewed", RenewResponse)}),
    Route("GET", "/v1/queue/items", "list_items", "The newest 200 items, oldest first", frozenset({"admin"}),
          responses={200: ("items", ItemList)}),
    Route("POST", "/v1/queue/items", "enqueue", "Enqueue a work item; idempotent on idempotencyKey",
          frozenset({"admin"}), EnqueueRequest, {201: ("created", EnqueueResponse), 200: ("already present", EnqueueResponse)}),
    Route("POST", "/v1/queue/terms", "start_term",
          "Start a new fencing term for this holder: leases of older terms are handed back, and calls naming them refused",
          frozenset({"credential"}), TermRequest, {200: ("started", TermStarted)}),
    Route("GET", "/v1/queue/deliveries", "deliveries", "The newest 1000 deliveries (item, holder, term, time), oldest first",
          frozenset({"admin"}), responses={200: ("deliveries", DeliveryLog)}),
    Route("POST", "/v1/queue/lease", "lease", "Lease the next item; waitSeconds > 0 long-polls for one",
          frozenset({"credential"}), LeaseRequest, {200: ("leased", LeasedItem), 204: ("the queue is empty", None),
                                                    409: ("the term named is over, or none was named while terms are in use",
                                                          ErrorBody),
                                                    429: (f"waitSeconds > 0 while {MAX_LONG_POLLS_PER_CREDENTIAL} long-polled "
                                                          f"calls wait for this credential, or {MAX_LONG_POLLS} in all; "
                                                          "Retry-After says when to call again", ErrorBody)}),
    Route("POST", "/v1/queue/items/{itemId}/ack", "ack", "Acknowledge a leased item", frozenset({"credential"}),
          LeaseRef, {200: ("acknowledged", ItemResult), **ITEM_ERRORS}),
    Route("POST", "/v1/queue/items/{itemId}/renew", "renew_lease",
          "Extend the lease of an item that is still running (refused once the lease expired or was replaced)",
          frozenset({"credential"}), LeaseRenewal, {200: ("renewed", RenewedLease), **ITEM_ERRORS}),
    Route("POST", "/v1/queue/items/{itemId}/release", "release", "Give a leased item back for redelivery now",
          frozenset({"credential"}), ReleaseRequest, {200: ("released", ItemResult), **ITEM_ERRORS}),
    Route("GET", "/v1/queue/items/{itemId}", "item_state",
          "An item's state (a consumer cleaning up after items that finished: done or failed ones need nothing more)",
          frozenset({"credential"}), responses={200: ("the item's state", ItemState), 404: ("no such item", ErrorBody)}),
    Route("GET", "/v1/status", "status", "Queue counts and registrations", frozenset({"admin", "credential"}),
          responses={200: ("status", StatusResponse)}),
    Route("POST", "/admin/faults", "arm_fault",
          "Inject a fault into the next matching authorized calls (never /healthz or /admin); a test facility, off unless "
          "the control plane runs with faultInjection", frozenset({"admin"}), FaultRequest,
          {200: ("armed", Armed), 404: FAULTS_OFF}),
    Route("DELETE", "/admin/faults", "clear_faults", "Clear every armed fault (a test facility, as above)",
          frozenset({"admin"}), responses={200: ("cleared", Cleared), 404: FAULTS_OFF}),
    Route("POST", "/admin/clusters/{clusterId}/token", "issue_cluster_token",
          "Give the cluster a registration token of its own (replacing the one it had); from its first use only it "
          "registers or deregisters the cluster", frozenset({"admin"}),
          responses={200: ("issued; the token is shown this once", ClusterToken),
                     422: ("the clusterId is not a cluster's name", ErrorBody)}),
    Route("DELETE", "/admin/clusters/{clusterId}/token", "reset_cluster_token",
          "Forget the cluster's own registration token: the shared registration token registers and deregisters it again",
          frozenset({"admin"}), responses={200: ("reset", ClusterTokenReset),
                                           422: ("the clusterId is not a cluster's name", ErrorBody)}),
    Route("GET", "/openapi.json", "openapi", "This document", frozenset(TOKENS), responses={200: ("OpenAPI 3.1", None)}),
]


def match(method: str, path: str) -> tuple[Route | None, dict[str, str], list[str]]:
    """(route, path parameters, methods allowed on this path). No route and no methods: 404;
    no route but methods: 405."""
    allowed, found, params = [], None, {}
    for r in ROUTES:
        m = r.pattern.match(path)
        if m:
            allowed.append(r.method)
            if r.method == method:
                found, params = r, m.groupdict()
    return found, params, allowed


# ---- the document ------------------------------------------------------------------------------

def _errors(route: Route) -> dict[int, str]:
    out = {}
    if route.tokens:
        out[401] = "missing, unknown or expired token"
        out[403] = "a valid token of another kind"
    if route.request is not None:
        out.update({400: "the body is not JSON (or nested too deeply, or holds NaN)",
                    413: f"the body is larger than {MAX_BODY} bytes; the error names its size and the limit",
                    415: "the body is not application/json",
                    422: "a field is missing or out of range (a list longer than its maxItems included); the error "
                         "names it"})
    return out


@functools.lru_cache(maxsize=1)
def document() -> dict[str, Any]:
    """Built once: the routes and models do not change while the server runs."""
    schemas: dict[str, Any] = {}

    def ref(model: type[Model]) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            schemas[name] = sub
        schemas[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def body(model: type[Model] | None) -> dict[str, Any]:
        return {"content": {"application/json": {"schema": ref(model)}}} if model else {}

    paths: dict[str, dict[str, Any]] = {}
    for r in ROUTES:
        op: dict[str, Any] = {"operationId": r.name, "summary": r.summary, "responses": {}}
        for code, (description, model) in sorted(r.responses.items()):
            op["responses"][str(code)] = {"description": description, **body(model)}
        for code, description in sorted(_errors(r).items()):
            op["responses"].setdefault(str(code), {"description": description, **body(ErrorBody)})
        if r.request is not None:
            op["requestBody"] = {"required": True, **body(r.request)}
        if r.tokens:
            op["security"] = [{"bearer": []}]
            op["description"] = "Tokens: " + ", ".join(sorted(r.tokens))
        else:
            op["security"] = []
        params = re.findall(r"\{(\w+)\}", r.path)
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": PATH_PARAMS[p][1]}
                                for p in params]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpu-agent reference control plane", "version": __version__},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": schemas},
        "paths": paths,
    }
