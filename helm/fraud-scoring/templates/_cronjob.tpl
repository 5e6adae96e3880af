{{/* One CronJob running a fraud-scoring subcommand.
(dict "ctx" $ "component" "batch" "job" .Values.batch "args" (list "batch")) */}}
{{- define "fraud-scoring.cronjob" -}}
{{- $ := .ctx }}
{{- $j := .job }}
apiVersion: batch/v1
kind: CronJob
metadata:
  namespace: {{ $.Release.Namespace }}
  name: {{ include "fraud-scoring.fullname" $ }}-{{ .component }}
  labels:
    {{- include "fraud-scoring.componentLabels" (dict "ctx" $ "component" .component) | nindent 4 }}
spec:
  schedule: {{ $j.schedule | quote }}
  timeZone: {{ $.Values.jobs.timeZone | quote }}
  # Runs are idempotent per day but must never overlap on the same day's files.
  concurrencyPolicy: Forbid
  startingDeadlineSeconds: {{ $.Values.jobs.startingDeadlineSeconds }}
  suspend: {{ $j.suspend }}
  successfulJobsHistoryLimit: {{ $.Values.jobs.successfulJobsHistoryLimit }}
  failedJobsHistoryLimit: {{ $.Values.jobs.failedJobsHistoryLimit }}
  jobTemplate:
    metadata:
      labels:
        {{- include "fraud-scoring.componentLabels" (dict "ctx" $ "component" .component) | nindent 8 }}
    spec:
      backoffLimit: {{ $j.backoffLimit }}
      activeDeadlineSeconds: {{ $j.activeDeadlineSeconds }}
      ttlSecondsAfterFinished: {{ $.Values.jobs.ttlSecondsAfterFinished }}
      template:
        metadata:
          labels:
            {{- include "fraud-scoring.componentLabels" (dict "ctx" $ "component" .component) | nindent 12 }}
          annotations:
            checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") $ | sha256sum }}
            {{- with $.Values.podAnnotations }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
        spec:
          {{- include "fraud-scoring.podCommon" $ | nindent 10 }}
          restartPolicy: Never
          containers:
            {{- include "fraud-scoring.jobContainer" (dict "ctx" $ "name" .component "args" (concat .args $j.extraArgs) "resources" $j.resources "component" .component) | nindent 12 }}
          volumes:
            {{- include "fraud-scoring.volumes" $ | nindent 12 }}
          {{- with $j.nodeSelector }}
          nodeSelector:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $j.tolerations }}
          tolerations:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $j.affinity }}
          affinity:
            {{- toYaml . | nindent 12 }}
          {{- end }}
{{- end }}
