#!/usr/bin/env bash
# `make release`: cut this checkout's version (pyproject.toml, the charts' appVersion).
#   1. the tree must be clean (a release is a commit, not a working copy);
#   2. the CRDs may store only a version the previous release already served (scripts/crd-storage-rule.py);
#   3. both charts are packaged into dist/ with an index.yaml, so that
#      `helm install gpu-agent gpu-agent --repo <URL of dist/>` works from any file server;
#   4. the image is built and saved as dist/gpu-agent-VERSION.oci.tar, named localhost/gpu-agent:VERSION
#      (RELEASE_IMAGE=0 skips it; it needs root, as `make images` does);
#   5. releases.yaml gains "VERSION: the commit it was cut from"; commit that change.
# RELEASE_REGISTRY=HOST[:PORT] (`make release-oci REGISTRY=...`; unset, none of this happens): in step 3 the charts are
# also signed (`helm package --sign`, each .tgz beside its .prov), verified, pushed to oci://HOST/charts and read
# back from there (scripts/release-oci.sh: the key, the login, REGISTRY_CA and REGISTRY_CREDENTIALS), before step 5.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
if [[ -n $(git status --porcelain) ]]; then
  echo "release: the tree is not clean; commit or stash these first:" >&2
  git status --short >&2
  exit 1
fi
version=$(python3 ci/tools/releases.py current)
commit=$(git rev-parse HEAD)
for chart in charts/gpu-agent charts/fake-gpu; do
  app=$(sed -n 's/^appVersion: "\(.*\)"/\1/p' "$chart/Chart.yaml")
  [[ $app == "$version" ]] || { echo "release: $chart has appVersion $app, pyproject.toml $version: make them agree" >&2; exit 1; }
done
recorded=$(python3 - "$version" <<'PY'
import sys
sys.path.insert(0, "ci/tools")
import releases
print(next((r["commit"] for r in releases.releases() if r["version"] == sys.argv[1]), ""))
PY
)
if [[ -n $recorded && $recorded != "$commit" ]]; then
  echo "release: $version was already cut from $recorded; bump the version for a new release" >&2
  exit 1
fi
# The CRDs keep the one-release-behind rule (a storage version the previous release already served).
# PYTHON: an interpreter with PyYAML (`make release` runs `make setup` first, so .venv has one).
python=${PYTHON:-$( [[ -x $repo/.venv/bin/python ]] && echo "$repo/.venv/bin/python" || command -v python3 )}
"$python" scripts/crd-storage-rule.py || { echo "release: the CRDs break the storage-version rule (above)" >&2; exit 1; }
source ci/scripts/paths.sh  # CI_CACHE: where make cluster-up (or ci/scripts/install-tools.sh) put helm
helm=${HELM:-$( [[ -x $CI_CACHE/tools/helm ]] && echo "$CI_CACHE/tools/helm" || command -v helm )}
[[ -n $helm ]] || { echo "release: helm not found (make cluster-up installs it, or put it on PATH)" >&2; exit 1; }
rm -rf dist && mkdir -p dist
if [[ -n ${RELEASE_REGISTRY:-} ]]; then
  HELM=$helm bash scripts/release-oci.sh "$RELEASE_REGISTRY" dist
else
  "$helm" package charts/gpu-agent charts/fake-gpu --destination dist >/dev/null
fi
"$helm" repo index dist
if [[ ${RELEASE_IMAGE:-1} != 0 ]]; then
  IMAGE_TAG=$version IMAGE_OUT=$repo/dist/gpu-agent-$version.oci.tar bash ci/scripts/build-images.sh project
fi
if [[ -z $recorded ]]; then
  printf -- '- version: %s\n  commit: %s\n  date: %s\n' "$version" "$commit" "$(date -u +%Y-%m-%d)" >> releases.yaml
fi
echo "release $version from commit ${commit:0:12}:"
ls -1 dist | sed 's/^/  dist\//'
[[ -n $recorded ]] || echo "releases.yaml records it: commit that change (git commit -m 'Release $version' releases.yaml)"
