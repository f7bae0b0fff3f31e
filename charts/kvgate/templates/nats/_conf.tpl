{{/* The NATS server configuration: pass (dict "root" $ "name" <sts> "headless" <service>). */}}
{{- define "kvgate.natsConf" -}}
{{- $n := .root.Values.nats.internal -}}
# Core NATS only: kvgate needs no JetStream, so nothing is written to disk.
server_name: $POD_NAME
port: 4222
http_port: 8222
max_payload: {{ int64 $n.maxPayload }}
{{- if gt (int $n.replicas) 1 }}
cluster {
  name: {{ .name }}
  port: 6222
  routes: [
    {{- range $i := until (int $n.replicas) }}
    nats://{{ $.name }}-{{ $i }}.{{ $.headless }}.{{ $.root.Release.Namespace }}.svc:6222
    {{- end }}
  ]
}
{{- end }}
{{- end -}}
