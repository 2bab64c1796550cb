"""Each cluster's identity at the real control plane, over real HTTP on loopback (issue 48, part 6): the cluster
agent runs with a registration token of its cluster's own, and its every flow still works (register, renew,
re-register periodically and after a GPU change, a restart with no credential in hand, the chart's cleanup hook
deregistering it), while that token can neither re-register nor deregister another cluster, nor the shared token
touch it; and the agent holds at most two valid credentials at a time however often it registers and renews."""

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_agent.foundations.control_plane_client import ControlPlaneError
from gpu_agent.foundations.gpus import Inventory
from tests.integration.harness import SECRETS, free_port, wait_until
from tests.loopback_kubeconfig import loopback_kubeconfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = [str(ROOT / d) for d in ("agent", "hooks")]


def valid_credentials(rig, cluster_id):
    """(how many of the cluster's credentials the control plane would take now, how many of those name a holder),
    read from its database."""
    db = sqlite3.connect(str(rig.root / "cp.sqlite"), timeout=5)
    try:
        return db.execute("""SELECT COUNT(*), COUNT(h.holder) FROM credentials c LEFT JOIN credential_holders h
            USING (token_sha256) WHERE c.cluster_id = ? AND c.expires_at > ?""", (cluster_id, time.time())).fetchone()
    finally:
        db.close()


def issued(rig, cluster_id):
    db = sqlite3.connect(str(rig.root / "cp.sqlite"), timeout=5)
    try:
        return db.execute("SELECT COUNT(*) FROM credentials WHERE cluster_id = ?", (cluster_id,)).fetchone()[0]
    finally:
        db.close()


def cleanup_hook(rig, cluster_id, token_file):
    """The chart's pre-delete hook, as a process of its own; its Kubernetes API is not there (those steps fail)."""
    argv = ["--kubeconfig", loopback_kubeconfig(free_port(), rig.root), "cleanup", "--namespace", "ns", "--release",
            "ga", "--cluster-id", cluster_id, "--control-plane-url", rig.cp_url, "--token-file", str(token_file),
            "--timeout", "20"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*PACKAGES, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "gpu_agent_hooks", *argv], capture_output=True, text=True, timeout=90,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return [line for line in r.stdout.splitlines() if "cleanup deregister" in line]


def refused(call):
    with pytest.raises(ControlPlaneError) as e:
        call()
    assert e.value.status == 403, e.value
    return str(e.value)


def registrations(cp, rig):
    return {r["clusterId"]: r for r in cp.status(rig.admin_token)["registrations"]}


def test_a_clusters_own_token_acts_for_it_alone_and_every_agent_flow_still_works(rig):
    cp = rig.start_control_plane("--credential-overlap", "1")
    token_a = cp.issue_cluster_token(rig.admin_token, "cluster-a")
    token_b = cp.issue_cluster_token(rig.admin_token, "cluster-b")
    SECRETS.extend([token_a.reveal(), token_b.reveal()])
    (rig.root / "token-a").write_text(token_a.reveal())
    (rig.root / "token-b").write_text(token_b.reveal())
    cred_b = cp.register(token_b, "cluster-b", 1, Inventory()).credential.token  # cluster B, registered with its own
    SECRETS.append(cred_b.reveal())

    rig.set_gpus(2)
    agent_flags = ("--cluster-id", "cluster-a", "--identity", "cluster-a-agent-0", "--reregistration-interval", "0.5",
                   "--credential-renew-interval", "0.2")
    agent = rig.start_agent(*agent_flags, token_file=rig.root / "token-a")
    rig.wait_health(200, 15)
    # Register, renew, re-register: a credential every ~0.2 s, of which at most two are valid at once.
    wait_until(lambda: len(agent.grep("credential renewed")) >= 3 and len(agent.grep(r"registered 2 GPUs .*periodic"))
               >= 3, 15, "three renewals and three periodic re-registrations")
    counts = []
    for _ in range(20):  # sampled while it goes on registering and renewing
        counts.append(valid_credentials(rig, "cluster-a"))
        time.sleep(0.05)
    assert all(1 <= valid <= 2 and with_holder == valid for valid, with_holder in counts), counts
    assert issued(rig, "cluster-a") >= 6

    # Cluster A's token can neither re-register nor deregister cluster B; the shared token cannot touch cluster A.
    assert "belongs to cluster 'cluster-a', not to 'cluster-b'" in refused(lambda: cp.deregister(token_a, "cluster-b"))
    refused(lambda: cp.register(token_a, "cluster-b", 9, Inventory()))
    assert "has a registration token of its own" in refused(lambda: cp.deregister(rig.registration_token, "cluster-a"))
    refused(lambda: cp.register(rig.registration_token, "cluster-a", 9, Inventory()))
    hook_lines = cleanup_hook(rig, "cluster-b", rig.root / "token-a")  # cluster A's hook, misconfigured
    assert len(hook_lines) == 1 and "failed" in hook_lines[0] and "403" in hook_lines[0], hook_lines
    assert registrations(cp, rig)["cluster-b"]["generation"] == 1
    assert "cluster-b" in registrations(cp, rig) and cp.status(cred_b)  # cluster B still works: its credential too
    assert rig.healthz()[0] == 200

    # A GPU change: registered again, at once.
    rig.set_gpus(3)
    wait_until(lambda: agent.grep("registered 3 GPUs"), 10, "the registration of 3 GPUs")
    rig.wait_health(200, 10)
    # A restart: the credential is gone with the process; the token alone registers it again, and the new process's
    # registration retires what the old one held (the same identity, as a Pod's name after a container restart).
    agent.stop()
    agent = rig.start_agent(*agent_flags, token_file=rig.root / "token-a")
    rig.wait_health(200, 15)
    assert valid_credentials(rig, "cluster-a")[0] <= 2  # the old process's are retired as a renewal's are
    assert registrations(cp, rig)["cluster-a"]["gpuCount"] == 3

    # The chart's cleanup hook deregisters its own cluster, and only that one.
    agent.stop()
    assert cleanup_hook(rig, "cluster-a", rig.root / "token-a") == ["gpu-agent-hook: cleanup deregister: ok"]
    assert set(registrations(cp, rig)) == {"cluster-b"}
    assert cp.status(cred_b)
    assert not rig.cp.grep("Traceback")
