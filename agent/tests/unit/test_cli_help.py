"""Every command's --help works and lists every option with its default and meaning."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from gpu_agent import cli
from gpu_agent.foundations.version import version_info


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


PARSERS = list(_parsers(cli.build_parser()))


@pytest.mark.parametrize("path,parser", PARSERS, ids=[" ".join(p) or "gpu-agent" for p, _ in PARSERS])
def test_help_renders_and_every_option_has_a_default_and_meaning(path, parser):
    text = parser.format_help()  # raised TypeError on the `80%` of a help text before
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version", "config"):
            continue
        assert action.help, f"{' '.join(path)} {action.option_strings[0]} has no help"
        if action.dest in ("payload",):
            continue
        assert "default:" in action.help, f"{' '.join(path)} {action.option_strings[0]} does not show its default"
    assert "%%" not in text


def test_every_subcommand_help_exits_zero_from_the_command_line():
    for path, _ in PARSERS:
        out = subprocess.run([sys.executable, "-m", "gpu_agent", *path, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "usage:" in out.stdout, (path, out.stderr[-500:])


def test_fake_gpu_help_for_every_subcommand_shows_defaults():
    out = subprocess.run([sys.executable, "-m", "fake_gpu", "cycle", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag, default in (("--from", "0"), ("--to", "4"), ("--times", "3"), ("--interval", "2")):
        assert re.search(rf"{flag} \w+\s+.*\(default {default}\)", out.stdout), (flag, out.stdout)
    for sub in ("set", "status", "daemon", "smi"):
        assert subprocess.run([sys.executable, "-m", "fake_gpu", sub, "--help"], capture_output=True).returncode == 0


def test_version_flag_and_subcommand_agree_and_name_a_commit_in_a_checkout():
    flag = subprocess.run([sys.executable, "-m", "gpu_agent", "--version"], capture_output=True, text=True)
    info = version_info()
    assert flag.returncode == 0
    assert flag.stdout.strip() == f"gpu-agent {info['version']} (commit {info['commit']}, built {info['buildDate']})"
    # The tests run from a git checkout: the commit is a real one, not "unknown".
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", info["commit"]), info
    assert re.match(r"\d{4}-\d{2}-\d{2}T", info["buildDate"]), info


def test_the_agents_do_not_load_the_control_planes_models():
    """pydantic (the control plane's models) costs about 10 MiB of RSS: the agents never import it."""
    code = ("import sys; import gpu_agent.cli, gpu_agent.roles.cluster_agent, gpu_agent.roles.node_agent; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'kubernetes')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_version_comes_from_the_image_env_then_git_then_the_wheels_stamp(tmp_path, monkeypatch):
    from gpu_agent.foundations import version

    monkeypatch.setenv("GPU_AGENT_BUILD_COMMIT", "0123456789ab")
    monkeypatch.setenv("GPU_AGENT_BUILD_DATE", "2026-11-30T00:00:00Z")
    version.version_info.cache_clear()
    assert version.version_info()["commit"] == "0123456789ab"
    assert version.version_info()["buildDate"] == "2026-11-30T00:00:00Z"
    monkeypatch.delenv("GPU_AGENT_BUILD_COMMIT")
    monkeypatch.delenv("GPU_AGENT_BUILD_DATE")
    stamp = tmp_path / "_build_info.json"
    stamp.write_text('{"commit": "feedfacecafe", "buildDate": "2026-01-01T00:00:00Z"}')
    monkeypatch.setattr(version, "BUILD_INFO_FILE", stamp)
    monkeypatch.setattr(version, "_from_git", lambda folder: None)  # as in an installed wheel
    version.version_info.cache_clear()
    assert version.version_info()["commit"] == "feedfacecafe"
    stamp.write_text("\xff not json")
    version.version_info.cache_clear()
    assert version.version_info()["commit"] == "unknown"
    version.version_info.cache_clear()
