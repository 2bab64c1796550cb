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

{{/* gpu-agent.image: a component's image reference; call with (dict "ctx" $ "image" .Values.clusterAgent.image).
Each empty field of the component's image inherits the top-level image's; the top-level digest only
applies to the top-level repository; global.imageRegistry, when set, is the registry (gpu-agent.withRegistry). */}}
{{- define "gpu-agent.image" -}}
{{- $top := .ctx.Values.image -}}
{{- $own := .image | default dict -}}
{{- $repository := default $top.repository $own.repository -}}
{{- $tag := default (default .ctx.Chart.AppVersion $top.tag) $own.tag -}}
{{- $digest := $own.digest | default (ternary "" ($top.digest | default "") (not (empty $own.repository))) -}}
{{- $repository = include "gpu-agent.withRegistry" (dict "ctx" .ctx "repository" $repository) -}}
{{- if $digest -}}
{{- printf "%s:%s@%s" $repository $tag $digest -}}
{{- else -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}
{{- end -}}

{{/* gpu-agent.withRegistry: a repository with global.imageRegistry as its registry; call with
(dict "ctx" $ "repository" REPO). Unset: REPO as given. Set: the registry host REPO names, if any, is replaced
(the first path component when it has a "." or a ":" or is "localhost", the rule Docker and containerd use to tell
a registry from a path), otherwise the registry is put in front: localhost/gpu-agent and gpu-agent both become
<registry>/gpu-agent, ghcr.io/org/gpu-agent becomes <registry>/org/gpu-agent (a mirror keeps the image's path). */}}
{{- define "gpu-agent.withRegistry" -}}
{{- $registry := trimSuffix "/" ((.ctx.Values.global | default dict).imageRegistry | default "") -}}
{{- $repository := .repository -}}
{{- if $registry -}}
{{- $parts := splitList "/" $repository -}}
{{- $first := first $parts -}}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) -}}
{{- $repository = join "/" (rest $parts) -}}
{{- end -}}
{{- $repository = printf "%s/%s" $registry $repository -}}
{{- end -}}
{{- $repository -}}
{{- end -}}

{{/* gpu-agent.imagePullSecrets: the pull secrets of every pod spec as a YAML list, "" for none: imagePullSecrets,
then global.imagePullSecrets (an umbrella chart's; each a {name: ...} or a name), each name once. */}}
{{- define "gpu-agent.imagePullSecrets" -}}
{{- $all := list -}}
{{- $names := list -}}
{{- range concat (.Values.imagePullSecrets | default list) ((.Values.global | default dict).imagePullSecrets | default list) -}}
{{- $secret := . -}}
{{- if kindIs "string" . }}{{ $secret = dict "name" . }}{{ end -}}
{{- if not (has $secret.name $names) -}}
{{- $names = append $names $secret.name -}}
{{- $all = append $all $secret -}}
{{- end -}}
{{- end -}}
{{- if $all }}{{ toYaml $all }}{{ end -}}
{{- end -}}

{{- define "gpu-agent.imagePullPolicy" -}}
{{- default .ctx.Values.image.pullPolicy (.image | default dict).pullPolicy -}}
{{- end -}}

{{/* gpu-agent.serviceAccountName: call with (dict "ctx" $ "component" "cluster-agent" "key" "clusterAgent"). */}}
{{- define "gpu-agent.serviceAccountName" -}}
{{- $sa := (index .ctx.Values .key).serviceAccount -}}
{{- if $sa.create -}}
{{- default (printf "%s-%s" (include "gpu-agent.fullname" .ctx) .component) $sa.name -}}
{{- else -}}
{{- required (printf "%s.serviceAccount.name is required when %s.serviceAccount.create=false: name an existing ServiceAccount, or set create=true" .key .key) $sa.name -}}
{{- end -}}
{{- end -}}

{{/* gpu-agent.tokensSecretName: the Secret with the reference control plane's tokens. */}}
{{- define "gpu-agent.tokensSecretName" -}}
{{- default (printf "%s-control-plane-tokens" (include "gpu-agent.fullname" .)) .Values.controlPlane.existingTokensSecret -}}
{{- end -}}

{{- define "gpu-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* gpu-agent.chartLabels: the labels the chart sets on its objects (selectors and policies rely on them). */}}
{{- define "gpu-agent.chartLabels" -}}
{{ include "gpu-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpu-agent
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* gpu-agent.userLabels: the labels a user adds to an object with the chart's labels `.own` (text): commonLabels,
and `.extra` (a dict: a pod template's podLabels, a monitor's labels; they win over commonLabels), as YAML; "" for
none. A commonLabels key the chart sets itself fails the render, naming it. */}}
{{- define "gpu-agent.userLabels" -}}
{{- $own := .own | fromYaml -}}
{{- $common := .ctx.Values.commonLabels | default dict -}}
{{- range $key, $_ := $common -}}
{{- if hasKey $own $key -}}
{{- fail (printf "commonLabels: %s is a label the chart sets itself (its selectors and policies rely on it): remove it from commonLabels" $key) -}}
{{- end -}}
{{- end -}}
{{- $all := merge (deepCopy (.extra | default dict)) $common -}}
{{- if $all }}{{ toYaml $all }}{{ end -}}
{{- end -}}

{{/* gpu-agent.labels: every object's labels, the chart's and commonLabels. */}}
{{- define "gpu-agent.labels" -}}
{{ include "gpu-agent.chartLabels" . }}
{{- with include "gpu-agent.userLabels" (dict "ctx" . "own" (include "gpu-agent.chartLabels" .)) }}
{{ . }}
{{- end }}
{{- end -}}

{{/* gpu-agent.componentLabels: labels of one component; call with (dict "ctx" $ "component" "cluster-agent"), and
"extra" (a dict of labels of the object's own: podLabels, a monitor's labels) where it has some. */}}
{{- define "gpu-agent.componentLabels" -}}
{{- $own := printf "%s\napp.kubernetes.io/component: %s" (include "gpu-agent.chartLabels" .ctx) .component -}}
{{ $own }}
{{- with include "gpu-agent.userLabels" (dict "ctx" .ctx "own" $own "extra" .extra) }}
{{ . }}
{{- end }}
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
{{- include "gpu-agent.tokensSecretName" . -}}
{{- else -}}
{{- required "controlPlane.existingSecret is required when controlPlane.enabled=false: name a Secret with key registrationToken, or set controlPlane.enabled=true" .Values.controlPlane.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "gpu-agent.controlPlaneUrl" -}}
{{- if .Values.controlPlane.enabled -}}
{{- printf "%s://%s-control-plane.%s.svc:8700" (ternary "https" "http" (include "gpu-agent.controlPlaneTlsOn" . | eq "true")) (include "gpu-agent.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "controlPlane.url is required when controlPlane.enabled=false: set it to your control plane's URL, or set controlPlane.enabled=true" .Values.controlPlane.url -}}
{{- end -}}
{{- end -}}

{{- /* "true" when the reference control plane of this release serves HTTPS. */ -}}
{{- define "gpu-agent.controlPlaneTlsOn" -}}
{{- if and .Values.controlPlane.enabled .Values.controlPlane.tls.enabled }}true{{ end -}}
{{- end -}}

{{- /* The kubernetes.io/tls Secret the reference control plane serves with (tls.crt, tls.key, ca.crt). */ -}}
{{- define "gpu-agent.controlPlaneTlsSecretName" -}}
{{- .Values.controlPlane.tls.existingSecret | default (printf "%s-control-plane-tls" (include "gpu-agent.fullname" .)) -}}
{{- end -}}

{{- /* The names the reference control plane's certificate holds: its Service's, and localhost for calls from
inside its own pod (`kubectl exec`). */ -}}
{{- define "gpu-agent.controlPlaneDnsNames" -}}
{{- $svc := printf "%s-control-plane" (include "gpu-agent.fullname" .) -}}
{{- $ns := .Release.Namespace -}}
{{- toJson (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) "localhost") -}}
{{- end -}}

{{- /* Where a client of the control plane finds the CA bundle it verifies the control plane with: a volume (as JSON)
holding ca.crt, or nothing (the system's trust store). The reference control plane's own CA unless controlPlane.caBundle
names another; an external control plane's controlPlane.caBundle. */ -}}
{{- define "gpu-agent.controlPlaneCaVolume" -}}
{{- if .Values.controlPlane.caBundle -}}
{{- toJson (dict "name" "control-plane-ca" "configMap" (dict "name" (printf "%s-control-plane-ca" (include "gpu-agent.fullname" .)) "items" (list (dict "key" "ca.crt" "path" "ca.crt")))) -}}
{{- else if include "gpu-agent.controlPlaneTlsOn" . -}}
{{- toJson (dict "name" "control-plane-ca" "secret" (dict "secretName" (include "gpu-agent.controlPlaneTlsSecretName" .) "items" (list (dict "key" "ca.crt" "path" "ca.crt")) "defaultMode" 288)) -}}
{{- end -}}
{{- end -}}

{{- define "gpu-agent.controlPlaneCaDir" -}}/var/run/gpu-agent/control-plane-ca{{- end -}}

{{- /* The control-plane client flags of a hook or test Pod: the CA file, and allowInsecure where it applies. */ -}}
{{- define "gpu-agent.controlPlaneClientFlags" -}}
{{- $flags := list -}}
{{- if include "gpu-agent.controlPlaneCaVolume" . -}}
{{- $flags = append $flags (printf "--control-plane-ca-file=%s/ca.crt" (include "gpu-agent.controlPlaneCaDir" .)) -}}
{{- end -}}
{{- if .Values.controlPlane.allowInsecure -}}
{{- $flags = append $flags "--control-plane-allow-insecure=true" -}}
{{- end -}}
{{- toJson $flags -}}
{{- end -}}

{{- /* Plain HTTP across the pod network sends the registration token and every credential in clear: refused at
render, as the agent refuses it at start, unless controlPlane.allowInsecure says so. */ -}}
{{- define "gpu-agent.checkControlPlaneUrl" -}}
{{- $url := include "gpu-agent.controlPlaneUrl" . -}}
{{- if and (hasPrefix "http://" $url) (not .Values.controlPlane.allowInsecure) -}}
{{- /* The host as the agent reads it (urlparse): after any user part (up to the authority's last "@"), before its
port. Loopback as the agent's rule has it: localhost, an address of 127.0.0.0/8, [::1]; a name that merely begins
with "127." (127.0.0.1.example.com) or a user part that looks like one (http://127.0.0.1:x@cp.example.com) is not. */ -}}
{{- $host := regexReplaceAll "^http://([^/?#]*@)?(\\[[^]/?#]*\\]|[^:/?#]*).*$" $url "${2}" -}}
{{- if not (or (eq (lower $host) "localhost") (regexMatch "^127(\\.(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}$" $host) (eq $host "[::1]")) -}}
{{- if .Values.controlPlane.enabled -}}
{{- fail "controlPlane.tls.enabled=false serves the reference control plane over plain HTTP, which sends the registration token and credentials across the pod network in clear: keep controlPlane.tls.enabled=true, or set controlPlane.allowInsecure=true to accept that" -}}
{{- else -}}
{{- /* Shown without its user part, which could hold a password (as the agent shows it). */ -}}
{{- fail (printf "controlPlane.url %s is plain HTTP, which sends the registration token and credentials across the network in clear: use https:// (with controlPlane.caBundle for a private CA), or set controlPlane.allowInsecure=true to accept that" (regexReplaceAll "^http://[^/?#]*@" $url "http://")) -}}
{{- end -}}
{{- end -}}
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
{{- $args := .args -}}
{{- /* The hooks log as the agents do: logFormat, unset (the default) renders nothing (gpu-agent-hook's text). */ -}}
{{- with .ctx.Values.logFormat }}{{ $args = append $args (printf "--log-format=%s" .) }}{{ end -}}
backoffLimit: {{ .ctx.Values.hooks.backoffLimit }}
activeDeadlineSeconds: {{ .ctx.Values.hooks.activeDeadlineSeconds }}
template:
  metadata:
    labels: {{- include "gpu-agent.componentLabels" (dict "ctx" .ctx "component" "hooks") | nindent 6 }}
  spec:
    serviceAccountName: {{ include "gpu-agent.serviceAccountName" (dict "ctx" .ctx "component" "hooks" "key" "hooks") }}
    {{- with include "gpu-agent.imagePullSecrets" .ctx }}
    imagePullSecrets: {{- . | nindent 6 }}
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
      image: {{ include "gpu-agent.image" (dict "ctx" .ctx "image" .ctx.Values.hooks.image) }}
      imagePullPolicy: {{ include "gpu-agent.imagePullPolicy" (dict "ctx" .ctx "image" .ctx.Values.hooks.image) }}
      command: [gpu-agent-hook]
      args: {{- toYaml $args | nindent 8 }}
      securityContext: {{- toYaml .ctx.Values.hooks.securityContext | nindent 8 }}
      resources: {{- toYaml .ctx.Values.hooks.resources | nindent 8 }}
      {{- with .ctx.Values.hooks.extraEnv }}
      env: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with concat (.volumeMounts | default list) .ctx.Values.hooks.extraVolumeMounts }}
      volumeMounts: {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- with concat (.volumes | default list) .ctx.Values.hooks.extraVolumes }}
    volumes: {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end -}}

{{/* gpu-agent.lintSuppressions: checkov annotations for the findings this chart accepts, each with
its reason (the test command runs checkov and allows no other finding); call with a list of IDs. */}}
{{- define "gpu-agent.lintSuppressions" -}}
{{- $reasons := dict
  "CKV_K8S_11" "no CPU limit: a limit throttles the agent under load; its request reserves what it needs"
  "CKV_K8S_15" "the pull policy is a value (image.pullPolicy); IfNotPresent suits pinned and locally imported images"
  "CKV_K8S_16" "nodeAgent.nvml.driverRoot: without the NVIDIA container runtime only a privileged container may open the host's GPU device nodes (the device cgroup)"
  "CKV_K8S_21" "a Node's Events live in namespace default (a Node has no namespace): the right to record them is granted there alone"
  "CKV_K8S_20" "privileged (nodeAgent.nvml.driverRoot) escalates anyway: the API server refuses privileged with allowPrivilegeEscalation false"
  "CKV_K8S_23" "root without capabilities or privilege: the GPU driver's device nodes are root's (NVML), as are the kubelet's plugin folders (DRA)"
  "CKV_K8S_38" "this component talks to the API server"
  "CKV_K8S_40" "root without capabilities or privilege: the GPU driver's device nodes are root's (NVML), as are the kubelet's plugin folders (DRA)"
  "CKV_K8S_8" "a one-shot test Pod (helm test): it serves nothing a kubelet could probe, and it ends by itself"
  "CKV_K8S_9" "a one-shot test Pod (helm test): it serves nothing a kubelet could probe, and it ends by itself"
  "CKV_K8S_43" "the digest is a value (image.digest); locally built images have none" -}}
{{- $lines := list -}}
{{- range $i, $id := . -}}
{{- $lines = append $lines (printf "checkov.io/skip%d: %s" (add1 $i) (printf "%s=%s" $id (index $reasons $id) | quote)) -}}
{{- end -}}
{{- join "\n" $lines -}}
{{- end -}}

{{/* Whether the members' admission policy is rendered: whenever node agents write GPUDomainMembers, the chart's
     domain or those they join by selector. "true" or "". */}}
{{- define "gpu-agent.memberPolicyOn" -}}
{{- if and .Values.nodeAgent.enabled (include "gpu-agent.domainsOn" .) (eq .Values.domain.writeStrategy "aggregate") .Values.domain.memberAdmissionPolicy }}true{{ end }}
{{- end }}

{{/* The members' admission policy: cluster-scoped, so its name carries a hash of the namespace as well as the
release's name, within 63 characters like every other name of the chart. */}}
{{- define "gpu-agent.memberPolicyName" -}}
{{- printf "%s-%s-own-member" (include "gpu-agent.fullname" . | trunc 44 | trimSuffix "-") (sha256sum .Release.Namespace | trunc 6) -}}
{{- end -}}

{{/* Whether the node agents are the DRA driver (dra.enabled, with node agents to be it): the DeviceClass, the RBAC,
     the ResourceSlices' admission policy, the kubelet's folders in the DaemonSet and the settings in its config.
     "true" or "". */}}
{{- define "gpu-agent.draOn" -}}
{{- if and .Values.nodeAgent.enabled .Values.dra.enabled }}true{{ end }}
{{- end }}

{{/* The ResourceSlices' admission policy: cluster-scoped like the members' one, so its name carries a hash of the
namespace as well, within 63 characters. */}}
{{- define "gpu-agent.draSlicePolicyName" -}}
{{- printf "%s-%s-dra-own-slices" (include "gpu-agent.fullname" . | trunc 40 | trimSuffix "-") (sha256sum .Release.Namespace | trunc 6) -}}
{{- end -}}

{{/* The work Pods' fencing policy: cluster-scoped like the members' one, so its name carries a hash of the namespace
as well, within 63 characters. */}}
{{- define "gpu-agent.workPodPolicyName" -}}
{{- printf "%s-%s-work-pod-fence" (include "gpu-agent.fullname" . | trunc 40 | trimSuffix "-") (sha256sum .Release.Namespace | trunc 6) -}}
{{- end -}}

{{/* The work Pods' shape policy: cluster-scoped like the fencing one, so its name carries a hash of the namespace as
well, within 63 characters. */}}
{{- define "gpu-agent.workPodShapePolicyName" -}}
{{- printf "%s-%s-work-pod-shape" (include "gpu-agent.fullname" . | trunc 40 | trimSuffix "-") (sha256sum .Release.Namespace | trunc 6) -}}
{{- end -}}

{{/* gpu-agent.workServiceAccountName: the ServiceAccount work Pods run as (workPods.serviceAccount), the one account
the shape policy admits on the Pods the cluster agent creates. It must hold no rights, so the name of one of the
chart's own accounts fails the render: an account's rights reach its Pods without a mounted token too (a cloud's
workload identity answers a Pod's metadata-server calls as the Pod's account). */}}
{{- define "gpu-agent.workServiceAccountName" -}}
{{- $work := include "gpu-agent.serviceAccountName" (dict "ctx" . "component" "work" "key" "workPods") -}}
{{- range $key, $component := dict "clusterAgent" "cluster-agent" "nodeAgent" "node-agent" "controlPlane" "control-plane" "hooks" "hooks" -}}
{{- $other := default (printf "%s-%s" (include "gpu-agent.fullname" $) $component) (index $.Values $key).serviceAccount.name -}}
{{- if eq $other $work -}}
{{- fail (printf "workPods.serviceAccount.name: %q is %s.serviceAccount's; work Pods need an account of their own that holds no rights (leave the name empty for <fullname>-work)" $work $key) -}}
{{- end -}}
{{- end -}}
{{- $work -}}
{{- end -}}

{{/* The leader-election Lease: the cluster agents' (--leader-election-lease-name); the WorkFence the leader writes,
the fencing policy's param, has the same name. */}}
{{- define "gpu-agent.leaseName" -}}
{{- include "gpu-agent.fullname" . }}-cluster-agent
{{- end -}}

{{/* Whether node agents publish into GPUDomains at all: the chart's own (domain.name) or those
     users create (domain.joinMatching). "true" or "". */}}
{{- define "gpu-agent.domainsOn" -}}
{{- if or .Values.domain.name .Values.domain.joinMatching (include "gpu-agent.channelsOn" .) }}true{{ end }}
{{- end }}

{{- /* GPUDomain channels through DRA: node agents offer a channel device and join a domain where its channel claims
land; the cluster agent folds every domain of the namespace and makes each one's channel ResourceClaimTemplate. */ -}}
{{- define "gpu-agent.channelsOn" -}}
{{- if and (include "gpu-agent.draOn" .) .Values.dra.domainChannels }}true{{ end }}
{{- end }}

{{- /* Whether the cluster agent makes the GPUDomains' channel ResourceClaimTemplates: where it folds domains (the
aggregate strategy) and node agents serve channels (dra.domainChannels; the channel DeviceClass is there). */ -}}
{{- define "gpu-agent.channelTemplatesOn" -}}
{{- if and (include "gpu-agent.channelsOn" .) (eq .Values.domain.writeStrategy "aggregate") }}true{{ end }}
{{- end }}

{{- /* The cluster agent Deployment's strategy type (deployment-cluster-agent.yaml renders the strategy;
the crds hook needs the type to know whether the rollout itself replaces a 0.1.x agent). */ -}}
{{- define "gpu-agent.clusterAgentStrategyType" -}}
{{- if .Values.clusterAgent.strategy -}}
{{- .Values.clusterAgent.strategy.type | default "RollingUpdate" -}}
{{- else if or .Values.gracefulNoGPU (not .Values.clusterAgent.leaderElection.enabled) -}}
Recreate
{{- else -}}
RollingUpdate
{{- end -}}
{{- end -}}

{{/* gpu-agent.nodeAgentAffinity: the node agent's affinity as YAML. nodeAgent.affinity as given, plus
     nodeAgent.gpuNodeSelectorTerms as a required nodeAffinity while neither nodeAgent.nodeSelector nor a
     nodeAffinity of the user's says where GPU nodes are. */}}
{{- define "gpu-agent.nodeAgentAffinity" -}}
{{- $affinity := deepCopy (.Values.nodeAgent.affinity | default dict) -}}
{{- if and (not .Values.nodeAgent.nodeSelector) (not $affinity.nodeAffinity) .Values.nodeAgent.gpuNodeSelectorTerms -}}
{{- $_ := set $affinity "nodeAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" .Values.nodeAgent.gpuNodeSelectorTerms)) -}}
{{- end -}}
{{- if $affinity }}{{ toYaml $affinity }}{{ end -}}
{{- end -}}

{{/* gpu-agent.nodeAgentRuntimeClass: the node agent's runtimeClassName, "" for none; only with gpuSource=nvml.
     nodeAgent.runtimeClassName as a string wins ("" is none); null: "nvidia" when the cluster has a
     RuntimeClass of that name. `lookup` answers only where Helm talks to the cluster (install, upgrade,
     --dry-run=server); under `helm template` and a client-side dry run it finds nothing, so null is none there. */}}
{{- define "gpu-agent.nodeAgentRuntimeClass" -}}
{{- if eq .Values.nodeAgent.gpuSource "nvml" -}}
{{- $set := .Values.nodeAgent.runtimeClassName -}}
{{- if kindIs "string" $set -}}{{ $set }}
{{- else if lookup "node.k8s.io/v1" "RuntimeClass" "" "nvidia" -}}nvidia
{{- end -}}
{{- end -}}
{{- end -}}

{{/* gpu-agent.nodeAgentHostDriver: "true" when the node agent reads NVML from the host's driver
     (gpuSource=nvml and nodeAgent.nvml.driverRoot set), else "". */}}
{{- define "gpu-agent.nodeAgentHostDriver" -}}
{{- if and (eq .Values.nodeAgent.gpuSource "nvml") .Values.nodeAgent.nvml.driverRoot }}true{{ end -}}
{{- end -}}

{{/* gpu-agent.nvmlLibraryHostPath: <driverRoot>/<libraryPath> on the host. */}}
{{- define "gpu-agent.nvmlLibraryHostPath" -}}
{{- clean (printf "%s/%s" .Values.nodeAgent.nvml.driverRoot .Values.nodeAgent.nvml.libraryPath) -}}
{{- end -}}

{{/* gpu-agent.clusterAgentAffinity: clusterAgent.affinity as given; empty with more than one replica, a soft
     podAntiAffinity by hostname so that leader and standby do not share a node. */}}
{{- define "gpu-agent.clusterAgentAffinity" -}}
{{- $affinity := .Values.clusterAgent.affinity | default dict -}}
{{- if and (not $affinity) (gt (int .Values.clusterAgent.replicas) 1) -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "gpu-agent.componentSelector" (dict "ctx" . "component" "cluster-agent") | fromYaml)) -}}
{{- $affinity = dict "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) -}}
{{- end -}}
{{- if $affinity }}{{ toYaml $affinity }}{{ end -}}
{{- end -}}

{{/* gpu-agent.nodeAgentRunsOn: "yes" when the node agent DaemonSet would place a pod on the node given as
     (dict "ctx" . "node" NODE): its labels match nodeAgent.nodeSelector, or one of the node affinity's terms, and
     the tolerations cover its NoSchedule and NoExecute taints. A term's matchFields and an operator other than
     In, NotIn, Exists and DoesNotExist count as matching (NOTES warn only when sure). */}}
{{- define "gpu-agent.nodeAgentRunsOn" -}}
{{- $v := .ctx.Values.nodeAgent -}}
{{- $labels := .node.metadata.labels | default dict -}}
{{- $placed := true -}}
{{- range $k, $want := $v.nodeSelector }}{{ if ne (toString (get $labels $k)) (toString $want) }}{{ $placed = false }}{{ end }}{{ end -}}
{{- $affinity := include "gpu-agent.nodeAgentAffinity" .ctx | fromYaml -}}
{{- $terms := dig "nodeAffinity" "requiredDuringSchedulingIgnoredDuringExecution" "nodeSelectorTerms" list $affinity -}}
{{- if $terms -}}
{{- $anyTerm := false -}}
{{- range $terms -}}
{{- $term := true -}}
{{- range .matchExpressions -}}
{{- $has := hasKey $labels .key -}}
{{- $value := toString (get $labels .key) -}}
{{- if eq .operator "In" }}{{ if not (and $has (has $value .values)) }}{{ $term = false }}{{ end -}}
{{- else if eq .operator "NotIn" }}{{ if and $has (has $value .values) }}{{ $term = false }}{{ end -}}
{{- else if eq .operator "Exists" }}{{ if not $has }}{{ $term = false }}{{ end -}}
{{- else if eq .operator "DoesNotExist" }}{{ if $has }}{{ $term = false }}{{ end -}}
{{- end -}}
{{- end -}}
{{- if $term }}{{ $anyTerm = true }}{{ end -}}
{{- end -}}
{{- if not $anyTerm }}{{ $placed = false }}{{ end -}}
{{- end -}}
{{- range .node.spec.taints | default list -}}
{{- $taint := . -}}
{{- if has $taint.effect (list "NoSchedule" "NoExecute") -}}
{{- $tolerated := false -}}
{{- range $v.tolerations | default list -}}
{{- $keyOk := or (and (not .key) (eq (.operator | default "Equal") "Exists")) (eq (toString .key) $taint.key) -}}
{{- $valueOk := or (eq (.operator | default "Equal") "Exists") (eq (toString .value) (toString $taint.value)) -}}
{{- $effectOk := or (not .effect) (eq .effect $taint.effect) -}}
{{- if and $keyOk $valueOk $effectOk }}{{ $tolerated = true }}{{ end -}}
{{- end -}}
{{- if not $tolerated }}{{ $placed = false }}{{ end -}}
{{- end -}}
{{- end -}}
{{- if $placed }}yes{{ end -}}
{{- end -}}

{{- /* An agent's config file (the ConfigMap the Deployment and the DaemonSet mount at /etc/gpu-agent):
the wiring this chart sets for the release (`.wiring`, a dict), then the settings the user set: the named
values (`.named`, a list of [setting, value, value's name]; null is unset) and the agent's free-form
config map (`.config`). A setting set both ways to different values fails the render, naming both: there
is no silent winner. A setting nobody set is absent, so the agent's own default applies. */ -}}
{{- define "gpu-agent.agentConfig" -}}
{{- $set := dict -}}
{{- $from := dict -}}
{{- range $n := .named -}}
{{- $setting := index $n 0 -}}{{- $value := index $n 1 -}}
{{- if not (or (kindIs "invalid" $value) (and (kindIs "string" $value) (eq $value ""))) -}}
{{- $_ := set $set $setting $value -}}{{- $_ := set $from $setting (index $n 2) -}}
{{- end -}}
{{- end -}}
{{- range $setting, $value := .config -}}
{{- if and (hasKey $set $setting) (ne (toString $value) (toString (get $set $setting))) -}}
{{- fail (printf "%s.config.%s (%v) and %s (%v) set the same setting to different values: set one of them" $.key $setting $value (get $from $setting) (get $set $setting)) -}}
{{- end -}}
{{- if not (kindIs "invalid" $value) }}{{ $_ := set $set $setting $value }}{{ end -}}
{{- end -}}
# Set by the chart for this release.
{{ toYaml .wiring }}
{{- if $set }}
# Set in values ({{ .key }}.config and the values named in its comments); every other setting is the agent's default
# (gpu-agent {{ .role }} --help lists them).
{{ toYaml $set }}
{{- else }}
# Every other setting is the agent's default (gpu-agent {{ .role }} --help lists them).
{{- end }}
{{- end -}}

{{/* gpu-agent.workPods: the workPods values that are set (JSON; {} when none is, and the setting is not rendered), after
     refusing what is the agent's own: a label or annotation key under gpu-agent.io/ (and the labels
     app.kubernetes.io/managed-by and instance: the work labels, the release selector), nvidia.com/gpu in resources
     (claims: the schema), and a nodeSelector key clusterAgent.gpuNodeSelector sets to another value. The cluster
     agent checks the same at start (agent/gpu_agent/foundations/work_pods.py). */}}
{{- define "gpu-agent.workPods" -}}
{{- $wp := .Values.workPods | default dict -}}
{{- $set := dict -}}
{{- /* serviceAccount and admissionPolicy are the chart's (the workServiceAccount setting, the shape policy) */ -}}
{{- range $key, $value := omit $wp "serviceAccount" "admissionPolicy" }}{{ if $value }}{{ $_ := set $set $key $value }}{{ end }}{{ end -}}
{{- $agentLabels := list "app.kubernetes.io/managed-by" "app.kubernetes.io/instance" -}}
{{- range $key := keys ($wp.labels | default dict) | sortAlpha -}}
{{- if or (hasPrefix "gpu-agent.io/" $key) (has $key $agentLabels) -}}
{{- fail (printf "workPods.labels: %q is a label key the agent sets on every work Pod (gpu-agent.io/..., %s); choose another key" $key (join ", " $agentLabels)) -}}
{{- end -}}
{{- end -}}
{{- range $key := keys ($wp.annotations | default dict) | sortAlpha -}}
{{- if hasPrefix "gpu-agent.io/" $key -}}
{{- fail (printf "workPods.annotations: %q is an annotation key the agent sets on work Pods (gpu-agent.io/...: the fencing token, the item); choose another key" $key) -}}
{{- end -}}
{{- end -}}
{{- range $part := list "requests" "limits" -}}
{{- if hasKey (get ($wp.resources | default dict) $part | default dict) "nvidia.com/gpu" -}}
{{- fail (printf "workPods.resources.%s: nvidia.com/gpu is the agent's own: each item asks for its GPUs (its payload's gpus)" $part) -}}
{{- end -}}
{{- end -}}
{{- $gpuNodes := .Values.clusterAgent.gpuNodeSelector | default dict -}}
{{- range $key := keys ($wp.nodeSelector | default dict) | sortAlpha -}}
{{- if and (hasKey $gpuNodes $key) (ne (toString (get $gpuNodes $key)) (toString (get $wp.nodeSelector $key))) -}}
{{- fail (printf "workPods.nodeSelector: %q is %q, but clusterAgent.gpuNodeSelector sets it to %q (the nodes whose GPUs the agent counts, where its work Pods must go); drop it from workPods.nodeSelector" $key (toString (get $wp.nodeSelector $key)) (toString (get $gpuNodes $key))) -}}
{{- end -}}
{{- end -}}
{{- toJson $set -}}
{{- end -}}

{{- define "gpu-agent.clusterAgentConfig" -}}
{{- $v := .Values -}}
{{- $wiring := dict "listenAddress" "0.0.0.0:8080" "clusterId" (include "gpu-agent.clusterId" .)
  "gpuSource" $v.clusterAgent.gpuSource "executor" $v.clusterAgent.executor "executorJournal" "/tmp/executions.sqlite"
  "workNamespace" .Release.Namespace
  "workImage" (default (include "gpu-agent.image" (dict "ctx" . "image" $v.clusterAgent.image)) $v.clusterAgent.workImage)
  "releaseName" .Release.Name "controlPlaneUrl" (include "gpu-agent.controlPlaneUrl" .)
  "controlPlaneTokenFile" "/var/run/secrets/gpu-agent/registrationToken" "gracefulNoGPU" $v.gracefulNoGPU -}}
{{- if include "gpu-agent.controlPlaneCaVolume" . }}{{ $_ := set $wiring "controlPlaneCaFile" (printf "%s/ca.crt" (include "gpu-agent.controlPlaneCaDir" .)) }}{{ end -}}
{{- if $v.controlPlane.allowInsecure }}{{ $_ := set $wiring "controlPlaneAllowInsecure" true }}{{ end -}}
{{- with $v.clusterAgent.gpuNodeSelector }}{{ $_ := set $wiring "gpuNodeSelector" . }}{{ end -}}
{{- with include "gpu-agent.workPods" . | fromJson }}{{ $_ := set $wiring "workPods" . }}{{ end -}}
{{- $_ := set $wiring "workServiceAccount" (include "gpu-agent.workServiceAccountName" .) -}}
{{- if $v.dra.enabled -}}
{{- /* GPUs through DRA: the cluster agent counts the driver's devices in ResourceSlices, and its work Pods claim
     theirs through ResourceClaimTemplates of the chart's DeviceClass. */ -}}
{{- if eq $v.clusterAgent.gpuSource "cluster" }}{{ $_ := set $wiring "draDriverName" $v.dra.driverName }}{{ end -}}
{{- if eq $v.clusterAgent.executor "pod" }}{{ $_ := set $wiring "draDeviceClassName" $v.dra.deviceClassName }}{{ end -}}
{{- end -}}
{{- if include "gpu-agent.channelTemplatesOn" . -}}
{{- /* Each folded GPUDomain with a spec.channel gets its channel ResourceClaimTemplate (the driver's channel class). */ -}}
{{- $_ := set $wiring "draDriverName" $v.dra.driverName -}}
{{- $_ := set $wiring "channelDeviceClassName" $v.dra.channelDeviceClassName -}}
{{- end -}}
{{- if and (include "gpu-agent.domainsOn" .) (eq $v.domain.writeStrategy "aggregate") -}}
{{- with $v.domain.name }}
{{ $_ := set $wiring "domainName" . }}{{ end -}}
{{- if or $v.domain.joinMatching (include "gpu-agent.channelsOn" .) }}{{ $_ := set $wiring "foldAllDomains" true }}{{ end -}}
{{- $_ := set $wiring "domainNamespace" .Release.Namespace -}}
{{- end -}}
{{- if $v.clusterAgent.leaderElection.enabled -}}
{{- $_ := set $wiring "leaderElectionLeaseName" (include "gpu-agent.leaseName" .) -}}
{{- $_ := set $wiring "leaderElectionNamespace" .Release.Namespace -}}
{{- $_ := set $wiring "leaderElectionOwner" (printf "%s-cluster-agent" (include "gpu-agent.fullname" .)) -}}
{{- if $v.clusterAgent.workPodFencing }}{{ $_ := set $wiring "workPodFence" (include "gpu-agent.leaseName" .) }}{{ end -}}
{{- end -}}
{{- $le := $v.clusterAgent.leaderElection -}}
{{- $named := list
  (list "verbosity" $v.logVerbosity "logVerbosity")
  (list "logFormat" $v.logFormat "logFormat")
  (list "featureGates" (include "gpu-agent.featureGates" .) "featureGates")
  (list "gpuLossDebounce" $v.clusterAgent.gpuLossDebounce "clusterAgent.gpuLossDebounce")
  (list "gpuHealthIgnoredXids" $v.gpuHealth.ignoredXids "gpuHealth.ignoredXids")
  (list "gpuHealthRecovery" $v.gpuHealth.recovery "gpuHealth.recovery")
  (list "registrationRetryInitial" $v.clusterAgent.registrationRetryInitial "clusterAgent.registrationRetryInitial")
  (list "registrationRetryMax" $v.clusterAgent.registrationRetryMax "clusterAgent.registrationRetryMax")
  (list "reregistrationInterval" $v.clusterAgent.reregistrationInterval "clusterAgent.reregistrationInterval")
  (list "credentialRenewInterval" $v.clusterAgent.credentialRenewInterval "clusterAgent.credentialRenewInterval")
  (list "queueMaxInFlight" $v.queue.maxInFlight "queue.maxInFlight")
  (list "leaderElectionLeaseDuration" $le.leaseDuration "clusterAgent.leaderElection.leaseDuration")
  (list "leaderElectionRenewDeadline" $le.renewDeadline "clusterAgent.leaderElection.renewDeadline")
  (list "leaderElectionRetryPeriod" $le.retryPeriod "clusterAgent.leaderElection.retryPeriod")
  (list "kubeApiQps" $v.clusterAgent.kubeAPI.qps "clusterAgent.kubeAPI.qps")
  (list "kubeApiBurst" $v.clusterAgent.kubeAPI.burst "clusterAgent.kubeAPI.burst") -}}
{{- if and (include "gpu-agent.domainsOn" .) (eq $v.domain.writeStrategy "aggregate") -}}
{{- $named = append $named (list "domainHeartbeatTtl" $v.domain.heartbeatTTL "domain.heartbeatTTL") -}}
{{- end -}}
{{- include "gpu-agent.agentConfig" (dict "wiring" $wiring "named" $named "config" ($v.clusterAgent.config | default dict)
  "key" "clusterAgent" "role" "cluster-agent") -}}
{{- end -}}

{{- define "gpu-agent.nodeAgentConfig" -}}
{{- $v := .Values -}}
{{- /* gpuHealthEvents is wired, not named: the Role that lets the agents record them is rendered with it. */ -}}
{{- $wiring := dict "listenAddress" "0.0.0.0:8081" "gpuSource" $v.nodeAgent.gpuSource
  "fakeGpuStateFile" "/var/run/fake-gpu/fake-gpus.json" "gpuHealthEvents" $v.nodeAgent.gpuHealthEvents -}}
{{- $named := list
  (list "verbosity" $v.logVerbosity "logVerbosity")
  (list "logFormat" $v.logFormat "logFormat")
  (list "gpuLossDebounce" $v.nodeAgent.gpuLossDebounce "nodeAgent.gpuLossDebounce")
  (list "gpuHealthIgnoredXids" $v.gpuHealth.ignoredXids "gpuHealth.ignoredXids")
  (list "gpuHealthRecovery" $v.gpuHealth.recovery "gpuHealth.recovery")
  (list "kubeApiQps" $v.nodeAgent.kubeAPI.qps "nodeAgent.kubeAPI.qps")
  (list "kubeApiBurst" $v.nodeAgent.kubeAPI.burst "nodeAgent.kubeAPI.burst") -}}
{{- if include "gpu-agent.domainsOn" . -}}
{{- with $v.domain.name }}{{ $_ := set $wiring "domainName" . }}{{ end -}}
{{- if $v.domain.joinMatching }}{{ $_ := set $wiring "joinMatchingDomains" true }}{{ end -}}
{{- $_ := set $wiring "domainNamespace" .Release.Namespace -}}
{{- $_ := set $wiring "domainWriteStrategy" $v.domain.writeStrategy -}}
{{- $_ := set $wiring "peersFile" "/tmp/peers" -}}
{{- $named = append $named (list "domainHeartbeatInterval" $v.domain.heartbeatInterval "domain.heartbeatInterval") -}}
{{- end -}}
{{- if include "gpu-agent.draOn" . -}}
{{- /* The DaemonSet mounts each folder at its host path: the paths the agent hands the kubelet resolve on the host. */ -}}
{{- $_ := set $wiring "draDriverName" $v.dra.driverName -}}
{{- $_ := set $wiring "draRegistryDir" $v.dra.kubeletRegistryDir -}}
{{- $_ := set $wiring "draPluginDir" $v.dra.kubeletPluginsDir -}}
{{- $_ := set $wiring "draCdiDir" $v.dra.cdiDir -}}
{{- if include "gpu-agent.channelsOn" . }}{{ $_ := set $wiring "draDomainChannels" true }}{{ end -}}
{{- end -}}
{{- include "gpu-agent.agentConfig" (dict "wiring" $wiring "named" $named "config" ($v.nodeAgent.config | default dict)
  "key" "nodeAgent" "role" "node-agent") -}}
{{- end -}}

{{/* gpu-agent.kubeVersionChecks: the Kubernetes version Chart.yaml's kubeVersion admits (1.30, for the
ValidatingAdmissionPolicies of admissionregistration.k8s.io/v1) is not enough for dra.enabled: resource.k8s.io/v1 (the
DeviceClass, ResourceSlices, ResourceClaimTemplates) is served from 1.34. .Capabilities.KubeVersion is the cluster's
on install and upgrade; under `helm template` it is --kube-version, or the version helm was built with. */}}
{{- define "gpu-agent.kubeVersionChecks" -}}
{{- if and .Values.dra.enabled (semverCompare "<1.34.0-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "dra.enabled=true needs Kubernetes 1.34 or later (resource.k8s.io/v1: DeviceClass, ResourceSlice, ResourceClaimTemplate), and this cluster is %s: set dra.enabled=false (GPUs through the device plugin), or upgrade the cluster to 1.34+ (under `helm template`, pass --kube-version)" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}

{{/* gpu-agent.alertSelector: the PromQL label matchers (no braces) of this release's agents' series, for the
alerts of templates/prometheusrule.yaml: metrics.prometheusRule.selector, else the release's namespace and the jobs
its ServiceMonitors (job: the Service's name) or PodMonitors (job: namespace/name) give both agents. The cluster
agent's own metrics (readiness, leadership, registration, queue, domains, control plane) only it exports. */}}
{{- define "gpu-agent.alertSelector" -}}
{{- $rule := .Values.metrics.prometheusRule -}}
{{- if $rule.selector -}}
{{- $rule.selector -}}
{{- else -}}
{{- $ns := .Release.Namespace -}}
{{- printf "namespace=%q,job=~%q" $ns (printf "(%s/)?%s-(cluster|node)-agent" (regexQuoteMeta $ns) (regexQuoteMeta (include "gpu-agent.fullname" .))) -}}
{{- end -}}
{{- end -}}

{{/* gpu-agent.alertLabels: an alert's labels, its severity and metrics.prometheusRule.alertLabels; call with
(dict "ctx" $ "severity" .severity). */}}
{{- define "gpu-agent.alertLabels" -}}
{{- toYaml (merge (dict "severity" .severity) (deepCopy (.ctx.Values.metrics.prometheusRule.alertLabels | default dict))) -}}
{{- end -}}

{{/* gpu-agent.runbookUrl: an alert's runbook, its section of docs/alerts.md (the heading is the alert's name, whose
GitHub anchor is that name in lower case); call with (dict "ctx" $ "alert" "GPUAgentNoActiveLeader"). */}}
{{- define "gpu-agent.runbookUrl" -}}
{{- printf "%s#%s" .ctx.Values.metrics.prometheusRule.runbookUrl (lower .alert) -}}
{{- end -}}
