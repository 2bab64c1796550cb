{{- define "fake-gpu.fullname" -}}
{{- printf "%s-fake-gpu" .Release.Name | trunc 63 | trimSuffix "-" -}}
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
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
