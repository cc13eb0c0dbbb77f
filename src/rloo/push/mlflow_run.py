"""The MLflow side of a push (step 3 and the tags of step 6): the push run, found again by its run key on a
re-run; the registered version with its decision and ``candidate`` alias; the outcome as tags; and an MLflow
server's refusal as one line. The registry itself (versions, aliases, champions): :mod:`rloo.push.registry`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rloo.errors import ServiceUnavailable, UserError
from rloo.push.config import PushConfig
from rloo.push.gate import CANDIDATE, CHAMPION, Decision
from rloo.push.registry import ModelFiles, Registry
from rloo.push.results import MlflowRecord
from rloo.storage.redact import redact


@dataclass(frozen=True)
class PushRun:
    """The MLflow push run and the registry it registers in."""

    registry: Registry
    run_id: str


def open_push_run(cfg: PushConfig, key: str, mlflow_client: Any, *, tracking: bool) -> PushRun:
    """The push run of this run key (found again on a re-run), in the registry it registers in."""
    from mlflow.tracking import MlflowClient

    from rloo.tracking.server import check_tracking_server

    if mlflow_client is None:
        check_tracking_server()
    client = mlflow_client or MlflowClient()
    registry = Registry(client, cfg.model_registry_name(tracking=tracking), key)
    try:
        run_id = registry.find_or_start_run(
            experiment=cfg.mlflow_experiment,
            parent_run_id=cfg.mlflow_parent_run_id,
            run_name="push",  # like "train" and "eval"; the run key is its rloo.source_run tag
        )
    except Exception as e:
        raise_mlflow_as_user_error(e)
        raise
    return PushRun(registry, run_id)


# MLflow's error codes for a server that is down, overloaded or too slow (mlflow/exceptions.py maps HTTP 503,
# 504 and 429 to them): nothing about the push is wrong
_TRANSIENT_MLFLOW_CODES = (
    "TEMPORARILY_UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "REQUEST_LIMIT_EXCEEDED",
    "RESOURCE_EXHAUSTED",
)


def _mlflow_unreachable(exc: BaseException) -> bool:
    """Whether an MLflow failure is the server out of reach or failing: a connection error or timeout under
    it (mlflow/utils/rest_utils.py wraps the requests exception it caught), a transient error code, or an
    HTTP 5xx without a JSON body (a proxy in front of a server that is down)."""
    import re

    from mlflow.protos.databricks_pb2 import ErrorCode

    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            break
        if type(cur).__module__.startswith(("requests", "urllib3")) and type(cur).__name__ in (
            "ConnectionError",
            "ConnectTimeout",
            "ReadTimeout",
            "Timeout",
            "MaxRetryError",
            "NewConnectionError",
            "ProtocolError",
            "RetryError",
        ):
            return True
        cur = cur.__cause__ or cur.__context__
    code = getattr(exc, "error_code", None)
    if (
        isinstance(code, int)
        and code in ErrorCode.values()
        and ErrorCode.Name(code) in _TRANSIENT_MLFLOW_CODES
    ):
        return True
    return re.search(r"failed with error code 5\d\d ", str(exc)) is not None


def raise_mlflow_as_user_error(exc: BaseException) -> None:
    """An MLflow server refusal (permissions, bad name) is one line for the CLI, not a traceback; the server out
    of reach or failing is one too, exiting 75 (a retried push step resumes without duplicates)."""
    if type(exc).__module__.startswith("mlflow") and isinstance(exc, Exception):
        text = redact(" ".join(str(exc).split()))[:300]
        if _mlflow_unreachable(exc):
            raise ServiceUnavailable(
                f"the MLflow tracking server failed during the push ({text}); re-run once it answers (the push "
                "resumes without duplicates)."
            ) from None
        raise UserError(
            f"MLflow refused the push ({text}); check MLFLOW_TRACKING_URI and the registry permissions, then "
            "re-run (it resumes without duplicates)."
        ) from None


def tag_and_check_newer(cfg: PushConfig, run: PushRun, decision: Decision) -> Decision:
    """Tag the push run with its sources; a champion decision becomes candidate when 'champion' is held by
    a version of a run that started after this one (an old run retried never takes it back)."""
    registry = run.registry
    for k, v in {
        "rloo.train_run_id": cfg.mlflow_train_run_id,
        "rloo.model_source": str(cfg.model_path),
    }.items():
        if v:
            registry.client.set_tag(run.run_id, k, v)
    if not registry.name:
        return decision
    registry.origin_start_ms(run.run_id, cfg.mlflow_train_run_id)
    newer = registry.newer_champion() if decision.promoted else None
    if newer is None:
        return decision
    return Decision(
        CANDIDATE,
        f"{decision.reason}; but 'champion' is version {newer.version} of "
        f"{(newer.tags or {}).get('rloo.source_run', 'another run')}, a newer run than this one: "
        "an older run never takes 'champion' back",
        decision.against_champion,
        decision.champion,
    )


def register(
    run: PushRun,
    staged: Path,
    decision: Decision,
    name: str,
    card: str,
    out: Path,
    *,
    published: str | None = None,
    train_run_id: str | None = None,
) -> MlflowRecord:
    """Step 3: one registered version per run key (none when the registry has no name), with its decision;
    ``candidate`` alias when not promoted ('champion' waits for step 5). ``published``: the copy step 2 made
    (an ``s3://`` one is registered by reference, without uploading the weights to MLflow again)."""
    registry = run.registry
    record = MlflowRecord(run.run_id)
    if registry.name:
        files = ModelFiles(staged, card, name, published, out / "mlflow_model")
        record.registered = registry.register(
            run.run_id, files, decision, description=decision.reason, train_run_id=train_run_id
        )
        registry.set_decision(record.registered.version, decision)
        if not decision.promoted:
            registry.set_alias(CANDIDATE, record.registered.version)
    return record


def record_outcome(run: PushRun, record: MlflowRecord, decision: Decision, version: str | None) -> None:
    """Step 6's MLflow part: the version's aliases and the champion in the result, the decision as tags."""
    client, registry = run.registry.client, run.registry
    if version is not None:
        record.aliases = registry.aliases_of(version)
        holder = registry.alias_holder(CHAMPION)
        record.champion_version = None if holder is None else str(holder.version)
        client.set_tag(run.run_id, "rloo.registered_version", version)
    client.set_tag(run.run_id, "rloo.promotion", decision.decision)
    client.set_tag(run.run_id, "rloo.promotion_reason", decision.reason[:5000])
