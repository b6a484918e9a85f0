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
# The per-deployment drain-token Secret: created with a random token, read by name; no list/watch of Secrets.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
# Events for decisions, rollouts and drains (kopf posts core/v1 Events).
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# A PodDisruptionBudget per variant.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "delete", "patch", "update"]
{{- end }}
