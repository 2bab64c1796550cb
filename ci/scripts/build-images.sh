#!/usr/bin/env bash
# Image archives for the CI cluster, built without a registry or a container engine.
#   build-images.sh system   pause (a static C program) and CoreDNS
#   build-images.sh project  the gpu-agent image from the project's Dockerfile, on the
#                            debootstrap base (BASE build argument), then imported if a cluster runs
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
source "$here/scripts/lib.sh"
images=$CI_CACHE/images
mkdir -p "$images"
what=${1:-project}

if [[ $what == system ]]; then
  if [[ ! -f $images/pause.oci.tar ]]; then
    work=$(mktemp -d); mkdir -p "$work/root"
    gcc -static -O2 -o "$work/root/pause" "$here/pause/pause.c"
    python3 "$here/tools/oci_image.py" layers --name localhost/pause:ci --out "$images/pause.oci.tar" \
      --layer "$work/root" --entrypoint '["/pause"]'
    rm -rf "$work"
  fi
  if [[ ! -f $images/coredns.oci.tar ]]; then
    work=$(mktemp -d); mkdir -p "$work/root"
    cp "$CI_CACHE/coredns-$COREDNS_VERSION/coredns" "$work/root/coredns"
    python3 "$here/tools/oci_image.py" layers --name localhost/coredns:ci --out "$images/coredns.oci.tar" \
      --layer "$work/root" --entrypoint '["/coredns"]'
    rm -rf "$work"
  fi
  exit 0
fi

# project images: wheels for the image are built here, so the Dockerfile needs no network
repo=$(cd "$here/.." && pwd)
bash "$repo/scripts/build-wheels.sh" >&2
t=$SECONDS
python3 "$here/tools/oci_image.py" build --name localhost/gpu-agent:dev --out "$images/gpu-agent.oci.tar" \
  --file "$repo/Dockerfile" --context "$repo" --base-rootfs "$images/base-rootfs-$BASE_ROOTFS_VERSION.tar" \
  --build-arg "BASE=local" --build-arg "BUILD_COMMIT=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)" \
  --build-arg "BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  --build-arg "VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")"
log "gpu-agent image built in $((SECONDS - t))s"
if [[ -S $CONTAINERD_SOCK ]] && running containerd; then
  ctr_ images import "$images/gpu-agent.oci.tar" >/dev/null
  # The chart's default tag is its appVersion: the same image under that name too, so a plain
  # `helm install charts/gpu-agent` runs what this build produced.
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")
  ctr_ images tag --force localhost/gpu-agent:dev "localhost/gpu-agent:$version" >/dev/null
  log "imported localhost/gpu-agent:dev (also tagged :$version) into the cluster's containerd"
fi
