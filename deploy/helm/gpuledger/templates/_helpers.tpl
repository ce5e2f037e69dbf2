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
{{- if and .Values.dra.enabled (ne .Values.scheduler.mode "second") -}}
{{- fail "dra.enabled needs scheduler.mode=second: the DRA scheduler configuration (DynamicResources bindingTimeout, the marker gpuledger.io/dra) is the second scheduler's" -}}
{{- end -}}
{{- if not (has .Values.dra.nodes (list "all" "labelled")) -}}
{{- fail (printf "dra.nodes must be \"all\" or \"labelled\", not %q" .Values.dra.nodes) -}}
{{- end -}}
{{- if and (eq .Values.dra.nodes "labelled") (not .Values.dra.enabled) -}}
{{- fail "dra.nodes=labelled needs dra.enabled=true: without DRA every node agent serves the device plugin" -}}
{{- end -}}
{{- if and .Values.etcd.bundled (not .Values.etcd.tlsSecret) -}}
{{- fail "the bundled etcd demands client certificates: etcd.tlsSecret must name the allocators' (gpuledger-etcd-client, made by deploy/scripts/gpuledger-certs.sh)" -}}
{{- end -}}
{{- if and (not .Values.etcd.bundled) (not .Values.etcd.endpoints) -}}
{{- fail "etcd.bundled=false needs etcd.endpoints (comma-separated client URLs)" -}}
{{- end -}}
{{- end -}}

{{- /* A projected token of the pod's ServiceAccount for the allocators alone (audience
gpuledger); the kubelet renews it in place and the components re-read it. */ -}}
{{- define "gpuledger.tokenVolume" -}}
- name: gpuledger-token
  projected:
    sources:
    - serviceAccountToken:
        audience: gpuledger
        expirationSeconds: 3600
        path: token
{{- end -}}

{{- /* The CA clients of the allocator trust: the script's ConfigMap gpuledger-ca, or with
cert-manager only the ca.crt of the Secret gpuledger-ca-bundle. The cert-manager form comes first
in the list, as the kustomize component's patch puts it (deploy-check compares the two). */ -}}
{{- define "gpuledger.caVolumeCertManager" -}}
{{- if .Values.certManager.enabled }}
- name: ca
  secret:
    items:
    - key: ca.crt
      path: ca.crt
    secretName: gpuledger-ca-bundle
{{- end }}
{{- end -}}

{{- define "gpuledger.caVolumeScript" -}}
{{- if not .Values.certManager.enabled }}
- configMap:
    name: gpuledger-ca
  name: ca
{{- end }}
{{- end -}}

{{- define "gpuledger.webhookCaInjection" -}}
{{- if .Values.certManager.enabled }}
annotations:
  cert-manager.io/inject-ca-from: gpuledger-system/gpuledger-webhook-tls
{{- end }}
{{- end -}}
