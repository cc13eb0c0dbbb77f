"""The push stage: gate, model card, then the targets in an order that never leaves a half-promoted model.

Order (each step idempotent for one run key):

1. stage the files to publish (hard links): the model's top-level files, ``eval_results.json`` and the
   model card as ``README.md``; ``checkpoint-N/`` and ``samples/`` stay behind;
2. object storage: ``<storage_uri>/<run key>/`` with its manifest (skipped when the same manifest is there);
3. MLflow (whenever a tracking server is configured): the push run, one registered version per run key
   (found again by its ``rloo.source_run`` tag) under ``registered_model_name`` (default: the experiment's
   name; ``register_model=False`` opts out), ``candidate`` alias when not promoted. A model that passes the
   gate but whose run started before the current champion's is registered as ``candidate`` (an old run
   retried never takes ``champion`` back), and the reason says so;
4. Hub: champions only, unless ``hub_push_candidates``;
5. promotion, last, only when everything above succeeded: publish to ``production_uri`` atomically for
   readers (a fresh ``versions/<id>/`` then the pointer manifest, older versions deleted after), then
   the ``champion`` alias. A re-run that decides ``candidate`` for a version holding ``champion`` moves the
   alias back to the newest other version still approved as champion (and republishes its copy to
   ``production_uri``), or removes it when there is none;
6. ``push_result.json`` (atomically) and the MLflow tags ``rloo.promotion`` / ``rloo.promotion_reason``.

A failure anywhere raises before step 5 finishes: the champion alias is never set on a version whose copies
are incomplete, and a production prefix is readable only with its manifest. The push run is marked FAILED.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from rloo.errors import UserError
from rloo.push.card import CardInputs, render_model_card, summarize_curves
from rloo.push.config import PushConfig, run_key
from rloo.push.gate import (
    CANDIDATE,
    CHAMPION,
    Decision,
    EvalResults,
    decide,
    load_eval_results,
    parse_eval_results,
)
from rloo.push.hub import upload_to_hub
from rloo.push.registry import Registry, build_mlflow_model_dir, link_or_copy
from rloo.storage import Location, download_dir, is_complete, publish_atomic, read_manifest, upload_dir
from rloo.storage.backends import backend_for
from rloo.storage.manifest import MANIFEST_NAME, build_manifest, sha256_file
from rloo.storage.redact import redact
from rloo.tracking.runs import pipeline_run_from_env

log = logging.getLogger("rloo.push")

RESULT_FILE = "push_result.json"
REQUIRED_MODEL_FILES = ("config.json", "training_complete.json")


# ------------------------------------------------------------------------------------------------------
def resolve_model_dir(model_path: str, work: Path) -> Path:
    """A local, complete trained-model directory: ``model_path`` itself, or its download."""
    loc = Location.parse(model_path)
    if loc.is_s3:
        dest = work / "model"
        download_dir(loc, dest, progress=False, overwrite=True)
        path = dest
    else:
        path = loc.path
    if not path.is_dir():
        raise UserError(f"--model_path {model_path}: no such directory; give the output_dir of 'rloo train'.")
    for name in REQUIRED_MODEL_FILES:
        if not (path / name).is_file():
            why = "training did not finish" if name == "training_complete.json" else "not a model directory"
            raise UserError(
                f"--model_path {model_path}: {name} is missing ({why}); push a finished 'rloo train' output_dir."
            )
    if not any(path.glob("*.safetensors")):
        raise UserError(
            f"--model_path {model_path}: no *.safetensors weights; push a finished 'rloo train' output_dir."
        )
    return path


def check_model_source(model_path: str) -> None:
    """:func:`resolve_model_dir`'s checks without downloading: a local directory is checked in place, an
    ``s3://`` prefix by its manifest (complete, with the files a finished training run writes)."""
    loc = Location.parse(model_path)
    if not loc.is_s3:
        resolve_model_dir(model_path, Path())  # a local directory is only read
        return
    try:
        files = set(read_manifest(loc).by_path)
    except UserError as e:
        raise UserError(f"--model_path {model_path}: {e}") from None
    for name in REQUIRED_MODEL_FILES:
        if name not in files:
            why = "training did not finish" if name == "training_complete.json" else "not a model directory"
            raise UserError(
                f"--model_path {model_path}: {name} is missing ({why}); push a finished 'rloo train' output_dir."
            )
    if not any(f.endswith(".safetensors") and "/" not in f for f in files):
        raise UserError(
            f"--model_path {model_path}: no *.safetensors weights; push a finished 'rloo train' output_dir."
        )


def read_eval_results(uri: str | None) -> EvalResults | None:
    if not uri:
        return None
    loc = Location.parse(uri)
    if loc.is_local:
        return load_eval_results(loc.path)
    parent = Location(loc.scheme, loc.bucket, "/".join(loc.key.split("/")[:-1]))
    data = backend_for(parent).read_bytes(loc.name)
    if data is None:
        raise UserError(
            f"--eval_results {uri}: no such object; pass the eval_results.json of the evaluation stage."
        )
    try:
        decoded = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"--eval_results {uri}: not valid JSON; fix or regenerate it.") from None
    return parse_eval_results(decoded, uri)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run must not block publishing
            if isinstance(row, dict):
                rows.append(row)
    return rows


def stage_files(model_dir: Path, eval_uri: str | None, eval_results: EvalResults | None, dest: Path) -> Path:
    """Hard-link the files to publish into ``dest`` (rebuilt from scratch): top-level files only."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and f.name not in (MANIFEST_NAME, "README.md") and not f.name.startswith("."):
            link_or_copy(f, dest / f.name)
    if eval_results is not None and eval_uri:
        loc = Location.parse(eval_uri)
        if loc.is_local:
            link_or_copy(loc.path, dest / "eval_results.json")
        else:  # already validated: write the canonical bytes we read
            (dest / "eval_results.json").write_text(json.dumps(_eval_as_dict(eval_results), indent=1))
    return dest


def _eval_as_dict(e: EvalResults) -> dict[str, Any]:
    return {
        "trained": {"win_rate": e.trained.estimate, "ci95": [e.trained.lo, e.trained.hi]},
        "baseline": {"win_rate": e.baseline.estimate, "ci95": [e.baseline.lo, e.baseline.hi]},
        "paired_difference": {
            "estimate": e.paired_difference.estimate,
            "ci95": [e.paired_difference.lo, e.paired_difference.hi],
        },
        "judge": {"model": e.judge_model, "base_url": e.judge_base_url},
        "num_examples": e.num_examples,
        "invalid": e.invalid,
        "ties": e.ties,
        **e.extra,
    }


def _content_key(digests: dict[str, str]) -> str:
    h = hashlib.sha256("\n".join(f"{k}:{v}" for k, v in sorted(digests.items())).encode()).hexdigest()
    return f"sha256-{h[:16]}"


def _publish(src: Path, uri: str, *, atomic: bool = False) -> bool:
    """Upload ``src`` to ``uri`` unless an identical complete copy is there. True if it uploaded.

    ``atomic`` (production): readers keep the complete previous version until the new one is complete, see
    :func:`rloo.storage.publish_atomic`; a push killed mid-copy leaves the old champion readable."""
    local = build_manifest(src)
    try:
        if is_complete(uri) and read_manifest(uri).by_path == local.by_path:
            return False
    except UserError:
        pass  # a missing bucket etc.: upload_dir says it properly
    if atomic:
        publish_atomic(src, uri, progress=False)
    else:
        upload_dir(src, uri, progress=False)
    return True


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".rloo-{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _raise_mlflow_as_user_error(exc: BaseException) -> None:
    """An MLflow server refusal (permissions, bad name, outage) is one line for the CLI, not a traceback."""
    if type(exc).__module__.startswith("mlflow") and isinstance(exc, Exception):
        text = redact(" ".join(str(exc).split()))[:300]
        raise UserError(
            f"MLflow refused the push ({text}); check MLFLOW_TRACKING_URI and the registry permissions, then "
            "re-run (it resumes without duplicates)."
        ) from None


# ------------------------------------------------------------------------------------------------------
def run_push(cfg: PushConfig, *, hub_api: Any = None, mlflow_client: Any = None) -> dict[str, Any]:
    """Run the push stage; returns (and writes to ``<output_dir>/push_result.json``) the result."""
    tracking = bool(os.environ.get("MLFLOW_TRACKING_URI")) or mlflow_client is not None
    if not tracking:
        cfg.check_tracking()
    out = Path(cfg.output_dir)
    result_path = out / RESULT_FILE
    result_path.unlink(missing_ok=True)  # a stale result must not outlive a failed re-run

    # every input is checked before output_dir is created: bad input leaves nothing behind
    check_model_source(str(cfg.model_path))
    eval_results = read_eval_results(cfg.eval_results)
    decision = decide(eval_results, cfg.promotion_margin)
    if cfg.hub_repo_id and (decision.promoted or cfg.hub_push_candidates):
        from rloo.push.hub import hub_token

        hub_token()  # fail on a missing token now, before anything is published
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(str(cfg.model_path), out)

    staged = stage_files(model_dir, cfg.eval_results, eval_results, out / "publish")
    digests = {f.name: sha256_file(f) for f in sorted(staged.iterdir())}
    kfp_id, kfp_name = pipeline_run_from_env()
    key = run_key(cfg.run_id or kfp_id or _content_key(digests))
    registered_name = cfg.model_registry_name(tracking=tracking)

    # The MLflow run first: whether this run may take 'champion' depends on its start time.
    registry: Registry | None = None
    run_id: str | None = None
    if tracking:
        from mlflow.tracking import MlflowClient

        from rloo.tracking.runs import check_tracking_server

        if mlflow_client is None:
            check_tracking_server()
        client = mlflow_client or MlflowClient()
        registry = Registry(client, registered_name, key)
        try:
            run_id = registry.find_or_start_run(
                experiment=cfg.mlflow_experiment,
                parent_run_id=cfg.mlflow_parent_run_id,
                run_name="push",  # like "train" and "eval"; the run key is its rloo.source_run tag
            )
        except Exception as e:
            _raise_mlflow_as_user_error(e)
            raise
    try:
        result = _push(cfg, key, kfp_id, kfp_name, model_dir, staged, digests, eval_results, decision,
                       registry, run_id, hub_api)  # fmt: skip
        _write_json_atomic(result_path, result)
        if registry is not None and run_id is not None:
            registry.client.log_artifact(run_id, str(result_path))
            registry.client.set_terminated(run_id, status="FINISHED")
    except BaseException as e:
        if registry is not None and run_id is not None:
            try:
                registry.client.set_terminated(run_id, status="FAILED")
            except Exception:  # the original error is the one to report
                log.warning("could not mark MLflow run %s FAILED", run_id)
        _raise_mlflow_as_user_error(e)
        raise
    log.info("push decision: %s (%s)", result["decision"], result["reason"])
    return result


def _push(
    cfg: PushConfig,
    key: str,
    kfp_id: str | None,
    kfp_name: str | None,
    model_dir: Path,
    staged: Path,
    digests: dict[str, str],
    eval_results: EvalResults | None,
    decision: Decision,
    registry: Registry | None,
    run_id: str | None,
    hub_api: Any,
) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    if registry is not None and run_id is not None:
        for k, v in {
            "rloo.train_run_id": cfg.mlflow_train_run_id,
            "rloo.model_source": str(cfg.model_path),
        }.items():
            if v:
                registry.client.set_tag(run_id, k, v)
        if registry.name:
            registry.origin_start_ms(run_id, cfg.mlflow_train_run_id)
            newer = registry.newer_champion() if decision.promoted else None
            if newer is not None:
                decision = Decision(
                    CANDIDATE,
                    f"{decision.reason}; but 'champion' is version {newer.version} of "
                    f"{(newer.tags or {}).get('rloo.source_run', 'another run')}, a newer run than this one: "
                    "an older run never takes 'champion' back",
                )

    train_cfg = _read_json(model_dir / "rloo_config.json")
    metrics = _read_metrics(model_dir / "metrics.jsonl")
    base_model = cfg.base_model or train_cfg.get("sft_model_path") or train_cfg.get("model_name_or_path")
    name = (
        cfg.model_name
        or (registry.name if registry is not None else None)
        or (cfg.hub_repo_id or "").split("/")[-1]
        or model_dir.name
    )
    datasets = [d for d in [train_cfg.get("dataset_name")] if d]
    lineage = {
        "push run key": key,
        "KFP run id": kfp_id,
        "KFP run name": kfp_name,
        "MLflow pipeline run": cfg.mlflow_parent_run_id,
        "MLflow training run": cfg.mlflow_train_run_id,
        "model source": str(cfg.model_path),
        "base model revision": cfg.base_model_revision,
        "evaluation results": cfg.eval_results,
    }
    card = render_model_card(
        CardInputs(
            model_name=name,
            base_model=str(base_model) if base_model else None,
            datasets=datasets,
            rloo_config=train_cfg,
            num_updates=len(metrics),
            curves=summarize_curves(metrics),
            eval=eval_results,
            decision=decision,
            lineage=lineage,
            digests=digests,
            base_model_revision=cfg.base_model_revision,
        )
    )
    (staged / "README.md").write_text(card)

    result: dict[str, Any] = {
        "decision": decision.decision,
        "promoted": decision.promoted,
        "reason": decision.reason,
        "promotion_margin": cfg.promotion_margin,
        "run_key": key,
        "digests": digests,
        "storage": None,
        "production": None,
        "mlflow": None,
        "hub": None,
    }

    # 2. object storage, versioned by run key
    if cfg.storage_uri:
        uri = Location.parse(cfg.storage_uri).child(key).uri
        uploaded = _publish(staged, uri)
        result["storage"] = {"uri": uri, "uploaded": uploaded}
        log.info("%s %s", "published to" if uploaded else "already published at", uri)

    # 3. MLflow registry
    version: str | None = None
    if registry is not None and run_id is not None:
        result["mlflow"] = {"run_id": run_id}
        if registry.name:
            mdir = build_mlflow_model_dir(staged, out / "mlflow_model", source_model_name=name, card=card)
            reg = registry.register(run_id, mdir, decision, description=decision.reason)
            version = reg.version
            registry.set_decision(version, decision)
            if not decision.promoted:
                registry.set_alias(CANDIDATE, version)
            result["mlflow"].update(
                {
                    "registered_model_name": reg.name,
                    "version": version,
                    "source": reg.source,
                    "reused": reg.reused,
                }
            )

    # 4. Hub
    if cfg.hub_repo_id and (decision.promoted or cfg.hub_push_candidates):
        result["hub"] = upload_to_hub(
            staged,
            cfg.hub_repo_id,
            private=cfg.hub_private,
            commit_message=f"rloo push {key}: {decision.decision}",
            api=hub_api,
        )

    # 5. promotion, last
    if decision.promoted:
        if cfg.production_uri:
            uri = Location.parse(cfg.production_uri).uri
            uploaded = _publish(staged, uri, atomic=True)
            result["production"] = {"uri": uri, "uploaded": uploaded}
        if registry is not None and version is not None:
            registry.set_alias(CHAMPION, version)
            # a re-run with a new decision (e.g. a lower margin) must not leave the version both
            registry.drop_alias_if_on(CANDIDATE, version)
    elif registry is not None and version is not None and CHAMPION in registry.aliases_of(version):
        # A re-run of this run decided candidate, but an earlier push of it made it champion: the alias goes
        # back to the newest other version still approved as champion, or is removed when there is none.
        result["production"] = _demote(cfg, registry, version, out)
    if registry is not None and run_id is not None:
        if version is not None:
            result["mlflow"]["aliases"] = registry.aliases_of(version)
            holder = registry.alias_holder(CHAMPION)
            result["mlflow"]["champion_version"] = None if holder is None else str(holder.version)
            registry.client.set_tag(run_id, "rloo.registered_version", version)
        registry.client.set_tag(run_id, "rloo.promotion", decision.decision)
        registry.client.set_tag(run_id, "rloo.promotion_reason", decision.reason[:5000])
    return result


def _demote(cfg: PushConfig, registry: Registry, version: str, out: Path) -> dict[str, Any] | None:
    """Move 'champion' off ``version`` (back to the previous champion, or nowhere) and put the previous
    champion's published copy back at ``production_uri`` when there is one."""
    previous = registry.previous_champion(version)
    if previous is None:
        registry.drop_alias(CHAMPION)
        log.warning("'champion' removed from version %s: no earlier champion to restore", version)
    else:
        registry.set_alias(CHAMPION, str(previous.version))
        log.info("'champion' moved back from version %s to version %s", version, previous.version)
    if not cfg.production_uri:
        return None
    prod = Location.parse(cfg.production_uri).uri
    source_key = (previous.tags or {}).get("rloo.source_run") if previous is not None else None
    if source_key and cfg.storage_uri:
        src = Location.parse(cfg.storage_uri).child(source_key).uri
        if is_complete(src):
            local = out / "previous_champion"
            download_dir(src, local, progress=False, overwrite=True)
            return {"uri": prod, "uploaded": _publish(local, prod, atomic=True), "restored_from": src}
    log.warning("%s still holds the demoted model: no published copy of an earlier champion to restore", prod)
    return {"uri": prod, "uploaded": False, "stale": True}


__all__ = ["RESULT_FILE", "Decision", "run_push"]
