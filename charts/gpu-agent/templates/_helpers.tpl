{{/* Names, labels and shared snippets. Every define is namespaced "gpu-agent.". */}}

{{- define "gpu-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* At most 40 characters, so that the longest object name (fullname + "-control-plane-tokens")
stays within 63, whatever the release name; a longer name keeps its start and gains a hash of the
whole, so two long release names never share objects. */}}
{{- define "gpu-agent.fullname" -}}
{{- $name := .Values.fullnameOverride -}}
{{- if not $name -}}
{{- $base := include "gpu-agent.name" . -}}
{{- $name = ternary .Release.Name (printf "%s-%s" .Release.Name $base) (contains $base .Release.Name) -}}
{{- end -}}
{{- if gt (len $name) 40 -}}
{{- printf "%s-%s" ($name | trunc 33 | trimSuffix "-") ($name | sha256sum | trunc 6) -}}
{{- else -}}
{{- $name | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-agent.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gpu-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpu-agent.labels" -}}
{{ include "gpu-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpu-agent
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* gpu-agent.componentLabels: labels of one component; call with (dict "ctx" $ "component" "cluster-agent") */}}
{{- define "gpu-agent.componentLabels" -}}
{{ include "gpu-agent.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpu-agent.componentSelector" -}}
{{ include "gpu-agent.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpu-agent.clusterId" -}}
{{- default .Release.Name .Values.clusterAgent.clusterId -}}
{{- end -}}

{{- define "gpu-agent.tokenSecret" -}}
{{- if .Values.controlPlane.enabled -}}
{{- printf "%s-control-plane-tokens" (include "gpu-agent.fullname" .) -}}
{{- else -}}
{{- required "controlPlane.existingSecret is required when controlPlane.enabled=false: name a Secret with key registrationToken, or set controlPlane.enabled=true" .Values.controlPlane.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "gpu-agent.controlPlaneUrl" -}}
{{- if .Values.controlPlane.enabled -}}
{{- printf "http://%s-control-plane.%s.svc:8700" (include "gpu-agent.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "controlPlane.url is required when controlPlane.enabled=false: set it to your control plane's URL, or set controlPlane.enabled=true" .Values.controlPlane.url -}}
{{- end -}}
{{- end -}}

{{- define "gpu-agent.featureGates" -}}
{{- $gates := list -}}
{{- range $name, $on := .Values.featureGates -}}
{{- $gates = append $gates (printf "%s=%t" $name $on) -}}
{{- end -}}
{{- join "," $gates -}}
{{- end -}}

{{/* Hook Jobs: bounded in time and retries, deleted before re-creation and on success. */}}
{{- define "gpu-agent.hookJobSpec" -}}
backoffLimit: {{ .ctx.Values.hooks.backoffLimit }}
activeDeadlineSeconds: {{ .ctx.Values.hooks.activeDeadlineSeconds }}
template:
  metadata:
    labels: {{- include "gpu-agent.componentLabels" (dict "ctx" .ctx "component" "hooks") | nindent 6 }}
  spec:
    serviceAccountName: {{ include "gpu-agent.fullname" .ctx }}-hooks
    {{- with .ctx.Values.imagePullSecrets }}
    imagePullSecrets: {{- toYaml . | nindent 6 }}
    {{- end }}
    restartPolicy: Never
    {{- with .ctx.Values.hooks.priorityClassName }}
    priorityClassName: {{ . }}
    {{- end }}
    {{- with .ctx.Values.hooks.nodeSelector }}
    nodeSelector: {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .ctx.Values.hooks.tolerations }}
    tolerations: {{- toYaml . | nindent 6 }}
    {{- end }}
    securityContext: {{- toYaml .ctx.Values.hooks.podSecurityContext | nindent 6 }}
    containers:
    - name: hook
      image: {{ include "gpu-agent.image" .ctx }}
      imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
      command: [gpu-agent-hook]
      args: {{- toYaml .args | nindent 8 }}
      securityContext: {{- toYaml .ctx.Values.hooks.securityContext | nindent 8 }}
      resources: {{- toYaml .ctx.Values.hooks.resources | nindent 8 }}
      {{- with .volumeMounts }}
      volumeMounts: {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- with .volumes }}
    volumes: {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end -}}
