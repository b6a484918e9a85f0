{{/* Names, labels and the cross-value checks every template shares. */}}

{{- define "llmfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's resource name: FULLNAME-COMPONENT, at most 63 characters. Call with (list . "operator"). */}}
{{- define "llmfleet.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "llmfleet.fullname" $root | trunc (int (sub 62 (len (index . 1))))) (index . 1) | trimSuffix "-" }}
{{- end }}

{{- define "llmfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmfleet.labels" -}}
helm.sh/chart: {{ include "llmfleet.chart" . }}
app.kubernetes.io/name: {{ include "llmfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: llmfleet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component. Call with (list . "operator"). */}}
{{- define "llmfleet.componentLabels" -}}
{{ include "llmfleet.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Selector labels of one component (immutable in Deployments: never add to them). Call with (list . "gateway"). */}}
{{- define "llmfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmfleet.name" (index . 0) }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "llmfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "llmfleet.workerImage" -}}
{{- $w := .Values.operator.workerImage }}
{{- printf "%s:%s" $w.repository (default .Chart.AppVersion $w.tag) }}
{{- end }}

{{/* The namespaces served, as a JSON list (empty with rbac.clusterWide: every namespace). */}}
{{- define "llmfleet.watchNamespaces" -}}
{{- if .Values.rbac.clusterWide }}
{{- list | toJson }}
{{- else if .Values.watchNamespaces }}
{{- .Values.watchNamespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{- define "llmfleet.alertsSecretName" -}}
{{- default (include "llmfleet.componentName" (list . "alerts-token")) .Values.operator.alerts.existingSecret }}
{{- end }}

{{/*
Cross-value rules the schema cannot express, failing with a message that says how to fix the values.
Included by every template that depends on them, so `helm template` stops before rendering anything wrong.
*/}}
{{- define "llmfleet.validate" -}}
{{- $v := .Values }}
{{- if and $v.rbac.clusterWide $v.watchNamespaces }}
{{- fail "rbac.clusterWide=true serves every namespace: leave watchNamespaces empty, or set rbac.clusterWide=false to serve only the listed namespaces" }}
{{- end }}
{{- if and (gt (int $v.operator.replicaCount) 1) (not $v.operator.peering.enabled) }}
{{- fail (printf "operator.replicaCount=%d needs operator.peering.enabled=true (kopf peering keeps one replica active); or set operator.replicaCount=1" (int $v.operator.replicaCount)) }}
{{- end }}
{{- if and $v.gateway.enabled (not $v.rbac.clusterWide) (gt (len (include "llmfleet.watchNamespaces" . | fromJsonArray)) 1) }}
{{- fail "the gateway watches one namespace or all of them: with several watchNamespaces set rbac.clusterWide=true, install one release per namespace, or set gateway.enabled=false" }}
{{- end }}
{{- if and $v.gateway.enabled (not $v.gateway.apiKeys.existingSecret) }}
{{- fail "gateway.apiKeys.existingSecret is empty: name the Secret holding the API keys (item `api-keys`)" }}
{{- end }}
{{- if eq (int $v.gateway.metricsPort) (int $v.gateway.port) }}
{{- fail "gateway.metricsPort must differ from gateway.port: /metrics is served on its own internal port" }}
{{- end }}
{{- if hasKey $v.gateway.config "allow_open_mode" }}
{{- fail "gateway.config.allow_open_mode: the chart runs the gateway with API keys only (gateway.apiKeys.existingSecret); remove it" }}
{{- end }}
{{- if hasKey $v.gateway.config "metrics_host" }}
{{- fail "gateway.config.metrics_host is set by the chart (the pod IP): remove it" }}
{{- end }}
{{- if hasKey $v.gateway.config "metrics_port" }}
{{- fail "gateway.config.metrics_port is set by the chart: use gateway.metricsPort instead" }}
{{- end }}
{{- if hasKey $v.gateway.config "host" }}
{{- fail "gateway.config.host is set by the chart (the pod IP): remove it" }}
{{- end }}
{{- if hasKey $v.gateway.config "port" }}
{{- fail "gateway.config.port is set by the chart: use gateway.port instead" }}
{{- end }}
{{- end }}

{{/* Pod anti-affinity spreading a component's replicas over nodes, unless the user gave an affinity. Call with (list . "operator" .Values.operator). */}}
{{- define "llmfleet.affinity" -}}
{{- $root := index . 0 }}
{{- $values := index . 2 }}
{{- if $values.affinity }}
{{- toYaml $values.affinity }}
{{- else if gt (int $values.replicaCount) 1 }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "llmfleet.selectorLabels" (list $root (index . 1)) | nindent 12 }}
{{- end }}
{{- end }}

{{/*
"true" when a peering object already exists in the cluster. Asks for its CRD first: looking up a kind the API
server does not serve yet is an error, a missing CRD is not. Without a cluster (helm template) nothing exists.
Call with (list CRD_NAME KIND NAMESPACE NAME).
*/}}
{{- define "llmfleet.peeringExists" -}}
{{- if lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" (index . 0) }}
{{- if lookup "kopf.dev/v1" (index . 1) (index . 2) (index . 3) }}true{{ end }}
{{- end }}
{{- end }}
