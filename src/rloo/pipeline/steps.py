"""What the pipeline's components do, as library functions (the components only unpack KFP types).

:func:`check_pipeline_params` (the validate step) runs first in the pipeline, on a CPU pod: a bad parameter
fails there in one line, before any GPU is requested.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import tempfile
import typing
from pathlib import Path
from typing import Any

from rloo.errors import UserError
from rloo.parsing import parse_values

log = logging.getLogger(__name__)

# The model and dataset placeholders validation substitutes: their real values are only known at run time.
_PLACEHOLDER_MODEL = "placeholder-model"


# The pipeline parameters that are 'rloo train' flags of the same name (their defaults are the config's: a test
# checks it); every other training setting comes through extra_train_args.
TRAIN_PARAMS = (
    "dataset_name",
    "dataset_train_split",
    "reward_model_path",
    "learning_rate",
    "total_episodes",
    "rloo_k",
    "kl_coef",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "response_length",
    "seed",
)


def train_args(params: dict[str, Any]) -> list[str]:
    """The ``rloo train`` flags the pipeline parameters ``params`` give: one per :data:`TRAIN_PARAMS` name,
    then ``extra_train_args``. Model, output and checkpoint locations are the training pod's own."""
    args: list[str] = []
    for name in TRAIN_PARAMS:
        value = params[name]
        if name == "reward_model_path" and not value:
            continue
        args += [f"--{name}", repr(value) if isinstance(value, float) else str(value)]
    return args + shlex.split(str(params["extra_train_args"]))


def check_pipeline_params(
    params: dict[str, Any], *, check_paths: bool = True, check_hub: bool = False
) -> dict[str, Any]:
    """Build every stage's config from the pipeline parameters (all of them, by their names in
    ``rloo_pipeline``: :func:`rloo.pipeline.params.with_defaults` fills in the rest); raise a one-line
    UserError naming the first bad one. ``check_paths``: the model and the bucket must be there
    (:func:`check_model_source`, :func:`check_storage_access`; ``check_hub``: Hub ids too).

    The validate step and ``rloo pipeline submit`` both call this, so a run is refused for the same reasons in
    both. Returns the training config the parameters give (``rloo train`` field names and typed values,
    defaults left out): the train step runs ``rloo train --config`` on it, adding only the pod-local
    locations."""
    from rloo.eval.config import EvalConfig
    from rloo.push.config import PushConfig

    _check_model(str(params["model"]), str(params["model_revision"]), check_paths=check_paths, hub=check_hub)
    _check_run(params, check_paths=check_paths)
    if check_paths:
        _check_datasets(params)
    train_config = _train_config(params)
    if not params["judge_base_url"]:
        raise UserError("judge_base_url is required: the OpenAI-compatible endpoint of the judge.")
    _stage_config(
        EvalConfig,
        params,
        {
            "eval_dataset_name": "dataset_name",
            "eval_dataset_split": "dataset_split",
            "eval_num_examples": "num_examples",
            "judge_base_url": "judge_base_url",
            "judge_model": "judge_model",
            "eval_max_new_tokens": "max_new_tokens",
        },
        model_name_or_path=_PLACEHOLDER_MODEL,
        baseline_model=_PLACEHOLDER_MODEL,
        report_to="none",
    )
    _stage_config(
        PushConfig,
        params,
        {
            name: name
            for name in (
                "promotion_margin",
                "compare_to_champion",
                "registered_model_name",
                "register_model",
                "hub_repo_id",
                "production_uri",
                "mlflow_experiment",
            )
        },
        model_path=_PLACEHOLDER_MODEL,
    )
    check_pod_params(params)
    return train_config


def _check_model(model: str, revision: str, *, check_paths: bool, hub: bool) -> None:
    from rloo.storage.location import source_kind

    if not model:
        raise UserError("model is required: a Hub id, s3://bucket/prefix or a local directory.")
    if revision and source_kind(model) != "hub":
        raise UserError(
            f"model_revision {revision!r} only applies to a Hugging Face Hub id, and model {model!r} is "
            "not one: drop model_revision (an s3:// upload is already pinned by its manifest)."
        )
    if revision and revision.split() != [revision]:  # no git ref holds whitespace
        raise UserError(
            f"model_revision {revision!r} is not a branch, tag or commit: drop the spaces (or leave it "
            "empty for main)."
        )
    if check_paths:
        check_model_source(model, hub=hub, revision=revision or None)


def _check_datasets(params: dict[str, Any]) -> None:
    """An s3:// dataset must be a complete upload (its manifest there) before any GPU is requested; Hub ids and
    directories are read by the stages themselves (a directory names a path inside the pods)."""
    from rloo.data import check_dataset_source
    from rloo.storage.location import source_kind

    for name in ("dataset_name", "eval_dataset_name"):
        if source_kind(str(params[name])) == "s3":
            check_dataset_source(str(params[name]), flag=name)


def _check_run(params: dict[str, Any], *, check_paths: bool) -> None:
    """Nodes, GPUs, where the run writes and the experiment it is tracked under."""
    gpu_count, num_nodes = int(params["gpu_count"]), int(params["num_nodes"])
    output_uri = str(params["output_uri"])
    if gpu_count < 0:
        raise UserError(f"gpu_count must be >= 0 (got {gpu_count}).")
    if num_nodes < 1:
        raise UserError(f"num_nodes must be >= 1 (got {num_nodes}).")
    if num_nodes > 1 and gpu_count < 1:
        raise UserError("num_nodes > 1 needs gpu_count >= 1 per node.")
    if not output_uri:
        raise UserError("output_uri is required: s3://bucket/prefix where models and results are written.")
    if num_nodes > 1 and not output_uri.startswith("s3://"):
        raise UserError(f"multi-node training needs an s3:// output_uri (got {output_uri!r}).")
    if check_paths:
        check_storage_access(output_uri, what="output_uri")
    if not str(params["mlflow_experiment"]).strip():
        raise UserError("mlflow_experiment must not be empty: it names the MLflow experiment of the run.")


def _train_config(params: dict[str, Any]) -> dict[str, Any]:
    """The training parameters and ``extra_train_args``, through the parser of 'rloo train' itself (exactly
    the checks the command applies), as the config values they give."""
    from rloo.config import RLOOConfig
    from rloo.pipeline.node import POD_LOCAL_FIELDS

    try:
        values = parse_values(RLOOConfig, train_args(params), prog="rloo train")
        for name in sorted(POD_LOCAL_FIELDS & values.keys()):
            raise UserError(f"--{name} is set by the pipeline itself; remove it from extra_train_args.")
        RLOOConfig(**({"model_name_or_path": _PLACEHOLDER_MODEL, "output_dir": "validate"} | values))
    except UserError as e:
        raise UserError(
            _in_pipeline_terms(str(e), has_reward_model=bool(params["reward_model_path"]))
        ) from None
    return values


def _stage_config(cls: type, params: dict[str, Any], fields: dict[str, str], **fixed: Any) -> None:
    """Build a stage's config from the pipeline parameters ``fields`` names (``{parameter: field}``) and
    ``fixed`` fields; its one-line error names the pipeline parameter (``--dataset_split`` ->
    ``eval_dataset_split``). KFP has no None: an optional field's unset value is the parameter's empty one
    ('' or 0)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for name, field in fields.items():
        value = params[name]
        optional = type(None) in typing.get_args(hints[field])
        unset = value == "" or (type(value) is int and value == 0)
        values[field] = None if optional and unset else value
    try:
        cls(**fixed, **values)
    except UserError as e:
        raise UserError(_as_parameters(str(e), {field: name for name, field in fields.items()})) from None


def _as_parameters(message: str, names: dict[str, str]) -> str:
    """``message`` with each ``--field`` of ``names`` (``{field: pipeline parameter}``) named as the
    parameter that sets it; other flags stay flags (of ``extra_train_args``)."""
    return re.sub(r"--(\w+)\b", lambda m: names.get(m[1], m[0]), message)


def _in_pipeline_terms(message: str, *, has_reward_model: bool) -> str:
    """A message of 'rloo train' in the pipeline's terms: its flags that are pipeline parameters named as the
    parameters (``--rloo_k`` -> ``rloo_k``); the others are flags of ``extra_train_args``."""
    if message.startswith("no reward source") and not has_reward_model:
        return (
            "no reward source: set the pipeline parameter reward_model_path (a reward model) and/or put "
            "--reward_funcs pkg.module:fn in extra_train_args."
        )
    if message.startswith(("unknown flag", "unexpected argument")):  # only extra_train_args has free flags
        return f"extra_train_args: {message}"
    return _as_parameters(message, {name: name for name in TRAIN_PARAMS})


def check_pod_params(params: dict[str, Any]) -> None:
    """The pod settings among ``params`` (those present): CPU and memory quantities, memory above the in-memory
    /dev/shm, service account, secret and namespace names, the GPU resource name and node selector labels, the
    Kueue queue and priority class, the multi-node backend and runtime. KFP and the API server would refuse a bad
    one only when that step's pod is created, possibly after hours of training."""
    from rloo.pipeline.constants import SHM_SIZE
    from rloo.pipeline.resources import (
        check_namespace,
        check_node_selector,
        check_pod_memory,
        check_resource_name,
        check_scheduling,
        check_secret_name,
        check_service_account,
        cpu_millis,
    )

    for name in ("train_cpu", "eval_cpu"):
        if name in params:
            cpu_millis(name, str(params[name]))
    for name in ("train_memory", "eval_memory"):
        if name in params:
            check_pod_memory(name, str(params[name]), SHM_SIZE)
    if "train_service_account" in params:
        check_service_account("train_service_account", str(params["train_service_account"]))
    for name in ("s3_secret", "mlflow_secret", "hf_secret", "judge_secret"):
        if name in params:
            check_secret_name(name, str(params[name]))
    if "gpu_resource" in params:
        check_resource_name("gpu_resource", str(params["gpu_resource"]))
    if "gpu_node_selector" in params:
        check_node_selector("gpu_node_selector", params["gpu_node_selector"])
    if "namespace" in params:
        check_namespace("namespace", str(params["namespace"]))
    if "queue_name" in params or "priority_class" in params:
        from rloo.pipeline.trainjob import DEFAULT_BACKEND

        multinode = int(params.get("num_nodes", 2)) > 1  # one node creates no job: nothing to queue
        check_scheduling(
            str(params.get("queue_name", "")),
            str(params.get("priority_class", "")),
            str(params.get("multinode_backend", DEFAULT_BACKEND)) if multinode else None,
        )
    if "multinode_backend" in params or "training_runtime" in params:
        from rloo.pipeline.trainjob import DEFAULT_BACKEND, DEFAULT_RUNTIME, check_multinode

        check_multinode(
            str(params.get("multinode_backend", DEFAULT_BACKEND)),
            str(params.get("training_runtime", DEFAULT_RUNTIME)),
        )


def check_model_source(
    model: str, *, hub: bool = False, hub_api: Any = None, revision: str | None = None
) -> None:
    """Fail in one line when the SFT model cannot be fetched: a directory without ``config.json``, an
    ``s3://`` prefix without a complete upload, or (``hub``) a Hub id the Hub does not know or will not
    serve. A Hub that cannot be reached is only logged: the fetch step retries, and it may be a mirror.
    Which of the three ``model`` is: :func:`rloo.storage.location.source_kind` (``gpt2`` is a Hub id)."""
    from rloo.storage.location import local_source_path, source_kind

    kind = source_kind(model)
    if kind == "s3":
        from rloo.storage import read_manifest

        try:
            read_manifest(model)
        except UserError as e:
            raise UserError(f"model {model}: {e}") from None
        return
    if kind == "local":
        path = local_source_path(model)
        if not path.is_dir():
            raise UserError(
                f"model {model!r}: no such directory; give a Hub id, an s3:// prefix or a directory."
            )
        if not (path / "config.json").is_file():
            raise UserError(f"model {model!r} has no config.json: not a transformers model directory.")
        return
    if not hub:
        return
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        (hub_api or HfApi()).model_info(model, revision=revision)
    except GatedRepoError:
        raise UserError(
            f"model {model}: gated on the Hugging Face Hub; accept its terms and put a token in the hf_secret."
        ) from None
    except RevisionNotFoundError:
        raise UserError(
            f"model {model}: the Hugging Face Hub has no revision {revision!r} of it; give a commit, branch or "
            "tag that exists (or no model_revision for the current main)."
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"model {model}: not found on the Hugging Face Hub (a private repo needs HF_TOKEN in the hf_secret); "
            "check the id, or give an s3:// prefix or a directory."
        ) from None
    except Exception as e:  # unreachable Hub, proxy, mirror quirks: the fetch step will tell
        log.warning("could not check %s on the Hub (%s); the fetch step will try", model, type(e).__name__)


# The validate step asks the bucket once, quickly: wrong credentials, a missing bucket or an unreachable
# endpoint then fail in seconds there, instead of in the fetch step after minutes of KFP retries.
ACCESS_CHECK_ATTEMPTS = 2
ACCESS_CHECK_TIMEOUT_S = 5.0


def check_storage_access(uri: str, *, what: str, client: Any = None) -> None:
    """For an ``s3://`` location: one HeadBucket with a short timeout (credentials, bucket, endpoint), a
    one-line UserError naming ``what``, the bucket and the AWS variables to set. Local paths pass."""
    from rloo.storage import Location, StorageError
    from rloo.storage.backends import S3Backend
    from rloo.storage.s3 import s3_client

    try:
        loc = Location.parse(uri)
    except UserError as e:
        raise UserError(f"{what}: {e}") from None
    if not loc.is_s3:
        return
    try:
        client = client or s3_client(
            max_attempts=ACCESS_CHECK_ATTEMPTS,
            connect_timeout=ACCESS_CHECK_TIMEOUT_S,
            read_timeout=ACCESS_CHECK_TIMEOUT_S,
        )
        S3Backend(loc, client).check_access(create=False)
    except StorageError as e:
        raise UserError(f"{what}: {e}") from None


def manifest_digest(manifest: Any) -> str:
    """One digest for a published directory: SHA-256 over its files' paths, sizes and SHA-256s (not the
    manifest's timestamp, so the same files always give the same digest)."""
    h = hashlib.sha256()
    for f in sorted(manifest.files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return "sha256:" + h.hexdigest()


def fetch_model(
    source: str,
    dest_uri: str,
    *,
    work: str | None = None,
    revision: str | None = None,
    hub_api: Any = None,
) -> dict[str, Any]:
    """Copy an SFT model (Hub id, s3:// prefix or local directory) to ``dest_uri`` as a verified upload.

    A Hub id is pinned: ``revision`` (a branch, tag or commit; default the repo's main) is resolved to its
    commit once, and exactly that commit is downloaded and recorded, so a re-run or a later reader knows which
    weights were trained even if the repo moves on. ``hub_api``: an ``HfApi`` (tests pass a stand-in).

    Returns the metadata of the KFP ``Model`` artifact: source, revision (the Hub commit, None for other
    sources), uri, manifest digest, file count, bytes.
    """
    from rloo.storage import download_dir, upload_dir, verify_prefix
    from rloo.storage.location import local_source_path, source_kind

    commit: str | None = None
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        kind = source_kind(source)
        if kind == "s3":
            local = Path(tmp) / "model"
            download_dir(source, local, progress=False)  # verifies every SHA-256 against the manifest
        elif kind == "local":
            check_model_source(source)
            local = local_source_path(source)
        else:
            commit = resolve_hub_commit(source, revision, hub_api)
            api = hub_api or _hf_api()
            from rloo.storage.progress import quiet_library_bars

            quiet_library_bars()  # a step's log is no terminal: no bars redrawn into one huge line
            local = Path(api.snapshot_download(source, revision=commit, local_dir=Path(tmp) / "model"))
        if revision and commit is None:
            raise UserError(
                f"--model_revision {revision!r} only applies to a Hugging Face Hub id, and {source!r} is not one."
            )
        if not (local / "config.json").is_file():
            raise UserError(f"model {source!r} has no config.json: not a transformers model directory.")
        upload_dir(local, dest_uri, progress=False, exclude=[".cache", ".cache/*"])
    manifest = verify_prefix(dest_uri)  # what readers will see, not what we meant to write
    return {
        "source": source,
        "revision": commit,
        "uri": dest_uri,
        "manifest_digest": manifest_digest(manifest),
        "num_files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
    }


def _hf_api() -> Any:
    from huggingface_hub import HfApi

    return HfApi()


def resolve_hub_commit(repo_id: str, revision: str | None, hub_api: Any = None) -> str:
    """The commit SHA that ``revision`` (default: main) of Hub model ``repo_id`` points at now."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = (hub_api or _hf_api()).model_info(repo_id, revision=revision or None)
    except RevisionNotFoundError:
        raise UserError(
            f"model {repo_id}: the Hugging Face Hub has no revision {revision!r} of it; give a commit, branch or "
            "tag that exists."
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"model {repo_id}: not found on the Hugging Face Hub (a private repo needs HF_TOKEN); check the id."
        ) from None
    sha = getattr(info, "sha", None)
    if not sha:
        raise UserError(
            f"model {repo_id}: the Hugging Face Hub did not say which commit {revision or 'main'} is."
        )
    return str(sha)


def multinode_spec(
    *,
    run_id: str,
    run_name: str,
    sft_uri: str,
    train_config: dict[str, Any],
    output_uri: str,
    namespace: str,
    image: str,
    gpu_count: int,
    num_nodes: int,
    gpu_resource: str,
    node_selector: dict[str, Any],
    cpu: str,
    memory: str,
    service_account: str,
    s3_secret: str,
    mlflow_secret: str,
    hf_secret: str,
    mlflow_experiment: str,
    queue_name: str = "",
    priority_class: str = "",
    istio_sidecar: bool = False,
    owner: Any = None,
    scratch_size: str = "",
    pod_platform: Any = None,
) -> Any:
    """The :class:`rloo.pipeline.trainjob.TrainJobSpec` of a pipeline run's multi-node job: the train step and
    ``rloo pipeline manifest`` both build it here, so the printed job is the one the step creates. ``owner``:
    the launcher pod (:class:`rloo.pipeline.trainjob.OwnerPod`), when known; ``scratch_size``: the pods'
    scratch emptyDir (default: the train step's, ``RLOO_SCRATCH_TRAIN`` where this runs); ``pod_platform``:
    the cluster's pull secrets, environment and CA bundle (:class:`rloo.pipeline.platform.Platform`;
    default: the ones the upload gave this step, ``RLOO_PLATFORM``)."""
    from rloo.pipeline import constants, platform
    from rloo.pipeline.layout import RunLayout
    from rloo.pipeline.trainjob import TrainJobSpec, job_name

    layout = RunLayout(output_uri, run_id)
    # the platform's pull secrets, environment and CA bundle, which the upload gave this step (RLOO_PLATFORM)
    if pod_platform is None:
        pod_platform = platform.from_env(os.environ)
    volumes, mounts = platform.job_volumes(pod_platform)
    run_env = {"KFP_RUN_ID": run_id, "KFP_RUN_NAME": run_name, "MLFLOW_EXPERIMENT_NAME": mlflow_experiment}
    return TrainJobSpec(
        name=job_name(run_id),
        namespace=namespace,
        image=image,
        train_config=train_config,
        sft_uri=sft_uri,
        model_uri=layout.model,
        checkpoint_uri=layout.checkpoints,
        num_nodes=num_nodes,
        gpus_per_node=gpu_count,
        gpu_resource=gpu_resource,
        cpu=cpu,
        memory=memory,
        shm_size=constants.SHM_SIZE,
        service_account=service_account,
        env={**pod_platform.all_env(), **run_env},
        secret_env=constants.secret_env(
            s3_secret=s3_secret, mlflow_secret=mlflow_secret, hf_secret=hf_secret
        ),
        tolerations=[dict(constants.GPU_TOLERATION)],
        node_selector={str(k): str(v) for k, v in node_selector.items()},
        active_deadline_seconds=constants.TRAIN_TIMEOUT_S,
        queue_name=queue_name,
        priority_class=priority_class,
        istio_sidecar=istio_sidecar,
        owner=owner,
        scratch_size=scratch_size or constants.scratch_size("train"),  # the launcher's: fixed at compile time
        image_pull_secrets=pod_platform.image_pull_secrets,
        extra_volumes=volumes,
        extra_mounts=mounts,
    )


def durable_model_name(fetched: dict[str, Any]) -> str:
    """How to name a fetched SFT model in cards and reports: its Hub id, else the store URI it was copied to
    (a path on the machine that ran the fetch step means nothing later)."""
    from rloo.storage.location import source_kind

    source = str(fetched.get("source") or "")
    if source and source_kind(source) == "hub":
        return source
    return str(fetched.get("uri") or source)


def push_stage(
    *,
    trained_uri: str,
    eval_results_uri: str,
    output_uri: str,
    kfp_run_id: str,
    base_model: str = "",
    base_model_revision: str = "",
    **push_options: Any,
) -> dict[str, Any]:
    """``rloo push`` for one pipeline run: staged in a temporary directory that is removed afterwards, the
    version published under ``<output_uri>/published/<run id>``, and ``push_result.json`` published to
    ``<output_uri>/<run id>/push`` next to the model and the evaluation (its URI is returned as
    ``result_uri``). ``push_options``: the other :class:`rloo.push.config.PushConfig` fields."""
    from rloo.pipeline.layout import RunLayout
    from rloo.push.config import PushConfig
    from rloo.push.stage import RESULT_FILE, run_push
    from rloo.storage import upload_dir

    layout = RunLayout(output_uri, kfp_run_id)
    with tempfile.TemporaryDirectory(prefix="rloo-push-") as tmp:
        cfg = PushConfig(
            model_path=trained_uri,
            eval_results=eval_results_uri or None,
            output_dir=str(Path(tmp) / "push"),
            run_id=kfp_run_id,
            storage_uri=layout.published,
            base_model=base_model or None,
            base_model_revision=base_model_revision or None,
            **push_options,
        )
        result = run_push(cfg)
        publish = Path(tmp) / "result"
        publish.mkdir()
        (Path(cfg.output_dir) / RESULT_FILE).rename(publish / RESULT_FILE)
        upload_dir(publish, layout.push, progress=False)
    return {**result.to_dict(), "result_uri": layout.push_result}


def evaluate_stage(
    *,
    trained_uri: str,
    sft_uri: str,
    results_uri: str,
    dataset_name: str,
    dataset_split: str,
    num_examples: int,
    judge_base_url: str,
    judge_model: str,
    work: str,
    max_new_tokens: int = 200,
    sft_name: str = "",
) -> tuple[dict[str, float], Path]:
    """Download both models, run ``rloo eval``, publish its output directory to ``results_uri``. The
    results name the models by ``trained_uri`` and ``sft_name`` (default ``sft_uri``), not by their
    downloads under ``work``.

    Returns the KFP metrics (``kfp_metrics.json``) and the local path of the HTML report.
    """
    import json

    from rloo.eval.config import EvalConfig
    from rloo.eval.runner import KFP_METRICS_FILE, REPORT_FILE, run_eval
    from rloo.storage import download_dir, upload_dir

    root = Path(work)
    models = {}
    for label, uri in (("trained", trained_uri), ("sft", sft_uri)):
        models[label] = root / label
        download_dir(uri, models[label], progress=False, overwrite=True)
    out = root / "eval"
    cfg = EvalConfig(
        model_name_or_path=str(models["trained"]),
        baseline_model=str(models["sft"]),
        dataset_name=dataset_name,
        dataset_split=dataset_split,
        num_examples=num_examples or None,
        max_new_tokens=max_new_tokens,
        judge_base_url=judge_base_url,
        judge_model=judge_model,
        output_dir=str(out),
    )
    run_eval(cfg, sources={"trained": trained_uri, "baseline": sft_name or sft_uri, "output": results_uri})
    upload_dir(out, results_uri, progress=False)
    return json.loads((out / KFP_METRICS_FILE).read_text()), out / REPORT_FILE
