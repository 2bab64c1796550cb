"""Pods the cluster agent's ServiceAccount may and may not create (issue 48, part 2): the work Pod as the agent's own
builder makes it (PodExecutor._pod), and one attempt per feature the chart's shape policy refuses
(charts/gpu-agent/templates/validatingadmissionpolicy-work-pod-shape.yaml), each that Pod with the one feature added.

One table for two tests, so that what the CEL unit test proves on the policy's expressions
(charts/tests/test_work_pod_shape.py) is what the e2e attack table sends to a real API server
(e2e/test_work_pod_shape.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.foundations.fencing import LEADER, LEASE_TRANSITIONS, LEASE_UID, LeaderToken
from gpu_agent.mechanisms.queues.pod_executor import PodExecutor
from gpu_agent.mechanisms.queues.work_claims import DraWorkClaims

Pod = dict[str, Any]


@dataclass(frozen=True)
class Names:
    """What a release names, as the chart names it for release `release`."""
    release: str
    namespace: str
    image: str = "localhost/gpu-agent:dev"

    @property
    def fullname(self) -> str:
        return self.release if "gpu-agent" in self.release else f"{self.release}-gpu-agent"

    @property
    def work_account(self) -> str:
        return f"{self.fullname}-work"

    @property
    def cluster_agent_account(self) -> str:
        return f"{self.fullname}-cluster-agent"

    @property
    def node_agent_account(self) -> str:
        return f"{self.fullname}-node-agent"

    @property
    def tokens_secret(self) -> str:
        return f"{self.fullname}-control-plane-tokens"


def work_pod(names: Names, leader: LeaderToken | None, *, key: str = "shape-check", gpus: int = 1,
             work_pods: dict[str, Any] | None = None, claims: DraWorkClaims | None = None,
             node_selector: str = "") -> Pod:
    """The Pod the cluster agent makes for an item of `gpus` GPUs, by its own code."""
    executor = PodExecutor(None, names.namespace, names.image, release=names.release, work_pods=work_pods,
                           claims=claims, node_selector=node_selector, service_account=names.work_account)
    item = WorkItem(item_id=0, idempotency_key=key, payload={"gpus": gpus}, lease_id="", deliveries=0)
    return executor._pod(item, leader)


def _container(pod: Pod) -> dict[str, Any]:
    return pod["spec"]["containers"][0]


def _security(pod: Pod) -> dict[str, Any]:
    return _container(pod).setdefault("securityContext", {})


def _volume(name: str, source: Callable[[Names], dict[str, Any]]) -> Callable[[Pod, Names], None]:
    """The volume `name` of `source` (given the release's names), mounted in the work container."""
    def change(pod: Pod, names: Names) -> None:
        pod["spec"].setdefault("volumes", []).append({"name": name, **source(names)})
        _container(pod).setdefault("volumeMounts", []).append({"name": name, "mountPath": f"/{name}"})
    return change


def _node_agents_account(pod: Pod, names: Names) -> None:
    pod["spec"]["serviceAccountName"] = names.node_agent_account
    pod["spec"]["automountServiceAccountToken"] = True


def _privileged(pod: Pod, _: Names) -> None:
    # the API server's own validation refuses privileged beside allowPrivilegeEscalation false, before any policy
    _security(pod).pop("allowPrivilegeEscalation", None)
    _security(pod)["privileged"] = True


def _privileged_init(pod: Pod, _: Names) -> None:
    init = copy.deepcopy(_container(pod))
    init["name"] = "init"
    init["securityContext"] = {"privileged": True}
    pod["spec"]["initContainers"] = [init]


def _env_secret(pod: Pod, names: Names) -> None:
    _container(pod)["env"] = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": names.tokens_secret,
                                                                               "key": "adminToken"}}}]


def _drop_labels(*keys: str) -> Callable[[Pod, Names], None]:
    def change(pod: Pod, _: Names) -> None:
        for k in keys:
            pod["metadata"]["labels"].pop(k, None)
    return change


def _claim(source: dict[str, str]) -> Callable[[Pod, Names], None]:
    def change(pod: Pod, _: Names) -> None:
        pod["spec"].setdefault("resourceClaims", []).append({"name": "stolen", **source})
        _container(pod)["resources"].setdefault("claims", []).append({"name": "stolen"})
    return change


def _other_release(pod: Pod, _: Names) -> None:
    pod["metadata"]["labels"]["app.kubernetes.io/instance"] = "other"


def _no_token(pod: Pod, _: Names) -> None:
    for key in (LEADER, LEASE_UID, LEASE_TRANSITIONS):
        pod["metadata"]["annotations"].pop(key, None)


def _set(path: str, value: Any) -> Callable[[Pod, Names], None]:
    """Set (or with value None, remove) a field at a dotted path from the Pod, `c` standing for its work container."""
    def change(pod: Pod, _: Names) -> None:
        *parents, last = path.split(".")
        node: dict[str, Any] = pod
        for part in parents:
            node = _container(pod) if part == "c" else node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return change


@dataclass(frozen=True)
class Attempt:
    what: str  # the table's row: what the Pod asks for
    change: Callable[[Pod, Names], None]  # made to a copy of the agent's work Pod
    named: Callable[[Names], str]  # what the refusal must say (the first refusing check's message holds it)
    fencing: bool = False  # only refused where the chart's fencing is on
    # the oldest Kubernetes whose API server hands the Pod as sent to the policy (the chart needs 1.30); None: none
    # that the e2e suite sends it to (its own validation refuses it first)
    since: tuple[int, int] | None = (1, 30)

    def pod(self, good: Pod, names: Names) -> Pod:
        pod = copy.deepcopy(good)
        self.change(pod, names)
        return pod


def _says(text: str) -> Callable[[Names], str]:
    return lambda _: text


ATTEMPTS = [
    Attempt("the node agent's ServiceAccount, its token mounted", _node_agents_account,
            lambda n: f"this Pod runs as serviceAccountName {n.node_agent_account}"),
    Attempt("the namespace's default ServiceAccount", _set("spec.serviceAccountName", None),
            _says("this Pod runs as serviceAccountName default")),
    Attempt("the work ServiceAccount with a token mounted", _set("spec.automountServiceAccountToken", True),
            _says("does not set automountServiceAccountToken to false")),
    # no token from the chart's account either (it does not automount), but a user's account may: the Pod must say
    Attempt("automountServiceAccountToken left to the account", _set("spec.automountServiceAccountToken", None),
            _says("does not set automountServiceAccountToken to false")),
    Attempt("a Secret volume of the control plane's tokens", _volume("tokens", lambda n: {"secret": {"secretName": n.tokens_secret}}),
            _says("this Pod has volume tokens (secret)")),
    Attempt("a projected ServiceAccount token", _volume("token", lambda _: {"projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}}]}}),
            _says("this Pod has volume token (projected)")),
    Attempt("a hostPath volume of /", _volume("host", lambda _: {"hostPath": {"path": "/"}}),
            _says("this Pod has volume host (hostPath)")),
    Attempt("a persistentVolumeClaim", _volume("data", lambda _: {"persistentVolumeClaim": {"claimName": "data"}}),
            _says("this Pod has volume data (persistentVolumeClaim)")),
    Attempt("the admin token in its environment", _env_secret,
            _says("container work takes a Secret into its environment")),
    Attempt("a whole Secret in its environment (envFrom)", _set("c.envFrom", [{"secretRef": {"name": "any"}}]),
            _says("container work takes a Secret into its environment")),
    Attempt("hostNetwork", _set("spec.hostNetwork", True), _says("this Pod sets hostNetwork")),
    Attempt("hostPID", _set("spec.hostPID", True), _says("this Pod sets hostPID")),
    Attempt("hostIPC", _set("spec.hostIPC", True), _says("this Pod sets hostIPC")),
    Attempt("a hostPort", _set("c.ports", [{"containerPort": 8080, "hostPort": 8080}]),
            _says("container work asks for a hostPort")),
    Attempt("a privileged container", _privileged, _says("container work is privileged")),
    Attempt("a privileged init container", _privileged_init, _says("container init is privileged")),
    Attempt("allowPrivilegeEscalation left unset", _set("c.securityContext.allowPrivilegeEscalation", None),
            _says("container work does not")),
    Attempt("an added capability (NET_ADMIN)", _set("c.securityContext.capabilities", {"drop": ["ALL"], "add": ["NET_ADMIN"]}),
            _says("container work (NET_ADMIN) adds some")),
    Attempt("seccomp Unconfined for the Pod", _set("spec.securityContext", {"seccompProfile": {"type": "Unconfined"}}),
            _says("not: the Pod (seccompProfile Unconfined)")),
    Attempt("seccomp Unconfined for a container", _set("c.securityContext.seccompProfile", {"type": "Unconfined"}),
            _says("not: container work (seccompProfile Unconfined)")),
    Attempt("AppArmor Unconfined for a container", _set("c.securityContext.appArmorProfile", {"type": "Unconfined"}),
            _says("not: container work (appArmorProfile Unconfined)")),
    # the API server refuses Unmasked without hostUsers false, and drops it where the ProcMountType gate is off
    Attempt("/proc unmasked", _set("c.securityContext.procMount", "Unmasked"), _says("not: container work (procMount Unmasked)"),
            since=None),
    # spec.resourceClaims is kept from 1.34 (resource.k8s.io/v1; earlier only behind the DynamicResourceAllocation gate)
    Attempt("another workload's ResourceClaim, shared by name", _claim({"resourceClaimName": "domain-channel"}),
            _says("this Pod claims stolen (ResourceClaim domain-channel)"), since=(1, 34)),
    Attempt("a ResourceClaimTemplate not the release's work templates", _claim({"resourceClaimTemplateName": "any-gpus"}),
            _says("this Pod claims stolen (ResourceClaimTemplate any-gpus)"), since=(1, 34)),
    Attempt("no work labels", _drop_labels("gpu-agent.io/work-item", "app.kubernetes.io/instance"),
            _says("this Pod has gpu-agent.io/work-item=(none) and app.kubernetes.io/instance=(none)")),
    Attempt("another release's instance label", _other_release,
            _says("this Pod has gpu-agent.io/work-item=true and app.kubernetes.io/instance=other")),
    Attempt("no fencing token", _no_token, _says(f"lacks the annotation {LEADER}, {LEASE_UID}, {LEASE_TRANSITIONS}"),
            fencing=True),
]


def as_admitted(pod: Pod) -> Pod:
    """`pod` as a validating admission policy sees it: with the API server's defaults and what its admission plugins
    add (DefaultTolerationSeconds' tolerations, the ServiceAccount plugin's default account) where the Pod has none."""
    out = copy.deepcopy(pod)
    spec = out["spec"]
    spec.setdefault("serviceAccountName", "default")
    spec["serviceAccount"] = spec["serviceAccountName"]
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    spec.setdefault("tolerations", []).extend(
        {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
        for taint in ("not-ready", "unreachable"))
    for container in (*spec.get("initContainers", []), *spec["containers"]):
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        container.setdefault("resources", {})
    return out
