"""The Pod executor: a work item runs as a Pod with a name derived from its idempotency key.

A redelivered item finds its Pod already there (AlreadyExists) and only waits for it, so an
item never makes a second Pod. The Pod is deleted only after the item is acknowledged
(`after_ack`): a crash between the Pod finishing and the ack leaves the Pod to be found by
the redelivery.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

from kubernetes import client

from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.foundations.klog import get_logger

log = get_logger(__name__)
LABEL = "gpu-agent.io/work-item"


def pod_name(key: str) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-")[:30].strip("-")
    return f"gpu-work-{slug}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


class PodExecutor:
    def __init__(self, api: client.ApiClient, namespace: str, image: str, release: str = "",
                 timeout_seconds: float = 600, poll_seconds: float = 0.5) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.image = image
        self.release = release
        self.timeout_seconds = timeout_seconds
        self.poll_seconds = poll_seconds

    def _pod(self, item: WorkItem) -> dict[str, Any]:
        payload = item.payload
        command = payload.get("command") or ["fake-gpu", "smi", "-L"]
        gpus = int(payload.get("gpus", 1))
        labels = {LABEL: "true", "app.kubernetes.io/managed-by": "gpu-agent"}
        if self.release:
            labels["app.kubernetes.io/instance"] = self.release
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name(item.idempotency_key), "labels": labels,
                         "annotations": {"gpu-agent.io/idempotency-key": item.idempotency_key[:250]}},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 5,
                "containers": [{
                    "name": "work", "image": self.image, "imagePullPolicy": "IfNotPresent",
                    "command": [str(c) for c in command],
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {},
                    # Admitted by Pod Security "restricted", like every pod of the chart.
                    "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
                }],
            },
        }

    def execute(self, item: WorkItem) -> str:
        name = pod_name(item.idempotency_key)
        outcome = "executed"
        try:
            self.core.create_namespaced_pod(self.namespace, self._pod(item))
            log.v(1, "created pod %s/%s for item %d", self.namespace, name, item.item_id)
        except client.ApiException as e:
            if e.status != 409:
                raise RuntimeError(f"creating pod {self.namespace}/{name} failed: {e.status} {e.reason}") from None
            outcome = "duplicate"  # a redelivery: the pod from the first delivery is the execution
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            phase = self.core.read_namespaced_pod(name, self.namespace).status.phase
            if phase in ("Succeeded", "Failed"):
                # A failed run is still a run: acknowledged, never started again.
                if phase == "Failed":
                    log.warning("work pod %s/%s of item %d ended Failed", self.namespace, name, item.item_id)
                return outcome
            if time.monotonic() > deadline:
                raise RuntimeError(f"pod {self.namespace}/{name} did not finish within {self.timeout_seconds:.0f}s")
            time.sleep(self.poll_seconds)

    def after_ack(self, item: WorkItem) -> None:
        try:
            self.core.delete_namespaced_pod(pod_name(item.idempotency_key), self.namespace, grace_period_seconds=0)
        except client.ApiException as e:
            if e.status != 404:
                log.warning("deleting pod of item %d failed: %s", item.item_id, e.reason)
