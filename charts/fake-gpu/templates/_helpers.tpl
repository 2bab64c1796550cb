{{- define "fake-gpu.fullname" -}}
{{- /* at most 56 characters, so that "<fullname>-layout" stays within 63 */ -}}
{{- printf "%s-fake-gpu" .Release.Name | trunc 56 | trimSuffix "-" -}}
{{- end -}}

{{- define "fake-gpu.selectorLabels" -}}
app.kubernetes.io/name: fake-gpu
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* fake-gpu.chartLabels: the labels the chart sets on its objects (its selectors rely on them). */}}
{{- define "fake-gpu.chartLabels" -}}
{{ include "fake-gpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: device-plugin
app.kubernetes.io/part-of: gpu-agent
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* fake-gpu.commonLabels: commonLabels as YAML, "" for none; a label the chart sets itself fails the render. */}}
{{- define "fake-gpu.commonLabels" -}}
{{- $own := include "fake-gpu.chartLabels" . | fromYaml -}}
{{- range $key, $_ := .Values.commonLabels -}}
{{- if hasKey $own $key -}}
{{- fail (printf "commonLabels: %s is a label the chart sets itself (its selectors rely on it): remove it from commonLabels" $key) -}}
{{- end -}}
{{- end -}}
{{- with .Values.commonLabels }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* fake-gpu.labels: every object's labels, the chart's and commonLabels. */}}
{{- define "fake-gpu.labels" -}}
{{ include "fake-gpu.chartLabels" . }}
{{- with include "fake-gpu.commonLabels" . }}
{{ . }}
{{- end }}
{{- end -}}

{{/* fake-gpu.image: the image reference, with global.imageRegistry as its registry when set: the registry host the
     repository names (a first path component with a "." or ":", or localhost) is replaced, otherwise the registry is
     put in front (the gpu-agent chart's rule, gpu-agent.withRegistry). */}}
{{- define "fake-gpu.image" -}}
{{- $repository := .Values.image.repository -}}
{{- $registry := trimSuffix "/" ((.Values.global | default dict).imageRegistry | default "") -}}
{{- if $registry -}}
{{- $parts := splitList "/" $repository -}}
{{- $first := first $parts -}}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) -}}
{{- $repository = join "/" (rest $parts) -}}
{{- end -}}
{{- $repository = printf "%s/%s" $registry $repository -}}
{{- end -}}
{{- printf "%s:%s" $repository .Values.image.tag -}}
{{- end -}}

{{/* fake-gpu.imagePullSecrets: global.imagePullSecrets (each {name: ...} or a name) as a YAML list, "" for none. */}}
{{- define "fake-gpu.imagePullSecrets" -}}
{{- $all := list -}}
{{- $names := list -}}
{{- range (.Values.global | default dict).imagePullSecrets | default list -}}
{{- $secret := . -}}
{{- if kindIs "string" . }}{{ $secret = dict "name" . }}{{ end -}}
{{- if not (has $secret.name $names) -}}
{{- $names = append $names $secret.name -}}
{{- $all = append $all $secret -}}
{{- end -}}
{{- end -}}
{{- if $all }}{{ toYaml $all }}{{ end -}}
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
