"""A node agent that lies about its address (issue 48): the cluster agent trusts only what it can check.

A member's `spec.ip` reaches every peer list of its domain, and nothing but its own node agent writes it. The
folder checks it against the member's owner Pod, the node agent's own (agent/gpu_agent/mechanisms/domain/trust.py):
a member whose address is not its Pod's is folded NotReady, its address left out of the status, with the reason in
the Ready condition's message and in a NodeUntrusted Event.

The lie is told as a compromised node agent would tell it: a merge patch of its own member with a token bound to its
Pod (the admission policy lets a node agent write its own node's member, and nothing binds the address). The node
agent itself applies its true spec again at its next heartbeat (server-side apply, forced, the whole spec), so the lie
stands until then: the test lies just after a heartbeat, with heartbeats 10 s apart, asserts the member NotReady with
the reason within LIE_SEEN, and then that it heals when the agent's next heartbeat applies the truth."""

from __future__ import annotations

import json
import time

from kubernetes import client

from e2e.helpers import pod_bound_client, wait_until
from e2e.release import Release
from gpu_agent.mechanisms.domain.members import member_name

GROUP, VERSION = "gpu-agent.io", "v1beta1"
NA = "app.kubernetes.io/component=node-agent"
DOMAIN = "fabric"
HEARTBEAT = 10  # seconds between the node agent's own applies: the lie stands about this long
LIE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): no node's address
LIE_SEEN = 5.0  # the bound: the folder sees the member's change at once and writes a loss of readiness at once


def test_a_member_lying_about_its_ip_is_marked_notready_with_the_reason_and_heals_when_the_truth_is_applied(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    node = fake_gpus.node
    fake_gpus.set(1)
    release = Release(api, core, apps, kubeconfig, namespace, name="trust")
    custom = client.CustomObjectsApi(api)
    member = member_name(DOMAIN, node)
    seen_ips: set[str] = set()  # every address the status showed for the node while the test read it

    def status() -> dict:
        try:
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomains", DOMAIN)
        except client.ApiException as e:
            if e.status == 404:
                return {}
            raise
        return obj.get("status") or {}

    def entry() -> tuple[tuple[str, str] | None, str, str]:
        """((ip, status) of the node's entry or None, the domain's Ready condition status, its message)."""
        s = status()
        nodes = [n for n in s.get("nodes") or [] if n.get("name") == node]
        seen_ips.update(n.get("ip", "") for n in nodes)
        ready = next((c for c in s.get("conditions") or [] if c.get("type") == "Ready"), {})
        return ((nodes[0].get("ip", ""), nodes[0].get("status", "")) if nodes else None,
                ready.get("status", ""), ready.get("message", ""))

    def heartbeat() -> str:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomainmembers", member)["spec"].get(
            "heartbeat", "")

    def untrusted_events() -> list[str]:
        # as JSON: the generated client refuses an events.k8s.io Event without eventTime (one the core API wrote)
        r = client.EventsV1Api(api).list_namespaced_event(namespace, _preload_content=False, _request_timeout=10)
        events = json.loads(r.data)["items"]
        return [e.get("note") or "" for e in events
                if e.get("reason") == "NodeUntrusted" and (e.get("regarding") or {}).get("name") == DOMAIN]

    try:
        release.install("--set", f"domain.name={DOMAIN}", "--set", f"domain.heartbeatInterval={HEARTBEAT}",
                        "--set", f"nodeAgent.nodeSelector.kubernetes\\.io/hostname={node}")
        wait_until(lambda: (lambda e: e[0] is not None and e[0][1] == "Ready" and e[1] == "True")(entry()), 120,
                   "the domain Ready with the node's member")
        (agent,) = [p for p in core.list_namespaced_pod(namespace, label_selector=NA).items
                    if p.spec.node_name == node and p.metadata.deletion_timestamp is None]
        truth = agent.status.host_ip
        assert entry()[0] == (truth, "Ready"), entry()
        why = f"MemberAddressMismatch: member says {LIE}, its Pod {agent.metadata.name} has {truth}"

        # Just after one of its heartbeats, the agent's next own apply is HEARTBEAT s away: the lie stands that long.
        beat = heartbeat()
        wait_until(lambda: heartbeat() != beat, HEARTBEAT + 5, "a heartbeat of the node agent", interval=0.05)
        as_agent = client.CustomObjectsApi(pod_bound_client(api, agent))
        as_agent.patch_namespaced_custom_object(GROUP, VERSION, namespace, "gpudomainmembers", member,
                                                {"spec": {"ip": LIE}})
        lied = time.monotonic()
        wait_until(lambda: (lambda e: e[0] == ("", "NotReady") and e[1] == "False" and why in e[2])(entry()), LIE_SEEN,
                   f"the member NotReady, its address withheld, and the Ready condition naming why ({why})",
                   interval=0.1)
        marked = time.monotonic() - lied
        message = entry()[2]

        # The agent's next heartbeat applies its true spec: the member is trusted again.
        wait_until(lambda: (lambda e: e[0] == (truth, "Ready") and e[1] == "True")(entry()), HEARTBEAT + LIE_SEEN,
                   "the member Ready again with its true address once its agent applied it", interval=0.1)
        healed = time.monotonic() - lied
        notes = wait_until(lambda: [n for n in untrusted_events() if why in n], 30, f"a NodeUntrusted Event naming {why}")
        print(f"\nlie told: member NotReady after {marked:.1f} s, Ready again after {healed:.1f} s (heartbeat "
              f"{HEARTBEAT} s); condition: {message}; event: {notes[0]}")
        assert LIE not in seen_ips, f"the lie reached the domain's status: {seen_ips}"
        assert heartbeat() != beat
    finally:
        release.uninstall_if_installed()
        fake_gpus.set(0)
