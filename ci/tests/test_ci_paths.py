"""Where the CI's caches and a cluster's state live (issue 50, the laptop path): root keeps the system folders, a
normal user gets folders under its home, CI_CACHE / CLUSTER_DIR win over either. One choice for the shell
(ci/scripts/paths.sh, sourced by common.sh and the release scripts) and one for Python (e2e/cluster.py's ci_dirs):
each is checked against the expected folders, the two against each other, the shell's once as a real non-root
user (setpriv, where this runs as root), and no other script or module may name the system folders itself.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from e2e.cluster import artifacts_dir, ci_dirs

REPO = Path(__file__).resolve().parents[2]
PATHS_SH = REPO / "ci" / "scripts" / "paths.sh"
SYSTEM = ("/var/cache/gpu-agent-ci", "/var/lib/gpu-agent-ci")
ROOTS_ONLY = (*SYSTEM, "/tmp/gpu-agent-e2e-artifacts")  # folders a normal user cannot write


def shell_dirs(uid: int, env: dict[str, str]) -> tuple[str, str]:
    """ci_dirs UID of paths.sh, in a bash with exactly ENV (and PATH): paths.sh is sourced first, as every script
    sources it, and its own exports for this process's user are then dropped so that only ENV's overrides count."""
    script = ('source "$1"; unset CI_CACHE CLUSTER_DIR; '
              '[[ -z ${T_CI_CACHE+x} ]] || export CI_CACHE=$T_CI_CACHE; '
              '[[ -z ${T_CLUSTER_DIR+x} ]] || export CLUSTER_DIR=$T_CLUSTER_DIR; ci_dirs "$2"')
    test_env = {"PATH": os.environ["PATH"]}
    for key, value in env.items():
        test_env[f"T_{key}" if key in ("CI_CACHE", "CLUSTER_DIR") else key] = value
    out = subprocess.run(["bash", "-c", script, "paths", str(PATHS_SH), str(uid)], env=test_env, check=True,
                         capture_output=True, text=True, timeout=30).stdout
    cache, state = out.splitlines()
    return cache, state


CASES = [
    # (id, uid, environment, expected CI_CACHE, expected CLUSTER_DIR)
    ("root", 0, {"HOME": "/root"}, *SYSTEM),
    ("root-ignores-xdg", 0, {"HOME": "/root", "XDG_CACHE_HOME": "/root/xc", "XDG_STATE_HOME": "/root/xs"}, *SYSTEM),
    ("root-override", 0, {"HOME": "/root", "CI_CACHE": "/srv/cache", "CLUSTER_DIR": "/srv/state"},
     "/srv/cache", "/srv/state"),
    ("user", 1000, {"HOME": "/home/u"}, "/home/u/.cache/gpu-agent-ci", "/home/u/.local/state/gpu-agent-ci"),
    ("user-xdg", 1000, {"HOME": "/home/u", "XDG_CACHE_HOME": "/fast/cache", "XDG_STATE_HOME": "/fast/state"},
     "/fast/cache/gpu-agent-ci", "/fast/state/gpu-agent-ci"),
    ("user-xdg-relative-ignored", 1000, {"HOME": "/home/u", "XDG_CACHE_HOME": "cache", "XDG_STATE_HOME": ""},
     "/home/u/.cache/gpu-agent-ci", "/home/u/.local/state/gpu-agent-ci"),
    ("user-override", 1000, {"HOME": "/home/u", "XDG_CACHE_HOME": "/fast/cache", "CI_CACHE": "/data/ci"},
     "/data/ci", "/home/u/.local/state/gpu-agent-ci"),
    ("user-override-state", 1000, {"HOME": "/home/u", "CLUSTER_DIR": "/data/cluster"},
     "/home/u/.cache/gpu-agent-ci", "/data/cluster"),
    ("user-empty-override-is-unset", 1000, {"HOME": "/home/u", "CI_CACHE": ""},
     "/home/u/.cache/gpu-agent-ci", "/home/u/.local/state/gpu-agent-ci"),
]


@pytest.mark.parametrize("uid, env, cache, state", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_root_keeps_the_system_folders_a_user_gets_its_own_and_an_override_wins_in_python(uid, env, cache, state):
    assert ci_dirs(env, uid) == (Path(cache), Path(state))


@pytest.mark.parametrize("uid, env, cache, state", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_root_keeps_the_system_folders_a_user_gets_its_own_and_an_override_wins_in_the_shell(uid, env, cache, state):
    assert shell_dirs(uid, env) == (cache, state)


def test_a_failed_tests_artifacts_go_where_that_user_may_write():
    """Root's stay in /tmp/gpu-agent-e2e-artifacts (mode 755, root's once made); another user's under its state
    folder; E2E_ARTIFACTS (one run's folder, set by make e2e) wins."""
    assert artifacts_dir({"HOME": "/root"}, 0) == Path("/tmp/gpu-agent-e2e-artifacts")
    assert artifacts_dir({"HOME": "/home/u"}, 1000) == Path("/home/u/.local/state/gpu-agent-ci/e2e-artifacts")
    assert artifacts_dir({"HOME": "/home/u", "CLUSTER_DIR": "/d"}, 1000) == Path("/d/e2e-artifacts")
    assert artifacts_dir({"HOME": "/home/u", "E2E_ARTIFACTS": "/run/x"}, 1000) == Path("/run/x")


def test_without_home_the_password_databases_home_is_used_by_both():
    """sudo -E or a bare environment can leave HOME unset: the folders are still the user's, never `/.cache`."""
    entry = next((p for p in pwd.getpwall() if p.pw_uid != 0 and p.pw_dir.startswith("/")), None)
    if entry is None:
        pytest.skip("no password entry other than root's")
    home = entry.pw_dir
    expected = (f"{home}/.cache/gpu-agent-ci", f"{home}/.local/state/gpu-agent-ci")
    assert shell_dirs(entry.pw_uid, {}) == expected
    assert tuple(map(str, ci_dirs({}, entry.pw_uid))) == expected


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to become a user")
def test_sourced_by_a_real_non_root_user_paths_sh_exports_that_users_folders_and_roots_the_system_ones(tmp_path):
    """Not ci_dirs with a made-up uid: paths.sh sourced as common.sh sources it, by a process whose EUID is 65534
    (setpriv), then by this root process; what it exports is what every CI script reads."""
    show = f'source {PATHS_SH}; printf "%s\\n" "$CI_CACHE" "$CLUSTER_DIR" "$E2E_ARTIFACTS_ROOT"'
    script = PATHS_SH.read_text() + '\nprintf "%s\\n" "$CI_CACHE" "$CLUSTER_DIR" "$E2E_ARTIFACTS_ROOT"\n'  # 65534 may not read the tree
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    user = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-c", script],
                          env=env, check=True, capture_output=True, text=True, timeout=30).stdout.splitlines()
    assert user == [f"{tmp_path}/.cache/gpu-agent-ci", f"{tmp_path}/.local/state/gpu-agent-ci",
                    f"{tmp_path}/.local/state/gpu-agent-ci/e2e-artifacts"]
    root = subprocess.run(["bash", "-c", show], env=env, check=True, capture_output=True, text=True,
                          timeout=30).stdout.splitlines()
    assert root == [*SYSTEM, "/tmp/gpu-agent-e2e-artifacts"]
    overridden = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-c", script],
                                env={**env, "CI_CACHE": "/data/ci"}, check=True, capture_output=True, text=True,
                                timeout=30).stdout.splitlines()
    assert overridden == ["/data/ci", f"{tmp_path}/.local/state/gpu-agent-ci",
                          f"{tmp_path}/.local/state/gpu-agent-ci/e2e-artifacts"]


def test_common_sh_takes_its_folders_from_paths_sh_and_derives_the_rest_from_them(tmp_path):
    """What the CI scripts read: common.sh's CI_CACHE, CLUSTER_DIR and what hangs off them (KUBECONFIG_PATH,
    TOOLS_BIN, KIND_BIN ...), with an override as a user would set it."""
    script = (f'source {REPO}/ci/scripts/common.sh; '
              'printf "%s\\n" "$CI_CACHE" "$CLUSTER_DIR" "$KUBECONFIG_PATH" "$TOOLS_BIN" "$GOMODCACHE" "$PKI"')
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CI_CACHE": str(tmp_path / "c"),
           "CLUSTER_DIR": str(tmp_path / "s")}
    out = subprocess.run(["bash", "-c", script], env=env, check=True, capture_output=True, text=True,
                         timeout=30).stdout.splitlines()
    assert out == [f"{tmp_path}/c", f"{tmp_path}/s", f"{tmp_path}/s/admin.kubeconfig", f"{tmp_path}/c/tools",
                   f"{tmp_path}/c/gomod", f"{tmp_path}/s/pki"]


def test_no_script_or_module_names_the_system_folders_but_the_two_that_choose():
    """A new hard-coded /var/cache/gpu-agent-ci would be a path a normal user cannot write: only paths.sh and
    e2e/cluster.py may name them (the docs and comments of Makefiles may say what root's are)."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"], check=True,
                           capture_output=True, text=True, timeout=30).stdout.split()
    allowed = {"ci/scripts/paths.sh", "e2e/cluster.py", "ci/tests/test_ci_paths.py"}
    offenders = []
    for name in files:
        if name in allowed or not name.endswith((".sh", ".py")) or not (REPO / name).is_file():
            continue
        text = (REPO / name).read_text(errors="replace")
        offenders += [f"{name}: {folder}" for folder in ROOTS_ONLY if folder in text]
    assert not offenders, "choose these through ci/scripts/paths.sh (shell) or e2e.cluster.ci_dirs (Python)"
