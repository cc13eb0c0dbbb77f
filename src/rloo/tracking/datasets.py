"""A stage's dataset as an MLflow dataset input: what the runs table's Dataset column shows.

One entity per dataset split a stage read (:class:`rloo.data.DatasetRecord`): its name is the Hub id (or the
directory's or prefix's name) and the split, its digest the start of the content digest (the Hub commit for
a Hub dataset), its profile the split's row count and every file read (key, size, SHA-256, the store's ETag),
its source what MLflow's own dataset sources write (``hugging_face``: the Hub id, config, split and commit,
which ``mlflow.data`` can load again; ``s3`` or ``local``: the URI), and the input's ``mlflow.data.context``
tag says what the run did with it (``training``, ``evaluation``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rloo.data import DatasetRecord, dataset_record
from rloo.errors import UserError

log = logging.getLogger(__name__)

TRAINING = "training"
EVALUATION = "evaluation"
# MLflow's tag for how a run used a dataset input (mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT)
CONTEXT_TAG = "mlflow.data.context"

# The split parameter a stage's settings name its dataset's split with, and what the stage does with it.
_SPLIT_PARAMS = (("dataset_train_split", TRAINING), ("dataset_split", EVALUATION))


def _source(record: DatasetRecord) -> tuple[str, dict[str, Any]]:
    if record.kind == "hub":
        return "hugging_face", {
            "path": record.name,
            "config_name": record.config,
            "data_dir": None,
            "data_files": None,
            "split": record.split,
            "revision": record.digest,
        }
    if record.kind == "s3":
        return "s3", {"uri": record.source}
    return "local", {"uri": Path(record.source).as_uri()}


# MLflow's limit on a dataset profile (mlflow.utils.validation.MAX_DATASET_PROFILE_SIZE: a MEDIUMTEXT column)
MAX_PROFILE_CHARS = 16_777_215


def _profile(record: DatasetRecord) -> str:
    """Split, rows, digest and each file read (key, size, SHA-256, the store's ETag): what the run read,
    exactly. A file list beyond MLflow's limit keeps its first files and says how many it left out."""
    files = [f.to_dict() for f in record.files]
    profile: dict[str, Any] = {"split": record.split, "num_rows": record.num_rows, "digest": record.digest}
    if files:
        profile["files"] = files
    text = json.dumps(profile)
    while len(text) > MAX_PROFILE_CHARS:
        files = files[: len(files) // 2]
        profile |= {"files": files, "files_left_out": len(record.files) - len(files)}
        text = json.dumps(profile)
    return text


def dataset_entity(record: DatasetRecord, context: str) -> Any:
    """The ``mlflow.entities.DatasetInput`` of ``record``, tagged with ``context``."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    source_type, source = _source(record)
    dataset = Dataset(
        name=record.display_name,
        digest=record.short_digest,
        source_type=source_type,
        source=json.dumps(source),
        profile=_profile(record),
    )
    return DatasetInput(dataset, tags=[InputTag(CONTEXT_TAG, context)])


def dataset_input(params: Mapping[str, Any]) -> Any | None:
    """The dataset input a stage's settings name (``dataset_name``, ``dataset_config`` and its split
    parameter), as read in this process; None when they name none or it cannot be described (logged)."""
    name = params.get("dataset_name")
    if not name:
        return None
    found = [(params[p], context) for p, context in _SPLIT_PARAMS if params.get(p)]
    if not found:
        return None
    split, context = found[0]
    try:
        # flattened params carry an unset config as the text "None"
        config = params.get("dataset_config")
        config = None if config in (None, "", "None") else str(config)
        record = dataset_record(str(name), str(split), config=config)
    except UserError as e:
        log.warning("the run's dataset is not recorded in MLflow: %s", e)
        return None
    return dataset_entity(record, context)
