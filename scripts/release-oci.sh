#!/usr/bin/env bash
# release-oci.sh REGISTRY DIST: both charts packaged and signed into DIST, verified, pushed to oci://REGISTRY/charts and
# read back from there. scripts/release.sh runs it when RELEASE_REGISTRY is set (`make release-oci REGISTRY=...`).
#   1. the signing key: RELEASE_SIGN_KEY (a name in its user ID) in RELEASE_KEYRING (a secret keyring in the legacy
#      format helm reads: `gpg --export-secret-keys > secring.gpg`) and RELEASE_PUBRING (`gpg --export`); without
#      them, a throwaway RSA key made in a temporary GNUPGHOME and gone when this script ends;
#   2. `helm package --sign` of charts/gpu-agent and charts/fake-gpu (each NAME-VERSION.tgz beside its .prov), then
#      `helm verify` of each; the public keyring is DIST/gpu-agent-release.pubring.gpg, for `helm verify --keyring`;
#   3. with REGISTRY_CREDENTIALS (a file of username=... and password=... lines: ci/scripts/registry.sh's), a
#      `helm registry login` into a registry config of this run's own (yours is left alone; without it, your own
#      login is used); REGISTRY_CA: the CA bundle of the registry's TLS, for every helm call that reaches it;
#   4. `helm push` of each chart (its .prov goes with it);
#   5. read back through a cache of this run's own: `helm show chart oci://...` names the chart and version just
#      pushed, and `helm pull --verify` gets the same bytes with a signature that still verifies.
# Every helm call that reaches the registry runs under `timeout`. The password goes to helm on stdin only.
set -euo pipefail
registry=${1:?usage: release-oci.sh REGISTRY DIST}
dist=${2:?usage: release-oci.sh REGISTRY DIST}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
source ci/scripts/paths.sh  # CI_CACHE: where make cluster-up (or ci/scripts/install-tools.sh) put helm
helm=${HELM:-$( [[ -x $CI_CACHE/tools/helm ]] && echo "$CI_CACHE/tools/helm" || command -v helm )}
[[ -n $helm ]] || { echo "release-oci: helm not found (make cluster-up installs it, or put it on PATH)" >&2; exit 1; }
registry=${registry#oci://}
call_timeout=${RELEASE_OCI_TIMEOUT:-120}
ca=()
if [[ -n ${REGISTRY_CA:-} ]]; then ca=(--ca-file "$REGISTRY_CA"); fi
mkdir -p "$dist"
work=$(mktemp -d)
cleanup() {
  [[ ! -d $work/gnupg ]] || GNUPGHOME=$work/gnupg timeout 10 gpgconf --kill gpg-agent 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# 1. the key
pubring=$dist/gpu-agent-release.pubring.gpg
if [[ -n ${RELEASE_SIGN_KEY:-} ]]; then
  [[ -f ${RELEASE_KEYRING:-} && -f ${RELEASE_PUBRING:-} ]] \
    || { echo "release-oci: RELEASE_SIGN_KEY needs RELEASE_KEYRING (secret keyring) and RELEASE_PUBRING (public)" >&2; exit 1; }
  key=$RELEASE_SIGN_KEY secring=$RELEASE_KEYRING
  cp "$RELEASE_PUBRING" "$pubring"
else
  key="gpu-agent release signing (throwaway $(date -u +%Y%m%dT%H%M%SZ))"
  mkdir -m 700 "$work/gnupg"
  export GNUPGHOME=$work/gnupg
  timeout 120 gpg --batch --quiet --pinentry-mode loopback --passphrase '' \
    --quick-generate-key "$key <release@gpu-agent.invalid>" rsa3072 sign never
  secring=$work/secring.gpg  # outside GNUPGHOME: gpg would "migrate" a secring.gpg found there
  (umask 077; timeout 30 gpg --batch --export-secret-keys > "$secring")
  timeout 30 gpg --batch --export > "$pubring"
  unset GNUPGHOME
  echo "release-oci: signed with a throwaway key (its secret part is deleted when this script ends)" >&2
fi

# 2. package, sign, verify
charts=()
for chart in charts/gpu-agent charts/fake-gpu; do
  out=$("$helm" package "$chart" --destination "$dist" --sign --key "$key" --keyring "$secring")
  tgz=${out##*: }
  [[ -f $tgz && -f $tgz.prov ]] || { echo "release-oci: helm package --sign left no $tgz and .prov: $out" >&2; exit 1; }
  "$helm" verify "$tgz" --keyring "$pubring" > /dev/null \
    || { echo "release-oci: helm verify refused $tgz, just signed" >&2; exit 1; }
  charts+=("$tgz")
done

# 3. the login, into a registry config and a content cache of this run's own
export HELM_CONTENT_CACHE=$work/content
if [[ -n ${REGISTRY_CREDENTIALS:-} ]]; then
  export HELM_REGISTRY_CONFIG=$work/registry-config.json
  username=$(sed -n 's/^username=//p' "$REGISTRY_CREDENTIALS")
  [[ -n $username ]] || { echo "release-oci: $REGISTRY_CREDENTIALS has no username= line" >&2; exit 1; }
  sed -n 's/^password=//p' "$REGISTRY_CREDENTIALS" \
    | timeout "$call_timeout" "$helm" registry login "$registry" --username "$username" --password-stdin "${ca[@]}" \
    > /dev/null
fi

# 4. push; 5. read back
for tgz in "${charts[@]}"; do
  base=$(basename "$tgz" .tgz)
  name=${base%-*} version=${base##*-}
  ref=oci://$registry/charts/$name
  pushed=$(timeout "$call_timeout" "$helm" push "$tgz" "oci://$registry/charts" "${ca[@]}" 2>&1) \
    || { echo "release-oci: helm push $tgz failed: $pushed" >&2; exit 1; }
  digest=$(sed -n 's/^Digest: //p' <<< "$pushed")
  shown=$(timeout "$call_timeout" "$helm" show chart "$ref" --version "$version" "${ca[@]}" 2>/dev/null)
  grep -qx "name: $name" <<< "$shown" && grep -qx "version: $version" <<< "$shown" \
    || { echo "release-oci: helm show chart $ref --version $version does not name $name $version" >&2; exit 1; }
  mkdir -p "$work/pulled"
  timeout "$call_timeout" "$helm" pull "$ref" --version "$version" --verify --keyring "$pubring" "${ca[@]}" \
    --destination "$work/pulled" > /dev/null 2>&1 \
    || { echo "release-oci: helm pull $ref --version $version --verify failed" >&2; exit 1; }
  cmp -s "$tgz" "$work/pulled/$base.tgz" || { echo "release-oci: $ref:$version pulled back differs from $tgz" >&2; exit 1; }
  echo "release-oci: pushed $ref:$version ($digest), shown, pulled back and verified" >&2
done
