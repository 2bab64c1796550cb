#!/usr/bin/env bash
# Image archives for the CI cluster, built without a registry or a container engine.
#   build-images.sh system   pause (a static C program) and CoreDNS
#   build-images.sh project  the gpu-agent image from the project's Dockerfile, on the
#                            debootstrap base (BASE build argument), then imported if a cluster runs
#   build-images.sh last-stable
#                            the newest release older than this checkout (releases.yaml), built from
#                            the commit it was cut from (a git worktree), tagged with its version and
#                            imported; its charts beside it. Cached by commit. Prints that folder.
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

repo=$(cd "$here/.." && pwd)

if [[ $what == last-stable ]]; then
  read -r version commit < <(python3 "$here/tools/releases.py" last-stable)
  out=$CI_CACHE/releases/$version-${commit:0:12}
  # Side-by-side e2e workers each ask for it at once: one builds and imports, the others wait for it.
  mkdir -p "$CI_CACHE/releases"; exec 9> "$CI_CACHE/releases/.lock"; flock 9
  if [[ ! -f $out/image.oci.tar ]]; then
    if ! git -C "$repo" cat-file -e "$commit^{commit}" 2>/dev/null; then
      echo "last stable $version was cut from commit $commit, which this clone does not have;" \
           "fetch it (git fetch --unshallow, or git fetch origin $commit) and run again" >&2
      exit 1
    fi
    work=$(mktemp -d)
    trap 'git -C "$repo" worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
    git -C "$repo" worktree add --detach --force "$work/tree" "$commit" >/dev/null 2>&1
    log "building last stable $version from commit ${commit:0:12} (a worktree)"
    bash "$work/tree/scripts/build-wheels.sh" >&2
    mkdir -p "$out.tmp"
    python3 "$here/tools/oci_image.py" build --name "localhost/gpu-agent:$version" --out "$out.tmp/image.oci.tar" \
      --file "$work/tree/Dockerfile" --context "$work/tree" --base-rootfs "$images/base-rootfs-$BASE_ROOTFS_VERSION.tar" \
      --build-arg "BASE=local" --build-arg "BUILD_COMMIT=${commit:0:12}" --build-arg "BUILD_DATE=unknown" \
      --build-arg "VERSION=$version" >&2
    cp -r "$work/tree/charts" "$out.tmp/charts"
    rm -rf "$out"; mv "$out.tmp" "$out"
  fi
  if [[ -S $CONTAINERD_SOCK ]] && running containerd; then
    import_image "$out/image.oci.tar"
    log "imported localhost/gpu-agent:$version (last stable, commit ${commit:0:12}) into every node's containerd"
  fi
  echo "$out"
  exit 0
fi

# project images: wheels for the image are built here, so the Dockerfile needs no network
bash "$repo/scripts/build-wheels.sh" >&2
t=$SECONDS
# IMAGE_TAG / IMAGE_OUT: `make release` names the image after the version and keeps the archive.
out=${IMAGE_OUT:-$images/gpu-agent.oci.tar}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")
# The chart's default tag is its appVersion: the dev image carries that name too, so a plain
# `helm install charts/gpu-agent` runs what this build produced (kind and k3d import both names from the archive).
names=(--name "localhost/gpu-agent:${IMAGE_TAG:-dev}")
[[ -n ${IMAGE_TAG:-} ]] || names+=(--name "localhost/gpu-agent:$version")
python3 "$here/tools/oci_image.py" build "${names[@]}" --out "$out" \
  --file "$repo/Dockerfile" --context "$repo" --base-rootfs "$images/base-rootfs-$BASE_ROOTFS_VERSION.tar" \
  --build-arg "BASE=local" --build-arg "BUILD_COMMIT=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)" \
  --build-arg "BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  --build-arg "VERSION=$version"
log "gpu-agent image built in $((SECONDS - t))s"
if [[ -z ${IMAGE_OUT:-} && -S $CONTAINERD_SOCK ]] && running containerd; then
  import_image "$images/gpu-agent.oci.tar" localhost/gpu-agent:dev "localhost/gpu-agent:$version"
  log "imported localhost/gpu-agent:dev (also tagged :$version) into every node's containerd"
fi
