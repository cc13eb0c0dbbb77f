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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo.diskspace import honour_umask, write_bytes_atomic
from rloo.errors import UserError
from rloo.models import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED_SUBDIR, check_safetensors_weights
from rloo.push.card import CardInputs, render_model_card, summarize_curves
from rloo.push.config import PushConfig, run_key
from rloo.push.gate import (
    CANDIDATE,
    CHAMPION,
    Champion,
    Decision,
    EvalResults,
    decide,
    load_eval_results,
    parse_eval_results,
)
from rloo.push.hub import upload_to_hub
from rloo.push.registry import (
    TAG_SOURCE_RUN,
    ModelFiles,
    Registry,
    RegistryResult,
    link_or_copy,
)
from rloo.storage import (
    Location,
    delete_prefix,
    download_dir,
    is_complete,
    publish_atomic,
    read_manifest,
    upload_dir,
)
from rloo.storage.backends import backend_for
from rloo.storage.errors import IncompleteArtifactError
from rloo.storage.location import source_kind
from rloo.storage.manifest import MANIFEST_NAME, build_manifest, sha256_file
from rloo.storage.redact import redact
from rloo.storage.transfer import read_published_file
from rloo.tracking.runs import pipeline_run_from_env

log = logging.getLogger("rloo.push")

RESULT_FILE = "push_result.json"
# In the production copy: which run's model it is, where its versioned copy is, and the champions before it.
LEDGER_FILE = "promotion.json"
# What a push writes under output_dir besides push_result.json; removed again when the push fails.
WORK_DIRS = ("publish", "production", "mlflow_model", "model", "champion", "previous_champion")
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
        if name == "config.json" and (path / ADAPTER_CONFIG).is_file():
            continue
        if not (path / name).is_file():
            why = "training did not finish" if name == "training_complete.json" else "not a model directory"
            raise UserError(
                f"--model_path {model_path}: {name} is missing ({why}); push a finished 'rloo train' output_dir."
            )
    if not any(path.glob("*.safetensors")):
        raise UserError(
            f"--model_path {model_path}: no *.safetensors weights; push a finished 'rloo train' output_dir."
        )
    # a NaN/overflowing model must never be published, whatever training_complete.json says
    check_safetensors_weights(path, flag="model_path", shown=model_path)
    if (path / MERGED_SUBDIR).is_dir():  # a LoRA run's merged model is what gets published
        check_safetensors_weights(
            path / MERGED_SUBDIR, flag="model_path", shown=f"{model_path}/{MERGED_SUBDIR}"
        )
    return path


def check_model_source(model_path: str) -> None:
    """:func:`resolve_model_dir`'s checks without downloading: a local directory is checked in place, an
    ``s3://`` prefix by its manifest (complete, with the files a finished training run writes). Which of the
    two it is: :func:`rloo.storage.location.source_kind`, the rule of every stage (a Hub id is no trained
    model: it fails as a missing directory)."""
    if source_kind(model_path) != "s3":
        resolve_model_dir(model_path, Path())  # a local directory is only read
        return
    loc = Location.parse(model_path)
    try:
        files = set(read_manifest(loc).by_path)
    except UserError as e:
        raise UserError(f"--model_path {model_path}: {e}") from None
    for name in REQUIRED_MODEL_FILES:
        if name == "config.json" and ADAPTER_CONFIG in files:
            continue
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
    if (dest / ADAPTER_CONFIG).is_file() and not (dest / "config.json").is_file():
        _stage_merged(model_dir, dest)
    if eval_results is not None and eval_uri:
        loc = Location.parse(eval_uri)
        if loc.is_local:
            link_or_copy(loc.path, dest / "eval_results.json")
        else:  # already validated: write the canonical bytes we read
            (dest / "eval_results.json").write_text(json.dumps(_eval_as_dict(eval_results), indent=1))
    return dest


def _stage_merged(adapter_dir: Path, dest: Path) -> None:
    """A LoRA output is published as a full model, which the registry, the Hub and vLLM load as any
    other: ``merged/`` as written by --merge_adapter, else the base model named in the adapter's config
    with the adapter merged in here. The adapter files are not published beside it: transformers would
    apply an adapter found next to a model's weights a second time."""
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        (dest / name).unlink(missing_ok=True)
    merged = adapter_dir / MERGED_SUBDIR
    if (merged / "config.json").is_file():
        for f in sorted(merged.iterdir()):
            if f.is_file() and f.suffix in (".json", ".safetensors") and not (dest / f.name).exists():
                link_or_copy(f, dest / f.name)
        return
    from rloo.models import load_causal_lm

    log.info("merging the LoRA adapter in %s into its base model", adapter_dir)
    load_causal_lm(str(adapter_dir), flag="model_path").save_pretrained(dest, safe_serialization=True)
    # safetensors writes its files 0600: a reader running as another user could not open them
    honour_umask(dest)


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


def _raise_mlflow_as_user_error(exc: BaseException) -> None:
    """An MLflow server refusal (permissions, bad name, outage) is one line for the CLI, not a traceback."""
    if type(exc).__module__.startswith("mlflow") and isinstance(exc, Exception):
        text = redact(" ".join(str(exc).split()))[:300]
        raise UserError(
            f"MLflow refused the push ({text}); check MLFLOW_TRACKING_URI and the registry permissions, then "
            "re-run (it resumes without duplicates)."
        ) from None


# ------------------------------------------------------------------------------------------------------
# Typed results: push_result.json is PushResult.to_dict() (the same document as before, key for key).
@dataclass(frozen=True)
class StoredCopy:
    """A copy under ``storage_uri`` or ``production_uri``: ``uploaded`` is False when an identical complete
    copy was already there; a demotion says where the restored copy came from, or that the demoted model's
    copy was withdrawn (deleted) because no earlier champion could be put back."""

    uri: str
    uploaded: bool
    restored_from: str | None = None
    withdrawn: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"uri": self.uri, "uploaded": self.uploaded}
        if self.restored_from is not None:
            d["restored_from"] = self.restored_from
        if self.withdrawn:
            d["withdrawn"] = True
        return d


@dataclass
class MlflowRecord:
    """The push run, and the registered version when the push registers one."""

    run_id: str
    registered: RegistryResult | None = None
    aliases: list[str] = field(default_factory=list)
    champion_version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"run_id": self.run_id}
        if self.registered is not None:
            reg = self.registered
            d.update(
                registered_model_name=reg.name,
                version=reg.version,
                source=reg.source,
                reused=reg.reused,
                model_id=reg.model_id,
            )
            d.update(aliases=self.aliases, champion_version=self.champion_version)
        return d


@dataclass
class PushResult:
    """What a push did, target by target (None: not configured, or not for this decision)."""

    decision: Decision
    promotion_margin: float
    run_key: str
    digests: dict[str, str]
    storage: StoredCopy | None = None
    production: StoredCopy | None = None
    mlflow: MlflowRecord | None = None
    hub: dict[str, str | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``push_result.json`` document."""
        return {
            "decision": self.decision.decision,
            "promoted": self.decision.promoted,
            "reason": self.decision.reason,
            "against_champion": self.decision.against_champion_dict(),
            "promotion_margin": self.promotion_margin,
            "run_key": self.run_key,
            "digests": self.digests,
            "storage": None if self.storage is None else self.storage.to_dict(),
            "production": None if self.production is None else self.production.to_dict(),
            "mlflow": None if self.mlflow is None else self.mlflow.to_dict(),
            "hub": self.hub,
        }


@dataclass(frozen=True)
class StagedPush:
    """Checked inputs and the staged files (step 1), before anything is published."""

    model_dir: Path
    staged: Path
    digests: dict[str, str]
    eval_results: EvalResults | None
    decision: Decision
    key: str
    kfp_id: str | None
    kfp_name: str | None


@dataclass(frozen=True)
class PushRun:
    """The MLflow push run and the registry it registers in."""

    registry: Registry
    run_id: str


# ------------------------------------------------------------------------------------------------------
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
        _raise_mlflow_as_user_error(e)
        raise
    _clean_work(out, existed=True)  # published: the staged copies and downloads are done with
    log.info("push decision: %s (%s)", result.decision.decision, result.decision.reason)
    return result


def _clean_work(out: Path, existed: bool) -> None:
    """The staged files and downloads go (after a failure a re-run stages them again); ``out`` too when this
    push created it and nothing else is left in it (a failed push: no push_result.json)."""
    for name in WORK_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)
    if not existed and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def stage_push(cfg: PushConfig, out: Path) -> StagedPush:
    """Step 1: check every input (before ``out`` is created: bad input leaves nothing behind), decide, and
    stage the files to publish under ``out/publish``."""
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
    return StagedPush(model_dir, staged, digests, eval_results, decision, key, kfp_id, kfp_name)


def open_push_run(cfg: PushConfig, key: str, mlflow_client: Any, *, tracking: bool) -> PushRun:
    """The push run of this run key (found again on a re-run), in the registry it registers in."""
    from mlflow.tracking import MlflowClient

    from rloo.tracking.runs import check_tracking_server

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
        _raise_mlflow_as_user_error(e)
        raise
    return PushRun(registry, run_id)


def publish(cfg: PushConfig, prepared: StagedPush, run: PushRun | None, hub_api: Any) -> PushResult:
    """Steps 2-5: the model card, then storage, MLflow, the Hub and promotion, in that order."""
    out = Path(cfg.output_dir)
    decision = prepared.decision
    if decision.promoted and cfg.compare_to_champion:
        champion = current_champion(cfg, prepared.key, run, out)
        decision = decide(prepared.eval_results, cfg.promotion_margin, champion)
    if run is not None:
        decision = _tag_and_check_newer(cfg, run, decision)
    name, card = write_card(cfg, prepared, decision, run)
    result = PushResult(decision, cfg.promotion_margin, prepared.key, prepared.digests)

    # 2. object storage, versioned by run key
    if cfg.storage_uri:
        uri = Location.parse(cfg.storage_uri).child(prepared.key).uri
        result.storage = StoredCopy(uri, _publish(prepared.staged, uri))
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
        _record_outcome(run, result.mlflow, decision, version)
    return result


def current_champion(cfg: PushConfig, key: str, run: PushRun | None, out: Path) -> Champion | None:
    """The champion a challenger must beat: the registry's ``champion`` version, else (no registry) the run
    in ``production_uri``'s ledger; None when there is none, or when it is this run's own model (a re-run)."""
    if run is not None and run.registry.name:
        holder = run.registry.alias_holder(CHAMPION)
        source = (holder.tags or {}).get(TAG_SOURCE_RUN) if holder is not None else None
        if holder is None or source == key:
            return None
        label = f"version {holder.version} of run {source or holder.run_id}"
        data, why = run.registry.eval_results_of(holder, out / "champion")
        return _champion(label, data, why)
    if not cfg.production_uri:
        return None
    where = Location.parse(cfg.production_uri).uri
    try:
        ledger = read_ledger(cfg.production_uri)
        if ledger is None or ledger.get("run_key") == key:
            return None
        label = f"run {ledger.get('run_key')} at {where}"
        raw = read_published_file(cfg.production_uri, "eval_results.json")
    except IncompleteArtifactError as e:
        return Champion(f"the model at {where}", None, str(e), damaged=True)
    if raw is None:
        return Champion(label, None, "its copy has no eval_results.json")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Champion(label, None, "its eval_results.json is not valid JSON")
    return _champion(label, data, "")


def _champion(label: str, data: Any, why: str) -> Champion:
    if data is None:
        return Champion(label, None, why)
    try:
        return Champion(label, parse_eval_results(data, "its eval_results.json"))
    except UserError as e:
        return Champion(label, None, str(e))


def read_ledger(production_uri: str) -> dict[str, Any] | None:
    """``promotion.json`` of the production copy: ``{"run_key", "storage_uri", "previous": [...]}``; None when
    there is none. IncompleteArtifactError when it does not match the copy's manifest."""
    raw = read_published_file(production_uri, LEDGER_FILE)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning(
            "%s/%s is not valid JSON: the production copy's run is unknown", production_uri, LEDGER_FILE
        )
        return None
    return data if isinstance(data, dict) else None


def _tag_and_check_newer(cfg: PushConfig, run: PushRun, decision: Decision) -> Decision:
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


def _training_dataset(train_cfg: dict[str, Any], model_dir: Path) -> str | None:
    """The training dataset as the card names it: name, split and content digest, as the trainer recorded it
    when it read the data (``training_dataset.json``); for a model trained before that file existed, worked
    out now (a local directory's data files hashed, an s3:// upload's from its manifest; a Hub dataset by
    name and split)."""
    from rloo.data import TRAINING_DATASET_FILE, DatasetRecord, dataset_record

    recorded = model_dir / TRAINING_DATASET_FILE
    if recorded.is_file():
        try:
            return DatasetRecord.from_json(recorded.read_text()).describe()
        except (ValueError, TypeError) as e:
            log.warning("%s is unreadable (%s): the dataset is described from the config", recorded, e)

    name, split = train_cfg.get("dataset_name"), train_cfg.get("dataset_train_split") or "train"
    if not name:
        return None
    try:
        return dataset_record(
            str(name), str(split), config=train_cfg.get("dataset_config") or None
        ).describe()
    except UserError as e:  # moved or deleted since training: the card still names it
        log.warning("the model card names the training dataset without its digest: %s", e)
        return f"{name} (split {split})"


def write_card(
    cfg: PushConfig, prepared: StagedPush, decision: Decision, run: PushRun | None
) -> tuple[str, str]:
    """Render the model card into the staged files as ``README.md``; returns (model name, card text)."""
    model_dir = prepared.model_dir
    train_cfg = _read_json(model_dir / "rloo_config.json")
    metrics = _read_metrics(model_dir / "metrics.jsonl")
    base_model = cfg.base_model or train_cfg.get("sft_model_path") or train_cfg.get("model_name_or_path")
    name = (
        cfg.model_name
        or (run.registry.name if run is not None else None)
        or (cfg.hub_repo_id or "").split("/")[-1]
        or model_dir.name
    )
    lineage = {
        "push run key": prepared.key,
        "KFP run id": prepared.kfp_id,
        "KFP run name": prepared.kfp_name,
        "MLflow pipeline run": cfg.mlflow_parent_run_id,
        "MLflow training run": cfg.mlflow_train_run_id,
        "model source": str(cfg.model_path),
        "base model revision": cfg.base_model_revision,
        "training dataset": _training_dataset(train_cfg, model_dir),
        "evaluation results": cfg.eval_results,
    }
    card = render_model_card(
        CardInputs(
            model_name=name,
            base_model=str(base_model) if base_model else None,
            datasets=[d for d in [train_cfg.get("dataset_name")] if d],
            rloo_config=train_cfg,
            num_updates=len(metrics),
            curves=summarize_curves(metrics),
            eval=prepared.eval_results,
            decision=decision,
            lineage=lineage,
            digests=prepared.digests,
            base_model_revision=cfg.base_model_revision,
        )
    )
    (prepared.staged / "README.md").write_text(card)
    return name, card


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


def promote(
    cfg: PushConfig,
    prepared: StagedPush,
    decision: Decision,
    registry: Registry | None,
    version: str | None,
    storage: str | None,
) -> StoredCopy | None:
    """Step 5: a champion goes to ``production_uri`` (atomically, with the ledger) and takes the alias; a
    candidate re-run of the model holding 'champion' gives it back (:func:`_demote`). Returns the production
    copy."""
    key = prepared.key
    if decision.promoted:
        production = None
        if cfg.production_uri:
            uri = Location.parse(cfg.production_uri).uri
            production = StoredCopy(uri, _publish_production(cfg, prepared.staged, key, storage))
        if registry is not None and version is not None:
            registry.take_champion(version, decision)
            # a re-run with a new decision (e.g. a lower margin) must not leave the version both
            registry.drop_alias_if_on(CANDIDATE, version)
        return production
    if registry is not None and version is not None:
        if CHAMPION in registry.aliases_of(version):
            return _demote(cfg, registry, version, Path(cfg.output_dir))
        return None
    if cfg.production_uri:  # no registry: the ledger says whose model production holds
        ledger = _ledger_or_empty(cfg.production_uri)
        if ledger.get("run_key") == key:
            return _demote_without_registry(cfg, ledger, Path(cfg.output_dir))
    return None


def _ledger_or_empty(production_uri: str) -> dict[str, Any]:
    """:func:`read_ledger` for the steps that go on without it: a damaged ledger is logged and read as none
    (the champion comparison, which must not, reads it itself)."""
    try:
        return read_ledger(production_uri) or {}
    except IncompleteArtifactError as e:
        log.warning(
            "the production copy's ledger is unreadable, its run and earlier champions unknown: %s", e
        )
        return {}


def _publish_production(cfg: PushConfig, staged: Path, key: str, storage: str | None) -> bool:
    """The staged files plus the ledger, atomically to ``production_uri``; True if it uploaded."""
    assert cfg.production_uri
    ledger = _ledger_or_empty(cfg.production_uri)
    previous = list(ledger.get("previous") or [])
    if ledger.get("run_key") and ledger.get("run_key") != key:
        previous.append({"run_key": ledger["run_key"], "storage_uri": ledger.get("storage_uri")})
    previous = [p for p in previous if isinstance(p, dict) and p.get("run_key") != key][-20:]
    return _publish_with_ledger(
        staged, cfg.production_uri, {"run_key": key, "storage_uri": storage, "previous": previous}
    )


def _publish_with_ledger(src: Path, uri: str, ledger: dict[str, Any]) -> bool:
    """``src``'s files (hard links) and ``ledger`` as ``promotion.json``, atomically to ``uri``."""
    dest = src.parent / "production"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in (LEDGER_FILE, MANIFEST_NAME):
            link_or_copy(f, dest / f.name)
    (dest / LEDGER_FILE).write_text(json.dumps(ledger, indent=1, sort_keys=True) + "\n")
    try:
        return _publish(dest, uri, atomic=True)
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def _record_outcome(run: PushRun, record: MlflowRecord, decision: Decision, version: str | None) -> None:
    """Step 6's MLflow part: the version's aliases and the champion in the result, the decision as tags."""
    client, registry = run.registry.client, run.registry
    if version is not None:
        record.aliases = registry.aliases_of(version)
        holder = registry.alias_holder(CHAMPION)
        record.champion_version = None if holder is None else str(holder.version)
        client.set_tag(run.run_id, "rloo.registered_version", version)
    client.set_tag(run.run_id, "rloo.promotion", decision.decision)
    client.set_tag(run.run_id, "rloo.promotion_reason", decision.reason[:5000])


def _demote(cfg: PushConfig, registry: Registry, version: str, out: Path) -> StoredCopy | None:
    """Move 'champion' off ``version`` (back to the previous champion, or nowhere) and put the previous
    champion's published copy back at ``production_uri``, or withdraw the production copy when none can be."""
    previous = registry.previous_champion(version)
    registry.give_up_champion(version, previous)
    if previous is None:
        log.warning("'champion' removed from version %s: no earlier champion to restore", version)
    else:
        log.info("'champion' moved back from version %s to version %s", version, previous.version)
    if not cfg.production_uri:
        return None
    source_key = (previous.tags or {}).get(TAG_SOURCE_RUN) if previous is not None else None
    return _restore_production(cfg, source_key, out)


def _demote_without_registry(cfg: PushConfig, ledger: dict[str, Any], out: Path) -> StoredCopy:
    """No registry: the ledger in ``production_uri`` names the champions before this one; the newest whose
    versioned copy is still complete goes back, else the production copy is withdrawn."""
    previous = [p for p in ledger.get("previous") or [] if isinstance(p, dict) and p.get("run_key")]
    while previous:
        last = previous.pop()
        src = last.get("storage_uri")
        if src and is_complete(src):
            return _put_back(cfg, last["run_key"], src, previous, out)
    return _withdraw(cfg)


def _restore_production(cfg: PushConfig, source_key: str | None, out: Path) -> StoredCopy:
    """The registry's previous champion (its run key) back at ``production_uri`` from its versioned copy
    under ``storage_uri``, else the production copy is withdrawn."""
    assert cfg.production_uri
    if source_key and cfg.storage_uri:
        src = Location.parse(cfg.storage_uri).child(source_key).uri
        if is_complete(src):
            ledger = _ledger_or_empty(cfg.production_uri)
            previous = [
                p
                for p in ledger.get("previous") or []
                if isinstance(p, dict) and p.get("run_key") != source_key
            ]
            return _put_back(cfg, source_key, src, previous, out)
    return _withdraw(cfg)


def _put_back(cfg: PushConfig, key: str, src: str, previous: list[Any], out: Path) -> StoredCopy:
    """Publish the versioned copy ``src`` of run ``key`` to ``production_uri`` again, ``previous`` the
    champions before it in its ledger."""
    assert cfg.production_uri
    local = out / "previous_champion"
    download_dir(src, local, progress=False, overwrite=True)
    entry = {"run_key": key, "storage_uri": src, "previous": previous}
    uploaded = _publish_with_ledger(local, cfg.production_uri, entry)
    log.info("production copy restored to the previous champion, run %s", key)
    return StoredCopy(Location.parse(cfg.production_uri).uri, uploaded, restored_from=src)


def _withdraw(cfg: PushConfig) -> StoredCopy:
    """No approved model to put at ``production_uri``: delete the copy there (its manifest first, so readers
    stop accepting it at once) rather than leave a model the gate no longer approves."""
    assert cfg.production_uri
    prod = Location.parse(cfg.production_uri).uri
    delete_prefix(prod)
    log.warning("%s withdrawn: no earlier champion's copy to put back", prod)
    return StoredCopy(prod, uploaded=False, withdrawn=True)


__all__ = ["RESULT_FILE", "Decision", "MlflowRecord", "PushResult", "StoredCopy", "run_push"]
