{{- define "fake-gpu.fullname" -}}
{{- /* at most 56 characters, so that "<fullname>-layout" stays within 63 */ -}}
{{- printf "%s-fake-gpu" .Release.Name | trunc 56 | trimSuffix "-" -}}
{{- end -}}

{{- define "fake-gpu.selectorLabels" -}}
app.kubernetes.io/name: fake-gpu
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fake-gpu.labels" -}}
{{ include "fake-gpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: device-plugin
app.kubernetes.io/part-of: gpu-agent
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* fake-gpu.lintSuppressions: checkov annotations for the findings this chart accepts, each with its reason. */}}
{{- define "fake-gpu.lintSuppressions" -}}
{{- $reasons := dict
  "CKV_K8S_8" "without the device plugin (devicePlugin.enabled false) there is no socket whose loss a liveness probe could see; the state file is the readiness probe's"
  "CKV_K8S_11" "no CPU limit: a limit throttles the plugin; its request reserves what it needs"
  "CKV_K8S_15" "the pull policy is a value (image.pullPolicy); IfNotPresent suits locally imported images"
  "CKV_K8S_23" "root without capabilities or privilege: kubelet's device-plugin folder and socket, and the state folder (hostPath), are root's"
  "CKV_K8S_38" "the daemon watches its layout ConfigMap and labels its node through the API server"
  "CKV_K8S_40" "root without capabilities or privilege: kubelet's device-plugin folder and socket, and the state folder (hostPath), are root's"
  "CKV_K8S_43" "fake GPUs are a development tool; its image is built locally and has no digest" -}}
{{- $lines := list -}}
{{- range $i, $id := . -}}
{{- $lines = append $lines (printf "checkov.io/skip%d: %s" (add1 $i) (printf "%s=%s" $id (index $reasons $id) | quote)) -}}
{{- end -}}
{{- join "\n" $lines -}}
{{- end -}}

{{/* fake-gpu.nodesRoleName: cluster-scoped, so a hash of the namespace tells two namespaces' releases of one
     name apart; at most 47 characters, so that "<it>-unlabel" stays within 63 like every other name. */}}
{{- define "fake-gpu.nodesRoleName" -}}
{{- printf "%s-%s-nodes" (include "fake-gpu.fullname" . | trunc 33 | trimSuffix "-") (sha256sum .Release.Namespace | trunc 6) -}}
{{- end -}}

{{/* fake-gpu.unlabelHookAnnotations: the post-delete hook's objects, in the order Helm makes them. */}}
{{- define "fake-gpu.unlabelHookAnnotations" -}}
helm.sh/hook: post-delete
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end -}}
