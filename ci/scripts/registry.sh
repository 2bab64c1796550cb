#!/usr/bin/env bash
# The CI's OCI distribution registry: TLS from the cluster's CA (ci/scripts/pki.sh), htpasswd basic auth with a
# generated user and password, storage in a temporary folder.
#   registry.sh install   the binary, cached in CI_CACHE by version (REGISTRY_BIN)
#   registry.sh start     install, then serve on REGISTRY_ADDR (default 127.0.0.1:5443) until `stop`; idempotent
#   registry.sh stop      stop it and remove its storage, credentials and state; idempotent
#   registry.sh env       `eval "$(ci/scripts/registry.sh env)"`: REGISTRY_HOST (the running registry's address,
#                         whatever the caller's REGISTRY_ADDR), REGISTRY_CA, REGISTRY_CERT_DIR (a folder holding the CA
#                         alone, for `skopeo --dest-cert-dir`, `podman --cert-dir`), REGISTRY_CREDENTIALS (a 0600 file:
#                         username=..., password=...) and REGISTRY_RELEASE_DIR (where the CI cluster's stage puts the
#                         signed charts it pushes: scripts/release-oci.sh's DIST); paths only, no secret
#   registry.sh push-image ARCHIVE
#                         every image of an OCI archive (ci/tools/oci_image.py's, named by io.containerd.image.name) to
#                         the running registry, its registry host replaced as the chart's global.imageRegistry does
#                         (localhost/gpu-agent:dev -> HOST/gpu-agent:dev), with skopeo (Debian's: install-deps.sh),
#                         digests kept: each manifest's digest read back from the registry must be the archive's.
#                         Not the archive a cluster's nodes import: a copy with another image ID (ci/scripts/e2e.sh
#                         registry_up pushes ci/tools/oci_relabel.py's), or a pull through a pull Secret would tie the
#                         preloaded image to that Secret on each node (KubeletEnsureSecretPulledImages)
#
# The CI cluster's nodes: each node's containerd reads its registry hosts from REGISTRY_HOSTS_DIR (config_path,
# node-config.sh); `start` writes REGISTRY_HOSTS_DIR/HOST/hosts.toml there (the registry's CA for HOST), `stop` removes
# it. containerd reads that folder at each pull: no restart.
#
# Which registry: Debian's docker-registry package (distribution 2.8.2, bookworm), taken out of its .deb with
# `apt-get download` + `dpkg-deb -x` as install-tools.sh takes promtool (no install: its user and service stay off
# the host). The cheaper of the two on a fresh machine, measured on this 2-core CI machine (niced, beside a CI run):
#   Debian's package    cold 1-3 s (one 5 MB download; plus an `apt-get update` where the lists are missing),
#                       cached 0 s; start to a verified login 2 s;
#   distribution v3.0.0 (cmd/registry) from the Go module proxy through go_build_cached: cold 207 s (about 100
#                       modules, the S3, Azure, GCS and OpenTelemetry SDKs among them, downloaded and compiled),
#                       10 s with warm Go caches, 0 s cached.
# 2.8 stores OCI manifests and artifacts, which is all `helm push` (charts and their .prov) and `podman push` need.
#
# Every wait polls to a deadline; every call that reaches a process or the network has a timeout. The password
# is read only from the credentials file (stdin or a 0600 file, never an argument) and printed nowhere.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
REGISTRY_LOG=${REGISTRY_LOG:-$LOGS/registry.log}
START_TIMEOUT=${REGISTRY_START_TIMEOUT:-30}

install_registry() {
  if [[ -x $REGISTRY_BIN ]]; then log "docker-registry $REGISTRY_VERSION cached"; return 0; fi
  local t=$SECONDS candidate deb
  candidate=$(apt-cache policy docker-registry 2>/dev/null | awk '/Candidate:/{print $2}')
  if [[ -z $candidate || $candidate == "(none)" ]]; then
    timeout 300 apt-get update -qq
    candidate=$(apt-cache policy docker-registry | awk '/Candidate:/{print $2}')
  fi
  if [[ $candidate != "$REGISTRY_VERSION"+* ]]; then
    log "Debian offers docker-registry ${candidate:-(none)}, not $REGISTRY_VERSION: set REGISTRY_VERSION in ci/scripts/common.sh"
    return 1
  fi
  deb=$(mktemp -d)
  # As root: apt's sandbox user (_apt) may not write into a private temporary folder.
  (cd "$deb" && timeout 300 apt-get download -qq -o APT::Sandbox::User=root "docker-registry=$candidate") \
    || { rm -rf "$deb"; return 1; }
  dpkg-deb -x "$deb"/docker-registry_*.deb "$deb/root"
  mkdir -p "$(dirname "$REGISTRY_BIN")"
  install -m 0755 "$deb/root/usr/bin/docker-registry" "$REGISTRY_BIN.tmp"
  mv "$REGISTRY_BIN.tmp" "$REGISTRY_BIN"
  rm -rf "$deb"
  log "docker-registry $REGISTRY_VERSION built in $((SECONDS - t))s: $REGISTRY_BIN (Debian's $candidate)"
}

running_pid() {  # the registry's pid if the pid file names a live docker-registry (not a recycled pid)
  local pid
  [[ -f $REGISTRY_DIR/pid ]] || return 1
  pid=$(< "$REGISTRY_DIR/pid")
  [[ $pid =~ ^[0-9]+$ ]] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q docker-registry || return 1
  echo "$pid"
}

# http_code PATH [AUTH]: the registry's answer to GET https://REGISTRY_ADDR/PATH (000: none), verified against the CA;
# AUTH=auth sends the credentials as a curl config on stdin.
http_code() {
  local auth=()
  if [[ ${2:-} == auth ]]; then auth=(-K -); fi
  {
    if [[ ${2:-} == auth ]]; then
      curl_login
    fi
  } | curl -sS -o /dev/null -w '%{http_code}' --max-time 3 --cacert "$PKI/ca.crt" "${auth[@]}" \
    "https://$REGISTRY_ADDR/$1" 2>/dev/null || true
}

curl_login() {  # the login as a curl config line (`user = "name:password"`), for `curl -K -` on stdin: never an argument
  # shellcheck disable=SC1091
  (source "$REGISTRY_DIR/credentials" && printf 'user = "%s:%s"\n' "$username" "$password")
}

htpasswd_line() {  # username and password on stdin (one a line): "username:bcrypt-hash", what the registry reads
  python3 -W ignore::DeprecationWarning -c '
import crypt, sys
user, password = sys.stdin.read().split("\n")[:2]
print(f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))}")'
}

start() {
  local pid
  install_registry
  if pid=$(running_pid); then log "registry already running (pid $pid) at https://$REGISTRY_ADDR"; return 0; fi
  rm -rf "$REGISTRY_DIR"
  mkdir -p "$REGISTRY_DIR/certs" "$(dirname "$REGISTRY_LOG")"
  chmod 700 "$REGISTRY_DIR"
  local host=${REGISTRY_ADDR%:*} san storage username password t=$SECONDS
  host=${host#[}; host=${host%]}
  if [[ $host =~ ^[0-9.]+$|: ]]; then san="IP:$host"; else san="DNS:$host"; fi
  [[ $host == 127.0.0.1 ]] || san+=",IP:127.0.0.1"
  san+=",DNS:localhost"
  timeout 60 bash "$here/scripts/pki.sh" registry "$san"
  install -m 0644 "$PKI/ca.crt" "$REGISTRY_DIR/certs/ca.crt"
  echo "$REGISTRY_ADDR" > "$REGISTRY_DIR/addr"

  username=ci-$(openssl rand -hex 4)
  password=$(openssl rand -hex 24)
  (umask 077; printf 'username=%s\npassword=%s\n' "$username" "$password" > "$REGISTRY_DIR/credentials")
  (umask 077; printf '%s\n%s\n' "$username" "$password" | htpasswd_line > "$REGISTRY_DIR/htpasswd")
  unset password
  storage=$(mktemp -d "${TMPDIR:-/tmp}/gpu-agent-registry.XXXXXX")
  echo "$storage" > "$REGISTRY_DIR/storage"
  (umask 077; cat > "$REGISTRY_DIR/config.yml" <<EOF
version: 0.1
log:
  level: info
  accesslog:
    disabled: false
  fields:
    service: gpu-agent-ci-registry
storage:
  filesystem:
    rootdirectory: $storage
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: $REGISTRY_ADDR
  secret: $(openssl rand -hex 16)
  tls:
    certificate: $PKI/registry.crt
    key: $PKI/registry.key
  headers:
    X-Content-Type-Options: [nosniff]
auth:
  htpasswd:
    realm: gpu-agent-ci-registry
    path: $REGISTRY_DIR/htpasswd
health:
  storagedriver:
    enabled: false
EOF
  )
  # Its own session: a Ctrl-C in the caller's terminal does not reach it; `stop` ends it by its pid. An empty
  # environment: the registry reads every REGISTRY_<FIELD> variable as a setting over its config file, and this
  # script's own (REGISTRY_ADDR, REGISTRY_VERSION, ...) and env's (REGISTRY_HOST, ...) are named so.
  env -i PATH=/usr/bin:/bin setsid "$REGISTRY_BIN" serve "$REGISTRY_DIR/config.yml" >> "$REGISTRY_LOG" 2>&1 < /dev/null &
  pid=$!
  echo "$pid" > "$REGISTRY_DIR/pid"

  # Up when /v2/ refuses the anonymous caller (401) and lets the generated user in (200), over verified TLS.
  local deadline=$((SECONDS + START_TIMEOUT)) anonymous=000 authed=000
  while ((SECONDS < deadline)); do
    if ! kill -0 "$pid" 2>/dev/null; then  # not running_pid: until the fork has exec'd, its cmdline is this script's
      log "the registry exited at start; the end of $REGISTRY_LOG:"; tail -n 20 "$REGISTRY_LOG" >&2; stop; return 1
    fi
    anonymous=$(http_code v2/)
    if [[ $anonymous == 401 ]]; then authed=$(http_code v2/ auth); [[ $authed == 200 ]] && break; fi
    sleep 0.2
  done
  if [[ $anonymous != 401 || $authed != 200 ]]; then
    log "the registry did not answer within ${START_TIMEOUT}s (anonymous $anonymous, with the login $authed; want 401, 200)"
    tail -n 20 "$REGISTRY_LOG" >&2; stop; return 1
  fi
  trust_for_containerd
  log "registry up in $((SECONDS - t))s at https://$REGISTRY_ADDR (pid $pid, storage $storage)"
}

# Every node's containerd (config_path = REGISTRY_HOSTS_DIR) verifies the registry against the CI's CA; pull and
# resolve only.
trust_for_containerd() {
  local dir=$REGISTRY_HOSTS_DIR/$REGISTRY_ADDR
  mkdir -p "$dir"
  cat > "$dir/hosts.toml.tmp" <<TOML
# ci/scripts/registry.sh start: the CI registry, verified against the CI's CA (registry.sh stop removes this folder)
server = "https://$REGISTRY_ADDR"

[host."https://$REGISTRY_ADDR"]
  capabilities = ["pull", "resolve"]
  ca = "$REGISTRY_DIR/certs/ca.crt"
TOML
  mv "$dir/hosts.toml.tmp" "$dir/hosts.toml"
}

stop() {
  local pid deadline
  if pid=$(running_pid); then
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "the registry outlived SIGTERM by 10s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
    log "registry stopped (pid $pid)"
  fi
  if [[ -f $REGISTRY_DIR/addr ]]; then
    local addr; addr=$(< "$REGISTRY_DIR/addr")
    [[ -z $addr ]] || rm -rf "${REGISTRY_HOSTS_DIR:?}/$addr"
    rmdir "$REGISTRY_HOSTS_DIR" 2>/dev/null || true
  fi
  if [[ -f $REGISTRY_DIR/storage ]]; then
    local storage; storage=$(< "$REGISTRY_DIR/storage")
    [[ $storage == */gpu-agent-registry.* ]] && rm -rf "$storage"
  fi
  rm -rf "$REGISTRY_DIR"
  rm -f "$PKI/registry.crt" "$PKI/registry.key"
}

env_lines() {
  running_pid > /dev/null || { echo "registry.sh: no registry running under $REGISTRY_DIR (registry.sh start)" >&2; return 1; }
  printf 'export REGISTRY_HOST=%q\n' "$(< "$REGISTRY_DIR/addr")"
  printf 'export REGISTRY_CA=%q\n' "$REGISTRY_DIR/certs/ca.crt"
  printf 'export REGISTRY_CERT_DIR=%q\n' "$REGISTRY_DIR/certs"
  printf 'export REGISTRY_CREDENTIALS=%q\n' "$REGISTRY_DIR/credentials"
  printf 'export REGISTRY_RELEASE_DIR=%q\n' "$REGISTRY_DIR/release"
}

# push-image ARCHIVE (see the top). The archive is an OCI layout: unpacked once into TMPDIR, each image copied from it
# (skopeo's oci-archive: would unpack it again for each); a second name of a manifest already pushed to the same
# repository is that manifest PUT under its tag alone (its blobs are there). The login reaches skopeo as a 0600 auth file in REGISTRY_DIR
# (0700), never as an argument; both are removed when the push ends. --insecure-policy: the source is this run's own archive, which carries no
# signature for a policy to check (the host's /etc/containers/policy.json, if any, is not this script's to rely on).
push_image() (  # a subshell: its EXIT trap removes the auth file and the unpacked layout however it ends
  local archive=${1:?usage: registry.sh push-image ARCHIVE} addr authfile layout names name digest media repo first path tag
  local pushed done=" "
  command -v skopeo > /dev/null || { log "push-image: skopeo is missing (ci/scripts/install-deps.sh installs Debian's)"; return 1; }
  running_pid > /dev/null || { log "push-image: no registry running under $REGISTRY_DIR (registry.sh start)"; return 1; }
  [[ -f $archive ]] || { log "push-image: no archive $archive"; return 1; }
  addr=$(< "$REGISTRY_DIR/addr")
  authfile=$(umask 077; mktemp "$REGISTRY_DIR/authfile.XXXXXX")
  layout=$(mktemp -d "${TMPDIR:-/tmp}/gpu-agent-push.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$authfile' '$layout'" EXIT
  tar -xf "$archive" -C "$layout"
  # shellcheck disable=SC1091
  (source "$REGISTRY_DIR/credentials" && printf '{"auths": {"%s": {"auth": "%s"}}}\n' "$addr" \
    "$(printf '%s:%s' "$username" "$password" | base64 -w0)") > "$authfile"
  # NAME DIGEST MEDIATYPE for each image of the archive's index
  names=$(python3 -c '
import json, sys
for m in json.load(sys.stdin)["manifests"]:
    print(m.get("annotations", {}).get("io.containerd.image.name", ""), m["digest"], m["mediaType"])' < "$layout/index.json")
  while read -r name digest media; do
    [[ -n $name ]] || continue
    tag=${name##*:} repo=${name%:*} path=${name%:*}
    first=${repo%%/*}
    # the registry host the name carries (a first component with a "." or ":", or localhost), replaced as the chart does
    if [[ $repo == */* && ( $first == *.* || $first == *:* || $first == localhost ) ]]; then path=${repo#*/}; fi
    if [[ $done == *" $path@$digest "* ]]; then
      # shellcheck disable=SC1091
      curl_login \
        | curl -sSf -o /dev/null -K - --max-time 60 --cacert "$REGISTRY_DIR/certs/ca.crt" -X PUT -H "Content-Type: $media" \
          --data-binary "@$layout/blobs/${digest/://}" "https://$addr/v2/$path/manifests/$tag" \
        || { log "push-image: the manifest PUT of $addr/$path:$tag failed"; exit 1; }
    elif ! timeout 300 skopeo copy --quiet --insecure-policy --preserve-digests --dest-cert-dir "$REGISTRY_DIR/certs" \
        --dest-authfile "$authfile" "oci:$layout:$tag" "docker://$addr/$path:$tag" < /dev/null; then
      log "push-image: skopeo copy of $name to $addr/$path:$tag failed"; exit 1
    fi
    pushed=$(manifest_digest "$path" "$tag")
    if [[ $pushed != "$digest" ]]; then
      log "push-image: $addr/$path:$tag reads back as ${pushed:-nothing}, not the archive's $digest"
      exit 1
    fi
    done+="$path@$digest "
    log "pushed $name as $addr/$path:$tag ($digest, the archive's own digest)"
  done <<< "$names"
)

manifest_digest() {  # manifest_digest PATH TAG: the registry's Docker-Content-Digest of PATH:TAG, "" when it has none
  # shellcheck disable=SC1091
  curl_login \
    | curl -sS -I -K - --max-time 10 --cacert "$REGISTRY_DIR/certs/ca.crt" \
      -H 'Accept: application/vnd.oci.image.manifest.v1+json' -H 'Accept: application/vnd.oci.image.index.v1+json' \
      -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
      "https://$(< "$REGISTRY_DIR/addr")/v2/$1/manifests/$2" 2>/dev/null \
    | tr -d '\r' | awk -F': ' 'tolower($1) == "docker-content-digest" {print $2}'
}

case ${1:-} in
  install) install_registry ;;
  start) start ;;
  stop) stop ;;
  env) env_lines ;;
  push-image) push_image "${@:2}" ;;
  *) echo "usage: registry.sh install|start|stop|env|push-image ARCHIVE" >&2; exit 2 ;;
esac
