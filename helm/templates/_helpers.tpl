{{/* Names ---------------------------------------------------------------------------------------- */}}

{{- define "rloo-kfp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource name prefix, 40 characters at most: with the longest suffix of a StatefulSet (-postgresql) it
stays within 52, which leaves room for the controller-revision-hash label of its pods (63 at most). */}}
{{- define "rloo-kfp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rloo-kfp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "rloo-kfp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rloo-kfp
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "mlflow") */}}
{{- define "rloo-kfp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rloo-kfp.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rloo-kfp.componentLabels" -}}
{{ include "rloo-kfp.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rloo-kfp.serviceAccountName" -}}
{{- include "rloo-kfp.fullname" . -}}
{{- end -}}

{{- define "rloo-kfp.pipelineNamespace" -}}
{{- default .Release.Namespace .Values.pipeline.namespace -}}
{{- end -}}

{{/* The compiled pipeline the upload Job uploads: upload.pipelinePackage (--set-file), else the chart's copy */}}
{{- define "rloo-kfp.pipelinePackage" -}}
{{- $package := .Values.upload.pipelinePackage | default (.Files.Get "files/rloo_pipeline.yaml") -}}
{{- if not (contains "pipelineInfo:" $package) -}}
{{- fail "upload.pipelinePackage is not a compiled pipeline (no pipelineInfo): pass the YAML that 'rloo pipeline compile' wrote, e.g. --set-file upload.pipelinePackage=build/rloo_pipeline.yaml" -}}
{{- end -}}
{{- $package -}}
{{- end -}}

{{/* "repository:tag", the tag defaulting to appVersion: (dict "ctx" $ "image" .Values.mlflow.image) */}}
{{- define "rloo-kfp.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* One of the project's images (slim, train, eval) from images.*: "repository:tag", then "@digest" when
images.<name>.digest is set; the repository defaults to <images.registry>/rloo-<name>, the tag to images.tag,
then appVersion (a tag may carry its own @sha256:...): (dict "ctx" $ "name" "train") */}}
{{- define "rloo-kfp.projectImage" -}}
{{- $images := .ctx.Values.images -}}
{{- $image := index $images .name -}}
{{- $repository := $image.repository | default (printf "%s/rloo-%s" (trimSuffix "/" $images.registry) .name) -}}
{{- $tag := $image.tag | default $images.tag | default .ctx.Chart.AppVersion -}}
{{- printf "%s:%s" $repository $tag -}}
{{- with $image.digest }}@{{ . }}{{ end -}}
{{- end -}}

{{/* What the upload applies to every step of the pipeline and to its training jobs (`rloo pipeline upload
--platform`): the project's images, the pull secrets, the environment (extraEnv under pipeline.extraEnv) and
the CA bundle. Always all four keys. */}}
{{- define "rloo-kfp.platform" -}}
{{- $images := dict -}}
{{- range $name := list "slim" "train" "eval" -}}
{{- $_ := set $images $name (include "rloo-kfp.projectImage" (dict "ctx" $ "name" $name)) -}}
{{- end -}}
{{- $env := dict -}}
{{- range $name, $value := .Values.extraEnv }}{{ $_ := set $env $name (toString $value) }}{{ end -}}
{{- range $name, $value := .Values.pipeline.extraEnv }}{{ $_ := set $env $name (toString $value) }}{{ end -}}
{{- $ca := dict -}}
{{- if .Values.caBundle.configMap -}}
{{- $ca = dict "configMap" .Values.caBundle.configMap "key" .Values.caBundle.key -}}
{{- end -}}
{{- toJson (dict "images" $images "imagePullSecrets" (.Values.imagePullSecrets | default list) "env" $env "caBundle" ($ca | default nil)) -}}
{{- end -}}

{{/* The data of the pipeline ConfigMap, which the upload Job's checksum covers as a whole. */}}
{{- define "rloo-kfp.pipelineConfigData" -}}
rloo_pipeline.yaml: {{ include "rloo-kfp.pipelinePackage" . | toJson }}
platform.json: |-
  {{ include "rloo-kfp.platform" . }}
{{- end -}}

{{/* Pods ------------------------------------------------------------------------------------------ */}}

{{/* A pod template's metadata: the component's selector labels over `labels` (its podLabels: the selector
labels win) and `extraLabels`, the chart's `chartAnnotations` over `annotations` (its podAnnotations).
(dict "ctx" $ "component" "mlflow" "labels" .Values.mlflow.podLabels "annotations" .Values.mlflow.podAnnotations) */}}
{{- define "rloo-kfp.podMetadata" -}}
{{- $labels := merge (include "rloo-kfp.selectorLabels" . | fromYaml) (.extraLabels | default dict) (.labels | default dict) -}}
{{- $annotations := merge (.chartAnnotations | default dict) (.annotations | default dict) -}}
labels:
  {{- toYaml $labels | nindent 2 }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* nodeSelector, tolerations and affinity of a pod, from a values block that has them (.Values.mlflow,
.Values.jobs); empty when none is set. */}}
{{- define "rloo-kfp.podPlacement" -}}
{{- $placement := dict -}}
{{- with .nodeSelector }}{{ $_ := set $placement "nodeSelector" . }}{{ end -}}
{{- with .tolerations }}{{ $_ := set $placement "tolerations" . }}{{ end -}}
{{- with .affinity }}{{ $_ := set $placement "affinity" . }}{{ end -}}
{{- with $placement }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* Environment of the containers that call other services: extraEnv, placed before the chart's own
variables (a repeated name keeps the chart's value). Empty without extraEnv. */}}
{{- define "rloo-kfp.extraEnv" -}}
{{- $env := list -}}
{{- range $name, $value := .Values.extraEnv }}{{ $env = append $env (dict "name" $name "value" (toString $value)) }}{{ end -}}
{{- with $env }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* The CA bundle's variables, after the chart's own; empty without caBundle.configMap. The steps get the
same mount path and variables through platform.json. */}}
{{- define "rloo-kfp.caEnv" -}}
{{- if .Values.caBundle.configMap -}}
{{- $path := printf "/etc/rloo/ca/%s" .Values.caBundle.key -}}
{{- $env := list -}}
{{- range $name := list "SSL_CERT_FILE" "REQUESTS_CA_BUNDLE" "AWS_CA_BUNDLE" "CURL_CA_BUNDLE" }}{{ $env = append $env (dict "name" $name "value" $path) }}{{ end -}}
{{- toYaml $env -}}
{{- end -}}
{{- end -}}

{{- define "rloo-kfp.caVolumeMount" -}}
{{- if .Values.caBundle.configMap -}}
- name: ca-bundle
  mountPath: /etc/rloo/ca
  readOnly: true
{{- end -}}
{{- end -}}

{{- define "rloo-kfp.caVolume" -}}
{{- with .Values.caBundle.configMap -}}
- name: ca-bundle
  configMap:
    name: {{ . }}
{{- end -}}
{{- end -}}

{{/* Security -------------------------------------------------------------------------------------- */}}

{{/* Pod securityContext meeting the "restricted" Pod Security Standard: (dict "ids" .Values.x.podSecurityContext) */}}
{{- define "rloo-kfp.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .ids.runAsUser }}
runAsGroup: {{ .ids.runAsGroup }}
fsGroup: {{ .ids.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container securityContext meeting the "restricted" standard, root filesystem read-only. */}}
{{- define "rloo-kfp.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
{{- end -}}

{{/* Empty without pull secrets; use as: with include "rloo-kfp.imagePullSecrets" . | nindent N */}}
{{- define "rloo-kfp.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Object storage -------------------------------------------------------------------------------- */}}

{{/* The S3 endpoint every component uses: SeaweedFS's S3 gateway, or s3.endpoint (empty: AWS). */}}
{{- define "rloo-kfp.s3Endpoint" -}}
{{- if .Values.seaweedfs.enabled -}}
{{- printf "http://%s-seaweedfs.%s.svc:8333" (include "rloo-kfp.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.s3.endpoint -}}
{{- end -}}
{{- end -}}

{{/* AWS_* credentials from the referenced Secret (never a literal value). */}}
{{- define "rloo-kfp.s3CredentialsEnv" -}}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.existingSecret }}
      key: {{ .Values.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.existingSecret }}
      key: {{ .Values.s3.secretAccessKeyKey }}
{{- end -}}

{{/* Database ------------------------------------------------------------------------------------- */}}

{{- define "rloo-kfp.db.host" -}}
{{- if .Values.postgresql.enabled -}}
{{- printf "%s-postgresql" (include "rloo-kfp.fullname" .) -}}
{{- else -}}
{{- .Values.externalDatabase.host -}}
{{- end -}}
{{- end -}}

{{- define "rloo-kfp.db.port" -}}
{{- if .Values.postgresql.enabled -}}5432{{- else -}}{{ .Values.externalDatabase.port }}{{- end -}}
{{- end -}}

{{- define "rloo-kfp.db.name" -}}
{{- if .Values.postgresql.enabled -}}{{ .Values.postgresql.database }}{{- else -}}{{ .Values.externalDatabase.database }}{{- end -}}
{{- end -}}

{{- define "rloo-kfp.db.user" -}}
{{- if .Values.postgresql.enabled -}}{{ .Values.postgresql.username }}{{- else -}}{{ .Values.externalDatabase.username }}{{- end -}}
{{- end -}}

{{- define "rloo-kfp.db.secret" -}}
{{- if .Values.postgresql.enabled -}}{{ .Values.postgresql.existingSecret }}{{- else -}}{{ .Values.externalDatabase.existingSecret }}{{- end -}}
{{- end -}}

{{- define "rloo-kfp.db.passwordKey" -}}
{{- if .Values.postgresql.enabled -}}{{ .Values.postgresql.passwordKey }}{{- else -}}{{ .Values.externalDatabase.passwordKey }}{{- end -}}
{{- end -}}

{{- define "rloo-kfp.db.sslMode" -}}
{{- if .Values.postgresql.enabled -}}disable{{- else -}}{{ .Values.externalDatabase.sslMode }}{{- end -}}
{{- end -}}

{{/* MLflow's database as a SQLAlchemy URI without a password: libpq reads it from PGPASSWORD. */}}
{{- define "rloo-kfp.mlflowBackendStoreUri" -}}
{{- printf "postgresql+psycopg2://%s@%s:%s/%s?sslmode=%s" (include "rloo-kfp.db.user" .) (include "rloo-kfp.db.host" .) (include "rloo-kfp.db.port" .) (include "rloo-kfp.db.name" .) (include "rloo-kfp.db.sslMode" .) -}}
{{- end -}}

{{/* Whether the MLflow Ingress authenticates: MLflow's basic-auth app, or an annotation naming auth (an
authenticating proxy such as nginx's auth-url). "true" or empty. */}}
{{- define "rloo-kfp.mlflowIngressAuthenticated" -}}
{{- $auth := .Values.mlflow.auth.enabled -}}
{{- range $key, $_ := .Values.mlflow.ingress.annotations -}}
{{- if regexMatch "(?i)auth" $key }}{{ $auth = true }}{{ end -}}
{{- end -}}
{{- if $auth }}true{{ end -}}
{{- end -}}

{{/* URLs ------------------------------------------------------------------------------------------ */}}

{{- define "rloo-kfp.mlflowUrl" -}}
{{- printf "http://%s-mlflow.%s.svc:%d" (include "rloo-kfp.fullname" .) .Release.Namespace (int .Values.mlflow.service.port) -}}
{{- end -}}

{{- define "rloo-kfp.judgeUrl" -}}
{{- printf "http://%s-judge.%s.svc:8000/v1" (include "rloo-kfp.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "rloo-kfp.judgeModelName" -}}
{{- default .Values.judge.model .Values.judge.servedModelName -}}
{{- end -}}

{{/* Checks the schema cannot express: one message naming the values and the fix. --------------------- */}}
{{- define "rloo-kfp.validate" -}}
{{- if and .Values.postgresql.enabled .Values.externalDatabase.host -}}
{{- fail "both databases enabled: externalDatabase.host is set and postgresql.enabled is true; set postgresql.enabled=false to use the external database, or clear externalDatabase.host to use the in-chart one" -}}
{{- end -}}
{{- if and (not .Values.postgresql.enabled) (not .Values.externalDatabase.host) -}}
{{- fail "no database: set externalDatabase.host (with externalDatabase.existingSecret) or postgresql.enabled=true" -}}
{{- end -}}
{{- if and .Values.externalDatabase.host (not .Values.externalDatabase.existingSecret) -}}
{{- fail "externalDatabase.existingSecret is empty: name the existing Secret holding the database password (key externalDatabase.passwordKey)" -}}
{{- end -}}
{{- if and .Values.seaweedfs.enabled .Values.s3.endpoint -}}
{{- fail "both object stores enabled: seaweedfs.enabled is true and s3.endpoint is set; set seaweedfs.enabled=false to use the external S3 endpoint, or clear s3.endpoint to use the in-chart SeaweedFS" -}}
{{- end -}}
{{- if and .Values.mlflow.ingress.enabled (not .Values.mlflow.ingress.host) -}}
{{- fail "mlflow.ingress.enabled is true but mlflow.ingress.host is empty: set the host name the Ingress serves" -}}
{{- end -}}
{{- range $name := list "slim" "train" "eval" -}}
{{- $image := index $.Values.images $name -}}
{{- if and $image.digest (contains "@" $image.tag) -}}
{{- fail (printf "images.%s.tag (%s) already names a digest and images.%s.digest is set too: keep one of them" $name $image.tag $name) -}}
{{- end -}}
{{- end -}}
{{- if .Values.caBundle.configMap -}}
{{- range $name := list "SSL_CERT_FILE" "REQUESTS_CA_BUNDLE" "AWS_CA_BUNDLE" "CURL_CA_BUNDLE" -}}
{{- if or (hasKey $.Values.extraEnv $name) (hasKey $.Values.pipeline.extraEnv $name) -}}
{{- fail (printf "%s is set in extraEnv (or pipeline.extraEnv) and by caBundle.configMap: remove it from extraEnv, caBundle sets it to /etc/rloo/ca/%s" $name $.Values.caBundle.key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
