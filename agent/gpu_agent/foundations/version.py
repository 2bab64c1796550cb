"""Build identity: version, commit and build date, wherever the agent runs.

Looked up once, in this order:
  1. the environment (`GPU_AGENT_BUILD_COMMIT`, `GPU_AGENT_BUILD_DATE`): stamped into the image
     by the Dockerfile's build args;
  2. a git checkout holding this package (an editable install, `make run`): the checked-out
     commit, `-dirty` when the tree has changes, and that commit's date as the build date;
  3. `_build_info.json` next to this file: written by `make wheels` into the wheel it builds;
  4. otherwise "unknown".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
from pathlib import Path

from gpu_agent import __version__

BUILD_INFO_FILE = Path(__file__).resolve().parent.parent / "_build_info.json"


def _from_git(folder: Path) -> dict[str, str] | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()

    try:
        if git("rev-parse", "--is-inside-work-tree") != "true":
            return None
        commit = git("rev-parse", "--short=12", "HEAD")
        date = git("show", "-s", "--format=%cI", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit + ("-dirty" if dirty else ""), "buildDate": date}


def _from_file(path: Path) -> dict[str, str] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    return {k: str(doc[k]) for k in ("commit", "buildDate") if isinstance(doc.get(k), str) and doc[k]} or None


@functools.lru_cache(maxsize=1)
def version_info() -> dict[str, str]:
    info = {"version": __version__, "commit": "unknown", "buildDate": "unknown"}
    env = {"commit": os.environ.get("GPU_AGENT_BUILD_COMMIT", ""), "buildDate": os.environ.get("GPU_AGENT_BUILD_DATE", "")}
    if env["commit"] and env["commit"] != "unknown":
        info.update({k: v for k, v in env.items() if v and v != "unknown"})
        return info
    found = _from_git(Path(__file__).resolve().parent) or _from_file(BUILD_INFO_FILE)
    if found:
        info.update(found)
    return info


def version_line(program: str) -> str:
    v = version_info()
    return f"{program} {v['version']} (commit {v['commit']}, built {v['buildDate']})"


class VersionAction(argparse.Action):
    """`--version` that looks the build identity up only when asked: every other run of a command
    skips the git calls a checkout's lookup makes (argparse's own action needs the text up front)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(version_line(parser.prog))
        parser.exit()
