"""Nothing in clear on the control-plane link (issue 48): what crosses the pod network between the cluster agent and
the chart's control plane, read off the wire.

The evidence is a packet capture taken inside the control plane pod's own network namespace (an ephemeral container
with CAP_NET_RAW, the way `kubectl debug` attaches one), so it sees every byte the control plane sends and receives,
independent of what either side logs. It reads the release's tokens from the pod's own token volume and reports only
whether their bytes appeared, never the bytes. Each row replaces the cluster agent while the capture runs, so a fresh
registration (the registration token) and the calls after it (a credential) cross the wire during it.

The row with TLS off (`controlPlane.tls.enabled=false`, `controlPlane.allowInsecure=true`) is the capture's own
control: there the token must be found, so a capture that saw nothing cannot pass the default row.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from kubernetes import client

from e2e.helpers import exec_in, pod_log, wait_until
from e2e.release import Release

PORT = 8700

# Runs in the ephemeral container: every IPv4 TCP segment to or from PORT on every interface of the pod's network
# namespace until /tmp/stop appears (or 150 s); then one JSON line with counts and whether each secret was seen.
CAPTURE = r"""
import json, os, socket, struct, sys, time
PORT = int(sys.argv[1])
needles = {}
for name in ("registrationToken", "adminToken"):
    with open("/var/run/secrets/gpu-agent/" + name, "rb") as f:
        needles[name] = f.read().strip()
needles["Authorization header"] = b"Authorization: Bearer"
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
s.settimeout(0.2)
print("CAPTURING", flush=True)
flows, first, syns, packets, start = {}, {}, 0, 0, time.monotonic()
while not os.path.exists("/tmp/stop") and time.monotonic() - start < 150:
    try:
        frame, addr = s.recvfrom(65535)
    except socket.timeout:
        continue
    if addr[2] == socket.PACKET_OUTGOING and addr[0] == "lo":
        continue  # loopback frames appear twice, once outgoing
    if len(frame) < 34 or frame[12:14] != b"\x08\x00":
        continue
    ip = frame[14:]
    ihl = (ip[0] & 15) * 4
    if ip[9] != 6:
        continue
    total = struct.unpack("!H", ip[2:4])[0]
    tcp = ip[ihl:total]
    sport, dport = struct.unpack("!HH", tcp[:4])
    if PORT not in (sport, dport):
        continue
    packets += 1
    flags, off = tcp[13], (tcp[12] >> 4) * 4
    key = (bytes(ip[12:16]), sport, bytes(ip[16:20]), dport)
    if flags & 0x02 and not flags & 0x10 and dport == PORT:
        syns += 1
    payload = tcp[off:]
    if payload:
        if key not in first:
            first[key] = payload[:5]
        flows[key] = flows.get(key, b"") + payload
wire = b"\n".join(flows.values())
to_port = [k for k in first if k[3] == PORT]
print("RESULT " + json.dumps({
    "packets": packets, "connections": syns, "payload_bytes": len(wire),
    "client_flows": len(to_port), "client_ips": sorted({socket.inet_ntoa(k[0]) for k in to_port}),
    "client_first_bytes": sorted({first[k][:1].hex() for k in to_port}),
    "found": {name: needle in wire for name, needle in needles.items()}}), flush=True)
"""


def attach_capture(core, namespace: str, pod: client.V1Pod, image: str) -> str:
    """An ephemeral container in `pod` running CAPTURE; returns its name once it prints CAPTURING."""
    name = f"capture-{int(time.time()) % 100000}"
    tokens = next(v.name for v in pod.spec.volumes if v.secret is not None and v.name == "tokens")
    container = {"name": name, "image": image, "imagePullPolicy": "Never", "command": ["python3", "-c", CAPTURE, str(PORT)],
                 "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                     "capabilities": {"add": ["NET_RAW"], "drop": ["ALL"]}},
                 "volumeMounts": [{"name": tokens, "mountPath": "/var/run/secrets/gpu-agent", "readOnly": True}]}
    core.patch_namespaced_pod_ephemeralcontainers(pod.metadata.name, namespace,
                                                  {"spec": {"ephemeralContainers": [container]}})
    wait_until(lambda: "CAPTURING" in pod_log(core, namespace, pod.metadata.name, name), 60,
               f"the capture in {pod.metadata.name} started")
    return name


def capture_result(api, core, namespace: str, pod: str, container: str) -> dict:
    exec_in(api, namespace, pod, container, ["touch", "/tmp/stop"])
    line = wait_until(lambda: next((x for x in pod_log(core, namespace, pod, container).splitlines()
                                    if x.startswith("RESULT ")), None), 30, "the capture's result")
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("mode", ["tls-default", "tls-off"])
def test_no_token_crosses_the_pod_network_in_clear_and_the_capture_finds_it_when_tls_is_off(
        api, core, apps, kubeconfig, namespace, fake_gpus, mode):
    fake_gpus.set(2)
    # A release name of its own: its cluster-scoped objects (the hooks' ClusterRole) are named after it.
    release = Release(api, core, apps, kubeconfig, namespace, name=f"tls{uuid.uuid4().hex[:5]}")
    extra = ["--set", "controlPlane.tls.enabled=false", "--set", "controlPlane.allowInsecure=true"] if mode == "tls-off" else []
    try:
        release.install("--set", "nodeAgent.enabled=false", *extra, "--wait", "--timeout", "3m")
        wait_until(lambda: release.healthz()[0] == 200, 90, "the cluster agent Ready")
        cp = core.read_namespaced_pod(release.control_plane_pod(), namespace)
        image = cp.spec.containers[0].image
        capture = attach_capture(core, namespace, cp, image)
        # A fresh registration and its first calls during the capture: the cluster agent replaced.
        old = release.agent_pod()
        core.delete_namespaced_pod(old, namespace)
        started = time.monotonic()
        wait_until(lambda: (release.agent_pod() not in (None, old)) and release.healthz()[0] == 200, 120,
                   "the replacement cluster agent registered and Ready")
        ready_after = time.monotonic() - started
        new_ip = core.read_namespaced_pod(release.agent_pod(), namespace).status.pod_ip
        result = capture_result(api, core, namespace, cp.metadata.name, capture)
        print(f"\n{mode}: the replacement Ready {ready_after:.1f}s after the delete; the capture: {json.dumps(result)}")
        # The capture saw the link in use: the replacement agent's own connections to the control plane, carrying data
        # (the kubelet's probes of the control plane are flows too, from the node's address).
        assert new_ip in result["client_ips"] and result["payload_bytes"] > 500, (new_ip, result)
        if mode == "tls-default":
            assert result["found"] == {"registrationToken": False, "adminToken": False, "Authorization header": False}, result
            # every client connection opened with a TLS handshake record (content type 22)
            assert result["client_first_bytes"] == ["16"], result
            agent_log = pod_log(core, namespace, release.agent_pod())
            assert "in clear" not in agent_log
        else:
            assert result["found"]["registrationToken"] and result["found"]["Authorization header"], result
            agent_log = pod_log(core, namespace, release.agent_pod())
            assert "in clear" in agent_log, agent_log[-2000:]
    finally:
        release.uninstall_if_installed()
