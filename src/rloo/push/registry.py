"""MLflow Model Registry target: log the model directory in the ``transformers`` flavor layout, register a
version, set aliases and the promotion tags.

Why the MLmodel file is written here rather than by ``mlflow.transformers.log_model``: with a checkpoint
path that function would not load the weights, but mlflow 3.17's flavor code breaks on transformers 5
(``pipelines.check_task`` returns class *names* now) and it copies the whole directory, checkpoints and
all. So we lay the files out exactly as it does (``MLmodel``, ``model/`` = the checkpoint, ``components/
tokenizer/``) with hard links, write the same flavor keys, and upload with ``log_artifacts``: nothing is
loaded. Loading is not affected by that bug: ``mlflow.transformers.load_model`` and ``mlflow.pyfunc.
load_model`` (mlflow-skinny is enough) load a registered version back as a text-generation pipeline (tested
against the MLflow server in tests/push).

Idempotency: every version carries ``rloo.source_run=<run key>``; an existing one is reused, never
duplicated. The push run is found again by the same tag.

Seniority: every version also carries ``rloo.run_started_ms``, the start time of the run it came from (the
pipeline's parent run, else the training run, else the push run). ``champion`` only moves to a version whose
run is newer than the current champion's, so retrying an old pipeline run never takes it back.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rloo.push.gate import CHAMPION, Decision

SUPERSEDED = "superseded"  # rloo.promotion of a version (and its runs) that held 'champion' and lost it

TAG_SOURCE_RUN = "rloo.source_run"
TAG_PROMOTION = "rloo.promotion"
TAG_REASON = "rloo.promotion_reason"
TAG_VERSION = "rloo.registered_version"
TAG_STARTED = "rloo.run_started_ms"
TAG_PARENT = "mlflow.parentRunId"
ARTIFACT_PATH = "model"
# Files of a tokenizer as transformers saves them; they go to components/tokenizer as well as model/.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
RLOO_FILES = ("rloo_config.json", "metrics.jsonl", "training_complete.json", "eval_results.json")


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard link (no bytes copied: weights can be tens of GB), falling back to a copy across devices."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_mlflow_model_dir(staged: Path, dest: Path, *, source_model_name: str, card: str) -> Path:
    """Lay out ``staged`` (model files + rloo files + README.md) as an MLflow transformers model in ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(p for p in staged.iterdir() if p.is_file()):
        if f.name == "README.md":
            continue
        if f.name in RLOO_FILES:
            link_or_copy(f, dest / "rloo" / f.name)
            continue
        link_or_copy(f, dest / "model" / f.name)
        if f.name in TOKENIZER_FILES:
            link_or_copy(f, dest / "components" / "tokenizer" / f.name)
    (dest / "model_card.md").write_text(card)
    config = json.loads((staged / "config.json").read_text())
    tok_cfg_path = staged / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    import mlflow
    import transformers

    flavor = {
        "task": "text-generation",
        "instance_type": "TextGenerationPipeline",
        "pipeline_model_type": (config.get("architectures") or ["AutoModelForCausalLM"])[0],
        "source_model_name": source_model_name,
        "model_binary": "model",
        "components": ["tokenizer"],
        "tokenizer_type": tok_cfg.get("tokenizer_class", "PreTrainedTokenizerFast"),
        "tokenizer_name": source_model_name,
        "torch_dtype": config.get("torch_dtype") or config.get("dtype"),
        "transformers_version": transformers.__version__,
        "code": None,
    }
    mlmodel = {
        "artifact_path": ARTIFACT_PATH,
        "flavors": {
            "python_function": {
                "loader_module": "mlflow.transformers",
                "python_version": platform.python_version(),
                "env": {"virtualenv": "python_env.yaml"},
            },
            "transformers": flavor,
        },
        "mlflow_version": mlflow.__version__,
        "model_size_bytes": sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()),
    }
    (dest / "MLmodel").write_text(yaml.safe_dump(mlmodel, sort_keys=False))
    (dest / "requirements.txt").write_text(f"mlflow\ntransformers=={transformers.__version__}\ntorch\n")
    (dest / "python_env.yaml").write_text(
        yaml.safe_dump({"python": platform.python_version(), "dependencies": ["-r requirements.txt"]})
    )
    return dest


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


@dataclass
class RegistryResult:
    name: str
    version: str
    run_id: str
    source: str
    reused: bool


def version_order(mv: Any) -> tuple[int, int]:
    """Seniority of a model version: its run's start time (the version's creation time for versions
    registered before the tag existed), then its version number."""
    try:
        started = int((mv.tags or {})[TAG_STARTED])
    except (KeyError, TypeError, ValueError):
        started = int(mv.creation_timestamp or 0)
    return started, int(mv.version)


class Registry:
    """The MLflow side of one push: its run, the model version, aliases and tags."""

    def __init__(self, client: Any, name: str | None, run_key: str) -> None:
        self.client = client
        self.name = name
        self.run_key = run_key
        self.started_ms: int | None = None  # set by origin_start_ms(), before register()

    # -- the push run ---------------------------------------------------------------------------------
    def find_or_start_run(self, **stage_kwargs: Any) -> str:
        """The push run of this run key (re-opened on a re-run), else a new stage run."""
        from rloo.tracking.runs import (
            DEFAULT_EXPERIMENT,
            EXPERIMENT_ENV,
            get_or_create_experiment,
            start_stage_run,
        )

        exp_name = stage_kwargs.get("experiment") or os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT
        exp_id = get_or_create_experiment(self.client, exp_name)
        found = self.client.search_runs(
            [exp_id],
            filter_string=f"tags.`rloo.stage` = 'push' and tags.`{TAG_SOURCE_RUN}` = '{_quote(self.run_key)}'",
            order_by=["attributes.start_time ASC"],
            max_results=1,
        )
        if found:
            run_id = found[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        stage = start_stage_run(
            "push",
            client=self.client,
            tags={TAG_SOURCE_RUN: self.run_key},
            supersede_running=False,
            **stage_kwargs,
        )
        return stage.run_id

    def origin_start_ms(self, run_id: str, train_run_id: str | None = None) -> int:
        """Start time of the run this push publishes: the pipeline (parent) run, else the training run,
        else the push run itself (found again on a re-run, so stable per run key)."""
        run = self.client.get_run(run_id)
        for other in (run.data.tags.get(TAG_PARENT), train_run_id):
            if other:
                self.started_ms = int(self.client.get_run(other).info.start_time)
                return self.started_ms
        self.started_ms = int(run.info.start_time)
        return self.started_ms

    def _name(self) -> str:
        """The registered model's name, for the methods that only run when there is one."""
        if not self.name:
            raise RuntimeError("no registered model name: this push does not register a version")
        return self.name

    # -- the version ------------------------------------------------------------------------------------
    def existing_version(self) -> Any | None:
        versions = self.client.search_model_versions(
            f"name = '{_quote(self._name())}' and tags.`{TAG_SOURCE_RUN}` = '{_quote(self.run_key)}'"
        )
        ready = [v for v in versions if getattr(v, "status", "READY") == "READY"]
        return min(ready, key=lambda v: int(v.version)) if ready else None

    def register(self, run_id: str, model_dir: Path, decision: Decision, description: str) -> RegistryResult:
        """Reuse this run key's version, or log ``model_dir`` and create one (tags set atomically with it)."""
        from mlflow.exceptions import MlflowException

        assert self.name, "register() needs a registered model name"
        found = self.existing_version()
        if found is not None:
            if self.started_ms is not None and TAG_STARTED not in (found.tags or {}):
                self.client.set_model_version_tag(self.name, found.version, TAG_STARTED, str(self.started_ms))
            return RegistryResult(self.name, str(found.version), run_id, found.source, reused=True)
        try:
            self.client.create_registered_model(self.name, description="RLOO-trained models (rloo push).")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        self.client.log_artifacts(run_id, str(model_dir), ARTIFACT_PATH)
        source = f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{ARTIFACT_PATH}"
        mv = self.client.create_model_version(
            self.name,
            source,
            run_id=run_id,
            # The source tag goes in with the version itself: a crash after this call cannot leave an
            # untagged version that a re-run would fail to find and duplicate.
            tags={
                TAG_SOURCE_RUN: self.run_key,
                TAG_PROMOTION: decision.decision,
                TAG_REASON: decision.reason,
                **({TAG_STARTED: str(self.started_ms)} if self.started_ms is not None else {}),
            },
            description=description,
        )
        return RegistryResult(self.name, str(mv.version), run_id, source, reused=False)

    def set_decision(self, version: str, decision: Decision) -> None:
        self.client.set_model_version_tag(self.name, version, TAG_PROMOTION, decision.decision)
        self.client.set_model_version_tag(self.name, version, TAG_REASON, decision.reason[:5000])

    def set_alias(self, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(self.name, alias, version)

    def drop_alias_if_on(self, alias: str, version: str) -> None:
        if alias in self.aliases_of(version):
            self.client.delete_registered_model_alias(self.name, alias)

    def aliases_of(self, version: str) -> list[str]:
        return sorted(self.client.get_model_version(self.name, version).aliases or [])

    def alias_holder(self, alias: str) -> Any | None:
        """The version ``alias`` points at, or None (also when the registered model does not exist yet)."""
        from mlflow.exceptions import MlflowException

        try:
            version = (self.client.get_registered_model(self.name).aliases or {}).get(alias)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return None if version is None else self.client.get_model_version(self.name, str(version))

    def newer_champion(self) -> Any | None:
        """The champion version when it belongs to another run that started after this one, else None."""
        holder = self.alias_holder(CHAMPION)
        if holder is None or (holder.tags or {}).get(TAG_SOURCE_RUN) == self.run_key:
            return None
        mine = self.started_ms if self.started_ms is not None else 0
        return holder if version_order(holder)[0] > mine else None

    def previous_champion(self, exclude_version: str) -> Any | None:
        """The newest other version approved as champion, holding it or superseded since (where
        ``champion`` goes back to when the version holding it is demoted), or None."""
        found = [
            v
            for status in (CHAMPION, SUPERSEDED)
            for v in self.client.search_model_versions(
                f"name = '{_quote(self._name())}' and tags.`{TAG_PROMOTION}` = '{status}'"
            )
        ]
        others = [
            self.client.get_model_version(self.name, str(v.version))
            for v in found
            if str(v.version) != str(exclude_version) and getattr(v, "status", "READY") == "READY"
        ]
        return max(others, key=version_order, default=None)

    def take_champion(self, version: str, decision: Decision) -> None:
        """Point ``champion`` at ``version``; the version that held it (another run's) and its runs say
        ``superseded`` from now on, so that only one row of the runs table claims ``champion``."""
        holder = self.alias_holder(CHAMPION)
        self.set_alias(CHAMPION, version)
        if holder is not None and str(holder.version) != str(version):
            reason = f"was champion until version {version} ({self.run_key}) beat it"
            self._mark(holder, SUPERSEDED, reason)

    def give_up_champion(self, version: str, previous: Any | None) -> None:
        """Move ``champion`` from ``version`` back to ``previous`` (or remove it), and make the tags agree:
        ``previous`` and its runs say ``champion`` again."""
        if previous is None:
            self.drop_alias(CHAMPION)
            return
        self.set_alias(CHAMPION, str(previous.version))
        if (previous.tags or {}).get(TAG_PROMOTION) != CHAMPION:
            self._mark(previous, CHAMPION, f"champion again: version {version} ({self.run_key}) was demoted")

    def _mark(self, mv: Any, status: str, reason: str) -> None:
        """``rloo.promotion`` of a version, its push run and that run's pipeline (parent) run."""
        self.client.set_model_version_tag(self.name, mv.version, TAG_PROMOTION, status)
        self.client.set_model_version_tag(self.name, mv.version, TAG_REASON, reason[:5000])
        if not mv.run_id:
            return
        from mlflow.exceptions import MlflowException

        try:
            runs = [mv.run_id]
            parent = self.client.get_run(mv.run_id).data.tags.get(TAG_PARENT)
            runs += [parent] if parent else []
            for run_id in runs:
                self.client.set_tag(run_id, TAG_PROMOTION, status)
                self.client.set_tag(run_id, TAG_REASON, reason[:5000])
        except MlflowException as e:  # a deleted run: the version's own tags are what count
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise

    def eval_results_of(self, mv: Any, dest: Path) -> tuple[Any, str]:
        """The ``eval_results.json`` registered with ``mv`` (decoded), or None and why not."""
        from mlflow.exceptions import MlflowException

        if not mv.run_id:
            return None, "it has no run to read its eval_results.json from"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        try:
            path = self.client.download_artifacts(
                mv.run_id, f"{ARTIFACT_PATH}/rloo/eval_results.json", str(dest)
            )
        except (MlflowException, OSError):
            return None, "it was registered without eval_results.json"
        try:
            return json.loads(Path(path).read_text()), ""
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, "its eval_results.json is not valid JSON"

    def drop_alias(self, alias: str) -> None:
        self.client.delete_registered_model_alias(self.name, alias)
