"""The leader's fencing token, written where the API server's work-Pod policy reads it: a WorkFence.

The chart's admission policy refuses a work Pod whose token is not the one in the release's WorkFence
(gpu-agent.io/v1alpha1, named like the Lease). The agent that takes the Lease writes its token there
before it runs any item, so from then on a create a deposed leader sent late is refused.

Why a deposed leader can never write over its successor's token:
- it writes only while `still_leading()` (the elector's holds_lease, on the local monotonic clock),
  checked after it read the fence: an agent paused for longer than the renew deadline finds it false;
- the write is conditional on the resourceVersion it read, so a successor's write in between
  (which can only come a lease duration after the deposed one last renewed) makes it a conflict;
- for the same Lease, the CRD itself refuses a write that lowers spec.leaseTransitions.

The fence is owned by the agents' Deployment (as the Lease is), so that the garbage collector deletes
it with the release. The chart cannot template it: Helm maps every kind of a new manifest before the
hook that applies the new CRDs runs, so an upgrade from a chart without the kind would fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client

from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import api_message
from gpu_agent.foundations.kube import api_status as _status
from gpu_agent.foundations.threads import RunBlocking, in_daemon_thread

log = get_logger(__name__)

GROUP, VERSION, PLURAL, KIND = "gpu-agent.io", "v1alpha1", "workfences", "WorkFence"
ATTEMPTS = 3  # a conflict is read again and retried: someone wrote between our read and our write


class FenceNotWritten(Exception):
    """The token could not be written (no longer leading, the API server refused or did not answer); the
    message says which and what to do."""


def token_of(fence: dict[str, Any] | None) -> LeaderToken | None:
    spec = (fence or {}).get("spec") or {}
    if not spec:
        return None
    return LeaderToken(str(spec.get("holder", "")), str(spec.get("leaseUid", "")), int(spec.get("leaseTransitions", 0)))


class KubeWorkFence:
    """`custom` and `apps` default to the API client's; unit tests hand in fakes."""

    def __init__(self, api: client.ApiClient | None, *, namespace: str, name: str, request_timeout: float = 5.0,
                 owner_deployment: str = "", custom: Any = None, apps: Any = None) -> None:
        self.custom = custom if custom is not None else client.CustomObjectsApi(api)
        self.apps = apps if apps is not None else client.AppsV1Api(api)
        self.namespace = namespace
        self.name = name
        self._where = (GROUP, VERSION, namespace, PLURAL)  # what every call on the fence names first
        self.timeout = request_timeout
        self.owner_deployment = owner_deployment
        self._owner: list[dict[str, str]] | None = None

    def _owner_references(self) -> list[dict[str, str]]:
        if self.owner_deployment and self._owner is None:
            try:
                deployment = self.apps.read_namespaced_deployment(self.owner_deployment, self.namespace, _request_timeout=self.timeout)
                uid = str((deployment.metadata or client.V1ObjectMeta()).uid or "")  # the API server always sets it
                self._owner = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": self.owner_deployment, "uid": uid}]
            except client.ApiException as e:  # the fence still works; it is only not garbage-collected
                if e.status != 404:
                    raise FenceNotWritten(f"reading Deployment {self.namespace}/{self.owner_deployment} (the "
                                          f"WorkFence's owner): {e.status} {e.reason}") from None
                self._owner = []
        return self._owner or []

    def _body(self, token: LeaderToken, version: str = "") -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace,
                                "labels": {"app.kubernetes.io/managed-by": "gpu-agent"}}
        if version:
            meta["resourceVersion"] = version
        if owners := self._owner_references():
            meta["ownerReferences"] = owners
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": meta,
                "spec": {"holder": token.holder, "leaseUid": token.lease_uid, "leaseTransitions": token.transitions}}

    def _read(self) -> dict[str, Any] | None:
        try:
            fence = self.custom.get_namespaced_custom_object(*self._where, self.name, _request_timeout=self.timeout)
            return fence if isinstance(fence, dict) else None
        except Exception as e:
            if _status(e) == 404:
                return None
            if _status(e) is None:
                raise  # no answer: the caller's problem to tell
            raise FenceNotWritten(self._explain("reading", e)) from None

    def _write(self, token: LeaderToken, fence: dict[str, Any] | None) -> bool:
        """Create the fence, or replace the one read (conditional on its resourceVersion); False on a conflict."""
        try:
            if fence is None:
                self.custom.create_namespaced_custom_object(*self._where, self._body(token), _request_timeout=self.timeout)
            else:
                version = str((fence.get("metadata") or {}).get("resourceVersion", ""))
                body = self._body(token, version)
                self.custom.replace_namespaced_custom_object(*self._where, self.name, body, _request_timeout=self.timeout)
            return True
        except Exception as e:
            if _status(e) == 409:  # written (or created) by someone since our read
                return False
            if _status(e) is None:
                raise
            raise FenceNotWritten(self._explain("creating" if fence is None else "updating", e)) from None

    def _explain(self, what: str, e: BaseException) -> str:
        status = _status(e)
        hint = ""
        if status == 404:  # on create: the kind itself is missing
            hint = ("; the WorkFence CRD (workfences.gpu-agent.io) is not installed: the chart's crds hook installs "
                    "it (helm upgrade), or set clusterAgent.workPodFencing=false")
        elif status == 403:
            hint = "; the cluster agent's Role must allow workfences create, get and update (the chart's does)"
        said = api_message(e)  # the API server's own words (a CRD rule's message names the field)
        reason = getattr(e, "reason", "")
        return f"{what} WorkFence {self.namespace}/{self.name}: {status} {reason}{': ' + said if said else ''}{hint}"

    async def publish(self, token: LeaderToken, still_leading: Callable[[], bool],
                      run_blocking: RunBlocking = in_daemon_thread) -> bool:
        """Write `token` unless the fence holds it already; True when it wrote. Each API call goes through
        `run_blocking` on its own (a daemon thread; the simulated network in agent/tests/sim), so that the read,
        the check and the write are the separate steps they are on a real network. FenceNotWritten when it could
        not, saying why."""
        for _ in range(ATTEMPTS):
            fence = await run_blocking(self._read)
            if token_of(fence) == token:
                return False
            if not still_leading():
                raise FenceNotWritten(f"not writing WorkFence {self.namespace}/{self.name}: this agent no longer holds "
                                      "the Lease")
            if await run_blocking(self._write, token, fence):
                log.info("wrote the fencing token %s into WorkFence %s/%s", token, self.namespace, self.name)
                return True
            log.v(1, "WorkFence %s/%s changed since it was read; reading it again", self.namespace, self.name)
        raise FenceNotWritten(f"WorkFence {self.namespace}/{self.name} changed under every one of {ATTEMPTS} writes")

