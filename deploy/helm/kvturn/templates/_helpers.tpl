{{/*
Names. The full name is cut to 40 characters so that "<fullname>-prefill" stays a valid
StatefulSet name (its pods' controller-revision-hash label adds about 11 more).
*/}}
{{- define "kvturn.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "kvturn.fullname" -}}
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

{{- define "kvturn.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvturn.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "decode"). */}}
{{- define "kvturn.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvturn.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The name of a pool's StatefulSet and of its headless Service: (dict "root" $ "role" "decode"). */}}
{{- define "kvturn.poolName" -}}
{{- printf "%s-%s" (include "kvturn.fullname" .root) .role }}
{{- end }}

{{/*
The stable DNS name of one engine pod: (dict "root" $ "role" "decode" "index" 0), e.g.
kvturn-decode-0.kvturn-decode.default.svc.cluster.local.
*/}}
{{- define "kvturn.engineHost" -}}
{{- $pool := include "kvturn.poolName" (dict "root" .root "role" .role) }}
{{- printf "%s-%d.%s.%s.svc.%s" $pool (int .index) $pool .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{- define "kvturn.gatewayName" -}}
{{- printf "%s-gateway" (include "kvturn.fullname" .) }}
{{- end }}

{{- define "kvturn.redisName" -}}
{{- printf "%s-redis" (include "kvturn.fullname" .) }}
{{- end }}

{{- define "kvturn.controlSecretName" -}}
{{- default (printf "%s-control" (include "kvturn.fullname" .)) .Values.controlSecret.existingSecret }}
{{- end }}

{{- define "kvturn.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "kvturn.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The gateway runs without API keys only when asked to and given none. */}}
{{- define "kvturn.authOpen" -}}
{{- if and .Values.auth.allowOpen (not .Values.auth.existingSecret) (not .Values.auth.keys) }}true{{ end }}
{{- end }}

{{/* The state URL written into the deployment file (empty: none there). */}}
{{- define "kvturn.redisUrl" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc.%s:%d/0" (include "kvturn.redisName" .) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) }}
{{- end }}
{{- end }}

{{/* The engine image: repository:tag. */}}
{{- define "kvturn.engineImage" -}}
{{- printf "%s:%s" .Values.engine.image.repository (toString .Values.engine.image.tag) }}
{{- end }}

{{- define "kvturn.gatewayImage" -}}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) }}
{{- end }}

{{/*
Value combinations that would deploy something broken, and that values.schema.json (which
checks each value on its own) cannot see, fail here at render time with a message that says
what to change. Included once, by the gateway's Deployment.
*/}}
{{- define "kvturn.validate" -}}
{{- $model := required "kvturn: model.name is required (a Hugging Face id or a path in the engine pods)" .Values.model.name }}
{{- $stores := 0 }}
{{- if .Values.redis.enabled }}{{ $stores = add1 $stores }}{{ end }}
{{- if .Values.redis.url }}{{ $stores = add1 $stores }}{{ end }}
{{- if .Values.redis.urlSecret }}{{ $stores = add1 $stores }}{{ end }}
{{- if gt $stores 1 }}
{{- fail "kvturn: give the gateway one Redis: redis.enabled (the chart's own), redis.url or redis.urlSecret, not several" }}
{{- end }}
{{- if and (eq $stores 0) (or (gt (int .Values.gateway.replicas) 1) (gt (int .Values.gateway.workers) 1)) }}
{{- fail (printf "kvturn: gateway.replicas=%d and gateway.workers=%d: several gateway processes share conversations only through Redis; set redis.enabled=true (a Redis deployed by this chart), redis.url or redis.urlSecret" (int .Values.gateway.replicas) (int .Values.gateway.workers)) }}
{{- end }}
{{- if .Values.redis.urlSecret }}
{{- $_ := required "kvturn: redis.urlSecret needs name and key" (and .Values.redis.urlSecret.name .Values.redis.urlSecret.key) }}
{{- end }}
{{- if .Values.auth.operatorKeySecret }}
{{- $_ := required "kvturn: auth.operatorKeySecret needs name and key" (and .Values.auth.operatorKeySecret.name .Values.auth.operatorKeySecret.key) }}
{{- end }}
{{- if .Values.engine.apiKeySecret }}
{{- $_ := required "kvturn: engine.apiKeySecret needs name and key" (and .Values.engine.apiKeySecret.name .Values.engine.apiKeySecret.key) }}
{{- end }}
{{- if .Values.model.hfTokenSecret }}
{{- $_ := required "kvturn: model.hfTokenSecret needs name and key" (and .Values.model.hfTokenSecret.name .Values.model.hfTokenSecret.key) }}
{{- end }}
{{- if and .Values.auth.existingSecret .Values.auth.keys }}
{{- fail "kvturn: give auth.existingSecret or auth.keys, not both" }}
{{- end }}
{{- end }}
