{{/*
The gRPC worker roles (prefill, decode, unified worker) share one shape: a Deployment, a headless
Service the router resolves to find every ready pod, and a PodDisruptionBudget.
Each define takes (dict "root" $ "component" "prefill").
*/}}

{{/* Resources with the GPU and RDMA device-plugin resources added. */}}
{{- define "tandem.worker.resources" -}}
{{- $values := index .root.Values .component }}
{{- $resources := deepCopy ($values.resources | default dict) }}
{{- $limits := deepCopy (get $resources "limits" | default dict) }}
{{- $ranks := mul (int $values.dp) (int $values.tp) (int $values.pp) }}
{{- if and (gt (int $values.gpus) 0) (ne (int $values.gpus) (int $ranks)) }}
{{- fail (printf "%s.gpus (%v) must be 0 (CPU) or equal dp x tp x pp (%v x %v x %v = %v): one GPU per rank of each data-parallel replica" .component $values.gpus $values.dp $values.tp $values.pp $ranks) }}
{{- end }}
{{- if gt (int $values.gpus) 0 }}
{{- $_ := set $limits .root.Values.gpuResourceName (int $values.gpus) }}
{{- end }}
{{- if and .root.Values.rdma.enabled (ne .component "worker") }}
{{- $_ := set $limits .root.Values.rdma.resourceName (int .root.Values.rdma.count) }}
{{- end }}
{{- if $limits }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{- define "tandem.worker.args" -}}
{{- $root := .root }}
{{- $values := index $root.Values .component }}
{{- $engine := mergeOverwrite (deepCopy $root.Values.engine) ($values.engine | default dict) }}
{{- if kindIs "invalid" $engine.device }}
{{- $_ := set $engine "device" (ternary "cuda" "cpu" (gt (int $values.gpus) 0)) }}
{{- end }}
- --log-level
- {{ $root.Values.logLevel }}
- {{ .component }}
- --host
- 0.0.0.0
- --port
- {{ include "tandem.number" $values.port | quote }}
{{- if eq .component "prefill" }}
- --bootstrap-port
- {{ include "tandem.number" $values.bootstrapPort | quote }}
{{- end }}
- --model
- {{ required "model.path is required when model.source is image" (include "tandem.modelPath" $root) | quote }}
{{- with $root.Values.model.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
- --drain-timeout
- {{ include "tandem.number" $values.drainTimeoutSeconds | quote }}
{{- if gt (int $values.tp) 1 }}
- --tp-size
- {{ include "tandem.number" $values.tp | quote }}
{{- end }}
{{- if ne (mod (int $values.tp) (int $values.ep)) 0 }}
{{- fail (printf "%s.ep (%v) must divide %s.tp (%v): the expert-parallel ranks are the tensor-parallel ranks (ep adds no GPUs; raise tp to a multiple of ep)" .component $values.ep .component $values.tp) }}
{{- end }}
{{- if gt (int $values.ep) 1 }}
- --ep-size
- {{ include "tandem.number" $values.ep | quote }}
{{- end }}
{{- if gt (int $values.pp) 1 }}
- --pp-size
- {{ include "tandem.number" $values.pp | quote }}
{{- end }}
{{- if gt (int $values.dp) 1 }}
{{- if $root.Values.metrics.enabled }}
{{- fail (printf "%s.dp (%v) with metrics.enabled: per-replica metrics of a data-parallel worker are not implemented yet (the worker refuses --metrics-port with --dp-size > 1); read per-rank load from GetLoads" .component $values.dp) }}
{{- end }}
- --dp-size
- {{ include "tandem.number" $values.dp | quote }}
{{- end }}
{{- include "tandem.flags" $engine }}
{{- if ne .component "worker" }}
{{- include "tandem.flags" $root.Values.transfer }}
{{- end }}
{{- if $root.Values.metrics.enabled }}
- --metrics-port
- {{ include "tandem.number" $root.Values.metrics.port | quote }}
{{- end }}
{{- include "tandem.tlsArgs" $root }}
{{- if $root.Values.tls.enabled }}
- --health-port
- {{ include "tandem.number" $root.Values.tls.healthPort | quote }}
{{- else }}
{{- /* Pods listen on 0.0.0.0: a plaintext worker there must say so (the NetworkPolicy is then its only fence). */}}
- --insecure
{{- end }}
{{- with $values.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tandem.worker.env" -}}
{{- $root := .root }}
{{- $values := index $root.Values .component }}
{{- include "tandem.baseEnv" $root }}
{{- if ne .component "worker" }}
{{- with $root.Values.nixl.ucxTls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with $root.Values.nixl.ucxNetDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- range $name := keys $root.Values.nixl.env | sortAlpha }}
- name: {{ $name }}
  value: {{ get $root.Values.nixl.env $name | toString | quote }}
{{- end }}
{{- end }}
{{- include "tandem.otelEnv" . }}
{{- with $values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tandem.worker.deployment" -}}
{{- $root := .root }}
{{- $component := .component }}
{{- $values := index $root.Values $component }}
{{- $grace := $values.terminationGracePeriodSeconds }}
{{- $minGrace := add (int $values.drainTimeoutSeconds) (int $values.preStopSleepSeconds) }}
{{- if kindIs "invalid" $grace }}
{{- $grace = add $minGrace 15 }}
{{- else if le (int $grace) $minGrace }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed drainTimeoutSeconds + preStopSleepSeconds (%d), or in-flight requests are killed mid-drain" $component $grace $minGrace) }}
{{- end }}
{{- $securityContext := deepCopy $root.Values.securityContext }}
{{- if and $root.Values.rdma.enabled $root.Values.rdma.ipcLock (ne $component "worker") }}
{{- $caps := deepCopy ($securityContext.capabilities | default dict) }}
{{- $_ := set $caps "add" (append ($caps.add | default list) "IPC_LOCK" | uniq) }}
{{- $_ := set $securityContext "capabilities" $caps }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | trim | nindent 4 }}
spec:
  {{- if not (and $root.Values.planner.enabled (ne $root.Values.planner.autoscaler "none") (ne $component "worker")) }}
  replicas: {{ $values.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | trim | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      # GPUs are scarce: replace pods one at a time without asking for a spare node.
      maxSurge: 0
      maxUnavailable: 1
  template:
    metadata:
      labels:
        {{- include "tandem.selectorLabels" . | trim | nindent 8 }}
        app.kubernetes.io/part-of: tandem
        {{- with merge (deepCopy ($values.podLabels | default dict)) ($root.Values.podLabels | default dict) }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with merge (deepCopy ($values.podAnnotations | default dict)) ($root.Values.podAnnotations | default dict) }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "tandem.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      terminationGracePeriodSeconds: {{ $grace }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "tandem.podSecurityContext" $root | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- with include "tandem.scheduling" . | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- if eq $root.Values.model.source "initContainer" }}
      {{- $init := $root.Values.model.initContainer }}
      initContainers:
        - name: fetch-model
          image: {{ printf "%s:%s" (required "model.initContainer.image.repository is required when model.source is initContainer" $init.image.repository) ($init.image.tag | toString) }}
          imagePullPolicy: {{ $init.image.pullPolicy }}
          {{- with $init.command }}
          command:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $init.args }}
          args:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          env:
            - name: MODEL_DIR
              value: {{ $root.Values.model.mountPath | quote }}
            {{- include "tandem.baseEnv" $root | trim | nindent 12 }}
            {{- with $init.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- with $init.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
            {{- include "tandem.scratchVolumeMounts" $root | trim | nindent 12 }}
      {{- end }}
      containers:
        - name: {{ $component }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["tandem"]
          args:
            {{- include "tandem.worker.args" . | trim | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $values.port }}
              protocol: TCP
            {{- if eq $component "prefill" }}
            - name: bootstrap
              containerPort: {{ $values.bootstrapPort }}
              protocol: TCP
            {{- end }}
            {{- if $root.Values.metrics.enabled }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- end }}
            {{- if $root.Values.tls.enabled }}
            - name: health
              containerPort: {{ $root.Values.tls.healthPort }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "tandem.worker.env" . | trim | nindent 12 }}
          # SglangScheduler and grpc.health.v1 share the port; health flips to NOT_SERVING on drain. With mutual
          # TLS the kubelet (no certificate) probes the plaintext health-only port instead.
          {{- $probePort := ternary $root.Values.tls.healthPort $values.port $root.Values.tls.enabled }}
          startupProbe:
            grpc:
              port: {{ $probePort }}
            periodSeconds: {{ $values.startupProbe.periodSeconds }}
            failureThreshold: {{ $values.startupProbe.failureThreshold }}
          readinessProbe:
            grpc:
              port: {{ $probePort }}
            periodSeconds: {{ $values.readinessProbe.periodSeconds }}
            failureThreshold: {{ $values.readinessProbe.failureThreshold }}
          livenessProbe:
            grpc:
              port: {{ $probePort }}
            periodSeconds: {{ $values.livenessProbe.periodSeconds }}
            failureThreshold: {{ $values.livenessProbe.failureThreshold }}
          {{- if gt (int $values.preStopSleepSeconds) 0 }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $values.preStopSleepSeconds }}
          {{- end }}
          {{- with (include "tandem.worker.resources" . | fromYaml) }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $securityContext | nindent 12 }}
          volumeMounts:
            {{- with include "tandem.modelVolumeMount" $root | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- include "tandem.scratchVolumeMounts" $root | trim | nindent 12 }}
            {{- with include "tandem.tlsVolumeMount" $root | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- if $root.Values.sharedMemory.enabled }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- with $values.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- with include "tandem.modelVolume" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- include "tandem.scratchVolumes" $root | trim | nindent 8 }}
        {{- with include "tandem.tlsVolume" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if $root.Values.sharedMemory.enabled }}
        - name: dshm
          emptyDir:
            medium: Memory
            {{- with $root.Values.sharedMemory.sizeLimit }}
            sizeLimit: {{ . }}
            {{- end }}
        {{- end }}
        {{- with $values.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}

{{/*
Headless: DNS returns one A record per ready pod, so the router (--*-dns) sees every worker
and drops draining ones. Not-ready pods stay out of DNS.
*/}}
{{- define "tandem.worker.service" -}}
{{- $root := .root }}
{{- $values := index $root.Values .component }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "tandem.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | trim | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "tandem.selectorLabels" . | trim | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $values.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if eq .component "prefill" }}
    - name: bootstrap
      port: {{ $values.bootstrapPort }}
      targetPort: bootstrap
      protocol: TCP
    {{- end }}
    {{- if $root.Values.metrics.enabled }}
    - name: metrics
      port: {{ $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
{{- end }}

{{- define "tandem.worker.pdb" -}}
{{- $values := index .root.Values .component }}
{{- if $values.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | trim | nindent 4 }}
spec:
  maxUnavailable: {{ $values.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | trim | nindent 6 }}
{{- end }}
{{- end }}

{{/* The headless Service's fully qualified DNS name. */}}
{{- define "tandem.worker.dnsName" -}}
{{- printf "%s.%s.svc.%s" (include "tandem.componentName" .) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}
