"""Step 1 of a push: every input checked (before anything is written), the gate's first decision, and the
files to publish staged under ``<output_dir>/publish`` as hard links: the model's top-level files (a LoRA
output merged into a full model), ``eval_results.json`` and, once the decision is final, the model card as
``README.md``. ``checkpoint-N/`` and ``samples/`` stay behind."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rloo.diskspace import honour_umask
from rloo.errors import UserError
from rloo.models import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED_SUBDIR
from rloo.push.card import CardInputs, render_model_card, summarize_curves
from rloo.push.config import PushConfig, run_key
from rloo.push.gate import Decision, EvalResults, decide, load_eval_results, parse_eval_results
from rloo.push.registry import link_or_copy
from rloo.push.trained import check_trained_model, fetch_trained_model
from rloo.storage import Location
from rloo.storage.backends import backend_for
from rloo.storage.manifest import MANIFEST_NAME, sha256_file
from rloo.tracking.lifecycle import pipeline_run_from_env

if TYPE_CHECKING:
    from rloo.push.mlflow_run import PushRun

log = logging.getLogger("rloo.push")


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


def stage_push(cfg: PushConfig, out: Path) -> StagedPush:
    """Step 1: check every input (before ``out`` is created: bad input leaves nothing behind), decide, and
    stage the files to publish under ``out/publish``."""
    model_dir = check_trained_model(str(cfg.model_path))  # None: an s3:// model, fetched below
    evaluation = read_eval_results(cfg.eval_results)
    eval_results = evaluation[0] if evaluation else None
    decision = decide(eval_results, cfg.promotion_margin)
    if cfg.hub_repo_id and (decision.promoted or cfg.hub_push_candidates):
        from rloo.push.hub import hub_token

        hub_token()  # fail on a missing token now, before anything is published
    out.mkdir(parents=True, exist_ok=True)
    if model_dir is None:
        model_dir = fetch_trained_model(str(cfg.model_path), out)
    staged = stage_files(model_dir, evaluation[1] if evaluation else None, out / "publish")
    digests = {f.name: sha256_file(f) for f in sorted(staged.iterdir())}
    kfp_id, kfp_name = pipeline_run_from_env()
    key = run_key(cfg.run_id or kfp_id or _content_key(digests))
    return StagedPush(model_dir, staged, digests, eval_results, decision, key, kfp_id, kfp_name)


def read_eval_results(uri: str | None) -> tuple[EvalResults, bytes] | None:
    """``--eval_results`` (a local file or an ``s3://`` object), checked, and the bytes it was read from;
    None when there is none. Those bytes are what gets published: a later challenger is compared with this
    model on its per-example scores and judge template digest, which the parsed results do not carry whole."""
    if not uri:
        return None
    loc = Location.parse(uri)
    if loc.is_local:
        return load_eval_results(loc.path), loc.path.read_bytes()
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
    return parse_eval_results(decoded, uri), data


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


def stage_files(model_dir: Path, eval_bytes: bytes | None, dest: Path) -> Path:
    """Hard-link the files to publish into ``dest`` (rebuilt from scratch): top-level files only, and
    ``eval_results.json`` exactly as it was read and checked (``eval_bytes``)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and f.name not in (MANIFEST_NAME, "README.md") and not f.name.startswith("."):
            link_or_copy(f, dest / f.name)
    if (dest / ADAPTER_CONFIG).is_file() and not (dest / "config.json").is_file():
        _stage_merged(model_dir, dest)
    if eval_bytes is not None:
        (dest / "eval_results.json").write_bytes(eval_bytes)
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


def _content_key(digests: dict[str, str]) -> str:
    h = hashlib.sha256("\n".join(f"{k}:{v}" for k, v in sorted(digests.items())).encode()).hexdigest()
    return f"sha256-{h[:16]}"


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
