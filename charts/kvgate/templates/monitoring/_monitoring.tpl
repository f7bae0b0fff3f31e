{{/*
Scrape relabelings shared by the ServiceMonitor and the PodMonitors. The Prometheus Operator
already sets namespace, pod, container and instance from the target; these add the labels
kvgate's alerts and dashboards select on, whatever the Operator's defaults:
  job:  kvgate-epp | kvgate-sidecar | kvgate-engine | kvgate-kvbm | kvgate-operator (stable
        across releases);
  pool: the InferencePool's name (the EPP exports it on its own metrics only, the sidecars,
        engines and block managers not at all);
  node: for the block managers, the node they manage (pass "node" true).
Pass (dict "root" $ "job" "kvgate-epp" ["node" true]).
*/}}
{{- define "kvgate.monitoring.relabelings" -}}
- action: replace
  targetLabel: job
  replacement: {{ .job | quote }}
- action: replace
  targetLabel: pool
  replacement: {{ include "kvgate.poolName" .root | quote }}
{{- if .node }}
- action: replace
  sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
{{- end }}
{{- end -}}

{{/* The label selector every rule expression of this release uses. */}}
{{- define "kvgate.monitoring.selector" -}}
{{- printf "namespace=%q, pool=%q" .Release.Namespace (include "kvgate.poolName" .) -}}
{{- end -}}
