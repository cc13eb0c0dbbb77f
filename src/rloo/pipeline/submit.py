"""Upload the compiled pipeline to a Kubeflow Pipelines installation and start runs there.

``rloo pipeline upload`` (also what the Helm chart's post-install Job runs) is idempotent: the pipeline is
created when its name is new, otherwise the package becomes a new version named after its digest, and
nothing happens when that version exists already. ``rloo pipeline submit`` uploads the same way, then starts
a run of exactly that version and prints its URL.

The KFP API is reached with ``kfp.Client``; this module only decides what to call, so it is tested with a
stand-in client (no KFP API server runs outside a cluster). In a cluster, ``kfp.Client`` authenticates with
the projected service-account token at ``/var/run/secrets/kubeflow/pipelines/token`` when it is mounted.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo.errors import ServiceUnavailable, UserError
from rloo.k8s.platform import Platform

DESCRIPTION = "RLHF with RLOO: fetch SFT, train, judge, push (rloo-kfp)."


@dataclass(frozen=True)
class Uploaded:
    pipeline_id: str
    version_id: str
    version_name: str
    created: str  # "pipeline" | "version" | "nothing" (this package was there already)


def package_digest(path: str | Path) -> str:
    """SHA-256 of the pipeline package, the identity of a version."""
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"--package {path}: no such file; run 'rloo pipeline compile' or pass the compiled YAML."
        )
    return hashlib.sha256(p.read_bytes()).hexdigest()


def version_name(digest: str) -> str:
    return f"sha256-{digest[:16]}"


def _versions(client: Any, pipeline_id: str) -> list[Any]:
    out, token = [], ""
    while True:
        resp = client.list_pipeline_versions(pipeline_id=pipeline_id, page_token=token, page_size=100)
        out += list(getattr(resp, "pipeline_versions", None) or [])
        token = getattr(resp, "next_page_token", "") or ""
        if not token:
            return out


def _newest_version_id(client: Any, pipeline_id: str) -> str:
    versions = sorted(_versions(client, pipeline_id), key=lambda v: str(getattr(v, "created_at", "") or ""))
    if not versions:
        raise UserError(f"pipeline {pipeline_id} has no versions; delete it in the KFP UI and upload again.")
    return str(versions[-1].pipeline_version_id)


def find_pipeline_id(client: Any, name: str, namespace: str | None = None) -> str | None:
    """The id of pipeline ``name`` in ``namespace`` (None: the shared pipelines). ``kfp.Client.
    get_pipeline_id`` looks in the shared space only, so in a multi-user KFP a pipeline uploaded into a profile
    would never be found again and every upgrade would try to create it anew."""
    import json

    predicate = {"operation": 1, "key": "display_name", "stringValue": name}  # 1: EQUALS (the v2beta1 API)
    result = client.list_pipelines(
        filter=json.dumps({"predicates": [predicate]}), namespace=namespace, page_size=2
    )
    found = list(getattr(result, "pipelines", None) or [])
    if len(found) > 1:
        where = f"namespace {namespace}" if namespace else "the shared space"
        raise UserError(
            f"{len(found)} pipelines are named {name!r} in {where}; delete all but one in the KFP UI."
        )
    return str(found[0].pipeline_id) if found else None


def ensure_uploaded(client: Any, package: str | Path, name: str, *, namespace: str | None = None) -> Uploaded:
    """Make sure the KFP installation behind ``client`` has ``package`` as a version of pipeline ``name``.

    The first upload creates the pipeline (its first version gets the pipeline's name, and the digest is
    recorded in the pipeline description); later uploads of a changed package add a version named
    ``sha256-<digest prefix>``; an unchanged package is found and nothing is created.
    """
    digest = package_digest(package)
    vname = version_name(digest)
    pipeline_id = find_pipeline_id(client, name, namespace)
    if pipeline_id is None:
        pipeline = client.upload_pipeline(
            str(package), pipeline_name=name, description=f"{DESCRIPTION} {vname}", namespace=namespace
        )
        pid = str(pipeline.pipeline_id)
        return Uploaded(pid, _newest_version_id(client, pid), name, "pipeline")
    versions = _versions(client, pipeline_id)
    for v in versions:
        if getattr(v, "display_name", None) == vname:
            return Uploaded(pipeline_id, str(v.pipeline_version_id), vname, "nothing")
    pipeline = client.get_pipeline(pipeline_id)
    if len(versions) == 1 and vname in str(getattr(pipeline, "description", "") or ""):
        # the pipeline's first version, uploaded with this very package
        return Uploaded(pipeline_id, str(versions[0].pipeline_version_id), name, "nothing")
    version = client.upload_pipeline_version(
        str(package),
        pipeline_version_name=vname,
        pipeline_id=pipeline_id,
        description=f"{DESCRIPTION} {vname}",
    )
    return Uploaded(pipeline_id, str(version.pipeline_version_id), vname, "version")


def start_run(
    client: Any,
    uploaded: Uploaded,
    params: dict[str, Any],
    *,
    experiment: str,
    run_name: str,
    namespace: str | None = None,
    service_account: str | None = None,
) -> str:
    """Start a run of the uploaded version in ``experiment`` (created when missing); returns the run id."""
    exp = client.create_experiment(experiment, namespace=namespace)  # returns the existing one if any
    run = client.run_pipeline(
        experiment_id=exp.experiment_id,
        job_name=run_name,
        params=params,
        pipeline_id=uploaded.pipeline_id,
        version_id=uploaded.version_id,
        service_account=service_account,
    )
    return str(run.run_id)


def run_url(ui_host: str, run_id: str) -> str:
    return f"{ui_host.rstrip('/')}/#/runs/details/{run_id}"


@contextmanager
def api_errors(host: str) -> Iterator[None]:
    """Turn the KFP API client's errors (HTTP status, connection refused, TLS) into one-line UserErrors."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        status = getattr(e, "status", None)
        if status in (401, 403):
            why = f"HTTP {status}: not authorised; mount the pipelines token in a cluster, or reach KFP through an authenticating proxy"
        elif status is not None:
            why = f"HTTP {status} {getattr(e, 'reason', '')}".strip()
        else:
            why = type(e).__name__
        raise UserError(
            f"Kubeflow Pipelines API at {host} failed ({why}); check --host and that KFP is running."
        ) from None


def connect(
    host: str, *, namespace: str | None = None, ui_host: str | None = None
) -> Any:  # pragma: no cover
    """A ``kfp.Client`` for ``host``, or a one-line UserError when the API cannot be reached."""
    import warnings

    from kfp import Client

    if not host.startswith(("http://", "https://")):
        raise UserError(
            f"--host {host}: give the KFP API URL, e.g. http://localhost:8080 (kubectl port-forward)."
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "only works with KFP v2.0.0-beta.2 and later"
            return Client(host=host, namespace=namespace or "kubeflow", ui_host=ui_host)
    except Exception as e:  # urllib3 / kfp_server_api errors: one line, not a traceback
        # exit 75: an API server restarting or a port-forward not yet up heals; a wrong --host does not, but
        # looks the same from here
        raise ServiceUnavailable(
            f"Kubeflow Pipelines at {host} is unreachable ({type(e).__name__}): check --host, or try again."
        ) from None


def params_for_submit(params: dict[str, Any], platform: Platform | None = None) -> dict[str, Any]:
    """Check parameters against the pipeline (names, required ones, types, the validate step's checks, with
    ``platform``: the settings the run's steps get) before anything is sent; returns them converted to the
    parameters' types."""
    from rloo.k8s.builders import check_queue_backend
    from rloo.pipeline.params import check_params, with_defaults
    from rloo.stages.validate import build_plan

    params = check_params(params, required=True)
    # check_paths=False: a local path names a path inside the cluster's pods
    plan = build_plan(with_defaults(params), check_paths=False)
    check_queue_backend(with_defaults(params), platform or Platform())
    if not plan.run.output_uri.startswith("s3://"):
        raise UserError(
            f"output_uri {plan.run.output_uri!r}: a cluster run needs s3://bucket/prefix (each step runs in a "
            "pod of its own, which a local path is not shared with)."
        )
    return params


# The oldest Kubeflow Pipelines backend that runs the compiled pipeline: its steps mark secret env vars
# 'optional', a field of the Kubernetes executor config that KFP understands from 2.15 (2.14's API server
# refuses the run: "failed to unmarshal kubernetes config: unknown field"; older drivers drop it, so a step
# whose optional secret is missing never starts). Pod-spec placeholders (GPU count, CPU, memory from
# parameters) need 2.4.
MIN_KFP_VERSION = (2, 15)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def kfp_version(client: Any) -> str | None:
    """The KFP API server's release (``tag_name`` of ``GET /apis/v2beta1/healthz``), None when it does not say.

    ``kfp.Client.get_kfp_healthz()`` drops ``tag_name`` (its response model has no such field), so the JSON is
    read raw. Release images report it from 2.16 on; 2.15 and builds from source say "unknown"."""
    try:
        resp = client._healthz_api.healthz_service_get_healthz(_preload_content=False)
        body = json.loads(resp.data)
    except Exception:  # an older client, a proxy page, no such endpoint: the version stays unknown
        return None
    tag = str(body.get("tag_name") or body.get("tagName") or "").strip()
    return tag or None


def check_kfp_version(tag: str | None, host: str) -> str:
    """A one-line UserError when ``tag`` is a KFP release older than :data:`MIN_KFP_VERSION`; else what is
    known of the version, for the command's output."""
    floor = ".".join(map(str, MIN_KFP_VERSION))
    m = _VERSION.match(tag or "")
    if m is None:
        return f"KFP version not reported ({tag or 'no tag'}); this pipeline needs {floor} or newer"
    if (int(m[1]), int(m[2])) < MIN_KFP_VERSION:
        raise UserError(
            f"Kubeflow Pipelines at {host} is {tag}; this pipeline needs {floor} or newer (its steps' optional "
            "secrets are refused by older API servers): upgrade KFP."
        )
    return f"KFP {tag}"


def check_training_runtime(params: dict[str, Any], custom_api: Any, namespace: str) -> str:
    """For a multi-node TrainJob run: the (Cluster)TrainingRuntime named by ``training_runtime`` must exist.
    ``custom_api``: a ``kubernetes.client.CustomObjectsApi`` with the caller's credentials, or None when there
    are none (then nothing is checked). Returns what was checked, for the command's output."""
    from rloo.k8s.builders import DEFAULT_BACKEND, DEFAULT_RUNTIME, runtime_ref

    if int(params.get("num_nodes", 1)) < 2 or params.get("multinode_backend", DEFAULT_BACKEND) != "trainjob":
        return ""
    runtime = str(params.get("training_runtime", DEFAULT_RUNTIME))
    ref = runtime_ref(runtime)
    if custom_api is None:
        return f"training runtime {runtime} not checked (no Kubernetes credentials here)"
    ns = str(params.get("namespace") or namespace)
    try:
        if ref["kind"] == "ClusterTrainingRuntime":
            custom_api.get_cluster_custom_object(
                "trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", ref["name"]
            )
        else:
            custom_api.get_namespaced_custom_object(
                "trainer.kubeflow.org", "v1alpha1", ns, "trainingruntimes", ref["name"]
            )
    except Exception as e:
        status = getattr(e, "status", None)
        if status == 404:
            where = "in the cluster" if ref["kind"] == "ClusterTrainingRuntime" else f"in namespace {ns}"
            listing = (
                "kubectl get clustertrainingruntimes"
                if ref["kind"] == "ClusterTrainingRuntime"
                else f"kubectl get trainingruntimes -n {ns}"
            )
            raise UserError(
                f"training_runtime {runtime}: no {ref['kind']} {ref['name']} {where} ({listing} lists them); "
                "install Kubeflow Trainer's torch-distributed runtime or name one that exists."
            ) from None
        why = f"HTTP {status}" if status else type(e).__name__
        return f"training runtime {runtime} not checked ({why})"
    return f"training runtime {runtime} found"


def kube_custom_api() -> Any:  # pragma: no cover - needs a kubeconfig or a pod
    """A CustomObjectsApi from the local kubeconfig or the pod's service account; None without either."""
    try:
        from kubernetes import client, config

        try:
            config.load_kube_config()
        except Exception:
            config.load_incluster_config()
        return client.CustomObjectsApi()
    except Exception:
        return None


ISTIO_QUIT_URL = "http://127.0.0.1:15020/quitquitquit"


def stop_istio_sidecar(url: str = ISTIO_QUIT_URL) -> str:
    """Ask the pod's Istio sidecar to exit (its pilot-agent's ``/quitquitquit``): a Job's pod completes only
    once every container has exited, and the sidecar never exits on its own. Returns what to tell the user;
    a pod without a sidecar answers nothing, which is fine."""
    import urllib.error
    import urllib.request

    # never through HTTP_PROXY (a NO_PROXY without 127.0.0.1 would send it to the proxy and the Job would hang)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, method="POST"), timeout=5) as resp:
            return f"asked the Istio sidecar to exit (HTTP {resp.status})"
    except (urllib.error.URLError, OSError) as e:
        return f"no Istio sidecar answered at {url} ({getattr(e, 'reason', e)}); nothing to stop"
