"""The Pod executor: a work item runs as a Pod with a name derived from its idempotency key.

A redelivered item finds its Pod already there (AlreadyExists) and only waits for it, so an
item never makes a second Pod. The Pod is deleted only after the item is acknowledged
(`after_ack`): a crash between the Pod finishing and the ack leaves the Pod to be found by
the redelivery.

A Pod that can never be scheduled (it asks for more GPUs than any node has) fails the attempt at
once instead of holding the queue for the whole timeout: the scheduler's Unschedulable condition
is checked against the nodes' allocatable GPUs (at most every NODE_CHECK_SECONDS), and the Pod,
which never ran, is deleted so that the redelivery (after the control plane's backoff) tries
afresh, and a failed item leaves nothing Pending behind. A Pod the kubelet refused before any of its
containers ran (Failed, e.g. UnexpectedAdmissionError after a kubelet restart) fails the attempt
the same way instead of being acknowledged as a run.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

from kubernetes import client

from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.kube import REQUEST_TIMEOUT

log = get_logger(__name__)
LABEL = "gpu-agent.io/work-item"
GPU = "nvidia.com/gpu"
NODE_CHECK_SECONDS = 15.0
CREATE_ATTEMPTS = 3


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

    def _create(self, item: WorkItem, name: str) -> str:
        """"executed", or "duplicate" when the Pod of an earlier delivery is there. A create that got no
        answer is sent again: if the first landed, the second's conflict is our own Pod."""
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                self.core.create_namespaced_pod(self.namespace, self._pod(item), _request_timeout=REQUEST_TIMEOUT)
                log.v(1, "created pod %s/%s for item %d", self.namespace, name, item.item_id)
                return "executed"
            except client.ApiException as e:
                if e.status != 409:
                    raise RuntimeError(f"creating pod {self.namespace}/{name} failed: {e.status} {e.reason}") from None
                # a redelivery: the pod from the first delivery is the execution (or our own unanswered create)
                return "duplicate" if attempt == 1 else "executed"
            except Exception as e:  # noqa: BLE001 - no answer (a timeout, a broken connection): try again
                log.warning("creating pod %s/%s got no answer (%s); attempt %d of %d", self.namespace, name,
                            type(e).__name__, attempt, CREATE_ATTEMPTS)
        raise RuntimeError(f"creating pod {self.namespace}/{name} got no answer {CREATE_ATTEMPTS} times")

    def _read(self, name: str) -> Any:
        """The Pod, or None when the API server did not answer in time (the caller polls again)."""
        try:
            return self.core.read_namespaced_pod(name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
        except client.ApiException as e:
            if e.status == 404:
                raise RuntimeError(f"work pod {self.namespace}/{name} was deleted by someone else before it "
                                   "finished") from None
            log.warning("reading pod %s/%s failed: %s %s; reading again", self.namespace, name, e.status, e.reason)
        except Exception as e:  # noqa: BLE001 - no answer: the next poll reads again
            log.warning("reading pod %s/%s got no answer (%s); reading again", self.namespace, name, type(e).__name__)
        return None

    def execute(self, item: WorkItem) -> str:
        name = pod_name(item.idempotency_key)
        outcome = self._create(item, name)
        deadline = time.monotonic() + self.timeout_seconds
        nodes_checked = float("-inf")
        while True:
            pod = self._read(name)
            phase = pod.status.phase if pod is not None else None
            if phase == "Pending" and unschedulable(pod) and time.monotonic() - nodes_checked >= NODE_CHECK_SECONDS:
                nodes_checked = time.monotonic()
                wanted, most = gpus_asked(pod), self._most_gpus_on_a_node()
                if wanted > most:
                    self._delete(name)
                    raise RuntimeError(f"the item asks for {wanted} {GPU} and no node has that many (the most on one node: "
                                       f"{most}); its pod {self.namespace}/{name} can never be scheduled and was deleted")
            if phase == "Failed" and never_started(pod):
                # Refused by the kubelet before any container ran (UnexpectedAdmissionError, OutOf<resource>
                # right after a kubelet restart): not a run. Deleted so that the retry makes a new Pod.
                self._delete(name)
                raise RuntimeError(f"work pod {self.namespace}/{name} failed before any container started "
                                   f"({pod.status.reason or 'no reason given'}: {pod.status.message or ''}); deleted, "
                                   "to be tried again")
            if phase in ("Succeeded", "Failed"):
                # A failed run is still a run: acknowledged, never started again.
                if phase == "Failed":
                    log.warning("work pod %s/%s of item %d ended Failed", self.namespace, name, item.item_id)
                return outcome
            if time.monotonic() > deadline:
                raise RuntimeError(f"pod {self.namespace}/{name} did not finish within {self.timeout_seconds:.0f}s")
            time.sleep(self.poll_seconds)

    def _most_gpus_on_a_node(self) -> int:
        nodes = self.core.list_node(_request_timeout=REQUEST_TIMEOUT).items
        return max((int((n.status.allocatable or {}).get(GPU, "0") or 0) for n in nodes if n.status), default=0)

    def _delete(self, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0, _request_timeout=REQUEST_TIMEOUT)
        except client.ApiException as e:
            if e.status != 404:
                log.warning("deleting pod %s/%s failed: %s", self.namespace, name, e.reason)

    def after_ack(self, item: WorkItem) -> None:
        self._delete(pod_name(item.idempotency_key))


def never_started(pod: Any) -> bool:
    """No container of the Pod ever ran: none is running or terminated with a start time, now or before."""
    for status in pod.status.container_statuses or []:
        for state in (status.state, status.last_state):
            if state is not None and (state.running is not None
                                      or (state.terminated is not None and state.terminated.started_at is not None)):
                return False
    return True


def unschedulable(pod: Any) -> bool:
    return any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
               for c in (pod.status.conditions or []))


def gpus_asked(pod: Any) -> int:
    return sum(int(((c.resources.limits if c.resources else None) or {}).get(GPU, "0")) for c in pod.spec.containers)
