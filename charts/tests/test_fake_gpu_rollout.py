"""charts/fake-gpu's DaemonSet rollout: node by node by default, as real device plugins roll; every node at once when a
test cluster asks (the e2e suite's shared release, whose devicePlugin.enabled the legacy DRA test turns off and on)."""

from __future__ import annotations

import pytest
import yaml

from e2e.release import CHART, helm

FAKE_GPU_CHART = CHART.parent / "fake-gpu"


def strategy(*sets: str) -> dict:
    out = helm("template", "t", str(FAKE_GPU_CHART), "--namespace", "ns", *sets).stdout
    (ds,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "DaemonSet"]
    return ds["spec"]["updateStrategy"]


def test_by_default_one_node_at_a_time():
    assert strategy() == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}


def test_every_node_at_once_when_asked_and_on_delete():
    assert strategy("--set-string", "updateStrategy.rollingUpdate.maxUnavailable=100%") == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}
    assert strategy("--set", "updateStrategy.type=OnDelete", "--set", "updateStrategy.rollingUpdate=null") == {
        "type": "OnDelete"}


@pytest.mark.parametrize("bad", ["updateStrategy.type=Recreate", "updateStrategy.surge=1"])
def test_a_strategy_kubernetes_has_not_is_refused_naming_the_value(bad):
    r = helm("template", "t", str(FAKE_GPU_CHART), "--namespace", "ns", "--set", bad, check=False)
    assert r.returncode != 0 and "updateStrategy" in r.stderr, r.stderr
