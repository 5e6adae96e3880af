{{/* Names ------------------------------------------------------------------- */}}

{{- define "fraud-scoring.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name, at most 52 characters so that suffixes such as
"-streaming" and CronJob's 11-character job suffix still fit in 63. */}}
{{- define "fraud-scoring.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fraud-scoring.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels ------------------------------------------------------------------ */}}

{{- define "fraud-scoring.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fraud-scoring.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "fraud-scoring.labels" -}}
helm.sh/chart: {{ include "fraud-scoring.chart" . }}
{{ include "fraud-scoring.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fraud-scoring
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels for one component: include with (dict "ctx" $ "component" "scoring"). */}}
{{- define "fraud-scoring.componentLabels" -}}
{{ include "fraud-scoring.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "fraud-scoring.componentSelectorLabels" -}}
{{ include "fraud-scoring.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "fraud-scoring.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fraud-scoring.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Images ------------------------------------------------------------------ */}}

{{- define "fraud-scoring.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .defaultTag .image.tag) }}
{{- end }}
{{- end }}

{{- define "fraud-scoring.image" -}}
{{- include "fraud-scoring.imageRef" (dict "image" .Values.image "defaultTag" .Chart.AppVersion) }}
{{- end }}

{{- define "fraud-scoring.jobsImage" -}}
{{- include "fraud-scoring.imageRef" (dict "image" .Values.jobsImage "defaultTag" (printf "%s-jobs" .Chart.AppVersion)) }}
{{- end }}

{{- define "fraud-scoring.gpuImage" -}}
{{- include "fraud-scoring.imageRef" (dict "image" .Values.gpu.image "defaultTag" (printf "%s-gpu" .Chart.AppVersion)) }}
{{- end }}

{{/* Redis ------------------------------------------------------------------- */}}

{{- define "fraud-scoring.redisFullname" -}}
{{- printf "%s-redis" (include "fraud-scoring.fullname" .) }}
{{- end }}

{{- define "fraud-scoring.redisHost" -}}
{{- if .Values.redis.inChart.enabled }}
{{- include "fraud-scoring.redisFullname" . }}
{{- else }}
{{- required "redis.host is required when redis.inChart.enabled is false" .Values.redis.host }}
{{- end }}
{{- end }}

{{/* Whether the pods authenticate to Redis with a password from a Secret. */}}
{{- define "fraud-scoring.redisAuth" -}}
{{- if or .Values.redis.existingSecret .Values.redis.password .Values.redis.inChart.enabled }}true{{ end }}
{{- end }}

{{- define "fraud-scoring.redisSecretName" -}}
{{- default (printf "%s-redis-auth" (include "fraud-scoring.fullname" .)) .Values.redis.existingSecret }}
{{- end }}

{{- define "fraud-scoring.redisSecretKey" -}}
{{- if .Values.redis.existingSecret }}
{{- .Values.redis.existingSecretPasswordKey }}
{{- else -}}
redis-password
{{- end }}
{{- end }}

{{/* REDIS_URL without the password, and FRAUD_REDIS_PASSWORD_FILE naming the Secret's
key mounted as a file (fraud-scoring puts it into the URL): the password is in no
environment variable. */}}
{{- define "fraud-scoring.redisEnv" -}}
{{- $scheme := ternary "rediss" "redis" .Values.redis.tls }}
{{- $inChart := .Values.redis.inChart.enabled }}
{{- $hostPort := printf "%s:%d" (include "fraud-scoring.redisHost" .) (ternary 6379 (int .Values.redis.port) $inChart) }}
{{- $user := ternary "" .Values.redis.username $inChart }}
{{- $userinfo := ternary (printf "%s@" $user) "" (ne $user "") }}
- name: REDIS_URL
  value: {{ printf "%s://%s%s/%d" $scheme $userinfo $hostPort (int .Values.redis.db) | quote }}
{{- if .Values.redis.cluster }}
{{- if $inChart }}
{{- fail "redis.cluster needs an external cluster: the in-chart Redis is one server" }}
{{- end }}
{{- if ne (int .Values.redis.db) 0 }}
{{- fail "redis.cluster needs redis.db: 0 (a Redis Cluster has database 0 only)" }}
{{- end }}
- name: FRAUD_REDIS_CLUSTER
  value: "true"
{{- end }}
{{- if include "fraud-scoring.redisAuth" . }}
- name: FRAUD_REDIS_PASSWORD_FILE
  value: {{ printf "%s/password" (include "fraud-scoring.redisAuthMountPath" .) | quote }}
{{- end }}
{{- if .Values.redis.caSecret }}
{{- if not .Values.redis.tls }}
{{- fail "redis.caSecret needs redis.tls: true" }}
{{- end }}
- name: FRAUD_REDIS_CA_FILE
  value: {{ printf "%s/%s" (include "fraud-scoring.redisCaMountPath" .) .Values.redis.caSecretKey | quote }}
{{- end }}
{{- end }}

{{- define "fraud-scoring.redisCaMountPath" -}}/etc/fraud-scoring-redis-ca{{- end }}

{{- define "fraud-scoring.redisAuthMountPath" -}}/etc/fraud-scoring-redis-auth{{- end }}

{{- define "fraud-scoring.testKeyMountPath" -}}/etc/fraud-scoring-test-key{{- end }}

{{/* Shared pod pieces ------------------------------------------------------- */}}

{{- define "fraud-scoring.configMountPath" -}}/etc/fraud-scoring{{- end }}

{{/* Environment every fraud-scoring container gets. Pass (dict "ctx" $ "component" "x"). */}}
{{- define "fraud-scoring.commonEnv" -}}
{{- $ := .ctx }}
{{ include "fraud-scoring.redisEnv" $ | trim }}
- name: FRAUD_DATA_DIR
  value: {{ printf "%s/data" $.Values.storage.mountPath | quote }}
- name: FRAUD_MODEL_REPO
  value: {{ printf "%s/models" $.Values.storage.mountPath | quote }}
- name: FRAUD_MODEL_NAME
  value: {{ $.Values.model.name | quote }}
- name: FRAUD_MODEL_VERSION
  value: {{ $.Values.model.version | quote }}
{{- with $.Values.model.challengerVersion }}
- name: FRAUD_CHALLENGER_VERSION
  value: {{ . | quote }}
{{- end }}
{{- if $.Values.model.canaryPercent }}
- name: FRAUD_CANARY_PERCENT
  value: {{ $.Values.model.canaryPercent | quote }}
{{- end }}
- name: FRAUD_BATCH_AVAILABLE_AFTER_S
  value: {{ $.Values.batchAvailableAfterSeconds | quote }}
- name: FRAUD_FEATURE_STORE_YAML
  value: {{ printf "%s/feature_store.yaml" (include "fraud-scoring.configMountPath" $) | quote }}
{{- if $.Values.features }}
- name: FRAUD_FEATURES_FILE
  value: {{ printf "%s/features.yaml" (include "fraud-scoring.configMountPath" $) | quote }}
{{- end }}
- name: FRAUD_STREAM_SOURCE
  value: {{ $.Values.streaming.source | quote }}
- name: FRAUD_STREAM_NAME
  value: {{ $.Values.streaming.streamName | quote }}
{{- with $.Values.streaming.kafka.bootstrapServers }}
- name: FRAUD_KAFKA_BOOTSTRAP
  value: {{ . | quote }}
{{- end }}
{{- with $.Values.decisionLog }}
{{- if and (eq .backend "kafka") (not $.Values.streaming.kafka.bootstrapServers) }}
{{- fail "decisionLog.backend kafka needs streaming.kafka.bootstrapServers" }}
{{- end }}
- name: FRAUD_DECISION_LOG
  value: {{ .backend | quote }}
{{- if .url }}
- name: FRAUD_DECISION_LOG_URL
  value: {{ .url | quote }}
{{- end }}
- name: FRAUD_DECISION_LOG_STREAM
  value: {{ .stream | quote }}
- name: FRAUD_FEEDBACK_STREAM
  value: {{ .feedbackStream | quote }}
- name: FRAUD_DECISION_LOG_RETENTION_S
  value: {{ .retentionSeconds | quote }}
- name: FRAUD_DECISION_LOG_BUFFER
  value: {{ .buffer | int64 | quote }}
{{- end }}
{{- if $.Values.piiKey.existingSecret }}
- name: FRAUD_PII_KEY_FILE
  value: {{ printf "%s/pii-key" (include "fraud-scoring.piiKeyMountPath" $) | quote }}
{{- else if regexMatch "(?m)^\\s*pii:\\s*true\\b" (toString $.Values.features) }}
{{- fail "features declares a pii: true field: set piiKey.existingSecret to a Secret holding the PII hash key (docs/data-contract.md, Your own fields)" }}
{{- end }}
- name: HOME
  value: /tmp
- name: K8S_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_SERVICE_NAME
  value: {{ printf "fraud-scoring-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ list (printf "k8s.namespace.name=%s" $.Release.Namespace) "k8s.pod.name=$(K8S_POD_NAME)" (printf "service.instance.id=$(K8S_POD_NAME)") $.Values.otel.resourceAttributes | compact | join "," | quote }}
{{- with $.Values.otel.endpoint }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: http/protobuf
{{- end }}
{{- with $.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "fraud-scoring.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: config
  mountPath: {{ include "fraud-scoring.configMountPath" . }}
  readOnly: true
- name: storage
  mountPath: {{ .Values.storage.mountPath }}
{{- if .Values.redis.caSecret }}
- name: redis-ca
  mountPath: {{ include "fraud-scoring.redisCaMountPath" . }}
  readOnly: true
{{- end }}
{{- if include "fraud-scoring.redisAuth" . }}
- name: redis-auth
  mountPath: {{ include "fraud-scoring.redisAuthMountPath" . }}
  readOnly: true
{{- end }}
{{- if .Values.piiKey.existingSecret }}
- name: pii-key
  mountPath: {{ include "fraud-scoring.piiKeyMountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "fraud-scoring.piiKeyMountPath" -}}/etc/fraud-scoring-pii{{- end }}

{{- define "fraud-scoring.storageClaimName" -}}
{{- default (printf "%s-storage" (include "fraud-scoring.fullname" .)) .Values.storage.pvc.existingClaim }}
{{- end }}

{{- define "fraud-scoring.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
- name: config
  configMap:
    name: {{ include "fraud-scoring.fullname" . }}-config
- name: storage
{{- if eq .Values.storage.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "fraud-scoring.storageClaimName" . }}
{{- else }}
{{- if not .Values.storage.volume }}
{{- fail "storage.volume must be set when storage.type is volume" }}
{{- end }}
  {{- toYaml .Values.storage.volume | nindent 2 }}
{{- end }}
{{- with .Values.redis.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ . }}
{{- end }}
{{- if include "fraud-scoring.redisAuth" . }}
- name: redis-auth
  secret:
    secretName: {{ include "fraud-scoring.redisSecretName" . }}
    items:
      - key: {{ include "fraud-scoring.redisSecretKey" . }}
        path: password
    defaultMode: 0440
{{- end }}
{{- with .Values.piiKey.existingSecret }}
- name: pii-key
  secret:
    secretName: {{ . }}
    items:
      - key: {{ $.Values.piiKey.existingSecretKey }}
        path: pii-key
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every fraud-scoring pod. */}}
{{- define "fraud-scoring.podCommon" -}}
serviceAccountName: {{ include "fraud-scoring.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automount }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A fraud-scoring container running one subcommand, for Jobs (the jobs image). The image's
entrypoint (tini -- fraud-scoring) runs it: only args are set, for every component.
(dict "ctx" $ "name" "x" "args" (list ...) "resources" {...} "component" "x") */}}
{{- define "fraud-scoring.jobContainer" -}}
- name: {{ .name }}
  image: {{ include "fraud-scoring.jobsImage" .ctx }}
  imagePullPolicy: {{ .ctx.Values.jobsImage.pullPolicy }}
  args:
    {{- toYaml .args | nindent 4 }}
  env:
    {{- include "fraud-scoring.commonEnv" (dict "ctx" .ctx "component" .component) | trim | nindent 4 }}
  {{- with .ctx.Values.extraEnvFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .ctx.Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  volumeMounts:
    {{- include "fraud-scoring.volumeMounts" .ctx | nindent 4 }}
{{- end }}

{{/* Egress rules for every release pod when networkPolicy.restrictEgress is on. */}}
{{- define "fraud-scoring.egressRules" -}}
{{- if .Values.networkPolicy.restrictEgress }}
egress:
  # DNS
  - ports:
      - port: 53
        protocol: UDP
      - port: 53
        protocol: TCP
  # Redis (in-chart or external)
  - ports:
      - port: {{ ternary 6379 (int .Values.redis.port) .Values.redis.inChart.enabled }}
        protocol: TCP
  {{- with .Values.networkPolicy.egressTo }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* API keys (scoring.auth) ------------------------------------------------------ */}}

{{- define "fraud-scoring.authRequired" -}}
{{- if eq .Values.scoring.auth.mode "required" }}true{{ end }}
{{- end }}

{{- define "fraud-scoring.authSecretName" -}}
{{- default (printf "%s-api-keys" (include "fraud-scoring.fullname" .)) .Values.scoring.auth.existingSecret }}
{{- end }}

{{- define "fraud-scoring.authSecretKey" -}}
{{- if .Values.scoring.auth.existingSecret }}
{{- .Values.scoring.auth.existingSecretKey }}
{{- else -}}
api-keys.jsonl
{{- end }}
{{- end }}

{{- define "fraud-scoring.authMountPath" -}}/etc/fraud-scoring-auth{{- end }}

{{/* Plaintext keys for the chart's own callers: Secrets the installer creates. */}}
{{- define "fraud-scoring.testKeySecret" -}}
{{- default (printf "%s-test-key" (include "fraud-scoring.fullname" .)) .Values.tests.apiKeySecret }}
{{- end }}

{{- define "fraud-scoring.metricsKeySecret" -}}
{{- default (printf "%s-metrics-key" (include "fraud-scoring.fullname" .)) .Values.metrics.serviceMonitor.apiKeySecret }}
{{- end }}

{{/* PromQL label matchers selecting this release's series, as the Prometheus Operator
labels what the ServiceMonitor (job: the Service's name) and the PodMonitor (job:
<namespace>/<name>) scrape. */}}
{{- define "fraud-scoring.promScoring" -}}
namespace="{{ .Release.Namespace }}",job="{{ include "fraud-scoring.fullname" . }}"
{{- end }}

{{- define "fraud-scoring.promStreaming" -}}
namespace="{{ .Release.Namespace }}",job="{{ .Release.Namespace }}/{{ include "fraud-scoring.fullname" . }}-streaming"
{{- end }}

{{- define "fraud-scoring.promScoreStream" -}}
namespace="{{ .Release.Namespace }}",job="{{ .Release.Namespace }}/{{ include "fraud-scoring.fullname" . }}-score-stream"
{{- end }}

{{- /* A stopped updater's series go stale (its pod gone, or not scraped): max() over the
last hour still sees when it last stepped, and absent() covers the rest (only where the
chart's PodMonitor scrapes it, else it would always fire). Both sides carry no labels, so
the alert stays one alert as it moves from one to the other. */}}
{{- define "fraud-scoring.updaterStalledExpr" -}}
time() - max(max_over_time({{ .sel }}[1h])) > 120
{{- if .scraped }} or sum(absent({{ .sel }})){{ end }}
{{- end }}
