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

{{/* "repository:tag", the tag defaulting to appVersion, then "@digest" when the image's digest is set:
(dict "ctx" $ "image" .Values.mlflow.image) */}}
{{- define "rloo-kfp.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- with .image.digest }}@{{ . }}{{ end -}}
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
--platform`): the project's images, the pull secrets, the environment (extraEnv under pipeline.extraEnv, its
proxies completed by rloo-kfp.proxyEnv), the CA bundle, Kueue (pipeline.kueue: the GPU steps' queue label, and
whether the validate step may accept a PyTorchJob queue) and whether S3 keys come from a workload identity (the
steps' S3 Secret optional). Always all six keys. */}}
{{- define "rloo-kfp.platform" -}}
{{- $images := dict -}}
{{- range $name := list "slim" "train" "eval" -}}
{{- $_ := set $images $name (include "rloo-kfp.projectImage" (dict "ctx" $ "name" $name)) -}}
{{- end -}}
{{- $env := include "rloo-kfp.proxyEnv" (dict "ctx" $ "env" (include "rloo-kfp.stepEnv" . | fromJson)) | fromJson -}}
{{- $ca := dict -}}
{{- if .Values.caBundle.configMap -}}
{{- $ca = dict "configMap" .Values.caBundle.configMap "key" .Values.caBundle.key -}}
{{- end -}}
{{- $kueue := dict "queueName" .Values.pipeline.kueue.queueName "pytorchJobIntegration" .Values.pipeline.kueue.pytorchJobIntegration -}}
{{- $identity := eq (include "rloo-kfp.s3WorkloadIdentity" .) "true" -}}
{{- toJson (dict "images" $images "imagePullSecrets" (.Values.imagePullSecrets | default list) "env" $env "caBundle" ($ca | default nil) "kueue" $kueue "s3WorkloadIdentity" $identity) -}}
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

{{/* nodeSelector, tolerations, affinity, topologySpreadConstraints, priorityClassName and runtimeClassName of
a pod, from a values block that has them (.Values.mlflow, .Values.jobs; runtimeClassName: the judge's only);
empty when none is set. */}}
{{- define "rloo-kfp.podPlacement" -}}
{{- $placement := dict -}}
{{- range $key := list "nodeSelector" "tolerations" "affinity" "topologySpreadConstraints" "priorityClassName" "runtimeClassName" -}}
{{- with index $ $key }}{{ $_ := set $placement $key . }}{{ end -}}
{{- end -}}
{{- with $placement }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* Environment -------------------------------------------------------------------------------------- */}}

{{/* `env` (NAME -> value) with its proxy variables completed, as JSON. When it sets HTTPS_PROXY or HTTP_PROXY
(either case): both cases of each of them, and NO_PROXY and no_proxy both set to its own NO_PROXY and no_proxy
entries, then whichever of .svc, .<clusterDomain>, .kubeflow, .<release namespace>, .<pipeline namespace>,
localhost and 127.0.0.1 they lack, without repeats. KFP's launcher in every step calls short names such as
ml-pipeline.kubeflow:8887 (kubeflow/pipelines#9702); curl reads only the lowercase http_proxy. Otherwise `env`
as it is. (dict "ctx" $ "env" .Values.extraEnv) */}}
{{- define "rloo-kfp.proxyEnv" -}}
{{- $env := dict -}}
{{- range $name, $value := .env }}{{ $_ := set $env $name (toString $value) }}{{ end -}}
{{- $proxied := false -}}
{{- range $name := list "HTTPS_PROXY" "HTTP_PROXY" -}}
{{- $value := get $env $name | default (get $env (lower $name)) -}}
{{- if $value -}}
{{- $proxied = true -}}
{{- $_ := set $env $name $value -}}
{{- $_ := set $env (lower $name) $value -}}
{{- end -}}
{{- end -}}
{{- if $proxied -}}
{{- $inCluster := list ".svc" (printf ".%s" .ctx.Values.clusterDomain) ".kubeflow" (printf ".%s" .ctx.Release.Namespace) (printf ".%s" (include "rloo-kfp.pipelineNamespace" .ctx)) "localhost" "127.0.0.1" -}}
{{- $entries := list -}}
{{- range $entry := concat (splitList "," (get $env "NO_PROXY")) (splitList "," (get $env "no_proxy")) $inCluster -}}
{{- $entry = trim $entry -}}
{{- if and $entry (not (has $entry $entries)) }}{{ $entries = append $entries $entry }}{{ end -}}
{{- end -}}
{{- $_ := set $env "NO_PROXY" (join "," $entries) -}}
{{- $_ := set $env "no_proxy" (join "," $entries) -}}
{{- end -}}
{{- toJson $env -}}
{{- end -}}

{{/* The environment the user gives the pipeline's steps, as JSON: extraEnv, then pipeline.extraEnv over it
(an empty value included). */}}
{{- define "rloo-kfp.stepEnv" -}}
{{- $env := dict -}}
{{- range $name, $value := .Values.extraEnv }}{{ $_ := set $env $name (toString $value) }}{{ end -}}
{{- range $name, $value := .Values.pipeline.extraEnv }}{{ $_ := set $env $name (toString $value) }}{{ end -}}
{{- toJson $env -}}
{{- end -}}

{{/* Environment of the containers that call other services: extraEnv (its proxies completed), placed before
the chart's own variables; rloo-kfp.validate refuses a name the chart sets itself. Empty without extraEnv. */}}
{{- define "rloo-kfp.extraEnv" -}}
{{- $env := list -}}
{{- range $name, $value := include "rloo-kfp.proxyEnv" (dict "ctx" . "env" .Values.extraEnv) | fromJson }}{{ $env = append $env (dict "name" $name "value" $value) }}{{ end -}}
{{- with $env }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* The variables pointing at the CA bundle (OpenSSL and httpx, requests, boto3, curl), as a JSON list: the
same as rloo.k8s.platform.CA_ENV. */}}
{{- define "rloo-kfp.caEnvNames" -}}
{{- list "SSL_CERT_FILE" "REQUESTS_CA_BUNDLE" "AWS_CA_BUNDLE" "CURL_CA_BUNDLE" | toJson -}}
{{- end -}}

{{/* The CA bundle's variables, after the chart's own; empty without caBundle.configMap. The steps get the
same mount path and variables through platform.json. */}}
{{- define "rloo-kfp.caEnv" -}}
{{- if .Values.caBundle.configMap -}}
{{- $path := printf "/etc/rloo/ca/%s" .Values.caBundle.key -}}
{{- $env := list -}}
{{- range $name := include "rloo-kfp.caEnvNames" . | fromJsonArray }}{{ $env = append $env (dict "name" $name "value" $path) }}{{ end -}}
{{- toYaml $env -}}
{{- end -}}
{{- end -}}

{{/* The environment variables the chart sets itself, by the container it sets them in, as JSON; every one
of them also gets the CA bundle's (rloo-kfp.caEnvNames). "steps": what the upload (platform.json) sets in every
step and training job of the pipeline. What extraEnv, pipeline.extraEnv, mlflow.extraEnv and judge.extraEnv may
not name (rloo-kfp.validate): Kubernetes refuses a container with a repeated name (server-side apply:
"duplicate entries for key"). tests/helm compares this list with every container the chart renders. */}}
{{- define "rloo-kfp.ownEnv" -}}
{{- $s3 := list "AWS_ACCESS_KEY_ID" "AWS_SECRET_ACCESS_KEY" "AWS_DEFAULT_REGION" -}}
{{- $db := list "HOME" "USER" "MLFLOW_BACKEND_STORE_URI" "PGPASSWORD" "MLFLOW_TMP_DIR" -}}
{{- $own := dict
  "upload" (list "HOME" "KF_PIPELINES_SA_TOKEN_PATH")
  "bucket" (concat (list "HOME" "BUCKET" "ABORT_INCOMPLETE_UPLOADS_DAYS" "S3_ENDPOINT_URL") $s3)
  "db-upgrade" $db
  "mlflow" (concat $db $s3 (list "MLFLOW_S3_ENDPOINT_URL" "MLFLOW_SERVER_ALLOWED_HOSTS" "MLFLOW_AUTH_CONFIG_PATH" "MLFLOW_AUTH_ADMIN_USERNAME" "MLFLOW_AUTH_ADMIN_PASSWORD" "MLFLOW_FLASK_SERVER_SECRET_KEY"))
  "judge" (list "HOME" "USER" "XDG_CACHE_HOME" "HF_HOME" "VLLM_CACHE_ROOT" "TRITON_CACHE_DIR" "NUMBA_CACHE_DIR" "VLLM_NO_USAGE_STATS" "VLLM_API_KEY" "HF_TOKEN" "HF_HUB_OFFLINE")
  "rollout" (list "HOME" "USER" "XDG_CACHE_HOME" "HF_HOME" "VLLM_CACHE_ROOT" "TRITON_CACHE_DIR" "NUMBA_CACHE_DIR" "VLLM_NO_USAGE_STATS" "HF_TOKEN" "HF_HUB_OFFLINE")
  "test-mlflow" (list "MLFLOW_URL" "MLFLOW_TRACKING_USERNAME" "MLFLOW_TRACKING_PASSWORD")
  "test-judge" (list "JUDGE_URL" "JUDGE_MODEL" "OPENAI_API_KEY")
  "steps" (list "RLOO_PLATFORM") -}}
{{- $ca := include "rloo-kfp.caEnvNames" . | fromJsonArray -}}
{{- range $container, $names := $own }}{{ $_ := set $own $container (concat $names $ca) }}{{ end -}}
{{- toJson $own -}}
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
{{- printf "http://%s:8333" (include "rloo-kfp.serviceHost" (dict "ctx" . "component" "seaweedfs")) -}}
{{- else -}}
{{- .Values.s3.endpoint -}}
{{- end -}}
{{- end -}}

{{/* Whether the S3 client finds its credentials in a workload identity, "true" or empty: s3.workloadIdentity,
or the chart's ServiceAccount annotated for IRSA (eks.amazonaws.com/role-arn: boto3 reads the web identity token
EKS mounts). Never with SeaweedFS, whose only identity is the keys. GKE's iam.gke.io/gcp-service-account gives
Google credentials, which boto3 does not use. */}}
{{- define "rloo-kfp.s3WorkloadIdentity" -}}
{{- $annotated := hasKey (.Values.serviceAccount.annotations | default dict) "eks.amazonaws.com/role-arn" -}}
{{- if and (not .Values.seaweedfs.enabled) (or .Values.s3.workloadIdentity $annotated) }}true{{ end -}}
{{- end -}}

{{/* AWS_* credentials from the referenced Secret (never a literal value); optional with a workload identity
(rloo-kfp.s3WorkloadIdentity): a pod without the Secret or its keys starts, and boto3 falls back to the
identity's credentials. */}}
{{- define "rloo-kfp.s3CredentialsEnv" -}}
{{- $optional := eq (include "rloo-kfp.s3WorkloadIdentity" .) "true" -}}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.existingSecret }}
      key: {{ .Values.s3.accessKeyIdKey }}
      {{- if $optional }}
      optional: true
      {{- end }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.s3.existingSecret }}
      key: {{ .Values.s3.secretAccessKeyKey }}
      {{- if $optional }}
      optional: true
      {{- end }}
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

{{/* A Service of the chart by its fully-qualified name, <fullname>-<component>.<namespace>.svc.<clusterDomain>:
KFP's driver appends the API server's proxy variables to every step's environment after the step's own, and
its default NO_PROXY bypasses only .svc.<cluster domain> (backend/src/apiserver/config/proxy/config.go), so a
shorter name would go to the proxy. (dict "ctx" $ "component" "mlflow") */}}
{{- define "rloo-kfp.serviceHost" -}}
{{- printf "%s-%s.%s.svc.%s" (include "rloo-kfp.fullname" .ctx) .component .ctx.Release.Namespace .ctx.Values.clusterDomain -}}
{{- end -}}

{{- define "rloo-kfp.mlflowUrl" -}}
{{- printf "http://%s:%d" (include "rloo-kfp.serviceHost" (dict "ctx" . "component" "mlflow")) (int .Values.mlflow.service.port) -}}
{{- end -}}

{{- define "rloo-kfp.judgeUrl" -}}
{{- printf "http://%s:8000/v1" (include "rloo-kfp.serviceHost" (dict "ctx" . "component" "judge")) -}}
{{- end -}}

{{/* The rollout server's base URL, as `rloo train --vllm_server_base_url` takes it (no /v1). */}}
{{- define "rloo-kfp.rolloutUrl" -}}
{{- printf "http://%s:8000" (include "rloo-kfp.serviceHost" (dict "ctx" . "component" "rollout")) -}}
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
{{- if and .Values.seaweedfs.enabled .Values.s3.workloadIdentity -}}
{{- fail "s3.workloadIdentity is true with seaweedfs.enabled, whose only identity is the keys of s3.existingSecret: set s3.workloadIdentity=false, or use an external S3 that trusts the identity (s3.endpoint, seaweedfs.enabled=false)" -}}
{{- end -}}
{{- if and .Values.seaweedfs.enabled .Values.s3.endpoint -}}
{{- fail "both object stores enabled: seaweedfs.enabled is true and s3.endpoint is set; set seaweedfs.enabled=false to use the external S3 endpoint, or clear s3.endpoint to use the in-chart SeaweedFS" -}}
{{- end -}}
{{- if and .Values.mlflow.ingress.enabled (not .Values.mlflow.ingress.host) -}}
{{- fail "mlflow.ingress.enabled is true but mlflow.ingress.host is empty: set the host name the Ingress serves" -}}
{{- end -}}
{{- /* images: published, pinned, one digest each */ -}}
{{- if not .Values.images.allowDefaultRegistry -}}
{{- range $name := list "slim" "train" "eval" -}}
{{- if hasPrefix "ghcr.io/rloo-kfp/" (include "rloo-kfp.projectImage" (dict "ctx" $ "name" $name)) -}}
{{- fail (printf "images.%s is %s, which no release has published: build and push the images to your registry first (make push-images RLOO_IMAGE_REGISTRY=registry.example.com/ml) and set images.registry to it (helm/README.md, Install), or set images.allowDefaultRegistry=true where a mirror serves that name" $name (include "rloo-kfp.projectImage" (dict "ctx" $ "name" $name))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.images.tag "latest" -}}
{{- fail "images.tag is latest, which names a different image over time: set a release tag (empty: the chart's appVersion), or pin images.<name>.digest" -}}
{{- end -}}
{{- range $name := list "slim" "train" "eval" -}}
{{- $image := index $.Values.images $name -}}
{{- if eq $image.tag "latest" -}}
{{- fail (printf "images.%s.tag is latest, which names a different image over time: set a release tag (empty: images.tag), or pin images.%s.digest" $name $name) -}}
{{- end -}}
{{- if and $image.digest (contains "@" $image.tag) -}}
{{- fail (printf "images.%s.tag (%s) already names a digest and images.%s.digest is set too: keep one of them" $name $image.tag $name) -}}
{{- end -}}
{{- end -}}
{{- range $component := list "mlflow" "postgresql" "seaweedfs" "judge" -}}
{{- $image := (index $.Values $component).image -}}
{{- if eq $image.tag "latest" -}}
{{- fail (printf "%s.image.tag is latest, which names a different image over time: set a release tag (values.yaml has the one the chart is tested with), or pin %s.image.digest" $component $component) -}}
{{- end -}}
{{- if and $image.digest (contains "@" $image.tag) -}}
{{- fail (printf "%s.image.tag (%s) already names a digest and %s.image.digest is set too: keep one of them" $component $image.tag $component) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.rolloutServer.enabled (not (trim .Values.rolloutServer.model)) -}}
{{- fail "rolloutServer.enabled is true but rolloutServer.model is empty: set it to the policy's starting checkpoint (the run's model_name_or_path, a Hub id or a path in the model cache)" -}}
{{- end -}}
{{- /* pod labels: the chart's selector labels stay the chart's */ -}}
{{- range $block := list "mlflow" "postgresql" "seaweedfs" "judge" "rolloutServer" "jobs" -}}
{{- range $key := list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" -}}
{{- if hasKey (index $.Values $block).podLabels $key -}}
{{- fail (printf "%s.podLabels sets %s, one of the chart's selector labels (app.kubernetes.io/name, instance, component): remove it, or use a label of your own" $block $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* the CA bundle */ -}}
{{- if and (not .Values.caBundle.configMap) (ne .Values.caBundle.key "ca.crt") -}}
{{- fail (printf "caBundle.key is %s but caBundle.configMap is empty, so no CA bundle is used: name the ConfigMap holding it in caBundle.configMap, or remove caBundle.key" .Values.caBundle.key) -}}
{{- end -}}
{{- /* environment: secrets only by reference; no name twice in a container */ -}}
{{- $caNames := include "rloo-kfp.caEnvNames" . | fromJsonArray -}}
{{- $own := include "rloo-kfp.ownEnv" . | fromJson -}}
{{- $where := dict "upload" "the upload container" "bucket" "the bucket Job's container" "db-upgrade" "the db-upgrade container" "mlflow" "the mlflow container" "judge" "the judge's vllm container" "rollout" "the rollout server's vllm container" "test-mlflow" "the helm test mlflow container" "test-judge" "the helm test judge container" "steps" "the pipeline's steps and training jobs (platform.json)" -}}
{{- range $value := list "extraEnv" "pipeline.extraEnv" -}}
{{- $env := ternary $.Values.extraEnv $.Values.pipeline.extraEnv (eq $value "extraEnv") -}}
{{- range $name := keys $env | sortAlpha -}}
{{- if and (regexMatch "(PASSWORD|SECRET|TOKEN|API_KEY|ACCESS_KEY)" $name) (not (regexMatch "_(PATH|FILE|DIR)$" $name)) -}}
{{- fail (printf "%s.%s looks like a credential, and %s takes literal values: secrets only by reference. Remove it; put it in a Secret and read it from there (mlflow.extraEnv or judge.extraEnv valueFrom.secretKeyRef; the pipeline's own Secrets for the steps)" $value $name $value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* no credentials in a URL: platform.json puts every value into the pipeline spec (KFP's UI) and every pod;
the value itself is never printed */ -}}
{{- $literal := list -}}
{{- range $name, $value := .Values.extraEnv }}{{ $literal = append $literal (list "extraEnv" $name (toString $value)) }}{{ end -}}
{{- range $name, $value := .Values.pipeline.extraEnv }}{{ $literal = append $literal (list "pipeline.extraEnv" $name (toString $value)) }}{{ end -}}
{{- range $block := list "mlflow" "judge" -}}
{{- range (index $.Values $block).extraEnv -}}
{{- if hasKey . "value" }}{{ $literal = append $literal (list (printf "%s.extraEnv" $block) .name (toString .value)) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- range $entry := $literal -}}
{{- $name := index $entry 1 -}}
{{- $pattern := ternary "^\\s*([A-Za-z][A-Za-z0-9+.-]*://)?[^/?#@\\s]*@" "^\\s*[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\\s]*@" (regexMatch "(?i)^(https?|all|ftp)_proxy$" $name) -}}
{{- if regexMatch $pattern (index $entry 2) -}}
{{- fail (printf "%s.%s has credentials in its URL (user:password@), which would be stored in plain text in the ConfigMap, the pipeline spec (KFP's UI), every pod spec and the training job: remove them, and let the proxy admit the cluster by its source addresses, or run an in-cluster forwarding proxy that adds them from a Secret (helm/README.md, \"Proxy credentials\")" (index $entry 0) $name) -}}
{{- end -}}
{{- end -}}
{{- $merged := include "rloo-kfp.stepEnv" . | fromJson -}}
{{- range $lower := list "https_proxy" "http_proxy" -}}
{{- $upper := upper $lower -}}
{{- range $pair := list (list "extraEnv" $.Values.extraEnv) (list "extraEnv and pipeline.extraEnv" $merged) -}}
{{- $env := index $pair 1 -}}
{{- if and (hasKey $env $upper) (hasKey $env $lower) (ne (toString (get $env $upper)) (toString (get $env $lower))) -}}
{{- fail (printf "%s set %s and %s to different values: set one of them (the chart sets both cases from it)" (index $pair 0) $upper $lower) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $mlflowNames := list -}}
{{- range .Values.mlflow.extraEnv }}{{ $mlflowNames = append $mlflowNames .name }}{{ end -}}
{{- $judgeNames := list -}}
{{- range .Values.judge.extraEnv }}{{ $judgeNames = append $judgeNames .name }}{{ end -}}
{{- $reach := list
  (list "extraEnv" (keys .Values.extraEnv | sortAlpha) (list "upload" "bucket" "db-upgrade" "mlflow" "judge" "rollout" "test-mlflow" "test-judge" "steps"))
  (list "pipeline.extraEnv" (keys .Values.pipeline.extraEnv | sortAlpha) (list "steps"))
  (list "mlflow.extraEnv" $mlflowNames (list "mlflow" "db-upgrade"))
  (list "judge.extraEnv" $judgeNames (list "judge")) -}}
{{- range $check := $reach -}}
{{- $value := index $check 0 -}}
{{- range $name := index $check 1 -}}
{{- if has $name $caNames -}}
{{- fail (printf "%s.%s is set by the chart itself: caBundle.configMap points it at the CA bundle (/etc/rloo/ca/<caBundle.key>) in the chart's containers and the pipeline's steps; remove it, and name the bundle's ConfigMap in caBundle.configMap" $value $name) -}}
{{- end -}}
{{- range $container := index $check 2 -}}
{{- if has $name (index $own $container) -}}
{{- fail (printf "%s.%s is set by the chart itself in %s; remove it" $value $name (index $where $container)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $extraEnv := include "rloo-kfp.proxyEnv" (dict "ctx" . "env" .Values.extraEnv) | fromJson -}}
{{- range $check := list (list "mlflow.extraEnv" .Values.mlflow.extraEnv) (list "judge.extraEnv" .Values.judge.extraEnv) -}}
{{- $value := index $check 0 -}}
{{- $seen := list -}}
{{- range $entry := index $check 1 -}}
{{- $name := $entry.name -}}
{{- if has $name $seen -}}
{{- fail (printf "%s names %s twice: keep one entry" $value $name) -}}
{{- end -}}
{{- $seen = append $seen $name -}}
{{- if hasKey $extraEnv $name -}}
{{- fail (printf "%s.%s is also set by extraEnv (which sets both cases of the proxy variables and completes NO_PROXY): set it in one of them" $value $name) -}}
{{- end -}}
{{- if and (hasKey $entry "value") (hasKey $entry "valueFrom") -}}
{{- fail (printf "%s.%s has both value and valueFrom: keep one" $value $name) -}}
{{- end -}}
{{- if and (regexMatch "(PASSWORD|SECRET|TOKEN|API_KEY|ACCESS_KEY)" $name) (not (regexMatch "_(PATH|FILE|DIR)$" $name)) (not ($entry.valueFrom | default dict).secretKeyRef) -}}
{{- fail (printf "%s.%s looks like a credential: secrets only by reference. Read it from a Secret (valueFrom.secretKeyRef), not a literal value" $value $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* the Job and helm test pods' volumes */ -}}
{{- range $jobVolume := .Values.jobs.extraVolumes -}}
{{- range $mlflowVolume := $.Values.mlflow.extraVolumes -}}
{{- if eq $jobVolume.name $mlflowVolume.name -}}
{{- fail (printf "jobs.extraVolumes and mlflow.extraVolumes both name a volume %s, and the db-upgrade Job gets both: rename one" $jobVolume.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
