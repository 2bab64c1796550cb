"""The charts' NetworkPolicies, enforced: every policy of both charts tried from inside and outside its peers.

The CI cluster runs a NetworkPolicy enforcer on every node (kube-network-policies, ci/scripts/netpol.sh). A
connection it refuses is dropped, so the prober sees a timeout; "refused" (a reset) would mean the packet
reached the pod. Probes are `kubectl exec`ed into pods pinned to every node, each trying every target at once
with a bounded timeout, so each target is tried from its own node and from the others.

On a cluster without an enforcer every policy is decoration and these tests would fail: they run on the CI
cluster (E2E_CLUSTER=ci), or where E2E_NETWORK_POLICIES=enforced says the cluster enforces them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e import cluster
from e2e.cluster import tool
from e2e.helpers import apply, wait_until
from e2e.release import BASE, CHART, Release, helm

ENFORCED = cluster.provider() == "ci" or os.environ.get("E2E_NETWORK_POLICIES") == "enforced"
pytestmark = [pytest.mark.skipif(not ENFORCED, reason="needs a cluster that enforces NetworkPolicies: the CI cluster "
                                                      "(E2E_CLUSTER=ci), or E2E_NETWORK_POLICIES=enforced"),
              # a refusal is a probe that timed out (TIMEOUT): on a loaded 2-core machine an admitted peer could too
              pytest.mark.serial(reason="places probes on every node and reads a refusal from a 3 s timeout, which "
                                        "other tests' load could fake")]


ARTIFACTS = cluster.artifacts_dir()
CONTROL_PLANE_PORT = 8700  # HTTPS with the chart's defaults
TIMEOUT = 3.0  # seconds a probe waits for a connection: a refused one times out (the enforcer drops it)
CLOSED = 9  # a port nothing listens on: "refused" without a policy, a timeout under one
SCRAPER = {"e2e.gpu-agent.io/scraper": "true"}  # the metricsFrom peer: this label, in the release's namespace
API = ("kubernetes", "10.96.0.1", 443)  # the API server's Service (the CI cluster's SERVICE_CIDR)

# Runs in a prober: argv[1] the targets [{key, ip, port, path}], argv[2] names to resolve; prints one JSON line.
PROBE = r"""
import json, socket, ssl, sys
from concurrent.futures import ThreadPoolExecutor
targets, names, timeout = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3])
def probe(t):
    try:
        s = socket.create_connection((t["ip"], t["port"]), timeout=timeout)
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return "error: %s" % e
    with s:
        if not t.get("path"):
            return "open"
        try:
            if t.get("tls"):  # reachability, not trust, is the question here: the certificate is not verified
                s = ssl._create_unverified_context().wrap_socket(s)
            s.sendall(("GET %s HTTP/1.0\r\nHost: %s\r\n\r\n" % (t["path"], t["ip"])).encode())
            status = s.makefile("rb").readline().split()
            return "open http %s" % status[1].decode() if len(status) > 1 else "open, no http answer"
        except OSError as e:
            return "open, http error: %s" % e
def resolve(name):
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        return "error: %s" % e
with ThreadPoolExecutor(len(targets) + len(names) + 1) as pool:
    probes = {t["key"]: pool.submit(probe, t) for t in targets}
    dns = {n: pool.submit(resolve, n) for n in names}
    print("RESULT " + json.dumps({"probes": {k: f.result() for k, f in probes.items()},
                                  "dns": {k: f.result() for k, f in dns.items()}}))
"""


def kubectl(kubeconfig, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([tool("kubectl"), "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True,
                          timeout=timeout)


def exec_argv(kubeconfig, namespace: str, pod: str, container: str, argv: list[str]) -> str:
    r = kubectl(kubeconfig, "exec", "-n", namespace, pod, "-c", container, "--", *argv)
    if r.returncode:
        raise AssertionError(f"exec in {namespace}/{pod} failed ({r.returncode}): {r.stderr[-800:]}")
    return r.stdout


def listening_ports(kubeconfig, namespace: str, pod: str, container: str) -> tuple[set[int], set[int]]:
    """(TCP ports the pod listens on beyond loopback, those on loopback only), from its /proc/net/tcp{,6}."""
    text = exec_argv(kubeconfig, namespace, pod, container, ["cat", "/proc/net/tcp", "/proc/net/tcp6"])
    reachable, loopback = set(), set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A" or ":" not in fields[1]:  # 0A: LISTEN
            continue
        addr, port = fields[1].split(":")
        local = (len(addr) == 8 and addr.endswith("7F")) or addr in (
            "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")  # 127/8, ::1, ::ffff:127.0.0.1
        (loopback if local else reachable).add(int(port, 16))
    return reachable, loopback - reachable


class Prober:
    """A pod that probes: (namespace, pod, container), a name for the matrix, and what it is."""

    def __init__(self, label: str, namespace: str, pod: str, container: str, role: str, node: str) -> None:
        self.label, self.namespace, self.pod, self.container, self.role, self.node = (
            label, namespace, pod, container, role, node)


class Target:
    """One port of one pod; `path`: an HTTP GET to send once connected (over TLS where `tls`)."""

    def __init__(self, component: str, pod: str, node: str, ip: str, port: int, path: str = "", tls: bool = False) -> None:
        self.component, self.pod, self.node, self.ip, self.port, self.path = component, pod, node, ip, port, path
        self.tls = tls
        self.key = f"{component}@{node}:{port}"


def run_round(kubeconfig, probers: list[Prober], targets: list[Target], names: list[str]) -> dict[str, dict[str, Any]]:
    """Every prober tries every target (its own pod left out) at once; {prober label: {probes, dns}}."""
    def one(p: Prober) -> dict[str, Any]:
        mine = [{"key": t.key, "ip": t.ip, "port": t.port, "path": t.path, "tls": t.tls} for t in targets if t.pod != p.pod]
        out = exec_argv(kubeconfig, p.namespace, p.pod, p.container,
                        ["python3", "-c", PROBE, json.dumps(mine), json.dumps(names), str(TIMEOUT)])
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        assert line, f"no result from {p.label}: {out[-800:]}"
        return json.loads(line[len("RESULT "):])

    with ThreadPoolExecutor(len(probers)) as pool:
        return dict(zip([p.label for p in probers], pool.map(one, probers), strict=True))


def wait_running(core, namespace: str, names: list[str], timeout: float = 90) -> dict[str, Any]:
    def running():
        pods = {n: core.read_namespaced_pod(n, namespace) for n in names}
        ok = all(p.status.phase == "Running" and p.status.pod_ip
                 and all(c.ready for c in p.status.container_statuses or []) for p in pods.values())
        return pods if ok else None

    return wait_until(running, timeout, f"pods {names} Running in {namespace}", interval=0.5)


def probe_pod(api, namespace: str, name: str, node: str, labels: dict[str, str], uid: int = 65532,
              serve: bool = False) -> None:
    apply(api, namespace, "netpol-probe.yaml.j2", name=name, node=node, labels={"e2e-netpol": "probe", **labels},
          uid=uid, serve=serve)


@pytest.fixture
def other_namespace(core, namespace):
    """A second namespace of the test's own, whose pods are outside every peer of the release."""
    name = f"{namespace}-out"[:63]
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"e2e": "true"})))
    wait_until(lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items,
               30, "default ServiceAccount")
    yield name
    core.delete_namespace(name, grace_period_seconds=0)


@pytest.fixture
def enforcer():
    """On the CI cluster: its control-plane node's enforcer runs (a cluster brought up before ci/scripts/netpol.sh
    existed has none, and every refusal below would fail)."""
    if cluster.provider() != "ci":
        return
    pid = cluster.CI_CLUSTER_DIR / "pids" / "netpol.pid"
    alive = pid.exists() and Path(f"/proc/{pid.read_text().strip()}").exists()
    assert alive, (f"the CI cluster runs no NetworkPolicy enforcer ({pid} names no live process): bring it up "
                   "again from this checkout (make cluster-down cluster-up)")


def ready(release: Release, component: str, count: int) -> list:
    pods = [p for p in release.pods(f"app.kubernetes.io/component={component}") if p.metadata.deletion_timestamp is None]
    ok = len(pods) == count and all(p.status.pod_ip and p.status.container_statuses
                                    and all(c.ready for c in p.status.container_statuses) for p in pods)
    return pods if ok else []


def rendered(release: Release, template: str, *extra: str) -> dict:
    out = helm("template", release.name, str(CHART), "-n", release.namespace, *BASE, *extra,
               "--show-only", f"templates/{template}").stdout
    return next(d for d in yaml.safe_load_all(out) if d)


def placement(nodes: list[str]) -> tuple[str, str]:
    """(cluster agent's node, control plane's node): two different nodes where there are two, workers first, so
    the agent reaches the control plane, the API server and DNS across nodes (and between two workers on 3)."""
    if len(nodes) == 1:
        return nodes[0], nodes[0]
    return nodes[1], nodes[2] if len(nodes) > 2 else nodes[0]


def verdict(seen: str) -> str:
    return "open" if seen.startswith("open") else seen


def matrix_text(rows: list[tuple[str, str, str, str]]) -> str:
    width = max(len(f"{s} -> {d}") for s, d, _, _ in rows)
    return "\n".join(f"{f'{s} -> {d}':<{width}}  expected {e:<7}  seen {seen}" for s, d, e, seen in rows)


def record(name: str, text: str, data: Any) -> Path:
    folder = ARTIFACTS / "network-policy"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.txt").write_text(text + "\n")
    (folder / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    return folder / f"{name}.txt"


def test_each_policy_admits_its_peers_and_refuses_everyone_else_on_every_port_and_node(
        api, core, apps, kubeconfig, namespace, other_namespace, fake_gpus, enforcer):
    """Both charts installed with their NetworkPolicies on (the defaults) and `metricsFrom` naming one label in the
    release's namespace. From a prober on every node: the scraper (that label) reaches /metrics of the cluster agent
    and of every node agent; the same label in another namespace, and a pod of the release's namespace without it
    (running as root: a pod's packets are not exempt like the node's own root processes), reach nothing; the
    cluster agent and the hook Jobs (the cleanup deregisters) reach the control plane, and only they. Every TCP
    port each component listens on (read from its /proc/net/tcp) and one it does not are tried: refused ones time
    out, dropped by the enforcer, while pods no policy selects answer that closed port with a reset over the same
    paths. fake-gpu and the hook Jobs admit no ingress (the hooks' policy lives only while a hook runs: it is
    applied as rendered, over a stand-in that listens and carries the hook Jobs' labels, and probes as a hook Job
    would). And the policies break nothing the agents need: the cluster agent, placed on another node than the
    control plane, turns Ready; DNS and the API server answer every prober."""
    nodes = sorted(n.metadata.name for n in core.list_node().items)
    agent_node, cp_node = placement(nodes)
    release = Release(api, core, apps, kubeconfig, namespace, name=f"np{uuid.uuid4().hex[:5]}")
    fake_gpus.set(1)
    metrics_from = [{"podSelector": {"matchLabels": SCRAPER}}]
    try:
        started = time.monotonic()
        release.install("--set-json", f"networkPolicy.metricsFrom={json.dumps(metrics_from)}",
                        "--set-json", f'clusterAgent.nodeSelector={{"kubernetes.io/hostname": "{agent_node}"}}',
                        "--set-json", f'controlPlane.nodeSelector={{"kubernetes.io/hostname": "{cp_node}"}}')
        probers: list[Prober] = []
        for node in nodes:
            probe_pod(api, namespace, f"scraper-{node}", node, SCRAPER)
            probe_pod(api, namespace, f"stranger-{node}", node, {}, uid=0)
            probe_pod(api, other_namespace, f"outsider-{node}", node, SCRAPER)
            probers += [Prober(f"scraper@{node}", namespace, f"scraper-{node}", "probe", "scraper", node),
                        Prober(f"stranger@{node}", namespace, f"stranger-{node}", "probe", "stranger", node),
                        Prober(f"outsider@{node}", other_namespace, f"outsider-{node}", "probe", "outsider", node)]
        # The hooks' policy as the chart renders it, without its hook annotations; the stand-in wears the hook Jobs'
        # pod labels (the CRDs hook's, as rendered), so the policy's selector is what picks it.
        hooks_policy = rendered(release, "networkpolicy-hooks.yaml")
        hooks_policy["metadata"].pop("annotations", None)
        client.NetworkingV1Api(api).create_namespaced_network_policy(namespace, hooks_policy)
        hook_labels = rendered(release, "job-crds.yaml")["spec"]["template"]["metadata"]["labels"]
        selector = hooks_policy["spec"]["podSelector"]["matchLabels"]
        assert selector.items() <= hook_labels.items(), (selector, hook_labels)
        probe_pod(api, namespace, "hook-stand-in", cp_node, hook_labels, serve=True)
        # It probes too: the cleanup hook deregisters the cluster, so the hook Jobs reach the control plane.
        probers.append(Prober(f"hooks@{cp_node}", namespace, "hook-stand-in", "probe", "hooks", cp_node))

        cp = wait_until(lambda: ready(release, "control-plane", 1), 120, "the control plane Ready")[0]
        agent = wait_until(lambda: ready(release, "cluster-agent", 1), 120,
                           "the cluster agent Ready (it needs the control plane, the API server and DNS)")[0]
        node_agents = wait_until(lambda: ready(release, "node-agent", len(nodes)), 120, "a node agent Ready on every node")
        ready_after = time.monotonic() - started
        assert (agent.spec.node_name, cp.spec.node_name) == (agent_node, cp_node)
        probers.append(Prober(f"cluster-agent@{agent_node}", namespace, agent.metadata.name, "cluster-agent",
                              "cluster-agent", agent_node))
        stand_in = wait_running(core, namespace, ["hook-stand-in"])["hook-stand-in"]
        wait_running(core, namespace, [p.pod for p in probers if p.namespace == namespace and p.role != "cluster-agent"])
        outsiders = wait_running(core, other_namespace, [p.pod for p in probers if p.namespace == other_namespace])

        # Targets: every port each pod listens on, beyond loopback, and CLOSED.
        plugins = [p for p in core.list_namespaced_pod(fake_gpus.namespace,
                                                       label_selector="app.kubernetes.io/name=fake-gpu").items
                   if p.metadata.deletion_timestamp is None]
        assert sorted(p.spec.node_name for p in plugins) == nodes
        pods = ([("control-plane", cp, namespace, "control-plane", "/healthz"),
                 ("cluster-agent", agent, namespace, "cluster-agent", "/metrics"),
                 ("hooks", stand_in, namespace, "probe", "/")]
                + [("node-agent", p, namespace, "node-agent", "/metrics") for p in node_agents]
                + [("fake-gpu", p, fake_gpus.namespace, "fake-gpu", "") for p in plugins])
        targets, declared, loopback_only = [], {}, {}
        for component, pod, ns, container, path in pods:
            ports, local = listening_ports(kubeconfig, ns, pod.metadata.name, container)
            declared[component] = sorted({p.container_port for c in pod.spec.containers for p in c.ports or []})
            assert set(declared[component]) <= ports, (component, declared[component], ports)
            if local:
                loopback_only[f"{component}@{pod.spec.node_name}"] = sorted(local)
            for port in sorted(ports | {CLOSED}):
                targets.append(Target(component, pod.metadata.name, pod.spec.node_name, pod.status.pod_ip, port,
                                      path if port in declared[component] else "",
                                      tls=component == "control-plane" and port == CONTROL_PLANE_PORT))
        # The control: pods no policy selects (the outsiders, in a namespace without policies) answer CLOSED with a
        # reset over the same paths, so a timeout above is a drop, not a network that loses packets.
        for pod in outsiders.values():
            targets.append(Target("no-policy", pod.metadata.name, pod.spec.node_name, pod.status.pod_ip, CLOSED))
        targets.append(Target(API[0], "", "service", API[1], API[2]))
        names = ["kubernetes.default.svc.cluster.local",
                 f"{release.fullname}-control-plane.{namespace}.svc.cluster.local"]

        def expected(p: Prober, t: Target) -> str:
            if t.component == API[0]:
                return "open"
            if t.component == "no-policy":
                return "refused"
            if t.port not in declared[t.component]:
                return "timeout"
            if t.component == "control-plane":
                return "open" if p.role in ("cluster-agent", "hooks") else "timeout"
            if t.component in ("cluster-agent", "node-agent"):
                return "open" if p.role == "scraper" else "timeout"
            return "timeout"  # fake-gpu and the hooks: no ingress

        # Rounds until every cell that should connect has (a prober's first packets may meet an enforcer that has
        # not seen its pod yet); a refused cell must be refused in every round.
        deadline, rounds = time.monotonic() + 45, []
        while True:
            results = run_round(kubeconfig, probers, targets, names)
            rounds.append(results)
            cells = [(p, t, expected(p, t), results[p.label]["probes"][t.key])
                     for p in probers for t in targets if t.pod != p.pod]
            rows = [(p.label, t.key, e, seen) for p, t, e, seen in cells]
            leaked = [r for r in rows if r[2] != "open" and verdict(r[3]) != r[2]]
            missing = [r for r in rows if r[2] == "open" and verdict(r[3]) != "open"]
            if leaked or not missing or time.monotonic() > deadline:
                break
        dns = {label: r["dns"] for label, r in results.items()}
        text = matrix_text(rows + [(label, f"DNS {name}", "answer", ip) for label, d in dns.items()
                                   for name, ip in d.items()])
        path = record("matrix", text, {"rounds": rounds, "declared": declared, "loopback_only": loopback_only,
                                       "placement": {"cluster-agent": agent_node, "control-plane": cp_node}})
        assert not leaked, (f"connected where a policy refuses (or a reset where a drop was due, or the reverse):\n"
                            f"{matrix_text(leaked)}\n\nthe whole matrix:\n{text}")
        assert not missing, f"refused where a policy admits:\n{matrix_text(missing)}\n\nthe whole matrix:\n{text}"
        http = [r for r in rows if r[2] == "open" and "http" in r[3] and not r[3].endswith(" 200")]
        assert not http, f"admitted, but the HTTP answer is not 200:\n{matrix_text(http)}"
        bad_dns = {label: d for label, d in dns.items() if any(v.startswith("error") for v in d.values())}
        assert not bad_dns, f"names did not resolve under the policies: {bad_dns}"
        opened, reset = (sum(1 for r in rows if r[2] == what) for what in ("open", "refused"))
        print(f"network policy matrix: {len(rows)} cells over {len(nodes)} node(s), {opened} admitted, "
              f"{len(rows) - opened - reset} dropped and {reset} reset by policy-free pods as expected, in "
              f"{len(rounds)} round(s); cluster agent on {agent_node}, "
              f"control plane on {cp_node}, all Ready {ready_after:.1f}s after the install; DNS answered "
              f"{len(dns)} probers; matrix in {path}")
        if loopback_only:
            print(f"listening on loopback only (not reachable, not probed): {loopback_only}")
    finally:
        release.uninstall_if_installed()
        fake_gpus.set(0)


def test_the_control_plane_refuses_outsiders_until_its_policy_is_deleted_and_again_once_it_is_back(
        api, core, apps, kubeconfig, namespace, other_namespace, enforcer):
    """The negative control: the refusals above are the enforcer's doing. A pod of another namespace and one of the
    release's namespace (on another node than the control plane where there are two) time out on the control
    plane's port; the chart's control-plane NetworkPolicy deleted, both connect and get its /healthz; the same
    policy created again, both time out again."""
    nodes = sorted(n.metadata.name for n in core.list_node().items)
    cp_node, other_node = nodes[0], nodes[-1]
    release = Release(api, core, apps, kubeconfig, namespace, name=f"nc{uuid.uuid4().hex[:5]}")
    try:
        release.install("--set", "nodeAgent.enabled=false", "--set", "gracefulNoGPU=true",
                        "--set-json", f'controlPlane.nodeSelector={{"kubernetes.io/hostname": "{cp_node}"}}')
        probe_pod(api, other_namespace, "outsider", other_node, {})
        probe_pod(api, namespace, "stranger", cp_node, {})
        cp = wait_until(lambda: ready(release, "control-plane", 1), 120, "the control plane Ready")[0]
        wait_running(core, other_namespace, ["outsider"])
        wait_running(core, namespace, ["stranger"])
        probers = [Prober(f"outsider@{other_node}", other_namespace, "outsider", "probe", "outsider", other_node),
                   Prober(f"stranger@{cp_node}", namespace, "stranger", "probe", "stranger", cp_node)]
        target = Target("control-plane", cp.metadata.name, cp.spec.node_name, cp.status.pod_ip, CONTROL_PLANE_PORT,
                        "/healthz", tls=True)
        net = client.NetworkingV1Api(api)
        name = f"{release.fullname}-control-plane"

        def seen() -> dict[str, str]:
            return {label: r["probes"][target.key] for label, r in run_round(kubeconfig, probers, [target], []).items()}

        def all_are(what: str):
            return lambda: (lambda s: s if all(verdict(v) == what for v in s.values()) else None)(seen())

        with_policy = seen()
        assert all(v == "timeout" for v in with_policy.values()), f"connected under the policy: {with_policy}"
        policy = net.read_namespaced_network_policy(name, namespace)
        net.delete_namespaced_network_policy(name, namespace)
        t = time.monotonic()
        without = wait_until(all_are("open"), 30, "both probers connecting once the policy is gone")
        opened_after = time.monotonic() - t
        assert all(v == "open http 200" for v in without.values()), without
        body = client.V1NetworkPolicy(metadata=client.V1ObjectMeta(
            name=name, labels=policy.metadata.labels, annotations=policy.metadata.annotations), spec=policy.spec)
        net.create_namespaced_network_policy(namespace, body)
        t = time.monotonic()
        again = wait_until(all_are("timeout"), 30, "both probers refused again once the policy is back")
        refused_after = time.monotonic() - t
        rows = ([(label, f"{target.key} (policy in place)", "timeout", v) for label, v in with_policy.items()]
                + [(label, f"{target.key} (policy deleted)", "open", v) for label, v in without.items()]
                + [(label, f"{target.key} (policy re-created)", "timeout", v) for label, v in again.items()])
        path = record("negative-control", matrix_text(rows), rows)
        print(f"negative control: with the control plane's policy both probers time out; deleted, both get /healthz "
              f"200 within {opened_after:.1f}s; re-created, both time out again within {refused_after:.1f}s "
              f"(rounds of {TIMEOUT:.0f}s probes); {path}")
    finally:
        release.uninstall_if_installed()
