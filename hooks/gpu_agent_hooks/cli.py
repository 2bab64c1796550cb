"""`gpu-agent-hook crds | skew-check | cleanup`: see the package docstring."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import yaml
from kubernetes import client

from gpu_agent.foundations import klog
from gpu_agent.foundations.config import ConfigError
from gpu_agent.foundations.control_plane_client import ControlPlaneClient, ControlPlaneError, check_transport
from gpu_agent.foundations.kube import REQUEST_TIMEOUT, api_client
from gpu_agent.foundations.secrets import REDACTOR, Secret
from gpu_agent.mechanisms.domain.writer import GROUP, VERSION
from gpu_agent.mechanisms.queues.pod_executor import LABEL, RELEASE_PATCH, RELEASE_PATCH_TYPE
from gpu_agent.mechanisms.queues.work_claims import CLAIM_LABEL as WORK_CLAIM_LABEL
from gpu_agent_hooks.migrate import MigrationError, migrate
from gpu_agent_hooks.skew import SkewError, check_stored_versions, check_versions

# The CRDs are applied under Helm's own field manager. Helm 4 server-side applies crds/ on every install, as
# "helm" and without --force-conflicts; if this hook owned the CRDs' fields under a name of its own, the first
# `helm install` of a chart whose CRDs differ from the cluster's (a second release, a reinstall after uninstall,
# which keeps the CRDs) would fail with "conflict with gpu-agent-hooks: .spec.versions" before any hook runs.
# Under one manager the last apply wins, which is what this hook is for. (Clusters where 0.2's hook applied
# them as "gpu-agent-hooks" move over at its first run here: a forced apply takes every field it sets.)
FIELD_MANAGER = "helm"


PREFIX = "gpu-agent-hook: "
# --log-format json: every line goes through the agent's JSON formatter (klog.JsonFormatter, on stderr) under this
# logger. None (text, the default): the plain `gpu-agent-hook: ...` lines of every release, on stdout (errors on
# stderr). Both pass through the agent's secret redactor: the registration token is a Secret once read.
_json_log: logging.Logger | None = None


def say(msg: str, level: int = logging.INFO) -> None:
    """One line of the hook's report; `level` shows in JSON only (a text line is the same at every level)."""
    if _json_log is not None:
        _json_log.log(level, "%s", msg, stacklevel=2)
    else:
        print(REDACTOR.scrub(f"{PREFIX}{msg}"), flush=True)


def warn(msg: str) -> None:
    if _json_log is not None:
        _json_log.warning("%s", msg, stacklevel=2)
    else:
        say(f"warning: {msg}")


def fail(msg: str) -> None:
    """The line that says why the hook failed: stderr in text, an error line in JSON."""
    if _json_log is not None:
        _json_log.error("%s", msg.removeprefix(PREFIX), stacklevel=2)
    else:
        print(REDACTOR.scrub(msg if msg.startswith(PREFIX) else f"{PREFIX}{msg}"), file=sys.stderr, flush=True)


def setup_logging(log_format: str) -> None:
    """--log-format: json sets up the agent's JSON logging (every gpu_agent logger, this hook's lines among them);
    text leaves everything as it always was."""
    global _json_log
    if log_format == "json":
        klog.setup(0, log_format="json")
        _json_log = logging.getLogger(f"{klog.ROOT}.gpu_agent_hooks")
    else:
        _json_log = None


def load_crds(folder: Path) -> list[dict[str, Any]]:
    crds = [doc for p in sorted(folder.glob("*.yaml")) for doc in yaml.safe_load_all(p.read_text()) if doc]
    if not crds:
        raise SystemExit(f"gpu-agent-hook: no CRDs in {folder}")
    return crds


def installed_crd(api: client.ApiClient, ext: client.ApiextensionsV1Api, name: str) -> dict[str, Any] | None:
    """The cluster's CRD `name` as a dict, or None when it is not installed."""
    try:
        return cast("dict[str, Any]", api.sanitize_for_serialization(ext.read_custom_resource_definition(
            name, _request_timeout=REQUEST_TIMEOUT)))
    except client.ApiException as e:
        if e.status != 404:
            raise
        return None


def apply_crds(api: client.ApiClient, folder: Path, timeout: float = 60) -> None:
    """Server-side apply each CRD, then migrate its stored objects to its storage version. A CRD
    that would stop serving a version objects are still stored at is refused before anything is
    applied (the API server would refuse it too, half-way through)."""
    ext = client.ApiextensionsV1Api(api)
    crds = load_crds(folder)
    for crd in crds:
        check_stored_versions(installed_crd(api, ext, crd["metadata"]["name"]), crd)
    custom = client.CustomObjectsApi(api)
    for crd in crds:
        name = crd["metadata"]["name"]
        ext.patch_custom_resource_definition(name, crd, field_manager=FIELD_MANAGER, force=True,
                                             _content_type="application/apply-patch+yaml",
                                             _request_timeout=REQUEST_TIMEOUT)
        deadline = time.monotonic() + timeout
        while True:
            status = ext.read_custom_resource_definition(name, _request_timeout=REQUEST_TIMEOUT).status
            conds = (status.conditions if status else None) or []
            if any(c.type == "Established" and c.status == "True" for c in conds):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"gpu-agent-hook: CRD {name} not Established after {timeout:.0f}s")
            time.sleep(0.5)
        say(f"applied CRD {name} (server-side, field manager {FIELD_MANAGER}); Established")
        say(migrate(ext, custom, crd))


def skew_check(api: client.ApiClient, namespace: str, deployment: str, to_version: str, folder: Path) -> None:
    try:
        dep = client.AppsV1Api(api).read_namespaced_deployment(deployment, namespace, _request_timeout=REQUEST_TIMEOUT)
        deployed = _labels(dep).get("app.kubernetes.io/version", "")
    except client.ApiException as e:
        if e.status != 404:
            raise
        deployed = ""
    say(check_versions(deployed, to_version) if deployed else f"no deployed agent found; installing {to_version}")
    ext = client.ApiextensionsV1Api(api)
    for crd in load_crds(folder):
        say(check_stored_versions(installed_crd(api, ext, crd["metadata"]["name"]), crd))


def hand_over_from_non_electing(api: client.ApiClient, namespace: str, deployment: str, target_strategy: str,
                                timeout: float = 90) -> None:
    """Run last before an upgrade or rollback (after the CRDs): a deployed cluster agent that does not
    elect is replaced by deleting its Deployment, unless the rollout itself recreates it (both the
    deployed and the target strategy Recreate)."""
    try:
        dep = client.AppsV1Api(api).read_namespaced_deployment(deployment, namespace, _request_timeout=REQUEST_TIMEOUT)
    except client.ApiException as e:
        if e.status != 404:
            raise
        return
    if elects(dep):
        return
    delete_stale_lease(api, namespace, deployment)
    version = _labels(dep).get("app.kubernetes.io/version", "")
    deployed_strategy = dep.spec.strategy.type if dep.spec.strategy else "RollingUpdate"
    if deployed_strategy == target_strategy == "Recreate":
        say(f"the deployed cluster agent ({version}) does not elect; the Recreate rollout replaces it")
        return
    replace_non_electing(api, dep, version, timeout)


def delete_stale_lease(api: client.ApiClient, namespace: str, name: str) -> None:
    """The leader-election Lease (named as the Deployment) while an agent that does not elect runs is
    stale: left by a leader whose RBAC a downgrade removed before it could release it. Its successor
    would otherwise wait a whole lease duration for a holder that is gone."""
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(name, namespace, _request_timeout=REQUEST_TIMEOUT)
        client.CoordinationV1Api(api).delete_namespaced_lease(name, namespace, _request_timeout=REQUEST_TIMEOUT)
    except client.ApiException as e:
        if e.status != 404:
            raise
        return
    holder = lease.spec.holder_identity if lease.spec else None
    say(f"deleted Lease {name}, left by {holder or 'nobody'} before the downgrade to an agent "
        "that does not elect; the new agents elect afresh")


def elects(dep: client.V1Deployment) -> bool:
    """Whether the deployed cluster agent takes part in leader election (0.2.0 on). Every chart since 0.2 passes
    `--leader-election=true` as a flag, also since its other settings moved into the agent's config file (the
    ConfigMap): keep it a flag, or this cannot tell an agent that elects."""
    pod = dep.spec.template.spec if dep.spec else None
    return any("--leader-election=true" in (c.args or []) for c in (pod.containers if pod else []))


def _labels(obj: client.V1Deployment) -> dict[str, str]:
    return (obj.metadata.labels if obj.metadata else None) or {}


def replace_non_electing(api: client.ApiClient, dep: client.V1Deployment, version: str, timeout: float) -> None:
    """An agent that does not elect (0.1.x) cannot hand over to its successor, and its Deployment's
    strategy (RollingUpdate, defaulted by the API server) cannot be switched to Recreate by Helm's
    server-side apply (the defaulted rollingUpdate stays; the API server refuses the pair). So it is
    deleted here, its pods waited out, and the upgrade creates the Deployment afresh: a Recreate that
    never runs two agents side by side."""
    meta = dep.metadata or client.V1ObjectMeta()
    name, namespace = meta.name or "", meta.namespace or ""
    say(f"the deployed cluster agent ({version or 'unknown version'}) does not take part in leader election: "
        f"deleting Deployment {name} so that it never runs beside its successor; the upgrade creates it again")
    try:
        client.AppsV1Api(api).delete_namespaced_deployment(name, namespace, propagation_policy="Foreground",
                                                         _request_timeout=REQUEST_TIMEOUT)
    except client.ApiException as e:
        if e.status != 404:
            raise
    match_labels = dep.spec.selector.match_labels if dep.spec else None
    selector = ",".join(f"{k}={v}" for k, v in (match_labels or {}).items())
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    while core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT).items:
        if time.monotonic() > deadline:
            raise SystemExit(f"gpu-agent-hook: the pods of Deployment {name} were still there after {timeout:.0f}s")
        time.sleep(0.5)
    say(f"Deployment {name} and its pods are gone")


def _bounded(name: str, seconds: float, fn: Any) -> None:
    """Run one cleanup step on a thread; give up on it (with a warning) after `seconds`."""
    outcome: list[str] = []

    def run() -> None:
        try:
            fn()
            outcome.append("ok")
        except Exception as e:  # noqa: BLE001 - cleanup is best effort, reported step by step
            outcome.append(f"failed: {type(e).__name__}: {str(e)[:200]}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(max(0.1, seconds))
    done = outcome[0] if outcome else f"gave up after {seconds:.0f}s"
    say(f"cleanup {name}: {done}", logging.INFO if done == "ok" else logging.WARNING)




def _ignore_404(call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        call(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
    except client.ApiException as e:
        if e.status != 404:
            raise


def delete_work_pods_of(core: client.CoreV1Api, namespace: str, release: str) -> int:
    """Delete the release's work Pods, each released first: the agent keeps a finalizer on a work Pod until its
    item is acknowledged, and once the release is gone nobody would remove it (the Pod would stay Terminating and
    hold its namespace's deletion). A Pod already gone is fine. Returns how many Pods were listed."""
    pods = core.list_namespaced_pod(namespace, label_selector=f"{LABEL}=true,app.kubernetes.io/instance={release}",
                                    _request_timeout=REQUEST_TIMEOUT).items
    for pod in pods:
        name = (pod.metadata or client.V1ObjectMeta()).name
        _ignore_404(core.patch_namespaced_pod, name, namespace, RELEASE_PATCH, _content_type=RELEASE_PATCH_TYPE)
        _ignore_404(core.delete_namespaced_pod, name, namespace, grace_period_seconds=0)
    return len(pods)


def delete_work_claim_templates_of(resource: Any, namespace: str, release: str) -> int:
    """Delete the ResourceClaimTemplates the release's cluster agent made for its work Pods (a claim made from one
    belongs to its Pod and goes with it). One already gone is fine. Returns how many were listed."""
    selector = f"{WORK_CLAIM_LABEL}=true,app.kubernetes.io/instance={release}"
    listed = resource.list_namespaced_resource_claim_template(namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT).items
    for template in listed:
        _ignore_404(resource.delete_namespaced_resource_claim_template, template.metadata.name, namespace)
    return len(listed)


def cleanup(api: client.ApiClient, namespace: str, release: str, cluster_id: str, url: str, token_file: Path,
            timeout: float, domain: str = "", work_claim_templates: bool = False, ca_file: str = "",
            allow_insecure: bool = False) -> None:
    deadline = time.monotonic() + timeout
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    selector = f"app.kubernetes.io/instance={release}"

    def deregister() -> None:
        if not token_file.exists():
            raise RuntimeError(f"no registration token at {token_file}")
        cp = ControlPlaneClient(url, timeout=5, ca_file=ca_file)
        try:
            cp.deregister(Secret(token_file.read_text().strip()), cluster_id)
        except ControlPlaneError as e:
            raise RuntimeError(str(e)) from None

    def clear_domains() -> None:
        domains = cast("dict[str, Any]", custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomains",
                                                       label_selector=selector, _request_timeout=REQUEST_TIMEOUT))
        for d in domains.get("items", []):
            custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, "gpudomains", d["metadata"]["name"],
                {"status": {"nodes": [], "readyNodes": 0, "status": "NotReady"}}, _request_timeout=REQUEST_TIMEOUT)

    def delete_work_pods() -> None:
        say(f"{delete_work_pods_of(core, namespace, release)} work pod(s) released (finalizer removed) and deleted")

    def delete_templates() -> None:
        if work_claim_templates:
            count = delete_work_claim_templates_of(client.ResourceV1Api(api), namespace, release)
            say(f"{count} work ResourceClaimTemplate(s) deleted")

    def delete_members() -> None:
        # members whose agents were killed before they could remove them (aggregate strategy)
        if not domain:
            return
        members = cast("dict[str, Any]", custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomainmembers",
                                                       label_selector=f"gpu-agent.io/domain={domain}", _request_timeout=REQUEST_TIMEOUT))
        for m in members.get("items", []):
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomainmembers",
                                                   m["metadata"]["name"], _request_timeout=REQUEST_TIMEOUT)

    steps: list[tuple[str, Any]] = [("deregister", deregister)]
    try:
        if insecure := check_transport(url, ca_file, allow_insecure):
            warn(insecure)
    except ConfigError as e:
        # Said whole (a failed step's message is cut short), and only this step is skipped: a failed hook would fail
        # the uninstall before the steps that let the namespace go (the work pods' finalizers).
        say(f"cleanup deregister: refused: {e}", logging.WARNING)
        steps = []
    steps += [("GPUDomain entries", clear_domains), ("work pods", delete_work_pods),
              ("work claim templates", delete_templates), ("GPUDomain members", delete_members)]
    for name, step in steps:
        _bounded(name, deadline - time.monotonic(), step)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu-agent-hook", description="Helm hooks of the gpu-agent chart")
    p.add_argument("--kubeconfig", default="", help="kubeconfig; empty: in-cluster")
    log_help = ("the line format: text (the plain `gpu-agent-hook: ...` lines, on stdout) or json (one JSON object a "
                "line on stderr, as gpu-agent's --log-format json: ts, level, v, logger, caller, msg, pid, thread, err), "
                "secrets redacted in both (default text)")
    p.add_argument("--log-format", choices=klog.FORMATS, default="text", help=log_help)
    sub = p.add_subparsers(dest="hook", required=True)
    c = sub.add_parser("crds", help="server-side apply the chart's CRDs; then replace a cluster agent that does not elect")
    c.add_argument("--dir", type=Path, required=True)
    c.add_argument("--namespace", default="", help="the release's namespace (with --cluster-agent)")
    c.add_argument("--cluster-agent", default="", help="the cluster agent's Deployment: deleted first if its agent "
                   "does not take part in leader election (0.1.x), so that it never runs beside its successor")
    c.add_argument("--target-strategy", default="RollingUpdate", choices=("Recreate", "RollingUpdate"),
                   help="the strategy the chart gives that Deployment")
    c.add_argument("--skew-check-to-version", default="", help="run the skew check first (as `skew-check` does, "
                   "against --cluster-agent), for an upgrade or rollback to this version; empty: no skew check")
    s = sub.add_parser("skew-check", help="refuse upgrades and downgrades the stored state cannot survive")
    s.add_argument("--namespace", required=True)
    s.add_argument("--deployment", required=True)
    s.add_argument("--to-version", required=True)
    s.add_argument("--crds", type=Path, required=True)
    u = sub.add_parser("cleanup", help="pre-delete cleanup, bounded in time")
    u.add_argument("--namespace", required=True)
    u.add_argument("--release", required=True)
    u.add_argument("--cluster-id", required=True)
    u.add_argument("--control-plane-url", required=True, help="where the deregistration goes: https://, or http:// to "
                   "a loopback host (else see --control-plane-allow-insecure)")
    u.add_argument("--control-plane-ca-file", default="", help="PEM bundle of the CA that signed the control plane's "
                   "certificate, which the deregistration verifies it against; empty: the default trusted CAs")
    u.add_argument("--control-plane-allow-insecure", choices=("true", "false"), default="false", help="true: "
                   "deregister over an http:// URL whose host is not loopback (the token crosses the network in clear)")
    u.add_argument("--token-file", type=Path, required=True)
    u.add_argument("--timeout", type=float, default=60)
    u.add_argument("--domain", default="", help="GPUDomain whose leftover members to delete")
    u.add_argument("--work-claim-templates", choices=("true", "false"), default="false",
                   help="true: also delete the ResourceClaimTemplates the cluster agent made for work Pods (dra.enabled)")
    for hook in sub.choices.values():  # also after the hook's name, as gpu-agent takes it after the command's
        hook.add_argument("--log-format", choices=klog.FORMATS, default=argparse.SUPPRESS, help=log_help)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    setup_logging(a.log_format)
    # No client-side rate limit: a hook is a short-lived Job bounded by its activeDeadlineSeconds, its waits already
    # pause 0.5 s between polls, and the cleanup's two calls per work Pod must fit in its timeout however many
    # Pods a large release leaves (300 Pods: 600 calls, which 20/s would stretch to 30 s of its 60).
    try:
        api = api_client(a.kubeconfig, limit=None)
        if a.hook == "crds":
            # One Job for both on every upgrade: a hook Job's pod costs seconds of each `helm upgrade`.
            if a.skew_check_to_version:
                skew_check(api, a.namespace, a.cluster_agent, a.skew_check_to_version, a.dir)
            apply_crds(api, a.dir)
            if a.cluster_agent:
                hand_over_from_non_electing(api, a.namespace, a.cluster_agent, a.target_strategy)
        elif a.hook == "skew-check":
            skew_check(api, a.namespace, a.deployment, a.to_version, a.crds)
        else:
            cleanup(api, a.namespace, a.release, a.cluster_id, a.control_plane_url, a.token_file, a.timeout, a.domain,
                    a.work_claim_templates == "true", ca_file=a.control_plane_ca_file,
                    allow_insecure=a.control_plane_allow_insecure == "true")
    except SkewError as e:
        fail(f"refused: {e}")
        return 1
    except MigrationError as e:
        fail(f"storage migration failed: {e}")
        return 1
    except SystemExit as e:
        if _json_log is None or not isinstance(e.code, str):
            raise
        fail(e.code)  # one JSON line rather than Python's plain one
        return 1
    except Exception:
        if _json_log is None:
            raise  # text: Python's traceback, as always
        _json_log.error("hook %s failed", a.hook, exc_info=True)
        return 1
    return 0
