#!/usr/bin/env bash
# make e2e CLUSTER=ci|existing|kind|k3d: one entry point for the end-to-end suite.
#   ci        the whole suite once, on a cluster of E2E_NODES nodes (default 5: the control-plane node
#             and four workers) brought up (idempotent), images built and imported, tests run (ci_suite
#             below: the cluster's qualification, the serial phase, the parallel phase on E2E_JOBS
#             workers with the lane beside it), torn down, the host checked to be exactly as before. E2E_NODES=1 for a quick
#             local run (the tests that need several nodes skip, saying so; then E2E_JOBS=0).

#             KEEP_CLUSTER=1: the running cluster (NODES nodes, default E2E_NODES), left running after
#   existing  the current KUBECONFIG; images must already be loadable by its nodes
#   kind|k3d  a local cluster (e2e/local_cluster.py): created unless it exists (E2E_CLUSTER_NAME, default
#             gpu-agent-e2e; E2E_NODE_IMAGE; E2E_WORKERS worker nodes, default 1), the project's image
#             built and imported into every node (with its version's name too), the suite run, the
#             cluster deleted unless E2E_KEEP_CLUSTER=1. The image: `docker build` (or podman's, with
#             E2E_ENGINE=podman, the default with KIND_EXPERIMENTAL_PROVIDER=podman) of the Dockerfile, or the
#             CI machines' way (debootstrap base and ci/tools/oci_image.py, no registry; root only) where
#             E2E_IMAGE_BUILD=ci. kind on podman: KIND_EXPERIMENTAL_PROVIDER=podman. Tests that need the CI
#             cluster's host skip, saying so. Runs as a normal user where kind does (Docker this user may use,
#             or rootless podman on cgroup v2): caches under ~/.cache (ci/scripts/paths.sh), and a preflight
#             (e2e/local_cluster.py preflight) stops before anything is made when the host needs root for it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/scripts/common.sh"
cluster=${1:-ci}
pytest=${PYTEST:-$repo/.venv/bin/pytest}
python=$(dirname "$pytest")/python
junit_prefix=$([[ $cluster == ci ]] && echo e2e || echo "$cluster")
export E2E_CLUSTER=$cluster
export E2E_ARTIFACTS=${E2E_ARTIFACTS:-$E2E_ARTIFACTS_ROOT/$(date -u +%Y%m%dT%H%M%S)}  # (paths.sh)
rc=0

run_suite() {  # run_suite WHAT PYTEST_ARGS...: one pytest run, its JUnit XML beside the others of `make test`
  local what=$1 t=$SECONDS slug cpu; shift
  cpu=$(cpu_mark)
  slug=$(tr -c 'a-z0-9\n' '-' <<< "${what,,}" | tr -s '-' | sed 's/-$//')
  local code=0
  "$pytest" -p no:cacheprovider ${TEST_JUNIT_DIR:+--junitxml="$TEST_JUNIT_DIR/$junit_prefix-$slug.xml"} "$@" || code=$?
  # 5: pytest selected nothing; a filtered run (make chaos, make handover: -k) leaves one phase empty
  if ((code == 5)); then log "e2e $what: no test selected"; elif ((code != 0)); then rc=$code; fi
  log "timing: e2e $what $((SECONDS - t))s $(cpu_busy "$cpu")"
}

kstatus() {
  local t=$SECONDS
  # The GitOps checks (e2e/test_gitops.py) run kstatus; cluster-up.sh has built it on ci, and the other
  # clusters may lack Go: then those tests fail naming the build command, the rest still run.
  bash "$here/scripts/build-kstatus.sh" || log "kstatus not built (needs Go): the GitOps tests will fail"
  log "timing: kstatus $((SECONDS - t))s"
}

# The suite on the CI cluster. The cluster's own qualification first (e2e/test_smoke.py: pods, rollouts, DNS, RBAC,
# helm), and nothing else if it fails. Then one fake-gpu release for the run (e2e/fake_gpu_release.py), and the
# suite in phases: the tests that cannot run beside others (marked serial, disruptive or ci_host: e2e/conftest.py
# serial_reason) one after another; those that can beside their own group only (serial with among=) on E2E_JOBS
# pytest-xdist workers; then the rest on E2E_JOBS workers (default 3: the phase mostly waits on its cluster), and beside them the lane (marked
# lane: e2e/conftest.py lane_of), its tests one after another on the last nodes, which no worker owns. Side by side
# each worker owns one fake-GPU node: the cluster needs E2E_JOBS nodes and the lane's. E2E_JOBS=0: every test in one
# process, one after another (no phases).
ci_suite() {  # ci_suite PYTEST_ARGS...
  local smoke=$repo/e2e/test_smoke.py jobs=${E2E_JOBS:-3} fake_ns t
  kstatus
  # whole, whatever the run selects (a -k would deselect it); its five tests side by side, each in its namespace: they
  # wait on Pods and rollouts, the CPU mostly idle (14% of both cores one after another)
  run_suite "cluster qualification" "$smoke" -n 5 --dist load
  if ((rc != 0)); then log "FAILED: the cluster's qualification (e2e/test_smoke.py): the product suite did not run"; return; fi
  t=$SECONDS
  fake_ns=$(cd "$repo" && "$python" -m e2e.fake_gpu_release up "$KUBECONFIG_PATH") || { rc=1; log "FAILED: fake-gpu install"; return; }
  log "timing: fake-gpu install $((SECONDS - t))s"
  if ((jobs == 0)); then
    phase_mark "suite in one process"
    E2E_FAKE_GPU_NAMESPACE=$fake_ns run_suite "suite in one process" "$repo/e2e" --ignore="$smoke" "$@"
  else
    phase_mark serial
    E2E_FAKE_GPU_NAMESPACE=$fake_ns E2E_PHASE=serial run_suite "serial phase" "$repo/e2e" --ignore="$smoke" "$@"
    phase_mark grouped
    E2E_FAKE_GPU_NAMESPACE=$fake_ns E2E_PHASE=grouped run_suite "grouped phase ($jobs workers)" "$repo/e2e" \
      --ignore="$smoke" -n "$jobs" --dist load "$@"
    # The lane beside the parallel phase, on nodes no worker owns: its output kept apart and printed after the
    # parallel phase's, so that neither is interleaved line by line with the other.
    phase_mark parallel
    lane_log=$(mktemp)
    (E2E_FAKE_GPU_NAMESPACE=$fake_ns E2E_PHASE=lane E2E_JOBS=$jobs run_suite "lane (beside the parallel phase)" \
      "$repo/e2e" --ignore="$smoke" "$@"; exit "$rc") > "$lane_log" 2>&1 &
    lane=$!
    E2E_FAKE_GPU_NAMESPACE=$fake_ns E2E_PHASE=parallel run_suite "parallel phase ($jobs workers)" "$repo/e2e" \
      --ignore="$smoke" -n "$jobs" --dist load "$@"
    log "waiting for the lane (it ran beside the parallel phase; its output follows)"
    wait "$lane" || rc=$?
    cat "$lane_log" >&2; rm -f "$lane_log"
  fi
  t=$SECONDS
  (cd "$repo" && "$python" -m e2e.fake_gpu_release down "$KUBECONFIG_PATH" "$fake_ns") || { rc=1; log "FAILED: fake-gpu uninstall"; }
  log "timing: fake-gpu uninstall $((SECONDS - t))s"
}

# E2E_PHASE_FILE: a file each phase's name is appended to as it starts: what runs beside the suite waits on it (make
# test's unit-compute and kind stages start with the serial phase, after the cluster's builds: scripts/beside-e2e.sh)
phase_mark() {
  [[ -z ${E2E_PHASE_FILE:-} ]] || echo "$1" >> "$E2E_PHASE_FILE"
}

# The CI registry (ci/scripts/registry.sh) on the first node's address (REGISTRY_CLUSTER_ADDR), which every node
# reaches and whose CA every node's containerd trusts for it (registry.sh start writes its hosts.toml); the project
# image pushed to it (skopeo, digests kept) and both charts signed and pushed (scripts/release-oci.sh), for
# e2e/test_oci_install.py. Its REGISTRY_* paths are exported to the suite. A failure fails the run (rc) but not the
# rest of the suite: the registry is stopped and that test skips, saying there is none. cluster-down stops it
# (registry.sh stop).
# The image pushed is a copy of the archive just built with one label added to its config (ci/tools/oci_relabel.py:
# io.gpu-agent.ci.copy=registry; the layers byte for byte), never that archive itself, which every node imported as
# localhost/gpu-agent:dev: the same image ID pulled through a pull Secret would make each node's kubelet
# (KubeletEnsureSecretPulledImages, default policy NeverVerifyPreloadedImages) require that Secret for the preloaded
# image too, and every later pod of the node on localhost/gpu-agent:dev with pullPolicy Never would fail
# ErrImageNeverPull. A distinct image ID keeps the two apart, as on an air-gapped cluster whose mirror is the only
# source; e2e/test_oci_install.py checks it.
registry_up() {
  local t=$SECONDS charts code=0 copy
  REGISTRY_ADDR=$REGISTRY_CLUSTER_ADDR bash "$here/scripts/registry.sh" start || return 1
  eval "$(bash "$here/scripts/registry.sh" env)"
  log "timing: registry start $((SECONDS - t))s"
  # side by side (the image push mostly writes and hashes, the charts' mostly signs): their lines kept apart
  t=$SECONDS
  HELM=$TOOLS_BIN/helm bash "$repo/scripts/release-oci.sh" "$REGISTRY_HOST" "$REGISTRY_RELEASE_DIR" \
    > "$REGISTRY_DIR/release-oci.log" 2>&1 &
  charts=$!
  # (the copy takes a fraction of a second: oci_relabel.py prints its time)
  copy=$(mktemp "${TMPDIR:-/tmp}/gpu-agent-registry-copy.XXXXXX")
  if python3 "$here/tools/oci_relabel.py" "$CI_CACHE/images/gpu-agent.oci.tar" "$copy" \
      --label io.gpu-agent.ci.copy=registry; then
    bash "$here/scripts/registry.sh" push-image "$copy" || code=1
  else
    code=1; log "ci/tools/oci_relabel.py failed: no image pushed"
  fi
  rm -f "$copy" "$copy.tmp"
  wait "$charts" || { code=1; log "scripts/release-oci.sh failed:"; }
  cat "$REGISTRY_DIR/release-oci.log" >&2
  log "timing: image and charts pushed to the registry $((SECONDS - t))s"
  return "$code"
}

cluster_up() {  # cluster_up NODES
  local t=$SECONDS
  NODES=$1 bash "$here/scripts/cluster-up.sh"; log "timing: cluster-up ($1 node(s)) $((SECONDS - t))s"
  t=$SECONDS; bash "$here/scripts/build-images.sh" project; log "timing: images $((SECONDS - t))s"
  if ! registry_up; then
    rc=1; log "FAILED: the CI registry (start, image push or charts push): stopped; e2e/test_oci_install.py will skip"
    bash "$here/scripts/registry.sh" stop || true
    unset REGISTRY_HOST REGISTRY_CA REGISTRY_CERT_DIR REGISTRY_CREDENTIALS REGISTRY_RELEASE_DIR
  fi
  # Inside `make test` (TEST_OUT: this run's folder), the kind stage loads this same archive instead of building the
  # image again (a minute of CPU beside the serial phase): a link in this run's folder is never an older build's.
  if [[ -n ${TEST_OUT:-} && -d $TEST_OUT ]]; then
    ln -f "$CI_CACHE/images/gpu-agent.oci.tar" "$TEST_OUT/gpu-agent.oci.tar" 2>/dev/null ||
      cp "$CI_CACHE/images/gpu-agent.oci.tar" "$TEST_OUT/gpu-agent.oci.tar"
  fi
}

case $cluster in
  ci)
    need_root "the CI cluster (make e2e, CLUSTER=ci by default)" "it installs Debian packages and brings up a cluster \
made of the host's own network, mount and cgroup namespaces, iptables rules and sysctls (ci/scripts/cluster-up.sh)"
    if [[ ${KEEP_CLUSTER:-0} == 1 ]]; then
      cluster_up "${NODES:-${E2E_NODES:-5}}"
      ci_suite "${@:2}"
      exit $rc
    fi
    # Teardown is checked too: the host must look exactly as it did before cluster-up.
    before=$(mktemp); after=$(mktemp)
    # Packages first: what an install step adds (iptables' empty tables, say) is the host's new
    # baseline, not something the cluster left behind.
    t=$SECONDS; bash "$here/scripts/install-deps.sh"; log "timing: host packages $((SECONDS - t))s"
    if [[ ! -d $CLUSTER_DIR ]]; then bash "$here/scripts/host-state.sh" > "$before"; else : > "$before"; fi
    down_and_check() {
      local t=$SECONDS
      bash "$here/scripts/cluster-down.sh"; log "timing: cluster-down $((SECONDS - t))s"
      [[ -s $before ]] || return 0
      bash "$here/scripts/host-state.sh" > "$after"
      if ! diff -u "$before" "$after"; then log "FAILED: cluster-down left the host changed (diff above)"; return 1; fi
      log "teardown check passed: host state identical to before cluster-up"
    }
    trap 'code=$?; down_and_check || code=1; rm -f "$before" "$after"; exit $code' EXIT
    cluster_up "${E2E_NODES:-5}"
    ci_suite "${@:2}"
    ;;
  existing)
    kstatus
    run_suite suite "$repo/e2e" "${@:2}"
    ;;
  kind|k3d)
    local_cluster() { python3 "$repo/e2e/local_cluster.py" "$cluster" "$@"; }
    export E2E_KUBECONFIG=${E2E_KUBECONFIG:-$HOME/.kube/${E2E_CLUSTER_NAME:-gpu-agent-e2e}-$cluster.yaml}
    # As a normal user, before anything is made: the engine reachable, kind's rootless rules (cgroup v2, delegated
    # controllers), /lib/modules, no E2E_IMAGE_BUILD=ci (debootstrap); each refusal names what needs root. Root: nothing.
    local_cluster preflight || exit $?
    ((EUID == 0)) || log "not root: caches in $CI_CACHE, kubeconfig $E2E_KUBECONFIG, failed tests' artifacts in $E2E_ARTIFACTS"
    if [[ ${E2E_KEEP_CLUSTER:-0} != 1 ]]; then
      # deleted however the run ends, a failed create included (kind and k3d leave half-made clusters)
      trap 'code=$?; t=$SECONDS; local_cluster down || code=1; log "timing: $cluster cluster down $((SECONDS - t))s"; exit $code' EXIT
    fi
    t=$SECONDS; local_cluster up
    # kind's --wait covers the control plane only; the workers' pod network is still starting
    kubectl --kubeconfig "$E2E_KUBECONFIG" wait --for=condition=Ready node --all --timeout=180s >&2
    log "timing: $cluster cluster up $((SECONDS - t))s"
    if [[ $cluster == kind ]]; then log "kind get clusters:"; "${KIND:-kind}" get clusters >&2
    else log "k3d cluster list:"; "${K3D:-k3d}" cluster list >&2; fi
    log "kubectl get nodes -o wide:"; kubectl --kubeconfig "$E2E_KUBECONFIG" get nodes -o wide >&2
    t=$SECONDS
    archive=$CI_CACHE/images/gpu-agent-$cluster.oci.tar
    mkdir -p "$(dirname "$archive")"
    if [[ ${E2E_IMAGE_BUILD:-engine} == ci && -n ${TEST_OUT:-} && -f $TEST_OUT/gpu-agent.oci.tar ]]; then
      archive=$TEST_OUT/gpu-agent.oci.tar  # the CI cluster's, built earlier in this run from this tree (cluster_up)
      log "the image: the archive the CI cluster's stage built in this run ($archive)"
    elif [[ ${E2E_IMAGE_BUILD:-engine} == ci ]]; then
      bash "$here/scripts/build-base-rootfs.sh"
      IMAGE_OUT=$archive bash "$here/scripts/build-images.sh" project
    else
      # the engine kind runs on, unless told: podman's images are not Docker's (rootless podman: not root's either)
      engine=${E2E_ENGINE:-$([[ $cluster == kind && ${KIND_EXPERIMENTAL_PROVIDER:-} == podman ]] && echo podman || echo docker)}
      version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")
      bash "$repo/scripts/build-wheels.sh" >&2
      "$engine" build -t localhost/gpu-agent:dev -t "localhost/gpu-agent:$version" \
        --build-arg "BUILD_COMMIT=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)" \
        --build-arg "BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)" --build-arg "VERSION=$version" "$repo"
      # podman writes several images into one archive only when asked to
      multi=(); [[ $engine != podman ]] || multi=(--multi-image-archive)
      "$engine" save "${multi[@]}" -o "$archive" localhost/gpu-agent:dev "localhost/gpu-agent:$version"
    fi
    log "timing: images $((SECONDS - t))s"; t=$SECONDS
    local_cluster load "$archive"; log "timing: image load into every $cluster node $((SECONDS - t))s"
    kstatus
    run_suite "suite ($cluster)" "$repo/e2e" "${@:2}"
    ;;
  *) echo "CLUSTER must be one of ci, existing, kind, k3d (got '$cluster')" >&2; exit 2 ;;
esac
if [[ -d $E2E_ARTIFACTS ]]; then log "what the failed tests touched (pods, logs, events, domains, helm history): $E2E_ARTIFACTS"; fi
exit $rc
