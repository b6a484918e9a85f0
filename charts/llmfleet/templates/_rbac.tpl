{{/* RBAC rules shared by the operator's Role (namespaced) and ClusterRole (cluster-wide). */}}

{{- define "llmfleet.operatorRules" -}}
# The custom resource: kopf patches finalizers/annotations; the operator writes status; `kubectl scale` reads scale.
- apiGroups: ["llmfleet.io"]
  resources: ["inferencedeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["llmfleet.io"]
  resources: ["inferencedeployments/status", "inferencedeployments/scale"]
  verbs: ["get", "patch", "update"]
# Worker pods: created one by one, annotated while draining, deleted after the drain.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# The headless Service of each deployment's workers.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "delete", "patch", "update"]
# No Secret rights at all: drain tokens are derived from the operator's own key (a file mounted from the chart's
# Secret into the operator pod), never created or read through the API.
# Events for decisions, rollouts and drains (kopf posts core/v1 Events).
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# A PodDisruptionBudget per variant.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "delete", "patch", "update"]
{{- if .Values.networkPolicy.enabled }}
# A NetworkPolicy per deployment (workers admit only the gateway, the operator and the scraper): read by name,
# created, its spec patched back; deletion is the garbage collector's (it is owner-referenced).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- end }}
