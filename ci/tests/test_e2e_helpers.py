"""e2e/helpers.py's wait_until: a poll rides out the API server's transient errors and fails on real answers.

The clock and the sleep are injected, so no test here waits in real time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import urllib3
from kubernetes import client


def _load():
    # by path: e2e/ is not a package the unit tests' import path holds
    spec = importlib.util.spec_from_file_location("e2e_helpers", Path(__file__).resolve().parents[2] / "e2e" / "helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helpers = _load()
transient, wait_until = helpers.transient, helpers.wait_until


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


def scripted(*answers):
    """A predicate that gives each answer in turn (raising the exceptions), then the last one forever."""
    calls = []

    def predicate():
        answer = answers[min(len(calls), len(answers) - 1)]
        calls.append(answer)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return predicate, calls


def test_a_value_after_transient_errors_is_returned():
    t = FakeTime()
    predicate, calls = scripted(client.ApiException(status=503), urllib3.exceptions.ProtocolError("reset"),
                                client.ApiException(status=429), None, "ready")
    assert wait_until(predicate, 10, "ready", 1, clock=t.clock, sleep=t.sleep) == "ready"
    assert len(calls) == 5 and t.sleeps == 4


@pytest.mark.parametrize("error", [client.ApiException(status=404), client.ApiException(status=403),
                                   TypeError("argument of type 'NoneType' is not iterable")])
def test_an_answer_that_is_not_transient_ends_the_wait_at_once(error):
    t = FakeTime()
    predicate, calls = scripted(error, "ready")
    with pytest.raises(type(error)):
        wait_until(predicate, 10, "ready", 1, clock=t.clock, sleep=t.sleep)
    assert len(calls) == 1 and t.sleeps == 0


def test_a_timeout_names_what_it_waited_for_and_the_last_transient_error():
    t = FakeTime()
    predicate, calls = scripted(client.ApiException(status=500, reason="etcdserver: leader changed"))
    with pytest.raises(AssertionError) as failure:
        wait_until(predicate, 3, "the member Ready", 1, clock=t.clock, sleep=t.sleep)
    assert "timed out after 3s waiting for the member Ready" in str(failure.value)
    assert "ApiException" in str(failure.value) and "leader changed" in str(failure.value)
    assert isinstance(failure.value.__cause__, client.ApiException)
    assert len(calls) == 5  # at 0, 1, 2, 3 and 4 s: the deadline passes after the read at 4 s


def test_a_timeout_after_a_false_answer_does_not_name_an_earlier_error():
    t = FakeTime()
    predicate, _ = scripted(client.ApiException(status=502), False)
    with pytest.raises(AssertionError) as failure:
        wait_until(predicate, 2, "x", 1, clock=t.clock, sleep=t.sleep)
    assert str(failure.value) == "timed out after 2s waiting for x"


def test_what_is_transient():
    assert transient(client.ApiException(status=503)) and transient(client.ApiException(status=429))
    assert transient(urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out"))
    assert not transient(client.ApiException(status=409)) and not transient(client.ApiException(status=404))
    assert not transient(ValueError("x")) and not transient(AssertionError("x"))
