// Builds kube-network-policies, the CI cluster's NetworkPolicy enforcer, from the Go module proxy
// (no image registry here; it runs as a plain process on every node, see ci/scripts/netpol.sh).
module gpu-agent.local/ci/kube-network-policies

go 1.24.0

require sigs.k8s.io/kube-network-policies v0.8.0
