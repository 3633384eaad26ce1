{{/* Names, labels and small shared pieces of the Tandem chart. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name, short enough to take a "-prefill"/"-router" suffix. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "router"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of every object of one component: (dict "root" $ "component" "router"). */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .root }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{/*
A number as the CLI reads it. Values set with --set-json or through an SDK arrive as float64,
which Go would print as 1e+06; whole numbers are printed as integers.
*/}}
{{- define "tandem.number" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/*
CLI flags from a map of camelCase flag names (pageSize -> --page-size), as YAML list items in
key order. null and false are left out (the CLI default applies); true is a bare switch.
*/}}
{{- define "tandem.flags" -}}
{{- range $key := keys . | sortAlpha }}
{{- $value := get $ $key }}
{{- if kindIs "bool" $value }}
{{- if $value }}
- --{{ kebabcase $key }}
{{- end }}
{{- else if not (kindIs "invalid" $value) }}
- --{{ kebabcase $key }}
- {{ include "tandem.number" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The --model argument: a directory under the model mount, or an absolute path in the image. */}}
{{- define "tandem.modelPath" -}}
{{- $model := .Values.model }}
{{- if eq $model.source "image" }}
{{- $model.path }}
{{- else if $model.path }}
{{- printf "%s/%s" (trimSuffix "/" $model.mountPath) (trimPrefix "/" $model.path) }}
{{- else }}
{{- $model.mountPath }}
{{- end }}
{{- end }}

{{/* The model volume (none when the weights are in the image). */}}
{{- define "tandem.modelVolume" -}}
{{- $model := .Values.model }}
{{- if eq $model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $model.pvc.claimName }}
    readOnly: {{ $model.pvc.readOnly }}
{{- else if eq $model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $model.hostPath.path }}
    type: {{ $model.hostPath.type }}
{{- else if eq $model.source "initContainer" }}
- name: model
  emptyDir:
    {{- with $model.initContainer.sizeLimit }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
{{- end }}
{{- end }}

{{- define "tandem.modelVolumeMount" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ ne .Values.model.source "initContainer" }}
{{- end }}
{{- end }}

{{/* OpenTelemetry env of one component: (dict "root" $ "component" "router"). */}}
{{- define "tandem.otelEnv" -}}
{{- $otel := .root.Values.otel }}
{{- if $otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $otel.protocol | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" $otel.serviceNamePrefix .component | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $otel.tracesSampler | quote }}
{{- with $otel.tracesSamplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | toString | quote }}
{{- end }}
{{- $attrs := printf "k8s.namespace.name=%s,k8s.pod.name=$(POD_NAME)" .root.Release.Namespace }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ ternary (printf "%s,%s" $attrs $otel.resourceAttributes) $attrs (ne $otel.resourceAttributes "") | quote }}
{{- end }}
{{- end }}

{{/* Env every Tandem container gets: pod identity and writable cache locations. */}}
{{- define "tandem.baseEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /cache
- name: XDG_CACHE_HOME
  value: /cache
- name: TMPDIR
  value: /tmp
{{- end }}

{{/* Writable emptyDirs behind a read-only root filesystem. */}}
{{- define "tandem.scratchVolumes" -}}
- name: cache
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "tandem.scratchVolumeMounts" -}}
- name: cache
  mountPath: /cache
- name: tmp
  mountPath: /tmp
{{- end }}

{{- define "tandem.podSecurityContext" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod-level scheduling keys of one component's values. */}}
{{- /*
Pod scheduling of one component; takes (dict "root" $ "component" "decode"). Without topologySpreadConstraints of
its own, a component's replicas are spread over topologySpread.topologyKeys (nodes, then zones): one node or zone
going down takes out as few replicas as possible.
*/ -}}
{{- define "tandem.scheduling" -}}
{{- $values := index .root.Values .component }}
{{- with $values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $spread := .root.Values.topologySpread }}
{{- if $values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml $values.topologySpreadConstraints | nindent 2 }}
{{- else if $spread.enabled }}
topologySpreadConstraints:
{{- range $spread.topologyKeys }}
  - maxSkew: {{ $spread.maxSkew }}
    topologyKey: {{ . }}
    whenUnsatisfiable: {{ $spread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "tandem.selectorLabels" (dict "root" $.root "component" $.component) | trim | nindent 8 }}
{{- end }}
{{- end }}
{{- end }}

{{/* The mutual-TLS Secret's name. */}}
{{- define "tandem.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "tandem.fullname" .)) }}
{{- end }}

{{/* The --tls-* flags of every process (root context). */}}
{{- define "tandem.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-ca-file
- /etc/tandem/tls/ca.crt
- --tls-cert-file
- /etc/tandem/tls/tls.crt
- --tls-key-file
- /etc/tandem/tls/tls.key
{{- with .Values.tls.serverName }}
- --tls-server-name
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "tandem.tlsSecretName" . }}
    defaultMode: 288 # 0440: the key is readable by the pod's fsGroup only
{{- end }}
{{- end }}

{{- define "tandem.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- end }}
