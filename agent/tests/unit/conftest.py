"""Fakes the unit tests share, handed out as fixtures (test modules do not import from one another)."""

import random

import pytest


class FixedRandom(random.Random):
    """A random source that returns a scripted sequence, so jitter is exact (and drawing past the
    script fails the test: an IndexError)."""

    def __init__(self, values):
        super().__init__(0)
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


@pytest.fixture
def fixed_random():
    """FixedRandom(values): a random source scripted with `values`."""
    return FixedRandom


@pytest.fixture(autouse=True)
def no_agents_threads_carried_over():
    """Each test starts with no agent's `Threads` current: an agent's constructor sets it in the test's own context
    (threads.CURRENT), and a later test would start its threads on that agent's owner (test_threads asserts it is
    unset: it failed whenever it ran after a test that built an agent)."""
    from gpu_agent.foundations.threads import CURRENT

    token = CURRENT.set(None)
    yield
    CURRENT.reset(token)
