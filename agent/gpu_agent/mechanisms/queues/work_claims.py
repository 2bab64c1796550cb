"""Work Pods' GPUs through DRA: a ResourceClaimTemplate per GPU count, made on first use.

On a cluster that offers GPUs through a DRA driver (the chart's dra.enabled), a work Pod asks for its GPUs as
a claim, not as `nvidia.com/gpu` limits: `spec.resourceClaims` names a template and the work container uses
it. Kubernetes' resourceclaim controller makes one claim per Pod from the template (owned by the Pod, deleted
with it), the scheduler allocates the claim's devices and the node's DRA driver prepares them; nothing about
a claim is this agent's to clean up after a run.

A template asks for an exact count of devices of one DeviceClass, so there is one per count an item asks for
(`<release>-work-gpus-<n>`), made the first time an item needs it and remembered for the agent's lifetime. A
template that is already there with other contents (an earlier release's class) is replaced: a template is
immutable, so it is deleted and made again. Templates carry the release's labels; the cleanup hook deletes them
with the release.

The scheduler's answer for an item that can never fit (more GPUs than any node offers) is read the same way as
for device-plugin Pods: `most_on_a_node` counts the untainted devices of the driver's current slices per node.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import items_of
from gpu_agent.foundations.slices import PoolSlice, field, pool_slice, untainted_per_node

log = get_logger(__name__)

CLAIM_LABEL = "gpu-agent.io/work-claim"
CLAIM_NAME = "gpus"  # the Pod's name for its claim, which the work container uses
GPU_COUNT_ANNOTATION = "gpu-agent.io/gpus"  # what the item asked for, read back by the executor's fit check

Api = Callable[..., Awaitable[Any]]  # the executor's way to the API server: offloaded, with a request timeout


def _status(e: BaseException) -> int | None:
    status = getattr(e, "status", None)
    return status if isinstance(status, int) and status > 0 else None


class DraWorkClaims:
    def __init__(self, resource: Any, namespace: str, device_class: str, *, release: str = "", driver: str = "") -> None:
        self.resource = resource  # kubernetes.client.ResourceV1Api, or a scripted stand-in
        self.namespace = namespace
        self.device_class = device_class
        self.release = release
        self.driver = driver  # whose slices `most_on_a_node` counts; "": every driver's
        self._made: set[int] = set()  # counts whose template is known to be there, as wanted

    def template_name(self, gpus: int) -> str:
        return f"{self.release or 'gpu-agent'}-work-gpus-{gpus}"

    def template(self, gpus: int) -> dict[str, Any]:
        labels = {CLAIM_LABEL: "true", "app.kubernetes.io/managed-by": "gpu-agent"}
        if self.release:
            labels["app.kubernetes.io/instance"] = self.release
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": self.template_name(gpus), "labels": labels},
                "spec": {"spec": {"devices": {"requests": [{"name": CLAIM_NAME, "exactly": {
                    "deviceClassName": self.device_class, "allocationMode": "ExactCount", "count": gpus}}]}}}}

    def pod_parts(self, gpus: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a work Pod of `gpus` GPUs adds: to its spec, and as its work container's resources."""
        return ({"resourceClaims": [{"name": CLAIM_NAME, "resourceClaimTemplateName": self.template_name(gpus)}]},
                {"claims": [{"name": CLAIM_NAME}]})

    def _wanted(self, obj: Any, gpus: int) -> bool:
        (request,) = field(obj, "spec", "spec", "devices", "requests") or [None]
        exactly = field(request, "exactly")
        return bool(field(exactly, "deviceClassName") == self.device_class and field(exactly, "count") == gpus)

    async def ensure(self, gpus: int, api: Api) -> None:
        """The template for `gpus` is there, as wanted; raises with what went wrong (the item's attempt fails)."""
        if gpus in self._made:
            return
        name, body = self.template_name(gpus), self.template(gpus)
        try:
            await api(self.resource.create_namespaced_resource_claim_template, self.namespace, body)
            log.info("made ResourceClaimTemplate %s/%s: %d device(s) of class %s for work Pods", self.namespace, name,
                     gpus, self.device_class)
        except Exception as e:  # noqa: BLE001 - 409: look at the one there; anything else fails the attempt
            if _status(e) != 409:
                raise RuntimeError(f"making ResourceClaimTemplate {self.namespace}/{name} failed: "
                                   f"{_status(e) or 'no answer'} {getattr(e, 'reason', '') or type(e).__name__}") from None
            there = await api(self.resource.read_namespaced_resource_claim_template, name, self.namespace)
            if not self._wanted(there, gpus):
                log.warning("ResourceClaimTemplate %s/%s asks for something else than %d device(s) of class %s; "
                            "replacing it", self.namespace, name, gpus, self.device_class)
                await api(self.resource.delete_namespaced_resource_claim_template, name, self.namespace)
                await api(self.resource.create_namespaced_resource_claim_template, self.namespace, body)
        self._made.add(gpus)

    async def most_on_a_node(self, usable_nodes: set[str], api: Api) -> int:
        """The most devices one of `usable_nodes` offers a new claim now (untainted, newest generation)."""
        selector = {"field_selector": f"spec.driver={self.driver}"} if self.driver else {}
        slices: dict[str, PoolSlice] = {}
        for obj in items_of(await api(self.resource.list_resource_slice, **selector)):
            kept = pool_slice(obj)
            if kept is not None:
                slices[str(field(obj, "metadata", "name"))] = kept
        return max(untainted_per_node(usable_nodes, slices).values(), default=0)
