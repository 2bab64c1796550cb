# Shared settings for the CI cluster scripts. Sourced, never run.
# Everything that should survive between runs on one machine lives under CI_CACHE,
# outside the clone; everything a running cluster owns lives under CLUSTER_DIR.
export CI_CACHE=${CI_CACHE:-/var/cache/gpu-agent-ci}
export K8S_VERSION=${K8S_VERSION:-v1.36.2}
export COREDNS_VERSION=${COREDNS_VERSION:-v1.12.4}
export GOMODCACHE=${GOMODCACHE:-$CI_CACHE/gomod}
export GOCACHE=${GOCACHE:-$CI_CACHE/gocache}
export K8S_BIN=$CI_CACHE/kubernetes-$K8S_VERSION
export TOOLS_BIN=$CI_CACHE/tools
export CLUSTER_DIR=${CLUSTER_DIR:-/var/lib/gpu-agent-ci}
export KUBECONFIG_PATH=${KUBECONFIG_PATH:-$CLUSTER_DIR/admin.kubeconfig}
log() { printf '%s ci: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
