"""The fetch step: the SFT model (a Hub id pinned to one commit, an ``s3://`` prefix written by any tool or a
local directory) copied to the run's object storage as a verified upload, whose record the later steps read.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

from rloo.errors import UserError
from rloo.stages.context import StepResult
from rloo.stages.layout import RunLayout
from rloo.stages.plan import PipelinePlan
from rloo.stages.sft import hub_model_info, local_sft_model


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

    An ``s3://`` source may come from any tool: an rloo upload is verified against its manifest (every
    SHA-256), a prefix without one (``aws s3 cp --recursive`` of a ``save_pretrained`` directory) is read as
    listed, its top-level files only (:func:`rloo.models.model_files`).

    Returns the metadata of the KFP ``Model`` artifact: source, revision (the Hub commit, None for other
    sources), uri, manifest digest, file count, bytes; for an ``s3://`` source also ``source_files`` (each
    file read: key, size, the store's ETag, SHA-256) and ``source_manifest`` (whether it had one).
    """
    from rloo.models import check_weight_headers, holds_model_config
    from rloo.storage import upload_dir, verify_prefix
    from rloo.storage.location import source_kind

    commit: str | None = None
    read: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        kind = source_kind(source)
        if kind == "s3":
            local = Path(tmp) / "model"
            read = _fetch_s3_model(source, local)
        elif kind == "local":
            local = local_sft_model(source)
        else:
            from rloo.storage.hub import hub_errors

            with hub_errors(f"model {source}"):  # the Hub out of reach: one line, exit 75 (a retry may heal)
                commit = resolve_hub_commit(source, revision, hub_api)
                local = _download_hub_model(hub_api or _hf_api(), source, commit, Path(tmp) / "model")
        if revision and commit is None:
            raise UserError(
                f"--model_revision {revision!r} only applies to a Hugging Face Hub id, and {source!r} is not one."
            )
        if not holds_model_config([p.name for p in local.iterdir()], adapter=False):
            raise UserError(f"model {source!r} has no config.json: not a transformers model directory.")
        # damaged weights are refused here, naming the user's model, not by the train step naming a scratch copy
        check_weight_headers(local, shown=f"model {source}")
        upload_dir(local, dest_uri, progress=False, exclude=[".cache", ".cache/*"])
    manifest = verify_prefix(dest_uri)  # what readers will see, not what we meant to write
    return {
        "source": source,
        "revision": commit,
        "uri": dest_uri,
        "manifest_digest": manifest_digest(manifest),
        "num_files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
        **read,
    }


def _fetch_s3_model(source: str, local: Path) -> dict[str, Any]:
    """Download the ``s3://`` model ``source`` into ``local``, whoever wrote it; what was read, for the
    artifact's metadata. One line naming the ``model`` parameter: exit 2 for a prefix that holds no model, 75
    for a store out of reach or a prefix rewritten during the read."""
    from rloo.models import check_model_prefix, model_files
    from rloo.storage.errors import prefixed
    from rloo.storage.prefix import fetch_prefix

    check_model_prefix("model", source, adapter=False)
    try:
        read = fetch_prefix(source, local, select=model_files)
    except UserError as e:
        raise prefixed(e, f"--model {source}") from None
    return {"source_files": [f.to_dict() for f in read.files], "source_manifest": read.manifest}


def _download_hub_model(api: Any, source: str, commit: str, local: Path) -> Path:
    from rloo.storage.progress import quiet_library_bars

    quiet_library_bars()  # a step's log is no terminal: no bars redrawn into one huge line
    return Path(api.snapshot_download(source, revision=commit, local_dir=local))


def _hf_api() -> Any:
    from huggingface_hub import HfApi

    return HfApi()


def resolve_hub_commit(repo_id: str, revision: str | None, hub_api: Any = None) -> str:
    """The commit SHA that ``revision`` (default: main) of Hub model ``repo_id`` points at now."""
    info = hub_model_info(repo_id, revision, hub_api or _hf_api())
    sha = getattr(info, "sha", None)
    if not sha:
        raise UserError(
            f"model {repo_id}: the Hugging Face Hub did not say which commit {revision or 'main'} is."
        )
    return str(sha)


def run(plan: PipelinePlan, run_id: str) -> StepResult:
    """Fetch the plan's SFT model to the run's ``sft/`` prefix; its record (:func:`fetch_model`) is the
    metadata of the step's ``Model`` artifact. A Hub id is pinned to one commit (``model_revision``, else
    main's commit now), recorded there."""
    layout = RunLayout(plan.run.output_uri, run_id)
    meta = fetch_model(plan.run.model, layout.sft, revision=plan.run.model_revision or None)
    return StepResult(model=meta, record=meta)
