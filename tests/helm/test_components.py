"""What each component renders to: the upload hook, RBAC, MLflow's wiring, SeaweedFS, the judge, helm tests, NOTES."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rloo.pipeline.constants import HF_SECRET_KEYS, JUDGE_SECRET_KEYS, MLFLOW_SECRET_KEYS, PIPELINE_NAME
from rloo.pipeline.trainjob import API_VERSION, KIND
from tests.fixtures.servers import free_port, stop_process
from tests.helm.helpers import CHART, NAMESPACE, documents, env_of, find, pod_spec, render, variant_values


def _docs(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return documents(render(values))


def _notes(values: dict[str, Any] | None = None) -> str:
    return render(values)["rloo-kfp/templates/NOTES.txt"]


def _container(doc: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    spec = pod_spec(doc)
    assert spec is not None
    found = [c for c in spec["containers"] if name is None or c["name"] == name]
    return found[0]


# Upload hook -------------------------------------------------------------------------------------------


def test_upload_job_is_an_idempotent_post_install_hook() -> None:
    docs = _docs()
    job = find(docs, "Job", "-upload")
    ann = job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "post-install,post-upgrade"
    assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    c = _container(job)
    assert c["image"] == "ghcr.io/rloo-kfp/rloo-slim:0.1.0"
    assert c["command"] + c["args"] == [
        "rloo",
        "pipeline",
        "upload",
        "--host",
        "http://ml-pipeline.kubeflow.svc.cluster.local:8888",
        "--package",
        "/etc/rloo/pipeline/rloo_pipeline.yaml",
        "--name",
        PIPELINE_NAME,
    ]
    spec = pod_spec(job)
    assert spec["serviceAccountName"] == "rel-rloo-kfp"
    # The compiled pipeline arrives, byte for byte, through the ConfigMap.
    cm = find(docs, "ConfigMap", "-pipeline")
    assert cm["data"]["rloo_pipeline.yaml"] == (CHART / "files" / "rloo_pipeline.yaml").read_text()
    pipeline_volume = next(v for v in spec["volumes"] if v["name"] == "pipeline")
    assert pipeline_volume["configMap"]["name"] == cm["metadata"]["name"]
    assert {"name": "pipeline", "mountPath": "/etc/rloo/pipeline", "readOnly": True} in c["volumeMounts"]


def test_upload_job_presents_a_kfp_token() -> None:
    job = find(_docs({"upload": {"serviceAccountName": "default-editor"}}), "Job", "-upload")
    spec = pod_spec(job)
    assert spec["serviceAccountName"] == "default-editor"
    token = next(v for v in spec["volumes"] if v["name"] == "kfp-token")
    source = token["projected"]["sources"][0]["serviceAccountToken"]
    assert source["audience"] == "pipelines.kubeflow.org" and source["path"] == "token"
    c = _container(job)
    mount = next(m for m in c["volumeMounts"] if m["name"] == "kfp-token")
    assert mount["mountPath"] + "/" + source["path"] == "/var/run/secrets/kubeflow/pipelines/token"
    assert env_of(c)["KF_PIPELINES_SA_TOKEN_PATH"]["value"] == "/var/run/secrets/kubeflow/pipelines/token"
    no_token = find(_docs({"upload": {"kfpToken": {"enabled": False}}}), "Job", "-upload")
    assert "kfp-token" not in {v["name"] for v in pod_spec(no_token)["volumes"]}


def test_upload_disabled_renders_no_hook() -> None:
    docs = _docs({"upload": {"enabled": False}})
    assert not [
        d
        for d in docs
        if d["kind"] == "Job" or (d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-pipeline"))
    ]


# RBAC --------------------------------------------------------------------------------------------------


def test_rbac_lets_the_pipeline_run_pytorchjobs() -> None:
    docs = _docs()
    role = find(docs, "Role", "-pipeline")
    assert role["metadata"]["namespace"] == NAMESPACE
    group, _, _ = API_VERSION.partition("/")
    rules = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    plural = KIND.lower() + "s"
    assert {"create", "get", "list", "watch", "delete", "patch"} <= rules[(group, plural)]
    assert "get" in rules[(group, f"{plural}/status")]
    for resource in ("pods", "pods/log", "events"):
        assert {"get", "list", "watch"} <= rules[("", resource)]
    binding = find(docs, "RoleBinding", "-pipeline")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pipeline-runner", "namespace": NAMESPACE}
    ]


def test_rbac_follows_a_multi_user_profile_namespace() -> None:
    docs = _docs(variant_values("external-db-values.yaml"))
    role, binding = find(docs, "Role", "-pipeline"), find(docs, "RoleBinding", "-pipeline")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "kubeflow-user-example-com"
    assert binding["subjects"][0] == {
        "kind": "ServiceAccount",
        "name": "default-editor",
        "namespace": "kubeflow-user-example-com",
    }
    assert not [
        d for d in _docs({"pipeline": {"rbac": {"create": False}}}) if d["kind"] in ("Role", "RoleBinding")
    ]


# MLflow ------------------------------------------------------------------------------------------------


def test_mlflow_uses_the_in_chart_database_and_proxies_artifacts() -> None:
    docs = _docs()
    c = _container(find(docs, "Deployment", "-mlflow"))
    env = env_of(c)
    assert env["MLFLOW_BACKEND_STORE_URI"]["value"] == (
        "postgresql+psycopg2://mlflow@rel-rloo-kfp-postgresql:5432/mlflow?sslmode=disable"
    )
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "rloo-postgres", "key": "password"}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "rloo-s3",
        "key": "AWS_ACCESS_KEY_ID",
    }
    assert "MLFLOW_S3_ENDPOINT_URL" not in env  # AWS S3
    assert "--serve-artifacts" in c["args"] and "--artifacts-destination=s3://rloo/mlflow" in c["args"]
    hosts = env["MLFLOW_SERVER_ALLOWED_HOSTS"]["value"].split(",")
    assert {
        "rel-rloo-kfp-mlflow",
        "rel-rloo-kfp-mlflow:*",
        f"rel-rloo-kfp-mlflow.{NAMESPACE}*",
        "localhost:*",
    } <= set(hosts)
    pg = find(docs, "StatefulSet", "-postgresql")
    pg_env = env_of(_container(pg))
    assert pg_env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "rloo-postgres",
        "key": "password",
    }
    assert find(docs, "Service", "-postgresql")["spec"]["ports"][0]["port"] == 5432
    service = find(docs, "Service", "-mlflow")
    assert (
        service["spec"]["selector"] == find(docs, "Deployment", "-mlflow")["spec"]["selector"]["matchLabels"]
    )


def test_mlflow_with_external_database_s3_and_ingress() -> None:
    docs = _docs(variant_values("external-db-values.yaml"))
    assert not [d for d in docs if "postgresql" in d["metadata"]["name"]]
    c = _container(find(docs, "Deployment", "-mlflow"))
    env = env_of(c)
    assert env["MLFLOW_BACKEND_STORE_URI"]["value"] == (
        "postgresql+psycopg2://mlflow@postgres.databases.svc.cluster.local:5432/mlflow?sslmode=require"
    )
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-db", "key": "postgres-password"}
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == "https://minio.storage.svc.cluster.local:9000"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "minio-credentials",
        "key": "secretkey",
    }
    hosts = env["MLFLOW_SERVER_ALLOWED_HOSTS"]["value"].split(",")
    assert {"mlflow.example.com", "mlflow.internal.example.com"} <= set(hosts)
    ingress = find(docs, "Ingress", "-mlflow")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["mlflow.example.com"], "secretName": "mlflow-tls"}]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rel-rloo-kfp-mlflow", "port": {"name": "http"}}
    assert pod_spec(find(docs, "Deployment", "-mlflow"))["imagePullSecrets"] == [
        {"name": "registry-credentials"}
    ]


# SeaweedFS ---------------------------------------------------------------------------------------------


def test_seaweedfs_serves_s3_with_the_referenced_keys() -> None:
    docs = _docs(variant_values("seaweedfs-values.yaml"))
    sts = find(docs, "StatefulSet", "-seaweedfs")
    spec = pod_spec(sts)
    init = spec["initContainers"][0]
    assert env_of(init)["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "rloo-s3"
    weed = _container(sts, "seaweedfs")
    assert "-s3.config=/etc/seaweedfs-s3/s3.json" in weed["args"] and "-s3" in weed["args"]
    config = next(v for v in spec["volumes"] if v["name"] == "config")
    assert config["emptyDir"]["medium"] == "Memory"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "standard"
    endpoint = "http://rel-rloo-kfp-seaweedfs.rloo.svc:8333"
    mlflow_env = env_of(_container(find(docs, "Deployment", "-mlflow")))
    assert mlflow_env["MLFLOW_S3_ENDPOINT_URL"]["value"] == endpoint
    bucket_job = find(docs, "Job", "-bucket")
    assert bucket_job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    # The bucket exists before the pipeline is uploaded (lower hook weight runs first).
    upload = find(docs, "Job", "-upload")
    assert int(bucket_job["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        upload["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    job_env = env_of(_container(bucket_job))
    assert job_env["S3_ENDPOINT_URL"]["value"] == endpoint and job_env["BUCKET"]["value"] == "rloo-artifacts"
    compile(_container(bucket_job)["args"][0], "create-bucket", "exec")  # the inline script is valid Python
    assert endpoint in _notes(variant_values("seaweedfs-values.yaml"))


def test_without_seaweedfs_nothing_of_it_renders() -> None:
    assert not [
        d
        for d in _docs()
        if "seaweedfs" in d["metadata"]["name"] or d["metadata"]["name"].endswith("-bucket")
    ]


# Judge -------------------------------------------------------------------------------------------------


def test_judge_is_a_gpu_vllm_server() -> None:
    docs = _docs(variant_values("judge-values.yaml"))
    deploy = find(docs, "Deployment", "-judge")
    c = _container(deploy, "vllm")
    assert c["image"] == "docker.io/vllm/vllm-openai:v0.31.0"
    assert c["command"] == ["vllm", "serve"] and c["args"][0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert "--served-model-name=judge" in c["args"] and "--tensor-parallel-size=2" in c["args"]
    assert "--dtype=bfloat16" in c["args"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["readinessProbe"]["httpGet"]["path"] == "/v1/models"
    spec = pod_spec(deploy)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "shared-model-cache"
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]  # the existing claim is used
    assert env_of(c)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "rloo-hf", "key": "HF_TOKEN"}
    assert env_of(c)["HF_HOME"]["value"].startswith("/models")
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    notes = _notes(variant_values("judge-values.yaml"))
    assert "--param judge_base_url=http://rel-rloo-kfp-judge.rloo.svc:8000/v1" in notes
    assert "--param judge_model=judge" in notes


def test_judge_model_cache_claim_and_emptydir() -> None:
    docs = _docs({"judge": {"enabled": True}})
    pvc = find(docs, "PersistentVolumeClaim", "-judge-model-cache")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    volumes = {v["name"]: v for v in pod_spec(find(docs, "Deployment", "-judge"))["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    docs = _docs(variant_values("all-in-values.yaml"))
    volumes = {v["name"]: v for v in pod_spec(find(docs, "Deployment", "-judge"))["volumes"]}
    assert volumes["model-cache"]["emptyDir"]["sizeLimit"] == "40Gi"
    assert not [d for d in _docs() if "judge" in d["metadata"]["name"]]


# helm test and NOTES -----------------------------------------------------------------------------------


def test_install_namespace_is_the_one_kfp_runs_pipelines_in() -> None:
    """Both READMEs install into kubeflow: standalone KFP runs pipelines there (as pipeline-runner), so the
    steps' Secrets and the chart's RBAC (pipeline.namespace defaults to the release's) belong there."""
    import re

    for readme in (CHART.parent / "README.md", CHART / "README.md"):
        installs = re.findall(r"helm install rloo \./helm -n ([\w-]+)", readme.read_text())
        assert installs and set(installs) == {"kubeflow"}, (readme, installs)
    warning = "standalone\nKubeflow Pipelines runs pipelines in namespace kubeflow"
    assert warning in _notes()  # rendered in namespace rloo
    assert warning not in render(namespace="kubeflow")["rloo-kfp/templates/NOTES.txt"]
    assert warning not in _notes({"pipeline": {"namespace": "kubeflow-user-example-com"}})


@pytest.mark.parametrize(("judge", "expected"), [(False, {"mlflow"}), (True, {"mlflow", "judge"})])
def test_helm_test_pods(judge: bool, expected: set[str]) -> None:
    docs = _docs({"judge": {"enabled": judge}})
    tests = [d for d in docs if (d["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"]
    assert {d["metadata"]["name"].rsplit("-", 1)[-1] for d in tests} == expected
    for pod in tests:
        assert pod["kind"] == "Pod" and pod["spec"]["restartPolicy"] == "Never"
        c = _container(pod)
        compile(c["args"][0], pod["metadata"]["name"], "exec")
        urls = [e["value"] for e in c["env"] if e["name"].endswith("_URL")]
        assert urls and all(u.startswith("http://rel-rloo-kfp-") for u in urls)


def test_notes_explain_secrets_mlflow_and_submit() -> None:
    notes = _notes()
    assert "kubectl -n rloo port-forward svc/rel-rloo-kfp-mlflow 5000:5000" in notes
    assert "rloo pipeline submit --host http://localhost:8888" in notes
    assert "kubectl -n rloo create secret generic rloo-postgres" in notes
    for secret, keys in (
        ("rloo-s3", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_ENDPOINT_URL"]),
        ("rloo-mlflow", list(MLFLOW_SECRET_KEYS)),
        ("rloo-hf", list(HF_SECRET_KEYS)),
        ("rloo-judge", list(JUDGE_SECRET_KEYS)),
    ):
        assert f"create secret generic {secret}" in notes, secret
        for key in keys:
            assert f"--from-literal={key}=" in notes, key
    assert "MLFLOW_TRACKING_URI='http://rel-rloo-kfp-mlflow.rloo.svc:5000'" in notes
    # One rloo-s3 when the chart's S3 Secret is the pipeline's, in the same namespace.
    assert notes.count("create secret generic rloo-s3") == 1
    other = _notes(variant_values("external-db-values.yaml"))
    assert "kubectl -n kubeflow-user-example-com create secret generic rloo-s3" in other
    assert "create secret generic mlflow-db" in other and "--namespace kubeflow-user-example-com" in other
    assert "https://mlflow.example.com/" in other


def test_mlflow_accepts_the_hosts_the_chart_allows(tmp_path: Path) -> None:
    """The pinned MLflow, run with the chart's MLFLOW_SERVER_ALLOWED_HOSTS, answers the Service's names (what the
    pipeline's `rloo-mlflow` Secret and a port-forward use) and rejects other hosts."""
    docs = _docs(variant_values("external-db-values.yaml"))
    allowed = env_of(_container(find(docs, "Deployment", "-mlflow")))["MLFLOW_SERVER_ALLOWED_HOSTS"]["value"]
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ALLOWED_HOSTS": allowed}
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    cmd += ["--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    cmd += ["--serve-artifacts", "--artifacts-destination", str(tmp_path / "artifacts")]
    with open(tmp_path / "mlflow.log", "wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
        )
    try:

        def status(host: str) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            body = b'{"max_results": 1}'
            headers = {"Host": host, "Content-Type": "application/json"}
            try:
                conn.request("POST", "/api/2.0/mlflow/experiments/search", body=body, headers=headers)
                return conn.getresponse().status
            finally:
                conn.close()

        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "mlflow.log").read_text()[-2000:]
            try:
                status("localhost")
                break
            except OSError:
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        for host in (
            "rel-rloo-kfp-mlflow.rloo.svc:5000",
            "rel-rloo-kfp-mlflow.rloo.svc.cluster.local:5000",
            "rel-rloo-kfp-mlflow:5000",
            "localhost:5000",
            "mlflow.example.com",
        ):
            assert status(host) == 200, host
        assert status("evil.example.com") == 403
    finally:
        stop_process(proc)


def test_bucket_job_sets_the_abort_incomplete_uploads_rule(s3_server: Any, tmp_path: Path) -> None:
    """The bucket Job's own script, run against SeaweedFS: creates the bucket, sets the lifecycle rule that
    aborts incomplete multipart uploads after the configured days, keeps other rules, and is idempotent."""
    values = variant_values("seaweedfs-values.yaml")
    values["seaweedfs"] = {**values.get("seaweedfs", {}), "abortIncompleteUploadsAfterDays": 3}
    job = _container(find(_docs(values), "Job", "-bucket"))
    assert env_of(job)["ABORT_INCOMPLETE_UPLOADS_DAYS"]["value"] == "3"
    script = job["args"][0]
    bucket = f"rloo-lifecycle-{os.urandom(3).hex()}"

    def run(days: str) -> str:
        env = {**os.environ, **s3_server.env(), "BUCKET": bucket, "ABORT_INCOMPLETE_UPLOADS_DAYS": days}
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    client = s3_server.client()
    rule = {"ID": "rloo-abort-incomplete-multipart-uploads", "Status": "Enabled", "Filter": {"Prefix": ""},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 3}}  # fmt: skip
    try:
        assert f"bucket {bucket} created" in run("3")
        assert client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"] == [rule]
        # someone else's rule survives an upgrade, and ours is replaced, not duplicated
        theirs = {"ID": "theirs", "Status": "Enabled", "Filter": {"Prefix": "tmp/"},
                  "Expiration": {"Days": 30}}  # fmt: skip
        client.put_bucket_lifecycle_configuration(
            Bucket=bucket, LifecycleConfiguration={"Rules": [theirs, rule]}
        )
        assert f"bucket {bucket} exists" in run("3")
        rules = client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
        assert sorted(r["ID"] for r in rules) == ["rloo-abort-incomplete-multipart-uploads", "theirs"]
        run("0")  # 0: no rule of ours
        assert [r["ID"] for r in client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]] == [
            "theirs"
        ]
    finally:
        client.delete_bucket(Bucket=bucket)
