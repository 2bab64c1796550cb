"""Listeners that hold (issue 48, part 5), on the CI cluster: the attack table's two availability rows, which
agent/tests/integration/test_slow_clients.py proves on loopback, tried from the pod network against a release
installed with the chart's defaults.

1. A slowloris from a pod of the test's namespace against the cluster agent's probe and metrics listener (port
   `http`, 8080): 200 half-open connections (a request line and a header, never the blank line that ends them; half
   of them trickle a byte a second so that only the read timeout, not the idle one, can end them), the ones the agent
   closed opened again every 7 s, for 30 s: each time the agent closes the 136 over its cap of 64 at once and the
   rest at its 5 s read timeout, so every slot it has is held by the attack but for a second or two in seven. The chart's default NetworkPolicy for the cluster agent admits every pod
   to that port (`networkPolicy.metricsFrom` is empty: the rule names the port and no peer), so the attacking pod
   carries no label and the test sets no value; the test reads the policy back and says so, and on the CI cluster,
   which enforces NetworkPolicies (ci/scripts/netpol.sh), the attack's connections are the proof that it admitted
   them. Meanwhile the test process samples /livez and /healthz every 0.5 s at the pod's own address, as the kubelet
   does (on the CI cluster this host routes to every pod: see e2e/test_alerts.py; elsewhere through the API server's
   pod proxy, which dials the same address from the API server). Asserted: the samples counted, every /livez 200
   within 2 s, every /healthz answered by the agent within 2 s; the kubelet's own probes saw nothing (no new
   Unhealthy event, the Ready condition not changed); no restart; the Lease's holder and transitions unchanged (no
   failover); and the attacking pod saw every connection closed by the agent, the ones it could hold past the cap
   at the read timeout, none later.

2. 16 long-polled lease calls against the chart's control plane, from inside its own pod (8 credentials of 8
   clusters registered with the registration token, 2 calls each: every long-poll slot the control plane has, not
   only one credential's), while /healthz is sampled 25 times from the same pod over HTTPS, a new connection each
   time as the kubelet's probe makes: each 200 in under 100 ms, and the long-polls held throughout (the rest refused
   429, none answered otherwise). No token or credential is printed.
"""

from __future__ import annotations

import json
import time
import uuid
from http.client import HTTPConnection
from statistics import median

import pytest
from kubernetes import client

from e2e import cluster
from e2e.helpers import IMAGE, Sampler, pod_http_get, pod_log, wait_until
from e2e.release import WAIT, Release
from gpu_agent.foundations import http
from gpu_agent.roles import endpoints
from gpu_agent.roles.control_plane import api as cp_api

PORT = 8080  # the agents' port `http`: probes and /metrics
CONNECTIONS = 200
ATTACK_SECONDS = 30
BOUND = 2.0  # each /livez and /healthz sample, generous for the loaded 2-core CI machine (the kubelet's own: 1 s)
INTERVAL = 0.5
# The agent closes a connection whose request has not arrived whole TIMEOUT_SECONDS after its first byte (or that is
# idle that long), looked for every SWEEP_SECONDS; 4 s more for a loaded machine and the attacker's own loop.
CLOSED_WITHIN = endpoints.TIMEOUT_SECONDS + http.SWEEP_SECONDS + 4.0
# On the CI cluster this host routes to every pod's address (e2e/test_alerts.py DIRECT), as the kubelet reaches it.
DIRECT = cluster.provider() == "ci"

# Every TOP_UP_SECONDS the attack opens again as many connections as the agent closed (a slowloris keeps its count
# up). Not at once: the agent closes the stalest connection for each new one past its cap, so an attack that replaced
# each at once would churn through connections and never meet the read timeout, which this row is about.
# Once the agent's sweep has closed the survivors (at most TIMEOUT_SECONDS + SWEEP_SECONDS), a second later.
TOP_UP_SECONDS = endpoints.TIMEOUT_SECONDS + http.SWEEP_SECONDS + 1.0

# The attacking pod's program: argv host port connections seconds every timeout. It opens `connections` half-open
# connections, every other one trickling a header byte a second, and every `every` seconds opens again as many as the
# agent closed, until `seconds` pass. It prints OPENED once the first batch is connected, and at the end one RESULT
# line: what it opened, what the agent closed and after how long (`closed_at_read_timeout`: after `timeout` less
# half a second or later), what was still open.
ATTACK = r"""
import json, selectors, socket, sys, time
host, port, n, seconds, every, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(float, sys.argv[4:7])
HEAD = b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Slow: "  # never ended: no CRLF, no blank line
sel = selectors.DefaultSelector()
conns = {}  # id -> [socket, kind, opened at, batch]
lifetimes, errors, answered, opened = [], {}, 0, [0]
ids = iter(range(10**9))
held = []

def open_one(batch, now0):
    i = next(ids)
    kind = "trickle" if i % 2 else "partial"
    try:
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(HEAD)
    except OSError as e:
        errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
        return False
    s.setblocking(False)
    opened[0] += 1
    conns[i] = [s, kind, time.monotonic() - now0, batch]
    sel.register(s, selectors.EVENT_READ, i)
    return True

def closed(i, now0):
    s, kind, opened, batch = conns.pop(i)
    sel.unregister(s)
    s.close()
    lifetimes.append((kind, batch, opened, time.monotonic() - now0 - opened))

start = time.monotonic()
first = 0
for _ in range(n):
    if sum(errors.values()) >= 5:  # refused or dropped (a NetworkPolicy): say so now, not after 200 timeouts
        break
    first += open_one(0, start)
print("OPENED %d of %d in %.2f s" % (first, n, time.monotonic() - start), flush=True)
next_top_up, next_trickle, batch = start + every, start + 1, 0
while time.monotonic() - start < seconds:
    for key, _ in sel.select(0.1):
        i = key.data
        try:
            data = key.fileobj.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            closed(i, start)
            continue
        if data:
            answered += 1  # the agent answered something (an error page) before it closes
        else:
            closed(i, start)
    now = time.monotonic()
    if now >= next_trickle:
        next_trickle = now + 1
        for i, (s, kind, _, _) in list(conns.items()):
            if kind == "trickle":
                try:
                    s.send(b"x")
                except BlockingIOError:
                    pass
                except OSError:
                    closed(i, start)
    if now >= next_top_up and now - start < seconds - 2:
        next_top_up, batch = now + every, batch + 1
        held.append(len(conns))
        for _ in range(n - len(conns)):
            open_one(batch, start)
end = time.monotonic() - start
still = [end - opened for _, _, opened, _ in conns.values()]
for s, _, _, _ in conns.values():
    s.close()
by_kind = {}
for kind, _, _, life in lifetimes:
    by_kind.setdefault(kind, []).append(life)
print("RESULT " + json.dumps({
    "first_batch_connected": first, "opened": opened[0], "connect_errors": errors, "closed_by_agent": len(lifetimes),
    "first_batch_closed": sum(1 for _, b, _, _ in lifetimes if b == 0),
    "longest_lived": round(max((x[3] for x in lifetimes), default=0.0), 3),
    "closed_within_1s": sum(1 for x in lifetimes if x[3] < 1),
    "closed_at_read_timeout": sum(1 for x in lifetimes if x[3] >= timeout - 0.5),
    "by_kind": {k: {"closed": len(v), "median_s": round(sorted(v)[len(v) // 2], 3), "max_s": round(max(v), 3)}
                for k, v in by_kind.items()},
    "answered_before_close": answered, "open_before_each_top_up": held, "seconds": round(end, 1),
    "still_open_at_end": len(still), "oldest_open_at_end": round(max(still, default=0.0), 3)}), flush=True)
"""


def attacker_pod(name: str, node: str, ip: str) -> dict:
    """A pod of the namespace with no label and no token, running ATTACK against ip:PORT; non-root, no capability,
    as the NetworkPolicy tests' probers run (e2e/manifests/netpol-probe.yaml.j2)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "automountServiceAccountToken": False, "enableServiceLinks": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{"name": "attack", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["python3", "-c", ATTACK, ip, str(PORT), str(CONNECTIONS),
                                                 str(ATTACK_SECONDS), str(TOP_UP_SECONDS),
                                                 str(endpoints.TIMEOUT_SECONDS)],
                                     "securityContext": {"allowPrivilegeEscalation": False,
                                                         "capabilities": {"drop": ["ALL"]}}}]}}


def probe(core: client.CoreV1Api, namespace: str, pod: str, ip: str, path: str):
    """One sample of the agent's `path`: (status, seconds). At the pod's address where this host routes to pods,
    else through the API server's pod proxy."""
    started = time.monotonic()
    if DIRECT:  # a connection of its own each time, as the kubelet's probe; no proxy from the environment
        conn = HTTPConnection(ip, PORT, timeout=BOUND + 3)
        try:
            conn.request("GET", f"/{path}")
            code = conn.getresponse().status
        finally:
            conn.close()
    else:
        code, _ = pod_http_get(core, namespace, pod, PORT, path, timeout=BOUND + 3)
    return code, time.monotonic() - started


def unhealthy_events(core: client.CoreV1Api, namespace: str, pod: str) -> tuple[int, list[str]]:
    """How many probe failures the kubelet has reported for `pod` (its Unhealthy events, each with its count) that the
    listener could cause: every liveness failure, and every readiness failure but a 503 (the agent answered: NotReady
    by its own verdict, which the Ready condition's check covers); and those events."""
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod},reason=Unhealthy").items
    counted = [e for e in events if not (str(e.message).startswith("Readiness probe failed")
                                         and "statuscode: 503" in str(e.message))]
    total = sum(max(e.count or 0, (e.series.count if e.series else 0) or 0, 1) for e in counted)
    return total, [f"{e.count}x {e.message}" for e in counted]


def ready_since(pod: client.V1Pod):
    return next((c.status, c.last_transition_time) for c in pod.status.conditions or [] if c.type == "Ready")


# The parallel phase: a frozen listener does not answer at all (the finding: /livez stopped within seconds),
# so a 2 s bound on each sample still tells a held listener from a starved one beside other workers' load; the samples
# go to the pod's address, not through the API server's proxy, whose queueing beside other workers' installs is what
# made a 2 s goal serial elsewhere (test_gpu_health.py). The attack itself costs little: 200 connections every 7 s.
def test_a_slowloris_of_200_half_open_connections_from_a_pod_leaves_the_cluster_agent_live_ready_and_leading(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    fake_gpus.set(2)
    # A release name of its own: its cluster-scoped objects (the hooks' ClusterRole, the policies) are named after it.
    release = Release(api, core, apps, kubeconfig, namespace, name=f"slow{uuid.uuid4().hex[:5]}")
    try:
        release.install("--set", "nodeAgent.enabled=false", *WAIT)
        wait_until(lambda: (release.healthz()[1] or {}).get("active"), 90, "the cluster agent Ready and active")
        # The chart's default policy: the port `http` from anyone (no `from`), so the attacker needs no label.
        policy = client.NetworkingV1Api(api).read_namespaced_network_policy(f"{release.fullname}-cluster-agent",
                                                                              namespace)
        rules = policy.spec.ingress or []
        assert rules and all(r._from is None for r in rules), \
            f"the default NetworkPolicy names peers for the cluster agent's port: {[r.to_dict() for r in rules]}"
        agent = core.read_namespaced_pod(release.agent_pod(), namespace)
        name, ip = agent.metadata.name, agent.status.pod_ip
        restarts = {c.name: c.restart_count for c in agent.status.container_statuses}
        ready = ready_since(agent)
        leases = client.CoordinationV1Api(api)
        lease = leases.read_namespaced_lease(f"{release.fullname}-cluster-agent", namespace).spec
        leader = (lease.holder_identity, lease.lease_transitions)
        # The kubelet's probe failures so far (at the agent's start, say), once they stop changing.
        before = settled_unhealthy(core, namespace, name)

        attacker = f"slowloris-{uuid.uuid4().hex[:5]}"
        core.create_namespaced_pod(namespace, attacker_pod(attacker, fake_gpus.node, ip))
        opened = wait_until(lambda: next((x for x in pod_log(core, namespace, attacker).splitlines()
                                          if x.startswith("OPENED ")), None), 90, "the attack's connections opened")
        with Sampler(lambda: probe(core, namespace, name, ip, "livez"), INTERVAL) as livez, \
                Sampler(lambda: probe(core, namespace, name, ip, "healthz"), INTERVAL) as healthz:
            line = wait_until(lambda: next((x for x in pod_log(core, namespace, attacker).splitlines()
                                            if x.startswith("RESULT ")), None), ATTACK_SECONDS + 60,
                              "the attack's result", interval=0.5)
        result = json.loads(line[len("RESULT "):])

        agent_after = core.read_namespaced_pod(name, namespace)
        lease = leases.read_namespaced_lease(f"{release.fullname}-cluster-agent", namespace).spec
        after = settled_unhealthy(core, namespace, name)  # a failure late in the attack is reported some time after
        events = unhealthy_events(core, namespace, name)[1]
        live = [v for _, v in livez.samples]
        health = [v for _, v in healthz.samples]
        ok_live = sorted(v[1] for v in live if isinstance(v, tuple) and v[0] == 200)
        answered = sorted(v[1] for v in health if isinstance(v, tuple) and v[0] in (200, 503))
        path = f"at {ip}:{PORT} from this host" if DIRECT else "through the API server's pod proxy"
        print(f"\nslowloris from pod {attacker} ({opened}) against cluster agent {name} {path}: {json.dumps(result)}"
              f"\n/livez: {len(live)} samples, {len(ok_live)} 200, median "
              f"{median(ok_live) * 1000 if ok_live else float('nan'):.1f} ms, worst "
              f"{max(ok_live, default=float('nan')) * 1000:.1f} ms; /healthz: {len(health)} samples, "
              f"{sum(1 for v in health if isinstance(v, tuple) and v[0] == 200)} 200, worst "
              f"{max(answered, default=float('nan')) * 1000:.1f} ms; the kubelet's Unhealthy events {before} -> {after}")

        # The attack reached the listener through the default policy, and the agent closed what it held.
        assert result["first_batch_connected"] == CONNECTIONS, result
        assert result["first_batch_closed"] == CONNECTIONS, f"the agent left some of the first 200 open: {result}"
        assert result["longest_lived"] <= CLOSED_WITHIN and result["oldest_open_at_end"] <= CLOSED_WITHIN, (
            f"a half-open connection outlived the agent's read timeout ({CLOSED_WITHIN} s): {result}")
        # ...those it kept past its cap (the trickling ones, never idle) at its read timeout: the timeout was met.
        assert result["closed_at_read_timeout"] > 0, f"no connection lived to the read timeout: {result}"
        # /livez answered throughout, as the kubelet's liveness probe asks it.
        assert len(live) >= 40 and len(health) >= 40, (len(live), len(health))
        late = [v for v in live if not (isinstance(v, tuple) and v[0] == 200 and v[1] <= BOUND)]
        assert not late, f"{len(late)} of {len(live)} /livez samples failed or took over {BOUND} s: {late[:8]}"
        late = [v for v in health if not (isinstance(v, tuple) and v[0] in (200, 503) and v[1] <= BOUND)]
        assert not late, f"{len(late)} of {len(health)} /healthz samples unanswered within {BOUND} s: {late[:8]}"
        # The kubelet's own probes: no failure, Ready throughout; no restart; no failover.
        assert after == before, f"the kubelet reported probe failures during the attack: {events}"
        assert ready_since(agent_after) == ready, (ready, ready_since(agent_after))
        assert {c.name: c.restart_count for c in agent_after.status.container_statuses} == restarts
        assert (lease.holder_identity, lease.lease_transitions) == leader, (leader, lease)
    finally:
        release.uninstall_if_installed()


def settled_unhealthy(core: client.CoreV1Api, namespace: str, pod: str) -> int:
    """The count of the kubelet's Unhealthy events for `pod` once two reads 2 s apart agree (the kubelet reports its
    probe failures aggregated, some time after them)."""
    last = [-1]

    def same() -> tuple[int] | None:
        now = unhealthy_events(core, namespace, pod)[0]
        agreed, last[0] = now == last[0], now
        return (now,) if agreed else None

    return wait_until(same, 30, "the kubelet's Unhealthy events settled", interval=2.0)[0]


# Run in the control plane's pod after release.CONTROL_PLANE_PRELUDE (`url`, `ca`, the admin token `t`): /healthz
# sampled (a new connection each time, as the kubelet's probe), then 16 long-polled lease calls from 8 credentials
# (8 clusters registered with the registration token), and /healthz sampled again while they are held. Prints one
# RESULT line of statuses and timings; no token or credential.
LONG_POLLS = r"""
import json, threading, time
import requests
V = ca or True

def fresh():
    # A session of its own for each call (a new connection, as the kubelet's probe), blind to proxy settings.
    session = requests.Session()
    session.trust_env = False
    return session

REGISTRATION = open("/var/run/secrets/gpu-agent/registrationToken").read().strip()
CREDENTIALS, CALLS = 8, 16

def healthz():
    started = time.monotonic()
    try:
        with fresh() as session:
            code = session.get(url + "/healthz", verify=V, timeout=5).status_code
    except requests.RequestException as e:
        code = type(e).__name__
    return code, round(time.monotonic() - started, 4)

def sample(n):
    out = []
    for _ in range(n):
        started = time.monotonic()
        out.append(healthz())
        time.sleep(max(0.0, 0.1 - (time.monotonic() - started)))
    return out

baseline = sample(10)
# The fencing term in use (the release's cluster agent leads and consumes): a lease naming none would be refused 409.
with fresh() as session:
    term = session.get(url + "/v1/status", headers={"Authorization": "Bearer " + t.reveal()}, verify=V,
                       timeout=10).json().get("term")
credentials = []
for i in range(CREDENTIALS):
    with fresh() as session:
        r = session.post(url + "/v1/register", json={"clusterId": "e2e-long-poll-%d" % i, "generation": 1, "gpus": [],
                                                     "holder": "e2e-long-poll-%d" % i},
                         headers={"Authorization": "Bearer " + REGISTRATION}, verify=V, timeout=10)
    assert r.status_code == 200, (r.status_code, r.text[:300])
    credentials.append(r.json()["credential"]["token"])
answers = []

def poll(i):
    body = {"waitSeconds": 30, "leaseSeconds": 30, "holder": "e2e-long-poll-%d" % (i // 2)}
    if term:
        body["term"] = term["term"]
    started = time.monotonic()
    try:
        with fresh() as session:
            code = session.post(url + "/v1/queue/lease", json=body, verify=V, timeout=45,
                                headers={"Authorization": "Bearer " + credentials[i // 2]}).status_code
    except requests.RequestException as e:
        code = type(e).__name__
    answers.append((i, code, round(time.monotonic() - started, 3)))

polls = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(CALLS)]
for p in polls:
    p.start()
# The calls over the bounds are answered at once: wait until no answer came for 1.5 s (at most 20 s).
deadline, seen, quiet = time.monotonic() + 20, -1, time.monotonic()
while time.monotonic() < deadline:
    if len(answers) != seen:
        seen, quiet = len(answers), time.monotonic()
    elif time.monotonic() - quiet >= 1.5:
        break
    time.sleep(0.05)
before = list(answers)
held = sum(p.is_alive() for p in polls)
under = sample(25)
print("RESULT " + json.dumps({"term": bool(term), "baseline": baseline, "under": under, "answered_before": before,
                              "held": held, "still_held_after": sum(p.is_alive() for p in polls),
                              "answered_after": list(answers)}), flush=True)
os._exit(0)  # the held calls are left to the control plane's 30 s wait
"""

HEALTHZ_BOUND = 0.1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@pytest.mark.serial(reason="measures a 100 ms goal of the control plane's /healthz from inside its pod, each sample a "
                           "new TLS connection made in Python: beside the parallel phase's workers on the 2-core CI "
                           "machine, CPU contention alone could take a sample past 100 ms with the control plane not "
                           "starved at all, and a starved one takes seconds, not 100 ms")
def test_the_control_plane_answers_healthz_within_100ms_while_16_long_polls_hold_every_slot_they_may(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    fake_gpus.set(1)
    release = Release(api, core, apps, kubeconfig, namespace, name=f"poll{uuid.uuid4().hex[:5]}")
    try:
        release.install("--set", "nodeAgent.enabled=false", *WAIT)
        # The cluster agent Ready and leading: it consumes the queue (its own long-poll, a fencing term in use).
        wait_until(lambda: (release.healthz()[1] or {}).get("active"), 90, "the cluster agent Ready and active")
        pod = release.control_plane_pod()
        restarts = {c.name: c.restart_count for c in core.read_namespaced_pod(pod, namespace).status.container_statuses}
        out = release.control_plane(LONG_POLLS)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        assert line, f"no result from the long-polls in {pod}: {out[-1500:]}"
        result = json.loads(line[len("RESULT "):])
        under = [seconds for _, seconds in result["under"]]
        base = [seconds for _, seconds in result["baseline"]]
        refused = [code for _, code, _ in result["answered_before"]]
        print(f"\n/healthz of control plane {pod} from its own pod: before the long-polls {len(base)} samples, p50 "
              f"{percentile(base, 0.5) * 1000:.1f} ms, max {max(base) * 1000:.1f} ms; with {result['held']} of 16 "
              f"long-polls held ({len(refused)} answered at once: {sorted(set(map(str, refused)))}), "
              f"{len(under)} samples, p50 {percentile(under, 0.5) * 1000:.1f} ms, max {max(under) * 1000:.1f} ms; "
              f"a fencing term in use: {result['term']}")

        # The long-polls held every slot they may: the cluster agent's own long-poll holds at most one credential's
        # share, so 16 calls from 8 credentials hold at least the rest; every other call refused 429 at once.
        least = cp_api.MAX_LONG_POLLS - cp_api.MAX_LONG_POLLS_PER_CREDENTIAL
        assert result["held"] >= least, f"only {result['held']} long-polls held (at least {least}): {result}"
        assert len(refused) + result["held"] == 16 and set(refused) <= {429}, result["answered_before"]
        assert result["still_held_after"] == result["held"] and result["answered_after"] == result["answered_before"], (
            f"a held long-poll was answered while /healthz was sampled: {result['answered_after']}")
        # /healthz answered within 100 ms throughout.
        assert len(under) >= 20, len(under)
        slow = [(code, seconds) for code, seconds in result["under"] if code != 200 or seconds >= HEALTHZ_BOUND]
        assert not slow, f"{len(slow)} of {len(under)} /healthz samples failed or took 100 ms or more: {slow}"
        after = {c.name: c.restart_count for c in core.read_namespaced_pod(pod, namespace).status.container_statuses}
        assert after == restarts, (restarts, after)
    finally:
        release.uninstall_if_installed()
