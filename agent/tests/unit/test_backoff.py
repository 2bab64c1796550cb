import random

import pytest

from gpu_agent.foundations.backoff import Backoff


def test_without_jitter_doubles_up_to_the_cap():
    b = Backoff(initial=1, cap=10, jitter=0.0)
    assert [b.next_delay() for _ in range(7)] == [1, 2, 4, 8, 10, 10, 10]


def test_jitter_shortens_by_the_drawn_fraction_exactly(fixed_random):
    b = Backoff(initial=1, cap=10, jitter=0.5, rng=fixed_random([0.0, 0.5, 1.0 - 1e-9, 0.2, 0.9]))
    got = [b.next_delay() for _ in range(5)]
    assert got == pytest.approx([1.0, 2 * 0.75, 4 * 0.5, 8 * 0.9, 10 * 0.55])


def test_jitter_stays_within_bounds_and_never_exceeds_the_cap():
    rng = random.Random(42)
    b = Backoff(initial=0.5, cap=30, jitter=0.25, rng=rng)
    for attempt in range(40):
        base = min(30, 0.5 * 2**attempt)
        d = b.next_delay()
        assert base * 0.75 <= d <= base <= 30


def test_seeded_sequences_are_reproducible():
    a = Backoff(1, 60, jitter=0.3, rng=random.Random(7))
    b = Backoff(1, 60, jitter=0.3, rng=random.Random(7))
    assert [a.next_delay() for _ in range(10)] == [b.next_delay() for _ in range(10)]


def test_reset_starts_again_from_initial():
    b = Backoff(initial=2, cap=100, jitter=0.0)
    [b.next_delay() for _ in range(4)]
    assert b.current_base == 32
    b.reset()
    assert b.next_delay() == 2


def test_initial_above_cap_is_kept_not_shortened():
    b = Backoff(initial=120, cap=60, jitter=0.0)
    assert [b.next_delay() for _ in range(3)] == [120, 120, 120]


def test_long_outage_does_not_overflow():
    b = Backoff(initial=1, cap=300, jitter=0.0)
    b.attempt = 10_000
    assert b.next_delay() == 300


@pytest.mark.parametrize("kwargs", [dict(initial=0, cap=1), dict(initial=1, cap=0), dict(initial=1, cap=2, jitter=1.0)])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        Backoff(**kwargs)
