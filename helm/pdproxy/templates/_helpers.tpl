{{/* Names ----------------------------------------------------------------------------- */}}

{{- define "pdproxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name, also the proxy's objects' name. Truncated to 54 characters so that the longest
suffix added to it ("-registry", "-prefill") still gives a valid 63-character DNS label.
*/}}
{{- define "pdproxy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdproxy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdproxy.registryServiceName" -}}
{{- printf "%s-registry" (include "pdproxy.fullname" .) }}
{{- end }}

{{/* The registry's in-cluster DNS name: vLLM's proxy_ip, the announce sidecar's host. */}}
{{- define "pdproxy.registryHost" -}}
{{- printf "%s.%s.svc.%s" (include "pdproxy.registryServiceName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "pdproxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdproxy.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels ---------------------------------------------------------------------------- */}}

{{- define "pdproxy.labels" -}}
helm.sh/chart: {{ include "pdproxy.chart" . }}
app.kubernetes.io/name: {{ include "pdproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdproxy
{{- end }}

{{/* All labels of one component's objects: call with (list $ "proxy"|"registry"|...). */}}
{{- define "pdproxy.componentLabels" -}}
{{ include "pdproxy.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Selector labels of one component: call with (list $ "proxy"|"prefill"|"decode"). */}}
{{- define "pdproxy.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pdproxy.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Images ----------------------------------------------------------------------------- */}}

{{- define "pdproxy.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdproxy.fleetImage" -}}
{{- $tag := required "fleet.image.tag is required when fleet.enabled: pin the vLLM release you run" .Values.fleet.image.tag }}
{{- printf "%s:%s" .Values.fleet.image.repository $tag }}
{{- end }}

{{/* The proxy's config file -------------------------------------------------------------- */}}

{{/*
config.yaml: the user's `config` plus the listening addresses, which the chart owns because the
Services and probes point at them.
*/}}
{{- define "pdproxy.configFile" -}}
{{- $config := deepCopy .Values.config }}
{{- if eq (include "pdproxy.discoveryOn" .) "true" }}
{{- /* Kubernetes discovery watches this release's fleet unless told otherwise. */}}
{{- $found := dict "kubernetes_namespace" .Release.Namespace "kubernetes_prefill_selector" (include "pdproxy.selectorString" (list . "prefill")) "kubernetes_decode_selector" (include "pdproxy.selectorString" (list . "decode")) }}
{{- $config = merge $config $found }}
{{- end }}
{{- $owned := dict "host" "0.0.0.0" "port" (int .Values.ports.http) "registry_bind" (printf "tcp://0.0.0.0:%d" (int .Values.ports.registry)) }}
{{- if .Values.auth.clientApiKeys.existingSecret }}
{{- $_ := set $owned "api_key_file" (include "pdproxy.secretFile" "client-api-keys") }}
{{- end }}
{{- if .Values.auth.adminToken.existingSecret }}
{{- $_ := set $owned "admin_token_file" (include "pdproxy.secretFile" "admin-token") }}
{{- end }}
{{- toYaml (merge $owned $config) }}
{{- end }}

{{/* Kubernetes discovery ------------------------------------------------------------------ */}}

{{/* "true" when the proxy watches pods (config.discovery: kubernetes). */}}
{{- define "pdproxy.discoveryOn" -}}
{{- eq (toString (default "registry" .Values.config.discovery)) "kubernetes" }}
{{- end }}

{{/* One component's selector labels as a label selector string: call with (list $ ROLE). */}}
{{- define "pdproxy.selectorString" -}}
{{- $labels := include "pdproxy.selectorLabels" . | fromYaml }}
{{- $terms := list }}
{{- range $key := keys $labels | sortAlpha }}
{{- $terms = append $terms (printf "%s=%s" $key (index $labels $key)) }}
{{- end }}
{{- join "," $terms }}
{{- end }}

{{/*
The name of the pod annotation the proxy reads one fact from: call with (list $ SETTING DEFAULT),
SETTING a config key (kubernetes_http_port_annotation, ...), DEFAULT pdproxy's own default.
*/}}
{{- define "pdproxy.podKey" -}}
{{- $root := index . 0 }}
{{- default (index . 2) (get $root.Values.config (index . 1)) }}
{{- end }}

{{/* Secrets mounted as files --------------------------------------------------------------- */}}

{{/*
Each mounted Secret is a volume named after what it holds ("client-api-keys", "admin-token",
"registry-secret"), mounted read-only at <secretsDir>/<name>, holding one file: the file name the
proxy or connector is given. Call secretMountPath / secretFile with that name.
*/}}
{{- define "pdproxy.secretsDir" -}}/var/run/secrets/pdproxy{{- end }}

{{- define "pdproxy.secretFileName" -}}
{{- get (dict "client-api-keys" "keys" "admin-token" "token" "registry-secret" "secret") . }}
{{- end }}

{{- define "pdproxy.secretMountPath" -}}
{{- printf "%s/%s" (include "pdproxy.secretsDir" .) . }}
{{- end }}

{{- define "pdproxy.secretFile" -}}
{{- printf "%s/%s" (include "pdproxy.secretMountPath" .) (include "pdproxy.secretFileName" .) }}
{{- end }}

{{/*
The volume of one Secret key: call with (list NAME SECRETREF), SECRETREF an {existingSecret, key}
value. Mode 0440 (288): owned by root and the pod's fsGroup, which lets the non-root user read
it; never world-readable.
*/}}
{{- define "pdproxy.secretVolume" -}}
{{- $name := index . 0 }}
{{- $ref := index . 1 }}
- name: {{ $name }}
  secret:
    secretName: {{ $ref.existingSecret | quote }}
    defaultMode: 288
    items:
      - key: {{ $ref.key | quote }}
        path: {{ include "pdproxy.secretFileName" $name }}
{{- end }}

{{/* The read-only mount of a volume made by pdproxy.secretVolume: call with its NAME. */}}
{{- define "pdproxy.secretMount" -}}
- name: {{ . }}
  mountPath: {{ include "pdproxy.secretMountPath" . }}
  readOnly: true
{{- end }}

{{/* The env var a registry secret is passed in (proxy and announce sidecar). */}}
{{- define "pdproxy.registrySecretEnv" -}}
- name: PDPROXY_REGISTRY_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auth.registrySecret.existingSecret | quote }}
      key: {{ .Values.auth.registrySecret.key | quote }}
{{- end }}

{{/* Shutdown ------------------------------------------------------------------------------ */}}

{{/*
terminationGracePeriodSeconds: on SIGTERM the proxy drains for config.drain_seconds (pdproxy's
default 30), then stops its registry and upstream connections and exits 0. The grace period is
that rounded up plus 10 seconds, or the value given, which must be larger than drain_seconds.
*/}}
{{- define "pdproxy.terminationGracePeriodSeconds" -}}
{{- $drain := 30.0 }}
{{- if hasKey .Values.config "drain_seconds" }}
{{- $drain = float64 .Values.config.drain_seconds }}
{{- end }}
{{- $grace := .Values.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $grace }}
{{- add (int (ceil $drain)) 10 }}
{{- else if le (float64 $grace) $drain }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be larger than config.drain_seconds (%v): Kubernetes would kill the proxy while it drains" $grace $drain) }}
{{- else }}
{{- int $grace }}
{{- end }}
{{- end }}

{{/* Consistency checks the schema cannot express; included by the proxy Deployment. */}}
{{- define "pdproxy.checkAuth" -}}
{{- if .Values.auth.clientApiKeys.existingSecret }}
{{- $open := list "/health" "/ready" "/metrics" }}
{{- if hasKey .Values.config "open_paths" }}
{{- $open = .Values.config.open_paths }}
{{- end }}
{{- range $path := list "/health" "/ready" }}
{{- if not (has $path $open) }}
{{- fail (printf "config.open_paths must include %s: the kubelet's probes send no API key" $path) }}
{{- end }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not (has "/metrics" $open)) }}
{{- fail "config.open_paths must include /metrics: the ServiceMonitor's scrapes send no API key" }}
{{- end }}
{{- end }}
{{- $fleet := .Values.fleet }}
{{- if and .Values.auth.registrySecret.existingSecret $fleet.enabled (eq $fleet.connector "P2pNcclConnector") (not $fleet.announce.enabled) (not .Values.config.registry_allow_unsigned_v0) }}
{{- fail "auth.registrySecret with a P2pNcclConnector fleet: stock vLLM sends unsigned v0 pings, which the registry would refuse; enable fleet.announce (which signs) or set config.registry_allow_unsigned_v0" }}
{{- end }}
{{- end }}

{{/* The fleet -------------------------------------------------------------------------- */}}

{{- define "pdproxy.servedModelName" -}}
{{- default .Values.fleet.model .Values.fleet.servedModelName }}
{{- end }}

{{/* The connector name pdproxy's v1 announcement uses for fleet.connector. */}}
{{- define "pdproxy.announceConnector" -}}
{{- $kinds := dict "PdproxyConnector" "pdproxy" "NixlConnector" "nixl" "P2pNcclConnector" "p2p_nccl" }}
{{- index $kinds .Values.fleet.connector }}
{{- end }}

{{/*
vLLM's --kv-transfer-config for one role: call with (list $ "prefill"|"decode").
proxy_ip/proxy_port point vLLM's announcements at the registry Service (strings: vLLM builds
proxy_ip + ":" + proxy_port); they are left out when the announce sidecar announces instead.
Top-level keys are only those every supported vLLM accepts (its config forbids unknown keys;
vLLM 0.32 has no kv_ip and no kv_buffer_size): the pod IP goes in kv_connector_extra_config as
kv_ip (pdproxy's connector announces it; P2pNcclConnector uses VLLM_HOST_IP), and
kv_buffer_size is sent to P2pNcclConnector only, which reads it. NixlConnector reads none of
the extra keys (its side channel comes from VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, set in fleet.yaml).
*/}}
{{- define "pdproxy.kvTransferConfig" -}}
{{- $root := index . 0 }}
{{- $role := index . 1 }}
{{- $fleet := $root.Values.fleet }}
{{- $spec := index $fleet $role }}
{{- $extra := dict "http_port" (toString $fleet.httpPort) "kv_ip" "$(POD_IP)" }}
{{- if eq $fleet.connector "PdproxyConnector" }}
{{- $_ := set $extra "prefill_work_report" (toString $fleet.prefillWorkReportSeconds) }}
{{- end }}
{{- if and (eq $fleet.connector "PdproxyConnector") $root.Values.auth.registrySecret.existingSecret }}
{{- $_ := set $extra "registry_secret_file" (include "pdproxy.secretFile" "registry-secret") }}
{{- end }}
{{- if not $fleet.announce.enabled }}
{{- $_ := set $extra "proxy_ip" (include "pdproxy.registryHost" $root) }}
{{- $_ := set $extra "proxy_port" (toString $root.Values.registryService.port) }}
{{- end }}
{{- $config := dict
  "kv_connector" $fleet.connector
  "kv_role" (ternary "kv_producer" "kv_consumer" (eq $role "prefill"))
  "kv_port" (int $fleet.kvPort)
  "kv_connector_extra_config" $extra }}
{{- if eq $fleet.connector "PdproxyConnector" }}
{{- $_ := set $config "kv_connector_module_path" "pdproxy.vllm_side.connector" }}
{{- else if eq $fleet.connector "P2pNcclConnector" }}
{{- $_ := set $config "kv_buffer_size" (toString $spec.kvBufferSize) }}
{{- end }}
{{- toJson $config }}
{{- end }}

{{/* The claim holding the fleet's models: the operator's, else the chart's; empty: none. */}}
{{- define "pdproxy.modelCacheClaim" -}}
{{- $cache := .Values.fleet.modelCache -}}
{{- if $cache.existingClaim -}}
{{ $cache.existingClaim }}
{{- else if $cache.persistentVolumeClaim.enabled -}}
{{ include "pdproxy.fullname" . }}-models
{{- end -}}
{{- end }}
