"""What a failed test leaves for a person to read: its namespace's pods, logs, events and objects.

The namespace fixture dumps after the test; a release the test uninstalls in its own `finally` is dumped by
`Release.uninstall_if_installed` first (when an exception is on its way out), or its agents' logs would be gone."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kubernetes import client

from e2e.cluster import artifacts_dir, tool
from e2e.helpers import pod_http_get


def failing_test() -> str:
    """The test pytest runs now (its name without the phase), from PYTEST_CURRENT_TEST; "" outside a test."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.split("::")[-1].rsplit(" ", 1)[0] if current else ""


ARTIFACTS = artifacts_dir()


def dump(core: client.CoreV1Api, ns: str, test: str, kubeconfig: Path | None = None, into: str = "") -> Path:
    """Everything a failed test touched in its namespace, into ARTIFACTS/<test>/[<into>/]: pods with their
    current and previous logs, events, GPUDomains and members, helm history, agents' /healthz."""
    folder = ARTIFACTS / test.replace("/", "_")[:120] / into
    folder.mkdir(parents=True, exist_ok=True)

    def save(name: str, text: str | None) -> None:
        (folder / name).write_text(text or "")

    lines = []
    for pod in core.list_namespaced_pod(ns).items:
        lines.append(f"pod {pod.metadata.name}: {pod.status.phase} "
                     f"{[(c.type, c.status) for c in pod.status.conditions or []]} "
                     f"restarts {[c.restart_count for c in pod.status.container_statuses or []]}")
        for c in pod.spec.containers:
            for previous in (False, True):
                try:
                    log = core.read_namespaced_pod_log(pod.metadata.name, ns, container=c.name, previous=previous)
                    save(f"{pod.metadata.name}.{c.name}{'.previous' if previous else ''}.log", log or "")
                except client.ApiException:
                    pass
            if "agent" in c.name:
                port = c.ports[0].container_port if c.ports else 8080
                code, body = pod_http_get(core, ns, pod.metadata.name, port, "healthz")
                save(f"{pod.metadata.name}.healthz.json", f"{code}\n{json.dumps(body, indent=1) if isinstance(body, dict) else body}")
    save("pods.txt", "\n".join(lines) + "\n")
    save("events.txt", "\n".join(f"{ev.last_timestamp} {ev.involved_object.kind}/{ev.involved_object.name}: "
                                 f"{ev.reason}: {ev.message}" for ev in core.list_namespaced_event(ns).items) + "\n")
    custom = client.CustomObjectsApi(core.api_client)
    for plural in ("gpudomains", "gpudomainmembers"):
        try:
            objs = custom.list_namespaced_custom_object("gpu-agent.io", "v1beta1", ns, plural)
            save(f"{plural}.json", json.dumps(objs, indent=1, default=str))
        except client.ApiException:
            pass
    if kubeconfig is not None:
        releases = subprocess.run([tool("helm"), "--kubeconfig", str(kubeconfig), "-n", ns, "list", "-q"],
                                  capture_output=True, text=True, timeout=60).stdout.split()
        for r in releases:
            history = subprocess.run([tool("helm"), "--kubeconfig", str(kubeconfig), "-n", ns, "history", r],
                                     capture_output=True, text=True, timeout=60)
            save(f"helm-history.{r}.txt", history.stdout + history.stderr)
    return folder
