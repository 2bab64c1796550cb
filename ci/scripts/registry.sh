#!/usr/bin/env bash
# The CI's OCI distribution registry: TLS from the cluster's CA (ci/scripts/pki.sh), htpasswd basic auth with a
# generated user and password, storage in a temporary folder.
#   registry.sh install   the binary, cached in CI_CACHE by version (REGISTRY_BIN)
#   registry.sh start     install, then serve on REGISTRY_ADDR (default 127.0.0.1:5443) until `stop`; idempotent
#   registry.sh stop      stop it and remove its storage, credentials and state; idempotent
#   registry.sh env       `eval "$(ci/scripts/registry.sh env)"`: REGISTRY_HOST, REGISTRY_CA, REGISTRY_CERT_DIR (a folder
#                         holding the CA alone, for `podman --cert-dir` and containerd's hosts.toml) and
#                         REGISTRY_CREDENTIALS (a 0600 file: username=..., password=...); paths only, no secret
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
      # shellcheck disable=SC1091
      (source "$REGISTRY_DIR/credentials" && printf 'user = "%s:%s"\n' "$username" "$password")
    fi
  } | curl -sS -o /dev/null -w '%{http_code}' --max-time 3 --cacert "$PKI/ca.crt" "${auth[@]}" \
    "https://$REGISTRY_ADDR/$1" 2>/dev/null || true
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
  log "registry up in $((SECONDS - t))s at https://$REGISTRY_ADDR (pid $pid, storage $storage)"
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
  if [[ -f $REGISTRY_DIR/storage ]]; then
    local storage; storage=$(< "$REGISTRY_DIR/storage")
    [[ $storage == */gpu-agent-registry.* ]] && rm -rf "$storage"
  fi
  rm -rf "$REGISTRY_DIR"
  rm -f "$PKI/registry.crt" "$PKI/registry.key"
}

env_lines() {
  running_pid > /dev/null || { echo "registry.sh: no registry running under $REGISTRY_DIR (registry.sh start)" >&2; return 1; }
  printf 'export REGISTRY_HOST=%q\n' "$REGISTRY_ADDR"
  printf 'export REGISTRY_CA=%q\n' "$REGISTRY_DIR/certs/ca.crt"
  printf 'export REGISTRY_CERT_DIR=%q\n' "$REGISTRY_DIR/certs"
  printf 'export REGISTRY_CREDENTIALS=%q\n' "$REGISTRY_DIR/credentials"
}

case ${1:-} in
  install) install_registry ;;
  start) start ;;
  stop) stop ;;
  env) env_lines ;;
  *) echo "usage: registry.sh install|start|stop|env" >&2; exit 2 ;;
esac
