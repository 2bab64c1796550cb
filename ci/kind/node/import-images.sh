#!/bin/bash
# Imports the node image's container images (/kind/images/*.tar: the control plane's, kube-proxy's, CoreDNS,
# pause and the CNI daemon's) into containerd before kubelet starts. kind's own node images carry them
# already unpacked in containerd's store, made by running containerd at image build time; this node image
# is assembled without a container engine (ci/scripts/build-kind-node.sh), so the import happens at boot,
# once per node (/var is the node's own volume).
set -euo pipefail
stamp=/var/lib/kind-images-imported
[[ -f $stamp ]] && exit 0
deadline=$((SECONDS + 60))
until ctr version >/dev/null 2>&1; do
  ((SECONDS < deadline)) || { echo "containerd did not answer within 60 s" >&2; exit 1; }
  sleep 0.2
done
# the snapshotter the CRI plugin uses (the entrypoint may have switched it from overlayfs)
# (containerd 2.x dumps TOML strings in single quotes, 1.x in double)
snapshotter=$(containerd config dump | sed -n "s/^ *snapshotter = [\"']\([^\"']\+\)[\"']\$/\1/p" | head -1)
for archive in /kind/images/*.tar; do
  ctr --namespace=k8s.io images import --all-platforms --digests --snapshotter="${snapshotter:-overlayfs}" "$archive"
done
touch "$stamp"
