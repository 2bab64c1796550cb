#!/usr/bin/env bash
# Regenerates agent/gpu_agent/mechanisms/dra/kubeletapi/*/api_pb2*.py from the api.proto files beside them
# (copied unchanged from k8s.io/kubelet v0.36.2). Needs grpcio-tools 1.85.1 (a throwaway venv is made).
set -euo pipefail
cd "$(dirname "$0")/../agent"
venv=${TMPDIR:-/tmp}/gpu-agent-grpc-tools
[[ -x $venv/bin/python ]] || { python3 -m venv "$venv" && "$venv/bin/pip" -q install grpcio-tools==1.85.1; }
d=gpu_agent/mechanisms/dra/kubeletapi
"$venv/bin/python" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
  $d/drav1/api.proto $d/drav1beta1/api.proto $d/registration/api.proto $d/health/api.proto
