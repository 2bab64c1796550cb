"""The attack table's availability rows on the real processes (issue 48, part 5): 200 slow or half-open
connections against the cluster agent's endpoints, and 16 long-polls against the control plane.

A sampler thread probes every 0.1 s and records; the test asserts on what it recorded, and on what the
server did to the slow connections as their client sees it.
"""

from __future__ import annotations

import threading
import time

import requests

from gpu_agent.foundations import http
from gpu_agent.roles import endpoints
from gpu_agent.roles.control_plane import api
from tests.slow_clients import BOUND, Sampler, SlowClients, wait_until


def test_the_agent_answers_its_probes_throughout_200_slow_connections_and_closes_them(rig):
    rig.start_control_plane()
    rig.set_gpus(2)
    agent = rig.start_agent()
    rig.wait_health(200, 15)
    address = rig.agent_url.removeprefix("http://")
    livez, healthz = Sampler(rig.agent_url + "/livez"), Sampler(rig.agent_url + "/healthz")
    livez.start()
    healthz.start()
    slow = SlowClients(address, 200)
    try:
        limit = endpoints.TIMEOUT_SECONDS + http.SWEEP_SECONDS + 1.0
        wait_until(slow.all_closed, limit + 2, "every slow connection closed by the agent")
        time.sleep(0.3)
    finally:
        samples, health = livez.stop(), healthz.stop()
        slow.close()
    last = slow.last_closed()
    print("\n" + livez.report("/livez under 200 slow connections") + "; " + healthz.report("/healthz") +
          f"; the last slow connection closed after {last:.2f} s")
    assert len(samples) >= 40 and len(health) >= 40, (len(samples), len(health))
    late = [(round(d, 3), c) for d, c in samples if c != 200 or d > BOUND]
    assert not late, f"{len(late)} of {len(samples)} /livez probes failed or took over {BOUND}s: {late[:5]}"
    late = [(round(d, 3), c) for d, c in health if c != 200 or d > BOUND]
    assert not late, f"{len(late)} of {len(health)} /healthz probes failed, were not ready or took over {BOUND}s: {late[:5]}"
    assert last <= limit, f"a slow connection was closed only after {last:.2f} s"
    assert agent.alive() and len(rig.agents) == 1


def test_the_control_plane_answers_healthz_within_100ms_while_16_long_polls_are_held(rig):
    rig.start_control_plane()
    token = requests.post(rig.cp_url + "/v1/register", json={"clusterId": "c", "generation": 1, "gpus": []},
                          headers={"Authorization": "Bearer " + rig.registration_token.reveal()},
                          timeout=5).json()["credential"]["token"]
    answers: list[int] = []

    def poll() -> None:
        r = requests.post(rig.cp_url + "/v1/queue/lease", json={"waitSeconds": 30},
                          headers={"Authorization": "Bearer " + token}, timeout=40)
        answers.append(r.status_code)

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(16)]
    for t in threads:
        t.start()
    held = api.MAX_LONG_POLLS_PER_CREDENTIAL
    wait_until(lambda: len(answers) == 16 - held, 10, "the long-polls over the bound answered")
    sampler = Sampler(rig.cp_url + "/healthz")
    sampler.start()
    time.sleep(2.0)  # 20 samples with the long-polls held
    samples = sampler.stop()
    print("\n" + sampler.report(f"/healthz with 16 long-polls from one credential ({held} held, {16 - held} answered 429)"))
    assert sum(t.is_alive() for t in threads) == held
    assert answers == [429] * (16 - held), answers
    assert len(samples) >= 15, len(samples)
    slow = [(round(d * 1000, 1), c) for d, c in samples if c != 200 or d >= 0.1]
    assert not slow, f"{len(slow)} of {len(samples)} /healthz calls failed or took 100 ms or more: {slow[:5]}"

