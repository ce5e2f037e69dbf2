{{- define "gpuledger.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "gpuledger.labels" -}}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuledger
{{- end -}}

{{- define "gpuledger.checkNamespace" -}}
{{- if ne .Release.Namespace "gpuledger-system" -}}
{{- fail "install gpuledger into the namespace gpuledger-system (-n gpuledger-system --create-namespace): the kubectl plugin and the components' addresses rely on it" -}}
{{- end -}}
{{- if not (has .Values.scheduler.mode (list "second" "default")) -}}
{{- fail (printf "scheduler.mode must be \"second\" or \"default\", not %q" .Values.scheduler.mode) -}}
{{- end -}}
{{- if and (not .Values.etcd.bundled) (not .Values.etcd.endpoints) -}}
{{- fail "etcd.bundled=false needs etcd.endpoints (comma-separated client URLs)" -}}
{{- end -}}
{{- end -}}
