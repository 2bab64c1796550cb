"""The election's record as a coordination.k8s.io/v1 Lease (what client-go's LeaseLock writes).

The agents create the Lease, so Helm does not know it. It is owned by the agents' Deployment
(when named): the garbage collector deletes it with the Deployment, and deletes it again if a
leader that is still shutting down recreates it after its Deployment is gone.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from kubernetes import client, watch

from gpu_agent.mechanisms.leadership.elector import LeaseConflict, LeaseRecord


def _time(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def _seconds(value: dt.datetime | None) -> float:
    return value.timestamp() if value is not None else 0.0


class KubeLease:
    """`coordination` and `apps` default to the API client's; unit tests hand in fakes."""

    def __init__(self, api: client.ApiClient | None, *, namespace: str, name: str, request_timeout: float = 5.0,
                 owner_deployment: str = "", coordination: client.CoordinationV1Api | None = None,
                 apps: client.AppsV1Api | None = None) -> None:
        self.owner_deployment = owner_deployment
        self._owner: list[client.V1OwnerReference] | None = None
        self.coordination = coordination if coordination is not None else client.CoordinationV1Api(api)
        self.apps = apps if apps is not None else client.AppsV1Api(api)
        self.namespace = namespace
        self.name = name
        self.timeout = request_timeout

    def _record(self, lease: client.V1Lease) -> LeaseRecord:
        spec = lease.spec or client.V1LeaseSpec()
        meta = lease.metadata or client.V1ObjectMeta()
        return LeaseRecord(spec.holder_identity or "", float(spec.lease_duration_seconds or 0),
                           _seconds(spec.acquire_time), _seconds(spec.renew_time), int(spec.lease_transitions or 0),
                           meta.resource_version or "", meta.uid or "")

    def _owner_references(self) -> list[client.V1OwnerReference] | None:
        if self.owner_deployment and self._owner is None:
            try:
                deployment = self.apps.read_namespaced_deployment(
                    self.owner_deployment, self.namespace, _request_timeout=self.timeout)
                uid = (deployment.metadata or client.V1ObjectMeta()).uid or ""  # the API server always sets it
                self._owner = [client.V1OwnerReference(api_version="apps/v1", kind="Deployment",
                                                       name=self.owner_deployment, uid=uid)]
            except client.ApiException as e:  # the Lease still works; it is only not garbage-collected
                if e.status != 404:
                    raise RuntimeError(f"reading Deployment {self.namespace}/{self.owner_deployment} (the Lease's owner): "
                                       f"{e.status} {e.reason}") from None
                self._owner = []
        return self._owner or None

    def _body(self, r: LeaseRecord) -> client.V1Lease:
        return client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace, resource_version=r.version or None,
                                         labels={"app.kubernetes.io/managed-by": "gpu-agent"},
                                         owner_references=self._owner_references()),
            spec=client.V1LeaseSpec(holder_identity=r.holder, lease_duration_seconds=max(1, round(r.lease_duration)),
                                    acquire_time=_time(r.acquire_time), renew_time=_time(r.renew_time),
                                    lease_transitions=r.transitions))

    def _call(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        """One API call: 409 is LeaseConflict (someone wrote first), 404 is None, anything else an error naming it."""
        try:
            return call(*args, _request_timeout=self.timeout, **kwargs)
        except client.ApiException as e:
            if e.status == 409:
                raise LeaseConflict() from None
            if e.status == 404:
                return None
            raise RuntimeError(f"{what} Lease {self.namespace}/{self.name}: {e.status} {e.reason}") from None

    def get(self) -> LeaseRecord | None:
        lease = self._call("reading", self.coordination.read_namespaced_lease, self.name, self.namespace)
        return None if lease is None else self._record(lease)

    def create(self, record: LeaseRecord) -> LeaseRecord:
        return self._record(self._call("creating", self.coordination.create_namespaced_lease, self.namespace,
                                       self._body(record)))

    def update(self, record: LeaseRecord) -> LeaseRecord:
        lease = self._call("updating", self.coordination.replace_namespaced_lease, self.name, self.namespace,
                           self._body(record))
        if lease is None:  # deleted meanwhile: someone else's doing, as a conflict is
            raise LeaseConflict()
        return self._record(lease)

    def delete(self, record: LeaseRecord) -> None:
        self._call("deleting", self.coordination.delete_namespaced_lease, self.name, self.namespace,
                   body=client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version=record.version)))

    def wait_released(self, version: str, timeout: float) -> bool:
        """Watch the Lease from `version` until it is deleted or has no holder (True), or `timeout`
        passes (False). The watch names the Lease (a field selector), which RBAC's resourceNames admits."""
        w = watch.Watch()
        try:
            for event in w.stream(self.coordination.list_namespaced_lease, self.namespace,
                                  field_selector=f"metadata.name={self.name}", resource_version=version,
                                  timeout_seconds=max(1, int(timeout)), _request_timeout=timeout + self.timeout):
                lease = event["object"]
                if event["type"] == "DELETED" or not (getattr(lease, "spec", None) and lease.spec.holder_identity):
                    return True
        except client.ApiException as e:  # 410 Gone (version compacted) and the like: the next attempt reads it
            raise RuntimeError(f"watching Lease {self.namespace}/{self.name}: {e.status} {e.reason}") from None
        finally:
            w.stop()
        return False
