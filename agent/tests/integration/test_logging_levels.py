"""What each verbosity shows and hides (klog levels, as docs/configuration.md promises), and the stack dump.

For each level 0..7 the cluster agent runs the same scenario (GPUs arrive, one work item runs)
and its log must hold the strings of every level up to it and none of the levels above.
"""

from __future__ import annotations

import signal

import pytest

from tests.integration.harness import wait_until

# level -> (strings that appear from this level on, logged by the agent)
SHOWN_FROM = {
    0: ["effective configuration (secrets redacted):", "  controlPlaneToken: <redacted>", "cluster agent Ready",
        "GPU inventory: 1 GPUs", "work item log-item done ("],
    2: ["gate acquired by initial", "registering 1 GPUs (generation"],
    4: ["executing item"],
    6: ["control plane: POST /v1/register -> 200 (", "control plane: POST /v1/queue/lease -> "],
}


@pytest.mark.parametrize("level", range(8))
def test_each_level_shows_its_lines_and_hides_the_ones_above(rig, level):
    cp = rig.start_control_plane()
    cp.enqueue(rig.admin_token, "log-item", {})
    rig.set_gpus(1)
    agent = rig.start_agent(verbosity=level)
    wait_until(lambda: agent.grep("work item log-item done"), 15, "the work item done")
    wait_until(lambda: level < 6 or agent.grep("control plane: POST /v1/queue/lease"), 10, "a lease round trip logged")
    text = "\n".join(agent.lines())
    for from_level, strings in SHOWN_FROM.items():
        for s in strings:
            if level >= from_level:
                assert s in text, f"-v {level} must show {s!r}"
            else:
                assert s not in text, f"-v {level} must not show {s!r} (a level {from_level} line)"
    assert rig.registration_token.reveal() not in text


def test_sigusr2_writes_every_threads_stack_and_the_agent_goes_on(rig):
    rig.start_control_plane()
    rig.set_gpus(1)
    agent = rig.start_agent()
    rig.wait_health(200, 10)
    agent.proc.send_signal(signal.SIGUSR2)
    # The dump is read while the agent writes it: poll until it holds every thread we expect (the event loop,
    # the endpoints, the GPU reader...), not just its first.
    def threads() -> list[str]:
        return agent.grep(r"^(Thread|Current thread) 0x")
    wait_until(lambda: len(threads()) >= 3, 5, "a stack dump of 3 threads or more in the log")
    assert agent.alive()
    rig.wait_health(200, 5)
