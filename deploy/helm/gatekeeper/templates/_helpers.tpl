{{/* Names and labels shared by every template. */}}
{{- define "gatekeeper.fullname" -}}
{{- if .Values.fullnameOverride -}}{{ .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}{{- else -}}gatekeeper{{- end -}}
{{- end -}}
{{- define "gatekeeper.webhookName" -}}{{ include "gatekeeper.fullname" . }}-webhook{{- end -}}
{{- define "gatekeeper.tlsSecret" -}}{{ include "gatekeeper.webhookName" . }}-tls{{- end -}}
{{- define "gatekeeper.labels" -}}
app.kubernetes.io/name: gatekeeper
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
{{- define "gatekeeper.selector" -}}
app.kubernetes.io/name: gatekeeper
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: webhook
{{- end -}}
{{- define "gatekeeper.image" -}}
{{- if .Values.image.digest -}}{{ .Values.image.repository }}@{{ .Values.image.digest }}{{- else -}}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}
{{- end -}}
{{/* namespaceSelector: never the webhook's own namespace, kube-system, extra exemptions, or a namespace
     carrying the emergency exemption label. */}}
{{- define "gatekeeper.namespaceSelector" -}}
matchExpressions:
- key: kubernetes.io/metadata.name
  operator: NotIn
  values:
  {{- range (concat (list .Release.Namespace "kube-system") .Values.exemptions.namespaces | uniq | sortAlpha) }}
  - {{ . }}
  {{- end }}
- key: {{ .Values.exemptions.label }}
  operator: NotIn
  values: ["true"]
{{- end -}}
{{- define "gatekeeper.objectSelector" -}}
{{- if .Values.exemptions.objectLabel -}}
objectSelector:
  matchExpressions:
  - key: {{ .Values.exemptions.label }}
    operator: NotIn
    values: ["true"]
{{- end }}
{{- end -}}
{{/* The caBundle the webhook configurations carry: the CA, never the serving certificate, so a
     rotated serving certificate is trusted before and after the kubelet refreshes the mounted Secret. */}}
{{- define "gatekeeper.certs" -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (include "gatekeeper.tlsSecret" .) -}}
{{- if and $secret (index $secret.data "ca.crt") -}}
ca: {{ index $secret.data "ca.crt" }}
crt: {{ index $secret.data "tls.crt" }}
key: {{ index $secret.data "tls.key" }}
{{- else -}}
{{- $svc := include "gatekeeper.webhookName" . -}}
{{- $ca := genCA "gatekeeper-webhook-ca" (int .Values.certificates.generated.caDays) -}}
{{- $dns := list (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) -}}
{{- $cert := genSignedCert (printf "%s.%s.svc" $svc .Release.Namespace) nil $dns (int .Values.certificates.generated.certDays) $ca -}}
ca: {{ $ca.Cert | b64enc }}
crt: {{ $cert.Cert | b64enc }}
key: {{ $cert.Key | b64enc }}
{{- end -}}
{{- end -}}
