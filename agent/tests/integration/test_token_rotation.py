"""Tokens rotated without a restart, over real processes on loopback (issue 48, part 4).

The control plane and the cluster agent each read their tokens from a folder laid out as the kubelet lays out a
Secret volume (`registrationToken -> ..data/registrationToken`, `..data` a link to a timestamped folder); the
Secret is updated by swapping `..data` to a new folder, the control plane's copy first and the agent's after, as two
kubelets would. Neither process restarts. Told from the control plane's side: its log names each registration made
with the replaced token; once the agent has read its new file its registrations come without that; the replaced
registration and admin tokens are still accepted within the overlap and refused (401) after it, no sooner; and the
agent's registrations go on succeeding after that, which only the new token can do.
"""

import os
import time

import pytest

from gpu_agent.foundations.control_plane_client import ControlPlaneError
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.foundations.secrets import Secret
from tests.integration.harness import SECRETS, wait_until
from tests.secret_volume import SecretVolume

pytestmark = pytest.mark.integration

OVERLAP = 4.0  # the control plane's tokenOverlap here (600 s by default)
CLUSTER = "rotating"


def accepted(call):
    """Whether the control plane took the call; False when it answered 401 (any other failure fails the test)."""
    try:
        call()
    except ControlPlaneError as e:
        assert e.status == 401, e
        return False
    return True


def registered_lines(rig, after):
    """The control plane's log lines after the first line matching `after` that say CLUSTER registered."""
    lines = rig.cp.lines()
    start = next((i for i, line in enumerate(lines) if after in line), None)
    if start is None:
        return []
    return [line for line in lines[start + 1:] if f"cluster {CLUSTER} registered" in line]


def test_a_rotated_secret_is_taken_without_a_restart_and_the_old_token_works_for_the_overlap_alone(rig):
    old_reg, old_admin = rig.registration_token, rig.admin_token
    new_reg, new_admin = Secret(f"reg-new-{os.urandom(12).hex()}"), Secret(f"adm-new-{os.urandom(12).hex()}")
    SECRETS.extend([new_reg.reveal(), new_admin.reveal()])
    cp_volume = SecretVolume(rig.root / "cp-tokens", {"registrationToken": old_reg.reveal(),
                                                      "adminToken": old_admin.reveal()})
    agent_volume = SecretVolume(rig.root / "agent-token", {"registrationToken": old_reg.reveal()})
    cp = rig.start_control_plane("--token-overlap", str(OVERLAP), token_folder=cp_volume.root)
    rig.set_gpus(2)
    agent = rig.start_agent("--cluster-id", CLUSTER, "--reregistration-interval", "0.3",
                            token_file=agent_volume.path("registrationToken"))
    rig.wait_health(200, 15)
    pid = agent.pid
    wait_until(lambda: rig.cp.grep(f"cluster {CLUSTER} registered 2 GPUs"), 10, "the agent's first registration")

    # The control plane's Secret is updated first: both tokens of each kind work from here until the overlap ends.
    swapped_at = time.monotonic()
    cp_volume.update({"registrationToken": new_reg.reveal(), "adminToken": new_admin.reveal()})
    assert accepted(lambda: cp.status(new_admin)) and accepted(lambda: cp.status(old_admin))
    assert accepted(lambda: cp.register(old_reg, "probe", 1, Inventory()))
    assert accepted(lambda: cp.register(new_reg, "probe", 2, Inventory()))
    changed = "registrationTokenFile " + str(cp_volume.path("registrationToken")) + " changed: using the new token"
    assert rig.cp.grep(changed)
    # Until its own copy changes, the agent still registers with the replaced token, and the control plane says so.
    wait_until(lambda: any("with the previous registration token" in line for line in registered_lines(rig, changed)),
               10, "a registration with the replaced token, named so")
    agent_volume.update({"registrationToken": new_reg.reveal()})
    wait_until(lambda: [line for line in registered_lines(rig, changed) if "previous" not in line], 10,
               "a registration with the new token")

    # The replaced tokens are refused once the overlap has passed, and not before.
    refused_at = wait_until(lambda: not accepted(lambda: cp.register(old_reg, "probe", 3, Inventory()))
                            and time.monotonic(), OVERLAP + 15, "the replaced registration token refused")
    assert refused_at - swapped_at >= OVERLAP, refused_at - swapped_at
    assert not accepted(lambda: cp.status(old_admin)) and accepted(lambda: cp.status(new_admin))
    assert rig.cp.grep("the token it held before its last change is no longer accepted")

    # The agent goes on registering after that: with the new token, the only one left. Same process, never refused.
    ended = "registrationTokenFile " + str(cp_volume.path("registrationToken")) + ": the token it held before"
    wait_until(lambda: len(registered_lines(rig, ended)) >= 3, 10, "three registrations after the overlap")
    assert not [line for line in registered_lines(rig, ended) if "previous" in line]
    assert agent.alive() and agent.pid == pid and rig.healthz()[0] == 200
    assert not agent.grep("registration attempt .* failed|refused"), agent.grep("failed|refused")
    assert agent.grep("controlPlaneTokenFile .* changed: using the new token")
    assert not rig.cp.grep("Traceback")
