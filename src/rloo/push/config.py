"""Configuration of the push stage (``rloo push``): what to publish, where, and the promotion margin.

Same conventions as :class:`rloo.config.RLOOConfig`: every field has a one-line help string, and a bad value
raises a one-line :class:`rloo.errors.UserError` naming the field, at construction.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from rloo.errors import UserError
from rloo.options import Exposed, check_fields, in_range, option

HF_TOKEN_ENV = "HF_TOKEN"
_HUB_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*/[A-Za-z0-9][A-Za-z0-9._\-]*$")
# MLflow accepts most names, but '/' and ':' break models:/ URIs and filter strings.
_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\- ]*$")


@dataclass
class PushConfig:
    """Everything ``rloo push`` needs. Every target is optional; with none set only the gate runs."""

    model_path: str | None = option(
        None, "Trained model: the output_dir of 'rloo train', or an s3:// prefix of one (with its manifest)."
    )
    eval_results: str | None = option(
        None,
        "eval_results.json of the evaluation stage (local path or s3://.../eval_results.json); without it "
        "the model can only be a candidate.",
    )
    output_dir: str = option("push_output", "Where push_result.json and the staged files are written.")
    run_id: str | None = option(
        None,
        "Identity of this push for idempotency and the versioned prefix (default: KFP_RUN_ID, else a digest "
        "of the model files).",
    )
    storage_uri: str | None = option(
        None, "s3://bucket/prefix (or a directory): the model is published at <storage_uri>/<run_id>/."
    )
    production_uri: str | None = option(
        None,
        "s3://bucket/prefix (or a directory) where a promoted model (champion) is copied.",
        pipeline=Exposed("production_uri", help="Where a promoted model is copied (empty: nowhere)."),
    )
    registered_model_name: str | None = option(
        None,
        "MLflow Model Registry name to register a version under (needs MLFLOW_TRACKING_URI; default: the MLflow "
        "experiment's name, e.g. 'rloo').",
        pipeline=Exposed(
            "registered_model_name",
            help="MLflow Model Registry name (empty: named after mlflow_experiment).",
        ),
    )
    register_model: bool = option(
        True,
        "Register a version in the MLflow Model Registry whenever MLFLOW_TRACKING_URI is set (false: log the "
        "push run only).",
        pipeline=Exposed(
            "register_model",
            help="Register a version when the MLflow secret names a tracking server (False: do not).",
        ),
    )
    mlflow_experiment: str | None = option(
        None, "MLflow experiment of the push run (default: MLFLOW_EXPERIMENT_NAME, else 'rloo')."
    )
    mlflow_parent_run_id: str | None = option(
        None, "MLflow pipeline (parent) run id to nest the push run under (default: found from KFP_RUN_ID)."
    )
    mlflow_train_run_id: str | None = option(None, "MLflow run id of the training stage, for the lineage.")
    hub_repo_id: str | None = option(
        None,
        "Hugging Face Hub repo 'owner/name' to upload a promoted model to (token from HF_TOKEN).",
        pipeline=Exposed(
            "hub_repo_id",
            help="Hugging Face Hub repo 'owner/name' for a promoted model (empty: not uploaded).",
        ),
    )
    hub_private: bool = option(True, "Create the Hub repo private (only applies when it does not exist yet).")
    hub_push_candidates: bool = option(
        False, "Also upload models that were not promoted to the Hub (default: champions only)."
    )
    promotion_margin: float = option(
        0.0,
        "Promote only if the lower bound of the 95 percent interval of the paired win-rate difference (trained "
        "minus SFT, and challenger minus champion) is above this.",
        pipeline="promotion_margin",
        check=in_range(-1, 1, open_high=True),
        hint=": it is a difference of win rates",
    )
    compare_to_champion: bool = option(
        True,
        "Promote only a model that also beats the current champion on the same examples and judge (false: the "
        "comparison with SFT alone decides).",
        pipeline="compare_to_champion",
    )
    base_model: str | None = option(
        None,
        "Base (SFT) model named in the model card: a Hub id or the store URI it was fetched to (default: the "
        "training config's model, which is a local path when training ran on a copy).",
    )
    base_model_revision: str | None = option(
        None,
        "Hub commit of the base model the training started from, shown in the model card (pinned fetch).",
    )
    model_name: str | None = option(
        None, "Name shown in the model card (default: registered_model_name, hub repo, or the directory)."
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.model_path:
            raise UserError(
                "--model_path is required: give the output_dir of 'rloo train' or its s3:// prefix."
            )
        from rloo.storage.location import require_local_path, require_not_file

        require_local_path("--output_dir", self.output_dir, "it holds push_result.json and the staged files.")
        require_not_file("--output_dir", self.output_dir)
        check_fields(self)  # each field's declared rule
        if self.hub_repo_id is not None and not _HUB_REPO_RE.match(self.hub_repo_id):
            raise UserError(f"--hub_repo_id must look like 'owner/name' (got {self.hub_repo_id!r}).")
        if self.registered_model_name is not None and not _MODEL_NAME_RE.match(self.registered_model_name):
            raise UserError(
                f"--registered_model_name {self.registered_model_name!r} is not usable: use letters, digits, "
                "'.', '_', '-' and spaces."
            )
        if self.run_id is not None and not run_key(self.run_id):
            raise UserError(f"--run_id {self.run_id!r} has no usable characters: use letters and digits.")
        if self.registered_model_name and not self.register_model:
            raise UserError(
                "--registered_model_name names a registry model but --register_model is false: drop one of them."
            )
        for name in ("storage_uri", "production_uri"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise UserError(f"--{name} is empty: give s3://bucket/prefix or a directory, or drop it.")
        if (
            self.storage_uri
            and self.production_uri
            and self.storage_uri.rstrip("/") == self.production_uri.rstrip("/")
        ):
            raise UserError(
                "--production_uri must differ from --storage_uri: versions live below storage_uri, the "
                "champion is copied to production_uri."
            )

    def model_registry_name(self, *, tracking: bool) -> str | None:
        """The registered model to create a version of: None when not registering (opted out, or no
        tracking server), else ``registered_model_name`` or the MLflow experiment's name made usable."""
        if not self.register_model or not tracking:
            return None
        if self.registered_model_name:
            return self.registered_model_name
        from rloo.tracking.experiment import DEFAULT_EXPERIMENT, EXPERIMENT_ENV

        experiment = self.mlflow_experiment or os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT
        return re.sub(r"[^A-Za-z0-9._\- ]+", "-", experiment).strip("-. ") or DEFAULT_EXPERIMENT

    def check_tracking(self) -> None:
        """An explicit registry name without a tracking server is a mistake the user must hear about. Checked
        when the push runs, not at construction: the pipeline validates parameters in a pod without the
        MLflow secret."""
        if self.registered_model_name and not os.environ.get("MLFLOW_TRACKING_URI"):
            raise UserError(
                "--registered_model_name needs a tracking server: set MLFLOW_TRACKING_URI (or drop the flag)."
            )


def run_key(text: str) -> str:
    """``text`` as one safe path segment / tag value: [A-Za-z0-9._-], at most 128 characters."""
    return re.sub(r"[^A-Za-z0-9._\-]+", "-", text.strip()).strip("-.")[:128]
