#!/usr/bin/env bash
# A throwaway CA and one certificate per identity, with openssl. Idempotent.
#   pki.sh                 the CA and the control plane's, the first node's and kube-proxy's identities
#   pki.sh node NAME IP    a worker node's kubelet identity (system:node:NAME) and serving certificate
#   pki.sh registry SAN    the CI registry's serving certificate (ci/scripts/registry.sh), issued anew for SAN
#                          ("IP:127.0.0.1,DNS:localhost"): a registry started on another address gets no stale one
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/scripts/common.sh"
mkdir -p "$PKI"
cd "$PKI"
[[ -f ca.key ]] || {
  openssl genrsa -out ca.key 2048 2>/dev/null
  openssl req -x509 -new -key ca.key -subj "/CN=gpu-agent-ci-ca" -days 3650 -out ca.crt 2>/dev/null
}
[[ -f sa.key ]] || { openssl genrsa -out sa.key 2048 2>/dev/null; openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null; }

# cert NAME CN O USAGE [SAN]
cert() {
  local name=$1 cn=$2 org=$3 usage=$4 san=${5:-}
  [[ -f $name.crt ]] && return 0
  openssl genrsa -out "$name.key" 2048 2>/dev/null
  local subj="/CN=$cn"; [[ -n $org ]] && subj="/O=$org$subj"
  openssl req -new -key "$name.key" -subj "$subj" -out "$name.csr" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [[ -n $san ]] && echo "subjectAltName=$san"
  } > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}
kubeconfig() {
  local name=$1 user=$2
  cat > "$CLUSTER_DIR/$name.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: gpu-agent-ci
  cluster:
    server: https://$NODE_IP:$API_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: $user
  user:
    client-certificate: $PKI/$user.crt
    client-key: $PKI/$user.key
contexts:
- name: gpu-agent-ci
  context: {cluster: gpu-agent-ci, user: $user}
current-context: gpu-agent-ci
KC
  chmod 600 "$CLUSTER_DIR/$name.kubeconfig"
}
if [[ ${1:-} == node ]]; then
  name=$2 ip=$3
  cert "kubelet-$name" "system:node:$name" system:nodes clientAuth
  cert "kubelet-serving-$name" "$name" "" serverAuth "DNS:$name,IP:$ip"
  chmod 600 ./*.key
  kubeconfig "kubelet-$name" "kubelet-$name"
  exit 0
fi
if [[ ${1:-} == registry ]]; then
  rm -f registry.crt registry.key
  cert registry gpu-agent-ci-registry "" serverAuth "$2"
  chmod 600 registry.key
  exit 0
fi
cert apiserver kube-apiserver "" serverAuth \
  "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$NODE_IP,IP:$API_SERVICE_IP"
cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters clientAuth
cert admin kubernetes-admin system:masters clientAuth
cert controller-manager system:kube-controller-manager "" clientAuth
cert scheduler system:kube-scheduler "" clientAuth
cert kube-proxy system:kube-proxy "" clientAuth
cert kubelet "system:node:$NODE_NAME" system:nodes clientAuth
cert kubelet-serving "$NODE_NAME" "" serverAuth "DNS:$NODE_NAME,IP:$NODE_IP"
chmod 600 ./*.key

kubeconfig admin admin
kubeconfig controller-manager controller-manager
kubeconfig scheduler scheduler
kubeconfig kube-proxy kube-proxy
kubeconfig kubelet kubelet
