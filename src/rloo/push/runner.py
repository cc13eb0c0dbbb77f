"""The push stage: gate, model card, then the targets in an order that never leaves a half-promoted model.

Order (each step idempotent for one run key):

1. stage the files to publish (hard links): the model's top-level files, ``eval_results.json`` and the
   model card as ``README.md``; ``checkpoint-N/`` and ``samples/`` stay behind;
2. object storage: ``<storage_uri>/<run key>/`` with its manifest (skipped when the same manifest is there);
3. MLflow (whenever a tracking server is configured): the push run, one registered version per run key
   (found again by its ``rloo.source_run`` tag) under ``registered_model_name`` (default: the experiment's
   name; ``register_model=False`` opts out), ``candidate`` alias when not promoted. A model that passes the
   gate but whose run started before the current champion's is registered as ``candidate`` (an old run
   retried never takes ``champion`` back), and the reason says so. A copy of step 2 in object storage is
   registered by reference (MLmodel written next to its weights, which never go through the MLflow
   server); otherwise the model is uploaded through the server (see :mod:`rloo.push.registry`);
4. Hub: champions only, unless ``hub_push_candidates``;
5. promotion, last, only when everything above succeeded: publish to ``production_uri`` atomically for
   readers (a fresh ``versions/<id>/`` then the pointer manifest, older versions deleted after), then
   the ``champion`` alias; the version (and the runs) that held it are marked ``superseded``. A re-run that
   decides ``candidate`` for the model holding ``champion`` moves it back to the previous champion (and
   republishes that copy to ``production_uri``), or, when there is none, removes the alias and withdraws the
   production copy: nothing is left pointing at a model the gate no longer approves;
6. ``push_result.json`` (atomically) and the MLflow tags ``rloo.promotion`` / ``rloo.promotion_reason``.

Champion against challenger: a model that passes the SFT comparison takes ``champion`` only when it also
beats the current champion (another run's) on the same examples with the same judge
(:func:`rloo.push.gate.decide`). The champion is the registry's alias holder; without a registry, the run
recorded in ``production_uri``'s ledger (``promotion.json``: the champion's run key, its versioned copy and
the champions before it), which is also how a demotion without MLflow finds the model to put back.

A failure anywhere raises before step 5 finishes: the champion alias is never set on a version whose copies
are incomplete, and a production prefix is readable only with its manifest. The push run is marked FAILED.

Where each part lives: the trained model's checks, :mod:`rloo.push.trained`; step 1,
:mod:`rloo.push.staging`; steps 2 and 5, :mod:`rloo.push.production`; step 3 and the MLflow tags,
:mod:`rloo.push.mlflow_run`; the result document, :mod:`rloo.push.results`. This module runs them in order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from rloo.diskspace import write_bytes_atomic
from rloo.push.config import PushConfig
from rloo.push.gate import Decision, decide
from rloo.push.hub import upload_to_hub
from rloo.push.mlflow_run import (
    PushRun,
    open_push_run,
    raise_mlflow_as_user_error,
    record_outcome,
    register,
    tag_and_check_newer,
)
from rloo.push.production import current_champion, promote, publish_copy
from rloo.push.results import MlflowRecord, PushResult, StoredCopy
from rloo.push.staging import StagedPush, stage_push, write_card
from rloo.storage import Location

log = logging.getLogger("rloo.push")

RESULT_FILE = "push_result.json"
NOTHING_PUBLISHED = (
    "nothing was published: give --storage_uri, --production_uri or --hub_repo_id, or a tracking server "
    "(MLFLOW_TRACKING_URI) to register the model in"
)
# What a push writes under output_dir besides push_result.json; removed again when the push fails.
WORK_DIRS = ("publish", "production", "mlflow_model", "model", "champion", "previous_champion")


def run_push(cfg: PushConfig, *, hub_api: Any = None, mlflow_client: Any = None) -> PushResult:
    """Run the push stage; returns the result, also written to ``<output_dir>/push_result.json``."""
    tracking = bool(os.environ.get("MLFLOW_TRACKING_URI")) or mlflow_client is not None
    if not tracking:
        cfg.check_tracking()
    out = Path(cfg.output_dir)
    result_path = out / RESULT_FILE
    result_path.unlink(missing_ok=True)  # a stale result must not outlive a failed re-run

    existed = out.exists()
    run: PushRun | None = None
    try:
        prepared = stage_push(cfg, out)
        # The MLflow run first: whether this run may take 'champion' depends on its start time.
        run = open_push_run(cfg, prepared.key, mlflow_client, tracking=tracking) if tracking else None
        result = publish(cfg, prepared, run, hub_api)
        write_bytes_atomic(
            result_path, json.dumps(result.to_dict(), indent=1, sort_keys=True).encode(), result_path.name
        )
        if run is not None:
            run.registry.client.log_artifact(run.run_id, str(result_path))
            run.registry.client.set_terminated(run.run_id, status="FINISHED")
    except BaseException as e:
        if run is not None:
            try:
                run.registry.client.set_terminated(run.run_id, status="FAILED")
            except Exception:  # the original error is the one to report
                log.warning("could not mark MLflow run %s FAILED", run.run_id)
        _clean_work(out, existed)
        raise_mlflow_as_user_error(e)
        raise
    _clean_work(out, existed=True)  # published: the staged copies and downloads are done with
    log.log(
        logging.INFO if result.published else logging.WARNING,
        "push decision: %s (%s)",
        result.decision.decision,
        result.decision.reason,
    )
    return result


def _clean_work(out: Path, existed: bool) -> None:
    """The staged files and downloads go (after a failure a re-run stages them again); ``out`` too when this
    push created it and nothing else is left in it (a failed push: no push_result.json)."""
    for name in WORK_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)
    if not existed and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def publish(cfg: PushConfig, prepared: StagedPush, run: PushRun | None, hub_api: Any) -> PushResult:
    """Steps 2-5: the model card, then storage, MLflow, the Hub and promotion, in that order."""
    out = Path(cfg.output_dir)
    decision = prepared.decision
    if decision.promoted and cfg.compare_to_champion:
        champion = current_champion(cfg, prepared.key, run, out)
        decision = decide(prepared.eval_results, cfg.promotion_margin, champion)
    if run is not None:
        decision = tag_and_check_newer(cfg, run, decision)
    name, card = write_card(cfg, prepared, decision, run)
    result = PushResult(decision, cfg.promotion_margin, prepared.key, prepared.digests)

    # 2. object storage, versioned by run key
    if cfg.storage_uri:
        uri = Location.parse(cfg.storage_uri).child(prepared.key).uri
        result.storage = StoredCopy(uri, publish_copy(prepared.staged, uri))
        log.info("%s %s", "published to" if result.storage.uploaded else "already published at", uri)

    # 3. MLflow registry
    if run is not None:
        result.mlflow = register(
            run,
            prepared.staged,
            decision,
            name,
            card,
            out,
            published=None if result.storage is None else result.storage.uri,
            train_run_id=cfg.mlflow_train_run_id,
        )
    version = (
        None
        if result.mlflow is None or result.mlflow.registered is None
        else result.mlflow.registered.version
    )

    # 4. Hub
    if cfg.hub_repo_id and (decision.promoted or cfg.hub_push_candidates):
        result.hub = upload_to_hub(
            prepared.staged,
            cfg.hub_repo_id,
            private=cfg.hub_private,
            commit_message=f"rloo push {prepared.key}: {decision.decision}",
            api=hub_api,
        )

    # 5. promotion, last
    registry = None if run is None else run.registry
    storage = None if result.storage is None else result.storage.uri
    result.production = promote(cfg, prepared, decision, registry, version, storage)
    if run is not None and result.mlflow is not None:
        record_outcome(run, result.mlflow, decision, version)
    if not result.published:  # the gate's verdict alone: say so where the decision is read
        result.decision = dataclasses.replace(decision, reason=f"{decision.reason}; {NOTHING_PUBLISHED}")
    return result


__all__ = ["RESULT_FILE", "Decision", "MlflowRecord", "PushResult", "StoredCopy", "run_push"]
