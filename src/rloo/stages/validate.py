"""The validate step: the pipeline parameters checked once and turned into the run's :class:`PipelinePlan`, on a
CPU pod, before any GPU is requested. A bad value fails here in one line that names the pipeline parameter.

``rloo pipeline submit`` and ``rloo pipeline manifest`` call :func:`build_plan` too (without looking at
storage or the Hub: their paths are the cluster's), and ``rloo pipeline run --local`` with the path checks,
so a run is refused for the same reasons everywhere.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Mapping
from typing import Any

from rloo.errors import UserError, reworded
from rloo.k8s.builders import check_queue_backend
from rloo.k8s.platform import from_env as platform_from_env
from rloo.stages.constants import STEP_SECRETS
from rloo.stages.context import StepResult
from rloo.stages.plan import (
    ClusterConfig,
    PipelinePlan,
    RunConfig,
    config_values,
    parameter_names,
    pipeline_fields,
)
from rloo.stages.sft import hub_model_info, local_sft_model

log = logging.getLogger(__name__)

# What stands for the models and directories only a step knows, while a stage config is checked here
_PLACEHOLDER_MODEL = "placeholder-model"


def build_plan(params: dict[str, Any], *, check_paths: bool = True, check_hub: bool = False) -> PipelinePlan:
    """The plan of a run with pipeline parameters ``params`` (all of them, by name: see
    :func:`rloo.pipeline.params.with_defaults`), every part built through its config's own checks; a one-line
    UserError naming the first bad parameter. ``check_paths``: the SFT model, the output bucket and s3://
    datasets must be there (``check_hub``: a Hub model too)."""
    from rloo.eval.config import EvalConfig
    from rloo.push.config import PushConfig

    for p in pipeline_fields():
        if p.required and params[p.name] in ("", None):
            raise UserError(f"{p.name} is required: {p.help}")
    run = _part(RunConfig, "run", config_values("run", params))
    cluster = _part(ClusterConfig, "cluster", config_values("cluster", params))
    if cluster.multinode and not run.output_uri.startswith("s3://"):
        raise UserError(f"multi-node training needs an s3:// output_uri (got {run.output_uri!r}).")
    if check_paths:
        check_pipeline_model(run.model, hub=check_hub, revision=run.model_revision or None)
        check_storage_access(run.output_uri, what="output_uri")
        _check_datasets(params)
    train = train_values(params, run.extra_train_args)
    if check_paths:
        _check_reward_model(train.get("reward_model_path"))
    eval_values = config_values("eval", params)
    weights = train.get("reward_weights") or [1.0]  # the reward model's weight first
    if float(weights[0]) != 0 and _reachable_from_every_step(train.get("reward_model_path")):
        # the evaluation scores the judged pairs with the reward model training optimised (the parameter or
        # extra_train_args' --reward_model_path): its agreement with the judge is the reward-hacking monitor.
        # Not one at weight 0: the policy never chased it, so its agreement would say nothing of hacking.
        eval_values["reward_model_path"] = train["reward_model_path"]
    for name in AGENT_SETTINGS:  # the evaluation runs the episodes training ran
        if name in train:
            eval_values[name] = train[name]
    placeholders = {"model_name_or_path": _PLACEHOLDER_MODEL, "baseline_model": _PLACEHOLDER_MODEL}
    _part(EvalConfig, "eval", eval_values, **placeholders, report_to="none")
    push_values = config_values("push", params)
    _part(PushConfig, "push", push_values, model_path=_PLACEHOLDER_MODEL)
    return PipelinePlan(run=run, cluster=cluster, train=train, eval=eval_values, push=push_values)


# the training settings of multi-turn episodes that the evaluation shares (EvalConfig declares the same names)
AGENT_SETTINGS = ("tools", "environment", "max_tool_calling_iterations", "tool_timeout")


def _check_reward_model(path: str | None) -> None:
    """An ``s3://`` reward model (an air-gapped cluster's) must hold a model before any GPU is requested; Hub ids
    and directories are checked where they are loaded."""
    from rloo.storage.location import source_kind

    if not path or source_kind(path) != "s3":
        return
    from rloo.models import check_model_prefix

    try:
        check_model_prefix("reward_model_path", path, adapter=False)
    except UserError as e:  # the same class: a store out of reach stays exit 75
        raise type(e)(_as_parameters(str(e), {"reward_model_path": "reward_model_path"})) from None


def _reachable_from_every_step(model: str | None) -> bool:
    """A Hub id, an ``s3://`` prefix (every step reads the run's store, and fetches the model into its own
    scratch before loading it), or a directory this step sees too. A directory baked into the training image
    only (not in this step's) would fail the evaluation after training: the monitor is left out rather than
    risk that. Asks no store: ``rloo pipeline submit`` builds the plan where the cluster's store is out of
    reach."""
    from rloo.storage.location import local_source_path, source_kind

    if not model:
        return False
    kind = source_kind(model)
    return kind in ("hub", "s3") or (kind == "local" and local_source_path(model).is_dir())


def _part(cls: type, part: str, values: dict[str, Any], **fixed: Any) -> Any:
    """``cls`` built from the field ``values`` of ``part`` and ``fixed`` fields; its one-line error names the
    pipeline parameter (``--dataset_split`` -> ``eval_dataset_split``)."""
    try:
        return cls(**fixed, **values)
    except UserError as e:
        raise UserError(_as_parameters(str(e), parameter_names(part))) from None


def _as_parameters(message: str, names: dict[str, str]) -> str:
    """``message`` with each ``--field`` of ``names`` (``{field: pipeline parameter}``) named as the
    parameter that sets it; other flags stay flags (of ``extra_train_args``)."""
    return re.sub(r"--(\w+)\b", lambda m: names.get(m[1], m[0]), message)


def train_values(params: dict[str, Any], extra_train_args: str) -> dict[str, Any]:
    """The training config values: the training parameters, with ``extra_train_args`` through the parser of
    'rloo train' itself (its flags win over the parameters, as later flags do on a command line), checked by
    building the config (exactly the checks the command applies). Unset optional fields are left out."""
    from rloo.config import RLOOConfig
    from rloo.parsing import parse_values
    from rloo.stages.node import POD_LOCAL_FIELDS

    has_reward_model = bool(params.get("reward_model_path"))
    try:
        extra = parse_values(RLOOConfig, shlex.split(extra_train_args), prog="rloo train")
        for name in sorted(POD_LOCAL_FIELDS & extra.keys()):
            raise UserError(f"--{name} is set by the pipeline itself; remove it from extra_train_args.")
    except UserError as e:
        raise UserError(_in_pipeline_terms(str(e), has_reward_model=has_reward_model)) from None
    except ValueError as e:  # shlex: an unclosed quote
        raise UserError(f"extra_train_args: {e}; quote each flag's value once.") from None
    _refuse_conflicts(params, extra)  # its message names the flags as such
    values = {k: v for k, v in config_values("train", params).items() if v is not None} | extra
    try:
        RLOOConfig(**({"model_name_or_path": _PLACEHOLDER_MODEL, "output_dir": "validate"} | values))
    except UserError as e:
        raise UserError(_in_pipeline_terms(str(e), has_reward_model=has_reward_model)) from None
    return values


def _refuse_conflicts(params: dict[str, Any], extra: dict[str, Any]) -> None:
    """A training setting given twice, as a pipeline parameter changed from its default and in
    ``extra_train_args`` (maybe under an alias: ``--beta`` is ``kl_coef``) with another value, is refused:
    either one silently winning would train something the run's record does not show."""
    from rloo.config import RLOOConfig
    from rloo.options import aliases_of

    aliases = aliases_of(RLOOConfig)
    for p in pipeline_fields():
        if p.part != "train" or p.field not in extra or p.name not in params:
            continue
        given, other = params[p.name], extra[p.field]
        if given != p.default and p.field_value(given) != other:
            flags = ", ".join(f"--{n}" for n in [p.field, *(a for a, f in aliases.items() if f == p.field)])
            raise UserError(
                f"{p.name} {given!r} and extra_train_args ({other!r}, given as one of {flags}) both set "
                f"{p.field}, to different values: set it in one place."
            )


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
    return _as_parameters(message, parameter_names("train"))


def _check_datasets(params: dict[str, Any]) -> None:
    """An s3:// dataset must hold data files in a Hub dataset layout, whoever wrote it, before any GPU is
    requested (:func:`rloo.data.check_dataset_source`: exit 2 for a bad or empty prefix, 75 for a store out
    of reach); Hub ids and directories are read by the stages themselves (a directory names a path inside the
    pods)."""
    from rloo.data import check_dataset_source
    from rloo.storage.location import source_kind

    for name in ("dataset_name", "eval_dataset_name"):
        if source_kind(str(params[name])) == "s3":
            check_dataset_source(str(params[name]), flag=name)


def check_pipeline_model(
    model: str, *, hub: bool = False, hub_api: Any = None, revision: str | None = None
) -> None:
    """Fail in one line when the SFT model cannot be fetched: a local path that is no model directory
    (:func:`rloo.models.local_model_dir`, the rule of every stage), an ``s3://`` prefix that holds no model
    (:func:`rloo.models.check_model_prefix`: an rloo upload that does not match its manifest, or any other
    prefix without a ``config.json`` at its top), or (``hub``) a Hub id the Hub does not know or will not
    serve. A Hub that cannot be reached is only logged: the fetch step retries, and it may be a mirror. Which
    of the three ``model`` is: :func:`rloo.storage.location.source_kind` (``gpt2`` is a Hub id)."""
    from rloo.storage.location import source_kind

    kind = source_kind(model)
    if kind == "s3":
        from rloo.models import check_model_prefix

        try:
            check_model_prefix("model", model, adapter=False)
        except UserError as e:  # the same class: an unreachable store still exits 75
            raise type(e)(_as_parameters(str(e), {"model": "model"})) from None
        return
    if kind == "local":
        from rloo.models import check_weight_headers

        # the weights' headers read here name the user's path; the train step would meet a damaged file
        # under its scratch copy's
        check_weight_headers(local_sft_model(model), shown=f"model {model}")
        return
    if not hub:
        return
    try:
        hub_model_info(model, revision, hub_api)
    except UserError:
        raise
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
    except StorageError as e:  # an unreachable store keeps its exit code (75: a retry may heal)
        raise reworded(e, f"{what}: {e}") from None


# Set on every step's pod by KFP's Argo compiler (backend/src/v2/compiler/argocompiler/common.go, commonEnvs):
# the step runs on a cluster, where its Secrets are mounted. kfp.local and the CLI mount none.
KFP_POD_ENV = "KFP_POD_NAME"


def check_secrets(params: dict[str, Any], env: Mapping[str, str]) -> None:
    """On a cluster, every Secret key a later step mounts with optional: false must have reached this step
    (which mounts them all optionally): a one-line UserError naming the Secret, its parameter and the missing
    keys otherwise. A missing Secret and a missing key look alike here (the variable is absent): both are
    named. S3 keys are not needed where the platform gives the pods a workload identity instead."""
    if KFP_POD_ENV not in env:
        return
    from rloo.k8s.platform import from_env

    platform = from_env(env)
    for param, (keys, needed) in STEP_SECRETS.items():
        if not needed or (param == "s3_secret" and getattr(platform, "s3_workload_identity", False)):
            continue
        missing = [key for key, var in keys.items() if var not in env]
        if missing:
            name = params[param]
            literals = " ".join(f"--from-literal={key}=..." for key in keys)
            raise UserError(
                f"Secret {name!r} ({param}) does not exist in the run's namespace or lacks "
                f"{', '.join(missing)}, which later steps need: kubectl create secret generic {name} {literals} "
                f"(or set {param} to the Secret that holds them)."
            )


def eval_gpu_limit(cluster: ClusterConfig) -> str:
    """The evaluation pod's GPU count as the driver reads it (text): one, none on a CPU cluster (gpu_count 0)."""
    return "1" if cluster.gpu_count > 0 else "0"


def run(
    params: dict[str, Any], env: Mapping[str, str] | None = None, *, check_judge: bool | None = None
) -> StepResult:
    """The validate step: the tracking URI and the Secrets later steps mount (``env``: this pod's, default
    ``os.environ``), then :func:`build_plan` with every check (the Hub included), then the judge
    (:func:`check_judge_endpoint`). ``check_judge`` None: on a cluster (where the evaluation follows hours of
    GPU training), unless the ``judge_check`` parameter is false; a local run serves its own judge."""
    from rloo.tracking.uri import check_tracking_uri

    env = os.environ if env is None else env
    check_tracking_uri(env.get("MLFLOW_TRACKING_URI"))
    check_secrets(params, env)
    check_queue_backend(params, platform_from_env(env))
    plan = build_plan(params, check_paths=True, check_hub=True)
    if plan.cluster.queue_name and not plan.cluster.multinode:
        log.warning(
            "queue_name %r queues the multi-node job only; this run trains on one node, whose pod Kueue queues "
            "only through the platform's kueue.queueName (the chart's pipeline.kueue.queueName).",
            plan.cluster.queue_name,
        )
    if check_judge is None:
        check_judge = KFP_POD_ENV in env and plan.run.judge_check
    if check_judge:
        check_judge_endpoint(plan.eval, env)
    # the pods' GPU counts as text: KFP's driver reads a pod-spec placeholder as a string (GetStringValue)
    gpus = (str(plan.cluster.gpu_count), eval_gpu_limit(plan.cluster))
    return StepResult(output=plan.to_json(), outputs=gpus, record=plan)


def check_judge_endpoint(eval_values: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """The judge, before any GPU is requested: it answers, accepts the key the evaluate step will send
    (``judge_secret``'s, mounted here too), serves ``judge_model`` and has context for the evaluation's
    requests as far as they are known here (:func:`rloo.judging.endpoint.request_floor_tokens`: this image
    reads no dataset; the evaluate step checks the largest request before it generates)."""
    from rloo.eval.config import EvalConfig
    from rloo.judging.endpoint import check_judge_server, request_floor_tokens

    cfg = EvalConfig(**{"model_name_or_path": _PLACEHOLDER_MODEL, "report_to": "none", **eval_values})
    assert cfg.judge_base_url and cfg.judge_model  # required
    key = env.get(cfg.judge_api_key_env) or "EMPTY"  # a self-hosted judge may need none (rloo.judging.client)
    check_judge_server(
        cfg.judge_base_url,
        cfg.judge_model,
        api_key=key,
        min_context_tokens=request_floor_tokens(
            cfg.template_text(), cfg.max_new_tokens, cfg.judge_max_tokens
        ),
    )
