"""Fixtures of the e2e suite: a kubeconfig from the chosen provider, API clients, a fresh
namespace per test (deleted afterwards; its pods, events and logs dumped if the test failed),
and Helm through pyhelm3 over the real binary."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

from e2e import cluster, fake_gpu_release, helpers, release
from e2e.artifacts import dump
from e2e.helpers import wait_until
from gpu_agent.foundations.kube import device_count
from gpu_agent.mechanisms.queues.pod_executor import FINALIZER, RELEASE_PATCH, RELEASE_PATCH_TYPE


@pytest.fixture(scope="session")
def kubeconfig(request) -> Path:
    which = cluster.provider()
    if which == "ci":
        if not cluster.CI_KUBECONFIG.exists():
            raise pytest.UsageError(f"no CI cluster: {cluster.CI_KUBECONFIG} is missing; run `make -C ci cluster-up`")
        return cluster.CI_KUBECONFIG
    if which == "existing":
        return Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
    # kind and k3d: the cluster `make e2e CLUSTER=kind|k3d` made (e2e/local_cluster.py up wrote the file)
    return cluster.local_kubeconfig(which)


@pytest.fixture(scope="session")
def api(kubeconfig) -> client.ApiClient:
    return config.new_client_from_config(str(kubeconfig))


# The last stable chart's work-Pod fencing policy takes the release's Lease as its param. Kubernetes up to 1.36.x (the
# CI cluster runs 1.36.2) watches a built-in param kind with an informer that it stops for good, in that API server
# process, as soon as no binding names the kind for one policy refresh (about 1 s): from then on every binding with a
# Lease param finds none ("no params found") or a frozen copy, until the API server restarts
# (kubernetes/kubernetes#130887). The current chart's param is a WorkFence of its own and needs nothing of the kind;
# the tests of the last stable release (upgrades from it, downgrades to it) keep one binding naming Lease params while
# they run, as that release's values tell its users to: it matches nothing (a namespace label no namespace has). Made
# by the `last_stable` fixture at first use and removed at the end of that session (the serial phase; a side-by-side
# phase's controller once every worker is done), so that every later test, the whole parallel phase, takes the user's
# path: no binding with a Lease param anywhere.
ANCHOR = "gpu-agent-e2e-lease-param-anchor"


def lease_param_anchor(api: client.ApiClient) -> bool:
    """Create the anchor policy and binding unless they exist; True when this call created them."""
    adm = client.AdmissionregistrationV1Api(api)
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": ANCHOR, "labels": {"e2e": "true"}},
              "spec": {"failurePolicy": "Ignore", "paramKind": {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"},
                       "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                               "operations": ["CREATE"], "resources": ["pods"]}]},
                       "validations": [{"expression": "true"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": ANCHOR, "labels": {"e2e": "true"}},
               "spec": {"policyName": ANCHOR, "validationActions": ["Deny"],
                        "paramRef": {"name": ANCHOR, "namespace": "default", "parameterNotFoundAction": "Allow"},
                        "matchResources": {"namespaceSelector": {"matchLabels": {ANCHOR: "never"}}}}}
    created = False
    for make in (lambda: adm.create_validating_admission_policy(policy),
                 lambda: adm.create_validating_admission_policy_binding(binding)):
        try:
            make()
            created = True
        except client.ApiException as e:
            if e.status != 409:
                raise
    return created


def remove_lease_param_anchor(api: client.ApiClient) -> None:
    adm = client.AdmissionregistrationV1Api(api)
    for remove in (adm.delete_validating_admission_policy_binding, adm.delete_validating_admission_policy):
        try:
            remove(ANCHOR)
        except client.ApiException as e:
            if e.status != 404:
                raise


@pytest.fixture(scope="session")
def core(api) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture(scope="session")
def apps(api) -> client.AppsV1Api:
    return client.AppsV1Api(api)


@pytest.fixture
def namespace(core, request):
    name = f"e2e-{request.node.name[:30].lower().replace('_', '-').strip('-')}-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"e2e": "true"})))
    # The namespace's default ServiceAccount appears asynchronously; pods need it.
    wait_until(lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items,
               30, "default ServiceAccount")
    yield name
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        folder = dump(core, name, request.node.name, kubeconfig=request.getfixturevalue("kubeconfig"))
        print(f"\nwhat {request.node.name} touched is in {folder}")
    core.delete_namespace(name, grace_period_seconds=0)
    # Work Pods keep the agent's finalizer until their item's ack; with the agent and the release gone (a test that
    # failed before its uninstall, a Pod made after the cleanup hook ran) nobody else releases them, and the namespace
    # would never go. Released here, and named in the summary: after a clean uninstall there should be none.
    stuck = release_work_pods(core, name)
    if stuck:
        FIGURES.append((request.node.nodeid, f"teardown released work Pods still holding the finalizer: {stuck}"))
    # A namespace goes asynchronously; its pods would hold GPUs the next test needs.
    wait_until(lambda: not core.list_namespaced_pod(name).items, 120, f"the pods of namespace {name} gone", interval=0.5)


def release_work_pods(core: client.CoreV1Api, namespace: str) -> list[str]:
    """Remove the work-item finalizer from every Pod of the namespace that still has it; their names."""
    released = []
    for pod in core.list_namespaced_pod(namespace).items:
        if FINALIZER in (pod.metadata.finalizers or []):
            try:
                core.patch_namespaced_pod(pod.metadata.name, namespace, RELEASE_PATCH, _content_type=RELEASE_PATCH_TYPE)
                released.append(pod.metadata.name)
            except client.ApiException as e:
                if e.status != 404:
                    raise
    return released


TIMINGS: dict[str, list] = {}  # nodeid -> [seconds of setup + call + teardown, outcome]
# What passing tests printed (their measured figures): pytest shows a passing test's output only
# with -s, so the summary repeats it, and CI logs keep the figures.
FIGURES: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    """Each phase's report, where the terminal is: in the one process, or in pytest-xdist's controller (the workers
    send theirs), so the tables below cover every worker's tests."""
    seconds, outcome = TIMINGS.setdefault(report.nodeid, [0.0, "passed"])
    TIMINGS[report.nodeid][0] = seconds + report.duration
    if report.failed:
        TIMINGS[report.nodeid][1] = "FAILED"
    elif report.skipped and outcome == "passed":
        TIMINGS[report.nodeid][1] = "skipped"
    if report.when == "call" and report.passed:
        FIGURES.extend((report.nodeid, line.strip()) for line in report.capstdout.splitlines() if line.strip())


def pytest_terminal_summary(terminalreporter):
    """Per-test wall time (setup + call + teardown), like bats --timing."""
    if not TIMINGS:
        return
    terminalreporter.section("per-test wall time")
    for nodeid, (seconds, outcome) in TIMINGS.items():
        terminalreporter.write_line(f"{seconds:7.1f}s  {outcome:7}  {nodeid}")
    terminalreporter.write_line(f"{sum(t for t, _ in TIMINGS.values()):7.1f}s  total of {len(TIMINGS)} tests")
    if FIGURES:
        terminalreporter.section("figures the tests measured")
        for nodeid, line in FIGURES:
            terminalreporter.write_line(f"{nodeid.split('::', 1)[-1][:60]}: {line}")


def serial_reason(item) -> str | None:
    """Why a test cannot run beside others, or None. A test says so itself: `@pytest.mark.serial(reason=...)`; a test
    that disrupts the cluster or a node (disruptive, ci_host) is serial without saying more."""
    mark = item.get_closest_marker("serial")
    if mark is not None:
        reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
        if not reason:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.serial needs reason=\"why it cannot run beside others\"")
        return reason
    for name in ("disruptive", "ci_host"):
        if item.get_closest_marker(name) is not None:
            return f"{name}: changes what other tests run on"
    return None


def among(item) -> str | None:
    """The group a serial test may run beside, or None: `@pytest.mark.serial(reason=..., among="name")` says the test
    cannot run beside the rest of the suite but can beside the other tests of the same group, which then run side by
    side in a phase of their own (E2E_PHASE=grouped), each worker owning its node as in the parallel phase."""
    mark = item.get_closest_marker("serial")
    return mark.kwargs.get("among") if mark is not None else None


def lane_of(item) -> tuple[str, int] | None:
    """(lane, nodes) of a test that runs in a lane, or None. `@pytest.mark.lane("name", nodes=N, reason=...)` says the
    test cannot run beside the suite's other tests on the same nodes (the reason), but can on nodes of its own: the
    lane's tests run one after another in a pytest process of their own (E2E_PHASE=lane), beside the parallel phase,
    on the last N fake-GPU nodes, which no side-by-side worker owns. The lane's releases run on those nodes alone
    (release.NODE_SCOPE), and `fake_gpus.nodes` are the nodes a test may change. Every lane's tests run in that one
    process (a lane's name says why its tests are there), on as many nodes as the most any of them asks. A serial mark
    on the test itself (or disruptive, ci_host) wins over its module's lane: that test runs in the serial phase."""
    mark = item.get_closest_marker("lane")
    if mark is None:
        return None
    name, nodes, reason = (mark.args[0] if mark.args else ""), mark.kwargs.get("nodes", 1), mark.kwargs.get("reason", "")
    if not name or not reason or not isinstance(nodes, int) or nodes < 1:
        raise pytest.UsageError(f'{item.nodeid}: @pytest.mark.lane needs a name, nodes=N (at least 1) and reason="why '
                                f'it cannot run beside others on the same nodes"; got {mark.args} {mark.kwargs}')
    return name, nodes


PHASES = ("serial", "grouped", "lane", "parallel")
SIDE_BY_SIDE = ("grouped", "parallel")  # phases whose workers each own a node
LANE: list[tuple[str, int]] = []  # (names, nodes) of the lanes this process runs (E2E_PHASE=lane), set at collection


def phase_of(item) -> str:
    if among(item) is not None:
        return "grouped"
    if serial_reason(item) is not None:
        return "serial"
    return "lane" if lane_of(item) is not None else "parallel"


def pytest_collection_modifyitems(config, items):
    """A cluster the suite did not create is never disrupted: those tests skip, saying why. E2E_PHASE picks one phase's
    tests (phase_of): serial, the tests that cannot run beside others; grouped, those that can beside their own group
    only (one group a run); lane, the tests of a lane (lane_of), on nodes of their own; parallel, the rest.
    ci/scripts/e2e.sh runs serial, then grouped on E2E_JOBS workers, then parallel on E2E_JOBS workers and the lane
    beside it. Unset, every test, one after another."""
    phase = os.environ.get("E2E_PHASE", "")
    if phase not in ("", *PHASES):
        raise pytest.UsageError(f"E2E_PHASE must be one of {', '.join(PHASES)} or unset; got {phase!r}")
    if phase:
        keep = [i for i in items if phase_of(i) == phase]
        groups = sorted({among(i) for i in keep if among(i) is not None})
        if len(groups) > 1:
            raise pytest.UsageError(f"E2E_PHASE=grouped runs one group beside itself; found {groups}: give each group "
                                    f"a phase of its own in ci/scripts/e2e.sh")
        # a serial test of a lane's module (its own serial mark wins) is no lane's: only E2E_PHASE=lane runs a lane
        lanes = [lane for lane in map(lane_of, keep) if lane is not None] if phase == "lane" else []
        if lanes:  # one process runs them all, one after another, on as many nodes as the most any asks
            LANE[:] = [(".".join(sorted({name for name, _ in lanes})), max(count for _, count in lanes))]
        dropped = [i for i in items if i not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    if cluster.provider() == "existing":
        skip = pytest.mark.skip(reason="disruptive (restarts kubelet or deletes cluster-wide objects): "
                                       "runs on E2E_CLUSTER=ci only, never on a cluster the suite did not create")
        for item in items:
            if "disruptive" in item.keywords:
                item.add_marker(skip)
    if cluster.provider() in ("kind", "k3d"):
        skip = pytest.mark.skip(reason=f"needs the CI cluster's host (kubelet restarts, node faults, kill -9 of a "
                                       f"node's process): runs on E2E_CLUSTER=ci only, not on {cluster.provider()}")
        for item in items:
            if "ci_host" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, "rep_" + rep.when, rep)  # for the namespace fixture's dump of a failed test
    return rep


def worker_index() -> int | None:
    """N of pytest-xdist's worker gwN (this process runs beside others), None in a process of its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


@pytest.fixture(scope="session")
def fake_gpus(kubeconfig, core, apps):
    """charts/fake-gpu (one device plugin per node): installed for the session, or the one ci/scripts/e2e.sh installed
    for the whole run where E2E_FAKE_GPU_NAMESPACE names it. Every test that needs GPUs sets the count it needs.

    Side by side (the grouped and parallel phases), worker gwN owns the Nth fake-GPU node: its GPUs are the only ones its tests
    change, its releases' cluster agents count only that node's GPUs and place their work Pods there
    (clusterAgent.gpuNodeSelector), their node agents run there alone (nodeAgent.nodeSelector), and the GPU Pods the
    tests make are bound to it (e2e/helpers.py GPU_NODE). A lane (lane_of) owns the last nodes the same way, labelled
    for its run. One process alone owns the first node and counts them all."""
    shared = os.environ.get("E2E_FAKE_GPU_NAMESPACE", "")
    ns = shared or fake_gpu_release.install(kubeconfig, core, apps)
    nodes = fake_gpu_release.labelled(core, apps, ns)
    index = worker_index() if os.environ.get("E2E_PHASE") in SIDE_BY_SIDE else None
    owned = nodes  # the nodes this process's tests may change
    if LANE:
        name, count = LANE[0]
        beside = int(os.environ.get("E2E_JOBS") or 0)  # the parallel phase's workers own the first nodes
        if len(nodes) < beside + count:
            raise pytest.UsageError(f"lane(s) {name} need {count} fake-GPU node(s) no side-by-side worker owns; the "
                                    f"cluster has {len(nodes)} ({nodes}) for {beside} worker(s) (E2E_JOBS) and the "
                                    f"lane: make cluster-up NODES={beside + count}, or E2E_JOBS=0")
        owned = nodes[-count:]
        for node in owned:
            core.patch_node(node, {"metadata": {"labels": {LANE_LABEL: name}}})
        release.NODE_SCOPE[:] = release.scope_to_label(LANE_LABEL, name)
        helpers.GPU_NODE = owned[0]
    elif index is not None:
        if index >= len(nodes):
            raise pytest.UsageError(f"worker gw{index} has no fake-GPU node of its own ({len(nodes)} nodes: {nodes}): "
                                    f"run at most {len(nodes)} workers (E2E_JOBS)")
        owned = [nodes[index]]
        release.NODE_SCOPE[:] = release.scope_to(owned[0])
        helpers.GPU_NODE = owned[0]
    # gpu-ci-node (the control plane) on the CI cluster in the serial phase; kind: the worker
    yield FakeGPUs(kubeconfig, core, ns, owned[0], owned)
    if LANE:
        for node in owned:
            core.patch_node(node, {"metadata": {"labels": {LANE_LABEL: None}}})
    if not shared:
        fake_gpu_release.uninstall(kubeconfig, core, ns)


LANE_LABEL = "gpu-agent.io/e2e-lane"  # on a lane's nodes while it runs: its releases' node selectors


class FakeGPUs:
    def __init__(self, kubeconfig, core, namespace, node, nodes):
        self.kubeconfig, self.core, self.namespace, self.node = str(kubeconfig), core, namespace, node
        self.nodes = list(nodes)  # the nodes this process's tests may change: every node, the worker's, or the lane's
        self.layout_configmap = "fg-fake-gpu-layout"  # the chart's, for release "fg"

    def command(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fake_gpu", "--kubeconfig", self.kubeconfig, "--namespace",
                               self.namespace, *args], capture_output=True, text=True, timeout=60)

    def plugin_pod(self, node: str | None = None):
        """The fake-gpu DaemonSet's pod on one node (the first node unless named)."""
        node = node or self.node
        pods = [p for p in self.core.list_namespaced_pod(self.namespace, label_selector="app.kubernetes.io/name=fake-gpu").items
                if p.spec.node_name == node and p.metadata.deletion_timestamp is None]
        assert len(pods) == 1, f"one fake-gpu pod on {node}, found {[p.metadata.name for p in pods]}"
        return pods[0]

    def allocatable(self, node: str | None = None) -> int:
        status = self.core.read_node(node or self.node).status
        return device_count(status.allocatable, "nvidia.com/gpu")  # a quantity: 5000 GPUs read "5k"

    def set(self, count: int, timeout: float = 10, node: str | None = None) -> float:
        """Set the count of one node (the first node unless named); returns seconds from the
        command's return to that node's allocatable matching."""
        node = node or self.node
        r = self.command("set", "--node", node, "--count", str(count))
        assert r.returncode == 0, r.stderr
        started = time.monotonic()
        wait_until(lambda: self.allocatable(node) == count, timeout, f"{node}: allocatable nvidia.com/gpu == {count}",
                   interval=0.05)
        return time.monotonic() - started


@pytest.fixture(scope="session")
def last_stable(api):
    """(version, chart folder) of the last stable release, its image imported into the cluster; the Lease-param
    anchor that release needs kept while the session runs (see ANCHOR)."""
    if cluster.provider() != "ci":
        pytest.skip("the last-stable image is built and imported into the CI cluster's containerd only")
    anchored = lease_param_anchor(api)
    yield _last_stable_chart()
    # Beside other workers, one that ends first must not take the anchor from a worker between two of its releases:
    # the xdist controller removes it once every worker is done (pytest_sessionfinish).
    if anchored and worker_index() is None:
        remove_lease_param_anchor(api)


def pytest_sessionfinish(session):
    """The controller of a side-by-side run removes the Lease-param anchor its workers may have made (see ANCHOR)."""
    if hasattr(session.config, "workerinput") or worker_index() is not None:
        return  # a worker
    if os.environ.get("E2E_PHASE") not in SIDE_BY_SIDE or cluster.provider() != "ci" or not cluster.CI_KUBECONFIG.exists():
        return
    with config.new_client_from_config(str(cluster.CI_KUBECONFIG)) as api:
        remove_lease_param_anchor(api)


def _last_stable_chart() -> tuple[str, Path]:
    from e2e.release import APP_VERSION

    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run(["bash", str(repo / "ci" / "scripts" / "build-images.sh"), "last-stable"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    folder = Path(r.stdout.strip().splitlines()[-1])
    version = yaml.safe_load((folder / "charts" / "gpu-agent" / "Chart.yaml").read_text())["appVersion"]
    assert version != APP_VERSION
    return version, folder / "charts" / "gpu-agent"
