{{/*
kvgate.sidecar: the sidecar container for a model-server pod, to place in the pod's
`containers` list beside the engine:

  containers:
    - name: vllm
      ...
    {{- include "kvgate.sidecar" (dict "root" $ "engine" "vllm" "role" "decode" "dpSize" 1) | nindent 4 }}

Parameters: root (the chart context), engine (vllm | sglang | sim), role (both | prefill |
decode), dpSize (data-parallel ranks the engine serves; default 1). The rest comes from
.Values.sidecar, .Values.model, the pool's name and the NATS URL.

The engine must publish KV events on tcp://*:<sidecar.engine.kvEventsPort> with replay on
<replayPort> (vLLM and SGLang: --kv-events-config, see kvgate.kvEventsConfig) and serve HTTP on
<sidecar.engine.port>. The pod's terminationGracePeriodSeconds should exceed 30 s (the
sidecar's drain).
*/}}
{{- define "kvgate.sidecar" -}}
{{- $root := .root -}}
{{- $s := $root.Values.sidecar -}}
{{- $dp := int (default 1 .dpSize) -}}
{{- $nats := include "kvgate.natsUrl" $root -}}
{{- if not $nats -}}
{{- fail "the sidecar publishes KV events over NATS: set nats.mode to internal or external" -}}
{{- end -}}
{{- if not (has .engine (list "vllm" "sglang" "sim")) -}}
{{- fail (printf "sidecar engine %q: expected vllm, sglang or sim" .engine) -}}
{{- end -}}
- name: kvgate-sidecar
  image: {{ include "kvgate.image" (dict "root" $root "image" $s.image) }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  args:
    - --engine={{ .engine }}
    - --engine-url=http://127.0.0.1:{{ $s.engine.port }}
    - --kv-events-endpoint=tcp://127.0.0.1:{{ $s.engine.kvEventsPort }}
    - --replay-endpoint=tcp://127.0.0.1:{{ $s.engine.replayPort }}
    - --dp-size={{ $dp }}
    - --model={{ include "kvgate.modelName" $root }}
    - --block-size={{ $root.Values.model.blockSize }}
    - --pool={{ include "kvgate.poolName" $root }}
    - --nats-url={{ $nats }}
    - --proxy-port={{ $s.ports.proxy }}
    - --metrics-port={{ $s.ports.metrics }}
    - --kv-connector={{ $s.kvConnector }}
    {{- if eq $s.kvConnector "sglang" }}
    - --sglang-bootstrap-port={{ $s.sglangBootstrapPort }}
    {{- end }}
    {{- if eq (default "both" .role) "decode" }}
    - --prefiller-allow-list=/etc/kvgate/prefillers/prefillers.yaml
    {{- end }}
    {{- range $s.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "kvgate.downwardEnv" $root | nindent 4 }}
    - name: RUST_LOG
      value: info
    {{- include "kvgate.tracingEnv" $root | nindent 4 }}
  ports:
    {{- range $r := until $dp }}
    - name: {{ if eq $r 0 }}http-proxy{{ else }}http-proxy-{{ $r }}{{ end }}
      containerPort: {{ add $s.ports.proxy $r }}
      protocol: TCP
    {{- end }}
    - name: kvgate-metrics
      containerPort: {{ $s.ports.metrics }}
      protocol: TCP
  livenessProbe:
    httpGet: {path: /health, port: kvgate-metrics}
    periodSeconds: 10
  readinessProbe:
    httpGet: {path: /ready, port: kvgate-metrics}
    periodSeconds: 2
    failureThreshold: 2
  resources:
    {{- toYaml $s.resources | nindent 4 }}
  securityContext:
    {{- include "kvgate.containerSecurityContext" $root | nindent 4 }}
  {{- if eq (default "both" .role) "decode" }}
  volumeMounts:
    - name: kvgate-prefillers
      mountPath: /etc/kvgate/prefillers
      readOnly: true
  {{- end }}
{{- end -}}

{{/* The volume the decode pods' sidecars read their prefiller allow-list from. */}}
{{- define "kvgate.sidecarVolumes" -}}
{{- if eq (default "both" .role) "decode" -}}
- name: kvgate-prefillers
  configMap:
    name: {{ include "kvgate.prefillersName" .root }}
    # The operator may create it after the pod starts; the sidecar refuses P/D until it exists.
    optional: true
{{- end -}}
{{- end -}}

{{/* The ConfigMap listing the prefill endpoints decode sidecars may call. */}}
{{- define "kvgate.prefillersName" -}}
{{- default (include "kvgate.componentName" (dict "root" . "component" "prefillers")) .Values.sidecar.prefillerAllowList -}}
{{- end -}}

{{/* vLLM's and SGLang's --kv-events-config for the sidecar's ports (rank 0; rank r adds r). */}}
{{- define "kvgate.kvEventsConfig" -}}
{{- $s := .Values.sidecar -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $s.engine.kvEventsPort)) "replay_endpoint" (printf "tcp://*:%d" (int $s.engine.replayPort)) | toJson -}}
{{- end -}}

{{/* An engine container's securityContext: no privilege escalation, no capabilities,
RuntimeDefault seccomp; root and a writable file system as vLLM's and SGLang's images need.
A model server's `securityContext` replaces it. */}}
{{- define "kvgate.engineSecurityContext" -}}
{{- if .securityContext -}}
{{- toYaml .securityContext -}}
{{- else -}}
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}
{{- end -}}
