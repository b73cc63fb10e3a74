{{/* Names: <release>-burstgate unless the release name already contains it. */}}
{{- define "burstgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "burstgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "burstgate.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "burstgate.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels of every object; `component` is gateway, redis, vllm or tgi. */}}
{{- define "burstgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "burstgate.selectorLabels" . }}
{{- end }}

{{- define "burstgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "burstgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Services are "<fullname>-<component>": never `vllm`, whose VLLM_PORT variable would stop vLLM. */}}
{{- define "burstgate.component" -}}
{{- printf "%s-%s" (include "burstgate.fullname" .) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "burstgate.keysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-keys" (include "burstgate.fullname" .)) }}
{{- end }}

{{/* The gateway's gateway.yaml: a model served by the enabled deployments, Redis when enabled,
     then gateway.config merged over it. */}}
{{- define "burstgate.gatewayConfig" -}}
{{- $deployments := list }}
{{- if .Values.vllm.enabled }}
{{- $service := include "burstgate.component" (dict "component" "vllm" "Values" .Values "Release" .Release "Chart" .Chart) }}
{{- $vllm := dict "kind" "openai" "name" "vllm" "url" (printf "http://%s:8000/v1" $service) "upstream_model" .Values.vllm.servedModelName "api_key" "os.environ/VLLM_API_KEY" "weight" .Values.vllm.weight "first_token_timeout_s" 60 }}
{{- if eq .Values.vllm.discovery "kubernetes" }}
{{- $_ := set $vllm "discover" (dict "source" "kubernetes" "selector" (printf "kubernetes.io/service-name=%s" $service) "port_name" "http") }}
{{- else if eq .Values.vllm.discovery "dns" }}
{{- $_ := set $vllm "discover" (dict "source" "dns" "name" (printf "%s-headless" $service)) }}
{{- end }}
{{- $deployments = append $deployments $vllm }}
{{- end }}
{{- if .Values.tgi.enabled }}
{{- $url := printf "http://%s:80" (include "burstgate.component" (dict "component" "tgi" "Values" .Values "Release" .Release "Chart" .Chart)) }}
{{- $deployments = append $deployments (dict "kind" "tgi" "name" "tgi" "url" $url "weight" .Values.tgi.weight) }}
{{- end }}
{{- if .Values.native.enabled }}
{{- $deployments = append $deployments (dict "kind" "native" "name" "native-cpu" "dtype" .Values.native.dtype "weight" .Values.native.weight "kv_cache_gb" .Values.native.kv_cache_gb) }}
{{- end }}
{{- $config := dict }}
{{- if $deployments }}
{{- $_ := set $config "models" (list (dict "name" .Values.model "routing" "prefix_affinity" "deployments" $deployments)) }}
{{- end }}
{{- if .Values.redis.enabled }}
{{- $redis := printf "redis://%s:6379/0" (include "burstgate.component" (dict "component" "redis" "Values" .Values "Release" .Release "Chart" .Chart)) }}
{{- $_ := set $config "limits" (dict "redis_url" $redis) }}
{{- end }}
{{- $_ := set $config "server" (dict "drain_grace_s" .Values.gateway.drain.graceSeconds "drain_timeout_s" .Values.gateway.drain.timeoutSeconds) }}
{{- with .Values.gateway.tracing.otlpTracesEndpoint }}
{{- $_ := set $config "tracing" (dict "otlp_traces_endpoint" . "sample_ratio" $.Values.gateway.tracing.sampleRatio "service_name" (include "burstgate.fullname" $)) }}
{{- end }}
{{- toYaml (mergeOverwrite $config (deepCopy .Values.gateway.config)) }}
{{- end }}

{{/* The gateway reads the vLLM Service's EndpointSlices (vllm.discovery: kubernetes). */}}
{{- define "burstgate.discoversKubernetes" -}}
{{- if and .Values.vllm.enabled (eq .Values.vllm.discovery "kubernetes") }}true{{ end }}
{{- end }}
