"""charts/fake-gpu's logFormat (issue 50, part 2) as `helm template` renders it: the value reaches the DaemonSet's
daemon and the post-delete hook Job as `fake-gpu --log-format`, where fake-gpu's own parser takes it; unset, nothing
is rendered (fake-gpu's default, text, and the pod templates of before); a bad value is refused naming it. The
gpu-agent chart's logFormat reaching its hook Jobs: test_render.py,
test_log_format_reaches_every_container_that_runs_gpu_agent_and_is_absent_unless_set."""

from __future__ import annotations

import pytest
import yaml

from e2e.release import CHART, helm
from fake_gpu.cli import _parser as fake_gpu_parser

FAKE_GPU_CHART = CHART.parent / "fake-gpu"


def render(*sets: str) -> list[dict]:
    out = helm("template", "t", str(FAKE_GPU_CHART), "--namespace", "ns", *sets).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def fake_gpu_args(docs: list[dict]) -> dict[str, list[str]]:
    """kind -> the args of its fake-gpu container (the DaemonSet's daemon, the hook Job's unlabel-nodes)."""
    out = {}
    for d in docs:
        if d["kind"] in ("DaemonSet", "Job"):
            (c,) = d["spec"]["template"]["spec"]["containers"]
            assert c["command"] == ["fake-gpu"]
            out[d["kind"]] = c["args"]
    return out


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_log_format_reaches_the_daemon_and_the_hook_where_fake_gpu_takes_it(monkeypatch, log_format):
    monkeypatch.setenv("NODE_NAME", "n1")  # the DaemonSet's pod has it from its spec.nodeName
    args = fake_gpu_args(render("--set", f"logFormat={log_format}"))
    assert sorted(args) == ["DaemonSet", "Job"]
    for kind, argv in args.items():
        assert [a for a in argv if "log-format" in a] == [f"--log-format={log_format}"], (kind, argv)
        parsed = fake_gpu_parser().parse_args(argv)
        assert (parsed.command, parsed.log_format) == ({"DaemonSet": "daemon", "Job": "unlabel-nodes"}[kind], log_format)


def test_unset_nothing_about_the_format_is_rendered():
    args = fake_gpu_args(render())
    assert not any("log-format" in a for argv in args.values() for a in argv), args


def test_a_bad_log_format_is_refused_naming_the_value():
    r = helm("template", "t", str(FAKE_GPU_CHART), "--set", "logFormat=xml", check=False)
    assert r.returncode != 0 and "/logFormat" in r.stderr, r.stderr
