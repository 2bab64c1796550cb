// Builds CoreDNS for the CI cluster's DNS from the Go module proxy (no image registry here).
module gpu-agent.local/ci/coredns

go 1.24.0

require github.com/coredns/coredns v1.12.4
