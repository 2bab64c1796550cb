"""`pods create` in the release namespace is no master key (issue 48, part 2), on a real API server with the chart's
defaults.

With a token of the cluster agent's ServiceAccount bound to its Pod (as the kubelet mounts it), this test sends dry-run
creates: the work Pod the agent's own builder makes under the Lease's current token is admitted, and each attempt of
e2e/work_pod_shapes.py (the node agent's ServiceAccount with its token, the control plane's tokens Secret as a volume,
a hostPath, hostNetwork, a privileged container, a work Pod without the fencing token, and the rest that this API
server's version hands to the policy as sent) is refused 403 by the chart's shape policy, with a message naming
what it refused. Every one of these is a Pod the API server admits without that policy: the ServiceAccount admission
plugin lets a Pod name any account of its namespace, the namespace enforces no Pod Security level (the node agents in
it could not run under `restricted`), and the fencing policy matches only Pods that carry its token; so with the
policy missing or a check gone, a row is admitted and the test fails. A dry run passes every admission step a create
does and persists nothing: a row that wrongly passes puts no hostPath or privileged Pod on the cluster.

Then an item enqueued at the control plane runs end to end: its Pod runs as the work ServiceAccount, without a token
or Service links, and the item is done. The table (attempt, status, message) is printed."""

from __future__ import annotations

import json
import uuid

from kubernetes import client

from e2e.helpers import admission, pod_bound_client, wait_until
from e2e.release import WAIT, Release, enqueue, items
from e2e.work_pod_shapes import ATTEMPTS, Names, work_pod
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.mechanisms.queues.pod_executor import pod_name


def dry_run_create(core: client.CoreV1Api, namespace: str, pod: dict) -> tuple[int, str]:
    """(201, "") when admitted, else (status, the API server's message); nothing is made either way."""
    pod = json.loads(json.dumps(pod))
    pod["metadata"].pop("name", None)
    pod["metadata"]["generateName"] = "shape-check-"
    return admission(lambda: core.create_namespaced_pod(namespace, pod, dry_run="All"))


def test_the_cluster_agents_token_creates_only_work_pods_of_the_agents_shape(api, core, apps, kubeconfig, namespace,
                                                                            fake_gpus):
    fake_gpus.set(1)
    # A release name of its own: the policies and the hooks' ClusterRole are cluster-scoped, named after it.
    release = Release(api, core, apps, kubeconfig, namespace, name=f"shape{uuid.uuid4().hex[:5]}")
    names = Names(release=release.name, namespace=namespace)
    try:
        release.install(*WAIT)
        wait_until(lambda: (release.healthz()[1] or {}).get("active"), 90, "the cluster agent active")
        agent = core.read_namespaced_pod(release.agent_pod(), namespace)
        assert agent.spec.service_account_name == names.cluster_agent_account
        as_agent = client.CoreV1Api(pod_bound_client(api, agent))
        lease = client.CoordinationV1Api(api).read_namespaced_lease(f"{release.fullname}-cluster-agent", namespace)
        leader = LeaderToken(lease.spec.holder_identity, lease.metadata.uid, lease.spec.lease_transitions or 0)
        good = work_pod(names, leader)

        rows: list[tuple[str, int, str]] = []
        wrong: list[str] = []
        status, message = dry_run_create(as_agent, namespace, good)
        rows.append(("the work Pod the agent builds (control)", status, message))
        if status != 201:
            wrong.append(f"the agent's own work Pod was refused: {status} {message}")
        version = client.VersionApi(api).get_code()
        server = (int(version.major), int(version.minor.rstrip("+")))
        for attempt in [a for a in ATTEMPTS if a.since is not None and a.since <= server]:
            status, message = dry_run_create(as_agent, namespace, attempt.pod(good, names))
            rows.append((attempt.what, status, message))
            if status != 403 or "-work-pod-shape'" not in message or attempt.named(names) not in message:
                wrong.append(f"{attempt.what}: {status} {message or '(admitted)'}; wanted 403 from the shape policy "
                             f"naming {attempt.named(names)!r}")
        width = max(len(r[0]) for r in rows)
        table = "\n".join(f"{what:<{width}}  {status}  {message}" for what, status, message in rows)
        print(f"\nPods created with the cluster agent's token (dry runs), release {release.name}:\n{table}")
        assert not wrong, "\n".join(wrong) + "\n" + table

        # The agent's own Pod of a real item: admitted, as the work ServiceAccount, without a token; the item done.
        enqueue(release, ["shape-item"], seconds=5)
        real = wait_until(lambda: _read(core, namespace, pod_name("shape-item")), 60, "the item's work Pod")
        assert real.spec.service_account_name == names.work_account, real.spec.service_account_name
        assert real.spec.automount_service_account_token is False and real.spec.enable_service_links is False
        assert not [v.name for v in real.spec.volumes or []], "a work Pod has no volume (no token projected)"
        wait_until(lambda: items(release).get("shape-item") == "done", 90, "the item done")
        print(f"a real item's Pod {real.metadata.name}: serviceAccountName {real.spec.service_account_name}, "
              "no token, no Service links; the item done")
    finally:
        release.uninstall_if_installed()


def _read(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    try:
        return core.read_namespaced_pod(name, namespace)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise
