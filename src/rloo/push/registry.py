"""MLflow Model Registry target: one registered version per run key, created from an MLflow 3 logged model
of the run the model came from, with its aliases and promotion tags.

**By reference** (the push's copy under ``storage_uri`` is in object storage: the pipeline on a cluster).
MLflow loads a version by downloading the directory its ``source`` names and reading ``MLmodel`` at its
root, so the small MLflow files go where the weights already are: next to the published, manifest-verified
copy ``<storage_uri>/<run key>/`` the push writes ``MLmodel`` (transformers flavor with ``model_binary: .``:
the checkpoint is that directory itself), ``requirements.txt``, ``python_env.yaml`` and
``components/tokenizer/`` (copies of the tokenizer files, where the flavor loads them from; ``MLmodel``
last), then registers the version with that ``s3://`` URI as its source. The server only stores the
pointer (``mlflow.server.handlers._validate_source_model`` restricts local, ``runs:``, ``models:`` and
``mlflow-artifacts`` sources, not ``s3://``), so no byte of the weights passes through it: its artifact
proxy stages every upload in the server's /tmp, which a 15 GB safetensors file does not fit. The copy's
manifest does not list these files (rloo's readers ignore objects a manifest does not list; the production
copy and the Hub get the same files as before). rloo never deletes a ``<run key>/`` copy (only a push of the
same run key writes to it), so the version's source stays valid.
Loading such a version (``mlflow.transformers.load_model("models:/NAME@champion")``, ``mlflow.pyfunc.
load_model``) reads ``s3://`` directly: the loading client needs the bucket's credentials
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, as the pipeline's steps have) and, for an S3-compatible
server, its endpoint in ``MLFLOW_S3_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``).

**By upload** (the copy is a local directory, or there is none: ``make demo``, small models): the files laid
out as ``mlflow.transformers`` saves them (``MLmodel``, ``model/`` = the checkpoint, ``components/
tokenizer/``, hard links) are uploaded through the server as the logged model's artifacts, and the version's
source is the logged model's artifact location. A log line says which of the two a push took.

Why the MLmodel is written here rather than by ``mlflow.transformers.log_model``: with a checkpoint path
that function would not load the weights, but mlflow 3.17's flavor code breaks on transformers 5
(``pipelines.check_task`` returns class *names* now) and it copies the whole directory, checkpoints and
all. So we write the same flavor keys ourselves: nothing is loaded. Loading is not affected by that bug:
``mlflow.transformers.load_model`` and ``mlflow.pyfunc.load_model`` (mlflow-skinny is enough) load a
registered version back as a text-generation pipeline (tested against the MLflow server in tests/push).

The logged model (what MLflow 3's runs table shows in its "Models" column): its ``source_run_id`` is the
training run (``--mlflow_train_run_id``, else the ``train`` stage run of the same pipeline run, else the push
run), which lists it among its outputs; the push run lists it among its inputs; the version is created with
its ``model_id`` (and names it in its ``rloo.model_id`` tag: the OSS registry does not keep a version's
``model_id``). Registered by reference it is marked external (``mlflow.model.isExternal``, as
``mlflow.create_external_model`` does: its own artifacts are a stub ``MLmodel`` and the model card), and its
``rloo.model_uri`` tag says where the model is.

Idempotency: every version carries ``rloo.source_run=<run key>``; an existing one is reused, never
duplicated. The logged model carries the same tag and the registered model's name, and is found again by
them (a push retried after it was created and before the version was); the push run by its tag too.

Seniority: every version also carries ``rloo.run_started_ms``, the start time of the run it came from (the
pipeline's parent run, else the training run, else the push run). ``champion`` only moves to a version whose
run is newer than the current champion's, so retrying an old pipeline run never takes it back.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rloo.diskspace import human_bytes
from rloo.push.gate import CHAMPION, Decision

log = logging.getLogger("rloo.push")

SUPERSEDED = "superseded"  # rloo.promotion of a version (and its runs) that held 'champion' and lost it

TAG_SOURCE_RUN = "rloo.source_run"
TAG_PROMOTION = "rloo.promotion"
TAG_REASON = "rloo.promotion_reason"
TAG_VERSION = "rloo.registered_version"
TAG_STARTED = "rloo.run_started_ms"
TAG_PARENT = "mlflow.parentRunId"
TAG_REGISTERED_MODEL = "rloo.registered_model"  # on the logged model: the registered model it is a version of
TAG_MODEL_URI = "rloo.model_uri"  # on an external logged model: where the model is
TAG_EXTERNAL = "mlflow.model.isExternal"  # mlflow.utils.mlflow_tags.MLFLOW_MODEL_IS_EXTERNAL
# On the version: its logged model (MLflow's own model_id field of a version is not kept by the OSS
# registry's store, which links them only through the logged model's mlflow.modelVersions tag).
TAG_MODEL_ID = "rloo.model_id"
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
MLMODEL = "MLmodel"
LARGE_UPLOAD = 1_000_000_000  # bytes: above this, an upload through the MLflow server is warned about


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard link (no bytes copied: weights can be tens of GB), falling back to a copy across devices."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fresh(dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    return dest


def _link_tokenizer(staged: Path, dest: Path) -> None:
    for f in sorted(p for p in staged.iterdir() if p.is_file() and p.name in TOKENIZER_FILES):
        link_or_copy(f, dest / "components" / "tokenizer" / f.name)


def _files_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _write_mlmodel(
    staged: Path,
    dest: Path,
    *,
    source_model_name: str,
    model_binary: str,
    artifact_path: str,
    size_bytes: int,
    model_id: str | None,
    run_id: str | None,
) -> None:
    """``MLmodel`` (transformers + python_function flavors, the keys ``mlflow.transformers`` writes),
    ``requirements.txt`` and ``python_env.yaml`` in ``dest``; the checkpoint is at ``dest/<model_binary>``."""
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
        "model_binary": model_binary,
        "components": ["tokenizer"],
        "tokenizer_type": tok_cfg.get("tokenizer_class", "PreTrainedTokenizerFast"),
        "tokenizer_name": source_model_name,
        "torch_dtype": config.get("torch_dtype") or config.get("dtype"),
        "transformers_version": transformers.__version__,
        "code": None,
    }
    mlmodel: dict[str, Any] = {
        "artifact_path": artifact_path,
        "flavors": {
            "python_function": {
                "loader_module": "mlflow.transformers",
                "python_version": platform.python_version(),
                "env": {"virtualenv": "python_env.yaml"},
            },
            "transformers": flavor,
        },
        "mlflow_version": mlflow.__version__,
        "model_size_bytes": size_bytes,
    }
    if model_id:  # what mlflow's own log_model records: a loaded model's traces link to its logged model
        mlmodel["model_id"] = model_id
    if run_id:
        mlmodel["run_id"] = run_id
    (dest / "requirements.txt").write_text(f"mlflow\ntransformers=={transformers.__version__}\ntorch\n")
    (dest / "python_env.yaml").write_text(
        yaml.safe_dump({"python": platform.python_version(), "dependencies": ["-r requirements.txt"]})
    )
    (dest / MLMODEL).write_text(yaml.safe_dump(mlmodel, sort_keys=False))


def build_mlflow_model_dir(
    staged: Path,
    dest: Path,
    *,
    source_model_name: str,
    card: str,
    model_id: str | None = None,
    run_id: str | None = None,
) -> Path:
    """Lay out ``staged`` (model files + rloo files + README.md) as an MLflow transformers model in ``dest``,
    as ``mlflow.transformers`` saves one (the upload path): ``model/`` the checkpoint, ``components/
    tokenizer/``, ``rloo/`` the rloo files, ``model_card.md``; hard links, nothing copied."""
    _fresh(dest)
    for f in sorted(p for p in staged.iterdir() if p.is_file()):
        if f.name == "README.md":
            continue
        link_or_copy(f, dest / ("rloo" if f.name in RLOO_FILES else "model") / f.name)
    _link_tokenizer(staged, dest)
    (dest / "model_card.md").write_text(card)
    _write_mlmodel(
        staged,
        dest,
        source_model_name=source_model_name,
        model_binary="model",
        artifact_path=ARTIFACT_PATH,
        size_bytes=_files_size(dest),
        model_id=model_id,
        run_id=run_id,
    )
    return dest


def build_reference_files(
    staged: Path,
    dest: Path,
    *,
    source_model_name: str,
    source_uri: str,
    model_id: str | None = None,
    run_id: str | None = None,
) -> Path:
    """The files that make the published copy of ``staged`` at ``source_uri`` an MLflow transformers model
    (the by-reference path), in ``dest``: ``MLmodel`` with ``model_binary: .`` (the checkpoint is the copy's
    own top level, where config.json and the safetensors files are), ``requirements.txt``,
    ``python_env.yaml`` and ``components/tokenizer/``. Small: no weights."""
    _fresh(dest)
    _link_tokenizer(staged, dest)
    _write_mlmodel(
        staged,
        dest,
        source_model_name=source_model_name,
        model_binary=".",
        artifact_path=source_uri,
        size_bytes=_files_size(staged) + _files_size(dest),
        model_id=model_id,
        run_id=run_id,
    )
    return dest


def write_reference_files(files: Path, uri: str) -> int:
    """Put ``files`` (see :func:`build_reference_files`) next to the published copy at ``uri``, ``MLmodel``
    last: a copy that has it has the rest. One PutObject per file (atomic each), and the copy's manifest is
    left alone. Returns the bytes written."""
    from rloo.storage import Location
    from rloo.storage.backends import backend_for

    backend = backend_for(Location.parse(uri))
    paths = sorted((p for p in files.rglob("*") if p.is_file()), key=lambda p: (p.name == MLMODEL, str(p)))
    for p in paths:
        backend.write_bytes(p.relative_to(files).as_posix(), p.read_bytes())
    return sum(p.stat().st_size for p in paths)


def logged_model_name(name: str) -> str:
    """A logged model's name may not hold ``/ : . % " '`` (mlflow.utils.validation), a registered one may."""
    return re.sub(r"[/:.%\"']+", "-", name).strip("-") or "model"


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


@dataclass
class RegistryResult:
    name: str
    version: str
    run_id: str
    source: str
    reused: bool
    model_id: str | None = None  # the logged model the version was created from (None: registered before)


@dataclass(frozen=True)
class ModelFiles:
    """What :meth:`Registry.register` registers: the staged files (model, rloo files, README.md card) and
    the URI of their published copy (step 2), if any."""

    staged: Path
    card: str
    source_model_name: str
    published_uri: str | None
    work: Path  # scratch directory for the MLflow layout (hard links)

    @property
    def by_reference(self) -> bool:
        """A copy in object storage is what the version refers to; a local one may not be readable where
        the model is loaded (another machine), and is small when it is a demo's."""
        return bool(self.published_uri) and str(self.published_uri).startswith("s3://")


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
        from rloo.tracking.experiment import DEFAULT_EXPERIMENT, EXPERIMENT_ENV, get_or_create_experiment
        from rloo.tracking.lifecycle import start_stage_run

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

    def register(
        self,
        run_id: str,
        files: ModelFiles,
        decision: Decision,
        description: str,
        train_run_id: str | None = None,
    ) -> RegistryResult:
        """Reuse this run key's version, or create one from a logged model of the run the model came from
        (by reference to the published copy, or by upload: see the module docstring). Its tags are set
        atomically with it."""
        from mlflow.exceptions import MlflowException

        name = self._name()
        found = self.existing_version()
        if found is not None:
            if self.started_ms is not None and TAG_STARTED not in (found.tags or {}):
                self.client.set_model_version_tag(name, found.version, TAG_STARTED, str(self.started_ms))
            model_id = getattr(found, "model_id", None) or (found.tags or {}).get(TAG_MODEL_ID)
            return RegistryResult(name, str(found.version), run_id, found.source, True, model_id)
        try:
            self.client.create_registered_model(name, description="RLOO-trained models (rloo push).")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        origin = self.source_run(run_id, train_run_id)
        model = self.logged_model(origin, external_uri=files.published_uri if files.by_reference else None)
        if files.by_reference:
            source = str(files.published_uri)
            ref = build_reference_files(
                files.staged,
                files.work,
                source_model_name=files.source_model_name,
                source_uri=source,
                model_id=model.model_id,
                run_id=origin.info.run_id,
            )
            written = write_reference_files(ref, source)
            self._log_external_stub(model, source, files.card)
            log.info(
                "registering %s by reference to %s: MLmodel and %d other small files (%s) written next to "
                "the weights, which do not pass through the MLflow server",
                name,
                source,
                sum(1 for p in ref.rglob("*") if p.is_file()) - 1,
                human_bytes(written),
            )
        else:
            mdir = build_mlflow_model_dir(
                files.staged,
                files.work,
                source_model_name=files.source_model_name,
                card=files.card,
                model_id=model.model_id,
                run_id=origin.info.run_id,
            )
            size = _files_size(mdir)
            # fine for a small model; a large one may not fit the server's staging /tmp: say what avoids it
            (log.warning if size >= LARGE_UPLOAD else log.info)(
                "registering %s by uploading the model (%s) through the MLflow server: its published copy "
                "is %s, not in object storage%s",
                name,
                human_bytes(size),
                files.published_uri or "not configured (no --storage_uri)",
                "; an s3:// --storage_uri registers it by reference instead" if size >= LARGE_UPLOAD else "",
            )
            self.client.log_model_artifacts(model.model_id, str(mdir))
            source = model.artifact_location
        self.client.finalize_logged_model(model.model_id, "READY")
        self.link_runs(model.model_id, origin.info.run_id, run_id)
        mv = self.client.create_model_version(
            name,
            source,
            run_id=run_id,
            # The source tag goes in with the version itself: a crash after this call cannot leave an
            # untagged version that a re-run would fail to find and duplicate.
            tags={
                TAG_SOURCE_RUN: self.run_key,
                TAG_PROMOTION: decision.decision,
                TAG_REASON: decision.reason,
                TAG_MODEL_ID: model.model_id,
                **({TAG_STARTED: str(self.started_ms)} if self.started_ms is not None else {}),
            },
            description=description,
            model_id=model.model_id,
        )
        return RegistryResult(name, str(mv.version), run_id, source, False, model.model_id)

    # -- the logged model -------------------------------------------------------------------------------
    def source_run(self, push_run_id: str, train_run_id: str | None = None) -> Any:
        """The run the model came from: ``train_run_id`` (``--mlflow_train_run_id``), else the training
        stage's run of the same pipeline run (the newest finished ``train`` run under the push run's
        parent), else the push run itself."""
        from rloo.tracking.tags import TAG_STAGE, TRAIN_STAGE

        if train_run_id:
            return self.client.get_run(train_run_id)
        push = self.client.get_run(push_run_id)
        parent = push.data.tags.get(TAG_PARENT)
        if parent:
            trains = self.client.search_runs(
                [push.info.experiment_id],
                filter_string=(
                    f"tags.`{TAG_PARENT}` = '{_quote(parent)}' and tags.`{TAG_STAGE}` = '{TRAIN_STAGE}'"
                ),
                order_by=["attributes.start_time DESC"],
                max_results=20,
            )
            finished = [r for r in trains if r.info.status == "FINISHED"]
            if finished or trains:
                return (finished or trains)[0]
        return push

    def logged_model(self, origin: Any, *, external_uri: str | None) -> Any:
        """This run key's logged model in ``origin``'s experiment (found again on a retry), else a new one
        whose ``source_run_id`` is ``origin``; ``external_uri``: the model is there, not in its artifacts."""
        name = self._name()
        experiment_id = origin.info.experiment_id
        found = self.client.search_logged_models(
            experiment_ids=[experiment_id],
            filter_string=(
                f"tags.`{TAG_SOURCE_RUN}` = '{_quote(self.run_key)}' "
                f"AND tags.`{TAG_REGISTERED_MODEL}` = '{_quote(name)}'"
            ),
        )
        if found:
            return min(found, key=lambda m: int(m.creation_timestamp or 0))
        tags = {TAG_SOURCE_RUN: self.run_key, TAG_REGISTERED_MODEL: name}
        if external_uri:
            tags.update({TAG_EXTERNAL: "true", TAG_MODEL_URI: external_uri})
        # The tags go in with the model: a retry finds it by them, never creates a second one.
        return self.client.create_logged_model(
            experiment_id, name=logged_model_name(name), source_run_id=origin.info.run_id, tags=tags
        )

    def _log_external_stub(self, model: Any, uri: str, card: str) -> None:
        """An external logged model's artifacts, as ``mlflow.create_external_model`` logs them: an MLmodel
        that says the model is elsewhere (loading ``models:/<model_id>`` says so instead of failing on
        missing weights), plus the model card; a few kB through the server."""
        from mlflow.models.utils import get_external_mlflow_model_spec

        spec = get_external_mlflow_model_spec(model)
        spec.metadata = {**(spec.metadata or {}), TAG_MODEL_URI: uri}
        with tempfile.TemporaryDirectory(prefix="rloo-logged-model-") as tmp:
            spec.save(os.path.join(tmp, MLMODEL))
            Path(tmp, "README.md").write_text(card)
            self.client.log_model_artifacts(model.model_id, tmp)

    def link_runs(self, model_id: str, origin_run_id: str, push_run_id: str) -> None:
        """The model as an output of the run it came from (what the runs table's "Models" column shows) and
        an input of the push run; each once (MLflow records a link again every time it is logged)."""
        from mlflow.entities import LoggedModelInput, LoggedModelOutput

        origin = self.client.get_run(origin_run_id)
        outputs = origin.outputs.model_outputs if origin.outputs is not None else []
        if model_id not in {o.model_id for o in outputs}:
            self.client.log_outputs(origin_run_id, [LoggedModelOutput(model_id, step=0)])
        if push_run_id == origin_run_id:
            return
        push = self.client.get_run(push_run_id)
        inputs = push.inputs.model_inputs if push.inputs is not None else []
        if model_id not in {i.model_id for i in inputs}:
            self.client.log_inputs(push_run_id, models=[LoggedModelInput(model_id)])

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
        """The ``eval_results.json`` registered with ``mv`` (decoded), or None and why not: read from the
        version's model directory, a published copy in object storage (checked against its manifest) for
        a version registered by reference, else its ``rloo/`` directory in MLflow's artifacts."""
        from rloo.storage.errors import StorageError, StorageUnavailable
        from rloo.storage.transfer import read_published_file

        uri = str(self.client.get_model_version_download_uri(self._name(), str(mv.version))).rstrip("/")
        raw: bytes | None = None
        if uri.startswith("s3://"):
            try:
                raw = read_published_file(uri, "eval_results.json")
            except StorageUnavailable:
                raise  # a retried push tries again; the champion is not 'uncomparable' for an outage
            except StorageError as e:  # damaged (not matching its manifest), or refused
                return None, f"its eval_results.json at {uri} is unreadable ({e})"
        if raw is None:
            import mlflow.artifacts

            _fresh(dest)
            try:
                path = mlflow.artifacts.download_artifacts(
                    artifact_uri=f"{uri}/rloo/eval_results.json",
                    dst_path=str(dest),
                    tracking_uri=self.client.tracking_uri,
                )
                raw = Path(path).read_bytes()
            except Exception:  # MLflow's errors, or the artifact store's (botocore's for an s3:// root)
                return None, "it was registered without eval_results.json"
        try:
            return json.loads(raw), ""
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, "its eval_results.json is not valid JSON"

    def drop_alias(self, alias: str) -> None:
        self.client.delete_registered_model_alias(self.name, alias)
