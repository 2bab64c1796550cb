#!/usr/bin/env bash
# A kind node image for K8S_VERSION, assembled here: no kindest/node or kindest/base image can be pulled (no
# registry), so it is built from what ci/ already builds, the way kind's images/base Dockerfile and
# pkg/build/nodeimage lay a node out:
#   - the root filesystem: Debian bookworm with systemd, containerd, runc, the CNI plugins and kind's network
#     tools (build-kind-rootfs.sh, debootstrap);
#   - kind's own node files (its entrypoint, the containerd/kubelet systemd units, the containerd config, the
#     cgroup scripts) from kind's module in the Go module cache, at KIND_VERSION, so the node is what kind
#     expects; containerd's sandbox image is our pause;
#   - kubeadm, kubelet and kubectl in /usr/bin, /kind/version;
#   - the images kubeadm runs, as archives in /kind/images, imported into containerd at boot before kubelet
#     (ci/kind/node/import-images.sh): kube-apiserver, controller-manager, scheduler and kube-proxy of
#     K8S_VERSION, etcd KIND_ETCD_VERSION (what kubeadm v1.36 deploys; its flags are 3.6's), CoreDNS and pause from
#     build-images.sh system, all named localhost/... (the kind config's patch, ci/kind/local-images.yaml,
#     points kubeadm there), and a tools image for the pod network daemon (ci/kind/node/default-cni.yaml).
# Cached under CI_CACHE keyed by the versions and a digest of these sources; loaded into podman (or docker,
# KIND_ENGINE) if the engine lacks it. Prints the image's name on stdout: KIND_NODE_IMAGE for e2e.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
engine=${KIND_ENGINE:-podman}
t0=$SECONDS

# --- the pieces, each cached on its own -------------------------------------------------------------
bash "$here/scripts/build-kind-rootfs.sh" >&2
bash "$here/scripts/build-kubernetes.sh" >&2
bash "$here/scripts/build-coredns.sh" >&2
bash "$here/scripts/build-containerd.sh" >&2
[[ -x $TOOLS_BIN/kubectl ]] || bash "$here/scripts/install-tools.sh" >&2  # the node needs kubectl (kind runs it there)
bash "$here/scripts/build-images.sh" system >&2
bash "$here/scripts/build-kind.sh" >&2
go_build_cached "etcd $KIND_ETCD_VERSION" "$KIND_ETCD_BIN" "$here/etcd" . "require go.etcd.io/etcd/server/v3 ${KIND_ETCD_VERSION}" >&2
if [[ ! -x $KUBEADM_BIN ]]; then
  log "building kubeadm $K8S_VERSION (after build-kubernetes.sh most of it is in the Go cache)"
  t=$SECONDS; mkdir -p "$(dirname "$KUBEADM_BIN")"
  (cd "$here/kubernetes" && GOEXPERIMENT=nojsonv2 GOFLAGS=-mod=mod CGO_ENABLED=0 \
    go build -trimpath -ldflags "-s -w $(kube_ldflags)" -o "$KUBEADM_BIN.tmp" k8s.io/kubernetes/cmd/kubeadm) >&2
  mv "$KUBEADM_BIN.tmp" "$KUBEADM_BIN"
  log "kubeadm built in $((SECONDS - t))s"
fi
log "timing: kind node pieces $((SECONDS - t0))s"

kind_files=$GOMODCACHE/sigs.k8s.io/kind@$KIND_VERSION/images/base/files
[[ -d $kind_files ]] || { echo "ci: kind's module is not in $GOMODCACHE (build-kind.sh downloads it)" >&2; exit 1; }
key=$( { echo "$K8S_VERSION $KIND_ETCD_VERSION $COREDNS_VERSION $KIND_VERSION $KIND_ROOTFS_VERSION $CONTAINERD_VERSION"
         cat "$0" "$here"/kind/node/*; } | sha256sum | cut -c1-10)
name=localhost/gpu-agent-kind-node:$K8S_VERSION-$key
tools=localhost/gpu-agent-kind-tools:$key
out=$CI_CACHE/images/kind-node-$K8S_VERSION-$key.oci.tar

if [[ ! -f $out ]]; then
  t=$SECONDS
  work=$(mktemp -d "$CI_CACHE/images/kind-node.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  root=$work/overlay images=$work/overlay/kind/images
  mkdir -p "$root" "$images"
  oci() { python3 "$here/tools/oci_image.py" layers "$@" >&2; }
  # the control plane: one static binary each, on PATH (kubeadm's static Pods run them by name)
  for c in kube-apiserver kube-controller-manager kube-scheduler; do
    mkdir -p "$work/$c/usr/local/bin"; cp "$K8S_BIN/$c" "$work/$c/usr/local/bin/"
    oci --name "localhost/$c:$K8S_VERSION" --out "$images/$c.tar" --layer "$work/$c"
  done
  mkdir -p "$work/etcd/usr/local/bin"; cp "$KIND_ETCD_BIN" "$work/etcd/usr/local/bin/etcd"
  oci --name "localhost/etcd:$KIND_ETCD_VERSION" --out "$images/etcd.tar" --layer "$work/etcd"
  # kube-proxy runs iptables, the pod network daemon bash, curl, jq and ip: the node's userland without the
  # container runtime, the CNI plugins, systemd's and the documentation
  python3 - "$KIND_ROOTFS" "$work/tools.tar" <<'PY'
import sys, tarfile
skip = ("./usr/bin/containerd", "./usr/bin/ctr", "./usr/sbin/runc", "./usr/lib/cni", "./usr/lib/systemd",
        "./lib/systemd", "./usr/share/doc", "./usr/share/locale", "./usr/share/man", "./usr/share/zoneinfo")
with tarfile.open(sys.argv[1]) as src, tarfile.open(sys.argv[2], "w", format=tarfile.PAX_FORMAT) as dst:
    for m in src:
        if m.name.startswith(skip):
            continue
        dst.addfile(m, src.extractfile(m) if m.isreg() else None)
PY
  oci --name "$tools" --out "$images/tools.tar" --layer "$work/tools.tar"
  mkdir -p "$work/kube-proxy/usr/local/bin"; cp "$K8S_BIN/kube-proxy" "$work/kube-proxy/usr/local/bin/"
  oci --name "localhost/kube-proxy:$K8S_VERSION" --out "$images/kube-proxy.tar" --layer "$work/tools.tar" --layer "$work/kube-proxy"
  cp "$CI_CACHE/images/pause.oci.tar" "$images/pause.tar"      # localhost/pause:ci
  cp "$CI_CACHE/images/coredns.oci.tar" "$images/coredns.tar"  # localhost/coredns:ci

  # kind's node files (images/base/files), as its Dockerfile copies them
  install -D -m 0755 "$kind_files/usr/local/bin/entrypoint" "$root/usr/local/bin/entrypoint"
  install -D -m 0755 "$kind_files/usr/local/bin/clean-install" "$root/usr/local/bin/clean-install"
  for f in "$kind_files"/kind/bin/*; do install -D -m 0755 "$f" "$root/kind/bin/$(basename "$f")"; done
  (cd "$kind_files/etc" && find . -type f) | while read -r f; do install -D -m 0644 "$kind_files/etc/$f" "$root/etc/$f"; done
  sed -i 's|^\( *sandbox_image = \).*|\1"localhost/pause:ci"|' "$root/etc/containerd/config.toml"
  grep -q 'sandbox_image = "localhost/pause:ci"' "$root/etc/containerd/config.toml"
  # Without CAP_SYS_RESOURCE (not in these machines' bounding set, so not in a privileged podman container either)
  # runc cannot lower a pod's oom_score_adj below the node's (kubelet asks -998 for static Pods), and every pod
  # fails with "can't get final child's PID from pipe"; kind sets this for rootless nodes, for the same reason.
  sed -i 's|^\( *restrict_oom_score_adj = \).*|\1true|' "$root/etc/containerd/config.toml"
  grep -q 'restrict_oom_score_adj = true' "$root/etc/containerd/config.toml"
  # containerd 2.x, the CI cluster's (build-containerd.sh), over Debian's 1.6: CDI, which kubelet 1.36 hands a DRA
  # claim's devices through, and the version kind's own node images run with this config.toml
  for b in containerd containerd-shim-runc-v2 ctr; do install -D -m 0755 "$CONTAINERD_BIN/$b" "$root/usr/bin/$b"; done
  # kind's base image: `ctr oci spec` with its product-files hook and without rlimits (the node's ctr)
  "$CONTAINERD_BIN/ctr" oci spec | python3 -c 'import json, sys
s = json.load(sys.stdin)
s.setdefault("hooks", {}).setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
s["process"].pop("rlimits", None)
json.dump(s, sys.stdout, indent=1)' > "$root/etc/containerd/cri-base.json"
  ln -s /usr/bin/containerd "$root/usr/local/bin/containerd"   # kind's containerd.service runs it from there
  mkdir -p "$root/opt/cni"; ln -s /usr/lib/cni "$root/opt/cni/bin"  # Debian's plugins, where containerd looks
  install -D -m 0755 "$here/kind/node/import-images.sh" "$root/kind/bin/import-images.sh"
  install -D -m 0644 "$here/kind/node/kind-import-images.service" "$root/etc/systemd/system/kind-import-images.service"
  mkdir -p "$root/etc/systemd/system/multi-user.target.wants" "$root/etc/kubernetes/manifests"
  for unit in containerd kubelet undo-mount-hacks kind-import-images; do
    ln -s "/etc/systemd/system/$unit.service" "$root/etc/systemd/system/multi-user.target.wants/$unit.service"
  done
  ln -s /dev/null "$root/etc/systemd/system/systemd-binfmt.service"
  # Kubernetes
  install -D -m 0755 "$KUBEADM_BIN" "$root/usr/bin/kubeadm"
  install -D -m 0755 "$K8S_BIN/kubelet" "$root/usr/bin/kubelet"
  install -D -m 0755 "$TOOLS_BIN/kubectl" "$root/usr/bin/kubectl"
  printf '%s' "$K8S_VERSION" > "$root/kind/version"
  mkdir -p "$root/kind/manifests"
  sed "s|KIND_TOOLS_IMAGE|$tools|" "$here/kind/node/default-cni.yaml" > "$root/kind/manifests/default-cni.yaml"
  install -D -m 0644 "$here/kind/node/default-storage.yaml" "$root/kind/manifests/default-storage.yaml"
  python3 "$here/tools/oci_image.py" layers --name "$name" --out "$out.tmp" --layer "$KIND_ROOTFS" --layer "$root" \
    --entrypoint '["/usr/local/bin/entrypoint", "/sbin/init"]' >&2
  mv "$out.tmp" "$out"
  log "kind node image assembled in $((SECONDS - t))s: $out ($(du -h "$out" | cut -f1))"
fi

if ! "$engine" image inspect "$name" >/dev/null 2>&1; then
  t=$SECONDS
  # podman names an OCI archive after its ref annotation (the tag alone), docker after the containerd name:
  # tag the loaded image by its ID either way
  loaded=$("$engine" load -i "$out" | tail -1)
  id=${loaded##* }; id=${id#sha256:}
  "$engine" tag "$id" "$name"
  log "kind node image loaded into $engine in $((SECONDS - t))s: $name"
fi
# Earlier builds (other versions or sources) are 400 MB archives and 700 MB engine images each: only this one stays.
find "$CI_CACHE/images" -maxdepth 1 -name 'kind-node-*.oci.tar' ! -path "$out" -delete
"$engine" images --format '{{.Repository}}:{{.Tag}}' | { grep "^${name%%:*}:" || true; } | { grep -vx "$name" || true; } \
  | while read -r old; do "$engine" rmi "$old" >/dev/null 2>&1 || log "could not remove $old from $engine (in use?)"; done
log "timing: kind node image $((SECONDS - t0))s"
echo "$name"
