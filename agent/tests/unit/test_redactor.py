"""The log redactor forgets credentials once they are retired, so that its cost per line stays flat (issue 48).

It kept every credential for ever: one a minute, a line cost 0.31 ms after a day and 9.7 ms after 30 days.
Time is a hand-driven clock; 100,000 credentials pass through it.
"""

from __future__ import annotations

import os
import time
import tracemalloc

from gpu_agent.foundations import secrets
from gpu_agent.foundations.control_plane_client import ControlPlaneClient
from gpu_agent.foundations.secrets import REDACTOR, Redactor

LINE = "I0101 00:00:00.000000    1234 manager.py:268] renewing credential %s for cluster c-1 (term 4, holder agent-7d9f)"
TTL = 3600.0  # the chart's credentialTtl
PACE = 60.0  # a credential a minute: the measurement


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def per_line_ms(r: Redactor, line: str, n: int = 2000) -> float:
    started = time.perf_counter()
    for _ in range(n):
        r.scrub(line)
    return (time.perf_counter() - started) / n * 1000


def test_100000_credentials_over_time_keep_the_redactor_bounded_and_scrub_the_current_one():
    clock = Clock()
    r = Redactor(monotonic=clock)
    r.register("registration-token-0123456789")  # from the settings: kept for the life of the process
    live_at_once = int((TTL + secrets.RETIRED_GRACE_SECONDS) / PACE) + 1  # alive, or within its grace, at any moment
    tracemalloc.start()
    sizes, costs, memory = [], {}, {}
    previous = ""
    try:
        for i in range(1, 100_001):
            clock.now += PACE
            current = os.urandom(16).hex()
            r.register(current, TTL)
            if i % 1000 == 0:
                sizes.append(len(r))
                assert sizes[-1] <= live_at_once + 1, f"{sizes[-1]} values kept after {i} credentials"
            if i in (1_000, 10_000, 100_000):
                memory[i] = tracemalloc.get_traced_memory()[0]
                costs[i] = per_line_ms(r, LINE % current)
            if i == 50_000:
                previous = current  # superseded from here on
    finally:
        tracemalloc.stop()
    print(f"\nkept after 1,000/10,000/100,000 credentials: {sizes[0]}/{sizes[9]}/{sizes[-1]}; per line "
          f"{costs[1_000]:.4f}/{costs[10_000]:.4f}/{costs[100_000]:.4f} ms; traced memory "
          f"{memory[1_000] // 1024}/{memory[10_000] // 1024}/{memory[100_000] // 1024} KiB")
    # Bounded: the credentials still usable (or within their grace) and the token from the settings, never more.
    assert max(sizes) <= live_at_once + 1, sizes
    assert memory[100_000] - memory[1_000] < 64 * 1024, memory  # flat: no trace of the 99,000 retired ones
    # The current credential and the permanent token are scrubbed; one retired past its overlap is forgotten.
    assert r.scrub(LINE % current) == LINE % "<redacted>"
    assert "registration-token-0123456789" in r
    assert previous not in r and r.scrub(LINE % previous) == LINE % previous


def test_a_superseded_credential_is_scrubbed_until_its_lifetime_and_the_grace_have_passed():
    clock = Clock()
    r = Redactor(monotonic=clock)
    old = "old-credential-0123456789"
    r.register(old, TTL)
    clock.now += 1800
    r.register("new-credential-0123456789", TTL)  # the renewal: the old one still works until it expires
    assert r.scrub(f"token {old}") == "token <redacted>"
    clock.now += TTL - 1800 + secrets.RETIRED_GRACE_SECONDS - 1
    assert old in r
    clock.now += 1
    assert old not in r and r.scrub(f"token {old}") == f"token {old}"
    assert "new-credential-0123456789" in r


def test_only_the_newest_are_kept_whatever_their_lifetime():
    clock = Clock()
    r = Redactor(monotonic=clock, max_expiring=16)
    values = [f"credential-{i:012d}" for i in range(100)]
    for v in values:
        r.register(v, 30 * 86400.0)  # the longest credentialTtl: all still valid
    assert len(r) == 16
    assert all(v in r for v in values[-16:]) and not any(v in r for v in values[:-16])
    r.register(values[-16], 60.0)  # registered again, with a short lifetime: kept, now the newest
    r.register("credential-x-000000000", 30 * 86400.0)
    assert values[-16] in r and values[-15] not in r


def test_a_credential_from_the_control_plane_is_registered_with_its_lifetime():
    doc = {"credential": {"token": "issued-credential-" + os.urandom(8).hex(), "expiresInSeconds": 120}}
    credential = ControlPlaneClient._credential(doc, "POST /v1/register")
    value = credential.token.reveal()
    forgets_at = REDACTOR.forgets_at(value)
    assert forgets_at is not None, "kept for ever: the redactor would grow with every credential"
    assert forgets_at - time.monotonic() <= 120 + secrets.RETIRED_GRACE_SECONDS
    assert REDACTOR.scrub(f"x {value} y") == "x <redacted> y"
