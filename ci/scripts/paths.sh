# shellcheck shell=bash
# Where the CI's caches (CI_CACHE) and a cluster's state (CLUSTER_DIR) live. Sourced, never run. Chosen here and only
# here for every shell script: common.sh sources it, and so do scripts/release.sh and scripts/release-oci.sh, which
# need no more of common.sh. The Python side is e2e/cluster.py's ci_dirs; ci/tests/test_ci_paths.py holds both to
# the same answers.
#   root          /var/cache/gpu-agent-ci and /var/lib/gpu-agent-ci: the CI machines (the CI cluster needs root)
#   anyone else   ${XDG_CACHE_HOME:-~/.cache}/gpu-agent-ci and ${XDG_STATE_HOME:-~/.local/state}/gpu-agent-ci: the
#                 laptop path (`make e2e CLUSTER=kind` as a normal user), which may not write the system folders
# CI_CACHE and CLUSTER_DIR, when set, win over either. An XDG variable that is not an absolute path is ignored, as
# the XDG Base Directory specification says; without HOME, the user's home from the password database.

# ci_dirs UID: the two folders for that user id, one a line: CI_CACHE's, then CLUSTER_DIR's
ci_dirs() {
  local uid=$1 cache=/var/cache/gpu-agent-ci state=/var/lib/gpu-agent-ci home xdg_cache xdg_state
  if [[ $uid != 0 ]]; then
    home=${HOME:-$(getent passwd "$uid" | cut -d: -f6)}
    xdg_cache=${XDG_CACHE_HOME:-} xdg_state=${XDG_STATE_HOME:-}
    [[ $xdg_cache == /* ]] || xdg_cache=$home/.cache
    [[ $xdg_state == /* ]] || xdg_state=$home/.local/state
    cache=$xdg_cache/gpu-agent-ci state=$xdg_state/gpu-agent-ci
  fi
  printf '%s\n%s\n' "${CI_CACHE:-$cache}" "${CLUSTER_DIR:-$state}"
}
{ read -r CI_CACHE; read -r CLUSTER_DIR; } < <(ci_dirs "$EUID")
export CI_CACHE CLUSTER_DIR
# Where `make e2e` keeps what failed tests touched (a folder per run below it; E2E_ARTIFACTS names one run's): root's
# in /tmp as before, another user's in its own state folder (/tmp/gpu-agent-e2e-artifacts is root's, mode 755, once
# root has run the suite: a user's failed test could not write there).
if [[ $EUID == 0 ]]; then E2E_ARTIFACTS_ROOT=/tmp/gpu-agent-e2e-artifacts; else E2E_ARTIFACTS_ROOT=$CLUSTER_DIR/e2e-artifacts; fi
export E2E_ARTIFACTS_ROOT
