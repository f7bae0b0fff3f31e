{{/* Names, labels and images shared by every template. */}}

{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A component's resource name: "<fullname>-<component>", at most 63 characters. */}}
{{- define "kvgate.componentName" -}}
{{- printf "%s-%s" (include "kvgate.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.poolName" -}}
{{- default (include "kvgate.fullname" .) .Values.inferencePool.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.eppName" -}}
{{- include "kvgate.componentName" (dict "root" . "component" "epp") -}}
{{- end -}}

{{- define "kvgate.natsName" -}}
{{- include "kvgate.componentName" (dict "root" . "component" "nats") -}}
{{- end -}}

{{- define "kvgate.kvbmName" -}}
{{- include "kvgate.componentName" (dict "root" . "component" "kvbm") -}}
{{- end -}}

{{/* Labels that never change for a component (selectors): pass (dict "root" $ "component" "epp"). */}}
{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvgate.labels" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvgate
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* A kvgate image: pass (dict "root" $ "image" .Values.epp.image). */}}
{{- define "kvgate.image" -}}
{{- if .image.override -}}
{{- .image.override -}}
{{- else -}}
{{- printf "%s/%s:%s" .root.Values.image.registry .image.name (default .root.Chart.AppVersion .root.Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The NATS URL every component uses, or "" when NATS is off. */}}
{{- define "kvgate.natsUrl" -}}
{{- if eq .Values.nats.mode "internal" -}}
{{- printf "nats://%s.%s.svc:4222" (include "kvgate.natsName" .) .Release.Namespace -}}
{{- else if eq .Values.nats.mode "external" -}}
{{- required "nats.url is required when nats.mode is external" .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.modelName" -}}
{{- required "model.name is required: the model name clients send and the engines serve" .Values.model.name -}}
{{- end -}}

{{/* The pod's own identity from the Downward API, as the binaries read it. */}}
{{- define "kvgate.downwardEnv" -}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
{{- end -}}

{{- define "kvgate.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- define "kvgate.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext -}}
{{- end -}}

{{/*
kvgate.tracingEnv: the OpenTelemetry variables of a traced container (the EPP, the sidecars);
nothing when tracing is off.
*/}}
{{- define "kvgate.tracingEnv" -}}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $.Values.tracing.sampleRatio | quote }}
{{- end }}
{{- end }}
