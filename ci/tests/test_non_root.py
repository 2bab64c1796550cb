"""The scripts that need root stop before doing anything when a normal user runs them, saying what needs root and why
(issue 50, the laptop path): the CI cluster (cluster-up.sh, e2e.sh ci), the kind stage (kind-stage.sh, `make
e2e-kind-podman`), and `make e2e CLUSTER=kind` where this host would not let kind run rootless (its preflight).

Run for real as uid 65534 (setpriv; so this needs root and skips without it), on a copy of ci/ and
e2e/local_cluster.py that uid may read, with every tool those scripts would reach for replaced by a fake that
leaves a mark: a mark is something done that should not have been.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
USER = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not Path("/usr/bin/python3").exists(),
                                reason="runs the scripts as uid 65534 through setpriv: needs root, setpriv and "
                                       "/usr/bin/python3")
# podman 4.3.1 as a fresh user of this CI machine (uidmap not installed), word for word
NO_NEWUIDMAP = 'Error: command required for rootless mode with multiple IDs: exec: "newuidmap": executable file not found in $PATH'
# what the scripts would run to build or change anything
MARKED = ("apt-get", "dpkg", "debootstrap", "iptables", "ip6tables", "iptables-save", "sysctl", "ip", "mount", "kind",
          "go", "docker", "kubectl", "mkdir-lib-modules")


@pytest.fixture
def sandbox():
    base = Path(tempfile.mkdtemp(prefix="gpu-agent-nonroot-"))
    try:
        base.chmod(0o755)
        repo, bin_dir, marks, home = base / "repo", base / "bin", base / "marks", base / "home"
        shutil.copytree(REPO / "ci", repo / "ci", ignore=shutil.ignore_patterns("__pycache__", "tests"))
        (repo / "e2e").mkdir()
        shutil.copy(REPO / "e2e" / "local_cluster.py", repo / "e2e")
        bin_dir.mkdir()
        marks.mkdir(mode=0o777)
        marks.chmod(0o777)
        home.mkdir()
        os.chown(home, USER, USER)
        for name in MARKED:
            tool = bin_dir / name
            tool.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marks}/{name}\nexit 1\n")
            tool.chmod(0o755)
        podman = bin_dir / "podman"
        podman.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marks}/podman-calls\n"
                          f"case \"$1\" in info) echo '{NO_NEWUIDMAP}' >&2; exit 125;; esac\n"
                          f"echo \"$0 $*\" >> {marks}/podman\nexit 1\n")
        podman.chmod(0o755)
        yield {"repo": repo, "bin": bin_dir, "marks": marks, "home": home}
    finally:
        shutil.rmtree(base)


def run_as_user(box, *argv: str, **env: str) -> subprocess.CompletedProcess:
    environment = {"PATH": f"{box['bin']}:/usr/bin:/bin", "HOME": str(box["home"]), **env}
    return subprocess.run(["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", *argv],
                          cwd=box["repo"], env=environment, capture_output=True, text=True, timeout=120)


def marks(box) -> list[str]:
    return sorted(p.name for p in box["marks"].iterdir() if p.name != "podman-calls")


def test_the_kind_stage_stops_as_a_normal_user_naming_each_part_that_needs_root_and_kinds_preflight(sandbox):
    done = run_as_user(sandbox, "bash", "ci/scripts/kind-stage.sh")
    assert done.returncode == 2, done.stderr
    err = done.stderr
    assert "runs as root only" in err and "nothing was done" in err
    for part in ("debootstrap", "apt-get install", "/etc/containers/containers.conf", "/lib/modules", "iptables",
                 "sysctls", "/run/netns", "KIND_CPU_SHARES"):
        assert part in err, part
    # then the preflight of a normal user's way, through podman, with podman's own words
    assert "newuidmap" in err and "apt-get install uidmap" in err
    assert "make e2e CLUSTER=kind" in err and f"{sandbox['home']}/.cache/gpu-agent-ci" in err
    assert marks(sandbox) == []
    assert list(sandbox["home"].iterdir()) == []  # no cache, no state: nothing was made


def test_make_e2e_cluster_kind_stops_before_creating_anything_when_rootless_podman_cannot_run_kind(sandbox):
    done = run_as_user(sandbox, "bash", "ci/scripts/e2e.sh", "kind", KIND_EXPERIMENTAL_PROVIDER="podman",
                       KIND=str(sandbox["bin"] / "kind"))
    assert done.returncode == 2, done.stderr
    assert "cannot run as this user here; nothing was made" in done.stderr
    assert "podman info` failed as uid 65534" in done.stderr and "newuidmap" in done.stderr
    if not Path("/sys/fs/cgroup/cgroup.controllers").exists():  # this host's cgroup v1: kind's own refusal too
        assert "running kind with rootless provider requires cgroup v2" in done.stderr
    # neither kind create nor, from the exit trap, kind delete: the trap is set after the preflight
    assert marks(sandbox) == []
    assert list(sandbox["home"].iterdir()) == []


@pytest.mark.parametrize("argv", [("bash", "ci/scripts/cluster-up.sh"), ("bash", "ci/scripts/e2e.sh", "ci")],
                         ids=["cluster-up", "e2e-ci"])
def test_the_ci_cluster_stops_as_a_normal_user_before_installing_or_building(sandbox, argv):
    done = run_as_user(sandbox, *argv)
    assert done.returncode == 2, done.stderr
    assert "the CI cluster" in done.stderr and "needs root" in done.stderr and "nothing was done" in done.stderr
    assert "make e2e CLUSTER=kind" in done.stderr
    assert marks(sandbox) == []
    assert list(sandbox["home"].iterdir()) == []
