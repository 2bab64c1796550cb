"""The bats "logging" group for the node agent, through the chart on every node: what level 0 shows
(the configuration, the GPU count, the domain joined and how many peers) and keeps out (the peer
list, other nodes' addresses, GPU UUIDs), and what level 3 adds. The cluster agent's levels 0..7
are covered on loopback (agent/tests/integration/test_logging_levels.py)."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from e2e.helpers import domain_status, pod_log, wait_until
from e2e.release import Release

pytestmark = pytest.mark.lane("every-node", nodes=2, reason="sets GPUs on every node its release runs on: beside the "
                                                          "parallel phase, a lane's nodes")

NA = "app.kubernetes.io/component=node-agent"
SHOWN_FROM = {  # level -> lines of the node agent that appear from this level on
    0: ["effective configuration (secrets redacted):", "GPU inventory: 1 GPUs", "joined GPUDomain"],
    2: ["GPU UUIDs: GPU-"],
    3: ["domain peers: 0="],
}
HIDDEN_UP_TO_3 = ["domain reconcile requested"]  # a level 4 line


def test_node_agent_levels_0_and_3_show_their_lines_and_level_0_keeps_the_peer_list_and_addresses_out(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    nodes = fake_gpus.nodes  # every node, or its lane's
    for node in nodes:
        fake_gpus.set(1, node=node)
    release = Release(api, core, apps, kubeconfig, namespace, name=f"lv{uuid.uuid4().hex[:5]}")
    custom = client.CustomObjectsApi(api)
    domain = ["--set", "domain.name=gpus", "--set", f"domain.expectedNodes={len(nodes)}"]

    def formed() -> bool:
        status = domain_status(custom, namespace, "gpus")
        return status.get("status") == "Ready" and len(status.get("nodes") or []) == len(nodes)

    def logs(pods) -> dict[str, str]:
        return {p.spec.node_name: pod_log(core, namespace, p.metadata.name) for p in pods}

    def running(exclude: set[str]):
        pods = [p for p in release.pods(NA) if p.metadata.name not in exclude and p.status.phase == "Running"
                and p.metadata.deletion_timestamp is None]
        return pods if len(pods) == len(nodes) else None

    try:
        release.install(*domain, "--set", "logVerbosity=0")
        wait_until(formed, 120, f"the GPUDomain Ready with {len(nodes)} members")
        at0 = running(set())
        assert at0, "a node agent per node"
        addresses = {p.spec.node_name: {p.status.pod_ip, p.status.host_ip} - {None} for p in at0}
        texts = wait_until(lambda: (lambda t: t if all(f"has {len(nodes)} peer(s)" in x for x in t.values()) else None)(logs(at0)),
                           30, f"every node agent's log saying it has {len(nodes)} peer(s)")
        for node, text in texts.items():
            for line in SHOWN_FROM[0]:
                assert line in text, f"{node} at -v 0 must show {line!r}"
            for level in (2, 3):
                for line in SHOWN_FROM[level]:
                    assert line not in text, f"{node} at -v 0 must not show {line!r} (a level {level} line)"
            for other, ips in addresses.items():
                for ip in ips if other != node else ():
                    assert ip not in text, f"{node} at -v 0 logged {other}'s address {ip}"
            for other in nodes:
                assert other == node or other not in text, f"{node} at -v 0 named its peer {other}"

        release.upgrade(*domain, "--set", "logVerbosity=3")
        at3 = wait_until(lambda: running({p.metadata.name for p in at0}), 120, "every node agent rolled to -v 3")
        wait_until(formed, 120, "the GPUDomain Ready again")
        texts = wait_until(lambda: (lambda t: t if all(all(n in x for n in nodes) and "domain peers: " in x
                                                       for x in t.values()) else None)(logs(at3)),
                           30, "every node agent's log listing its peers")
        for node, text in texts.items():
            for lines in SHOWN_FROM.values():
                for line in lines:
                    assert line in text, f"{node} at -v 3 must show {line!r}"
            for line in HIDDEN_UP_TO_3:
                assert line not in text, f"{node} at -v 3 must not show {line!r} (a level 4 line)"
        print(f"node agents on {len(nodes)} node(s): -v 0 keeps the peer list, {sum(map(len, addresses.values()))} "
              f"addresses and GPU UUIDs out; -v 3 lists the peers")
    finally:
        release.uninstall_if_installed()
        for node in nodes:
            fake_gpus.set(0, node=node)
