"""The names and descriptions of MLflow runs.

A pipeline's parent run is named after what was set (``lr=5e-4 k=4 on Qwen2.5-0.5B (1a2b3c4d)``, see
:func:`rloo.tracking.params.run_label`) unless its KFP run name was given by the user (not a generated
``<pipeline>-<timestamp>`` one) or the training config has a ``run_name``; its stage runs are named after it
(``<pipeline run's name> · train``). A description (``mlflow.note.content``) says what a run was given; a
name or description someone changed in the UI is never overwritten.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from rloo.tracking.params import (
    changed_settings,
    distinguishing_settings,
    human_count,
    run_label,
    training_defaults,
)
from rloo.tracking.tags import (
    TAG_GENERATED_NAME,
    TAG_KFP_RUN_NAME,
    TAG_KIND,
    TAG_NOTE,
    TAG_NOTE_DIGEST,
    TAG_PARENT,
    TAG_PIPELINE_RUN_ID,
    TAG_STAGE,
    TRAIN_STAGE,
    digest,
    filter_value,
    pipeline_ids,
    stage_settings,
)

# What KFP and 'rloo pipeline submit' call a run nobody named: '<pipeline>-<date>-<time>[-<micros>]',
# the KFP UI's 'Run of <pipeline> (<5 hex>)'.
_GENERATED_KFP_NAME = re.compile(
    r".+-\d{4}-?\d{2}-?\d{2}-\d{2}-?\d{2}-?\d{2}(-\d+)?|Run of .+ \([0-9a-f]{5}\)"
)
# How a stage run nested under a pipeline run is named: '<pipeline run's name> · train', so that a chart
# legend or a list of runs says whose stage it is.
STAGE_NAME_SEPARATOR = " · "


def stage_run_name(parent_name: str | None, stage: str) -> str:
    """The name of a pipeline run's stage run: ``lr=5e-4 k=4 ... (1a2b3c4d) · train``."""
    return f"{parent_name}{STAGE_NAME_SEPARATOR}{stage}" if parent_name else stage


def is_generated_kfp_name(name: str | None) -> bool:
    """Whether a KFP run name is one nobody chose (a timestamp): see :data:`_GENERATED_KFP_NAME`."""
    return bool(name) and _GENERATED_KFP_NAME.fullmatch(str(name)) is not None


def _user_run_name(settings: Mapping[str, str]) -> str | None:
    name = settings.get("run_name")
    return name if name not in (None, "", "None") else None


def _rename(client: Any, run: Any, name: str, replaceable: set[str]) -> bool:
    """Name ``run`` ``name`` if it still has a name rloo gave it or one of ``replaceable``; whether it has
    ``name`` now."""
    current = run.info.run_name
    if current == name:
        return True
    if current in replaceable or current == run.data.tags.get(TAG_GENERATED_NAME):
        client.update_run(run.info.run_id, name=name)
        client.set_tag(run.info.run_id, TAG_GENERATED_NAME, name)
        return True
    return False


def _rename_pipeline_run(client: Any, parent: Any, name: str, replaceable: set[str]) -> None:
    """Name a pipeline's parent run ``name`` (as :func:`_rename`) and its stage runs after it, those that
    still have the name rloo gave them (or their stage's)."""
    if not _rename(client, parent, name, replaceable):
        name = parent.info.run_name  # the user's: the stages are named after it all the same
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{TAG_PARENT}` = '{filter_value(parent.info.run_id)}'",
        max_results=200,
    )
    for child in children:
        stage = child.data.tags.get(TAG_STAGE)
        if stage:
            _rename(client, child, stage_run_name(name, stage), {stage})


# Peers a run's name is told apart from: the latest training runs of its experiment.
_MAX_PEERS = 50


def _training_peers(client: Any, experiment_id: str) -> list[Any]:
    """The latest training runs of an experiment (a pipeline's train stage, or a training run alone)."""
    return list(
        client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{TAG_STAGE}` = '{TRAIN_STAGE}'",
            order_by=["attributes.start_time DESC"],
            max_results=_MAX_PEERS,
        )
    )


def _peer_label(run: Any, parent: Any | None, first: set[str]) -> str | None:
    """The name a training run's peer (its train run ``run``, its pipeline's parent run ``parent``) gets
    among runs that differ in ``first``; None where its user named it."""
    tags = (parent or run).data.tags
    kfp_id = tags.get(TAG_PIPELINE_RUN_ID)
    settings, locations = stage_settings(run, [kfp_id] if kfp_id else [])
    if _user_run_name(settings):
        return None
    suffix = (kfp_id or parent.info.run_id)[:8] if parent is not None else run.info.run_id[:8]
    return run_label(settings, locations, suffix=suffix, run_ids=[kfp_id] if kfp_id else [], first=first)


def name_apart(client: Any, experiment_id: str, settings: Mapping[str, str], me: str) -> set[str]:
    """The training settings that tell the runs of an experiment apart (:func:`distinguishing_settings`
    over ``settings``, the run being named, and its peers, :func:`_training_peers`), and the peers renamed
    to start with them too, those that still have the name rloo gave them: two runs compared side by side
    read differently in the first words of their names. ``me``: the run being named (its train run or its
    parent run), not a peer."""
    peers = [
        r
        for r in _training_peers(client, experiment_id)
        if me not in (r.info.run_id, r.data.tags.get(TAG_PARENT))
    ]
    first = distinguishing_settings(
        [dict(settings), *(stage_settings(r, pipeline_ids(r.data.tags))[0] for r in peers)]
    )
    if not first:
        return first
    parent_ids = {r.data.tags[TAG_PARENT] for r in peers if r.data.tags.get(TAG_PARENT)}
    parents = {}
    if parent_ids:
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{TAG_KIND}` = 'pipeline'",
            order_by=["attributes.start_time DESC"],
            max_results=_MAX_PEERS * 2,
        )
        parents = {p.info.run_id: p for p in found if p.info.run_id in parent_ids}
    for run in peers:
        parent = parents.get(run.data.tags.get(TAG_PARENT, ""))
        if run.data.tags.get(TAG_PARENT) and parent is None:
            continue  # its pipeline run is gone, or older than the ones looked at
        label = _peer_label(run, parent, first)
        target = parent or run
        if label is None or label == target.info.run_name:
            continue
        if target.info.run_name != target.data.tags.get(TAG_GENERATED_NAME):
            continue  # named by its user (or renamed in the UI)
        if parent is not None:
            _rename_pipeline_run(client, parent, label, set())
        else:
            _rename(client, run, label, set())
    return first


def _describe(client: Any, run: Any, text: str) -> None:
    """Set ``run``'s description to ``text`` unless someone wrote it another one."""
    from mlflow.entities import RunTag

    current = run.data.tags.get(TAG_NOTE)
    if current == text or (current and digest(current) != run.data.tags.get(TAG_NOTE_DIGEST)):
        return
    client.log_batch(run.info.run_id, tags=[RunTag(TAG_NOTE, text), RunTag(TAG_NOTE_DIGEST, digest(text))])


def training_note(settings: Mapping[str, str], locations: Mapping[str, str]) -> list[str]:
    """Markdown lines of a description saying what a training run was given."""

    def code(value: str) -> str:
        return f"`{value}`"

    changed = changed_settings(settings, training_defaults())
    lines = [
        "- Training, changed from the defaults: "
        + (", ".join(code(f"{k}={v}") for k, v in changed.items()) or "nothing")
    ]
    model = (
        locations.get("model_source")
        or settings.get("model_name_or_path")
        or locations.get("model_name_or_path")
    )
    size = human_count(settings.get("model/total_params", ""))
    if model:
        lines.append(f"- Model: {code(model)}" + (f", {size} parameters" if size else ""))
    if settings.get("dataset_name") not in (None, "None"):
        split = settings.get("dataset_train_split", "train")
        lines.append(f"- Prompts: {code(settings['dataset_name'])}, split {code(split)}")
    rewards = (
        [settings["reward_model_path"]] if settings.get("reward_model_path") not in (None, "None") else []
    )
    try:
        funcs = json.loads(settings.get("reward_funcs") or "[]")
    except ValueError:
        funcs = [settings["reward_funcs"]]
    rewards += [str(f) for f in funcs] if isinstance(funcs, list) else []
    if rewards:
        lines.append("- Reward: " + ", ".join(code(r) for r in rewards))
    output = locations.get("publish_uri") or locations.get("output_dir")
    if output:
        lines.append(f"- Trained model: {code(output)}")
    return lines


def describe_pipeline_run(
    client: Any,
    parent_run_id: str,
    *,
    train: tuple[Mapping[str, str], Mapping[str, str]] | None = None,
    evaluation: Mapping[str, str] | None = None,
) -> None:
    """Name a pipeline's parent run after its training settings (``train``: the train run's settings and
    locations) unless the user named it, and describe it: training, evaluation (``evaluation``: the eval
    run's settings) and KFP run. Called when training starts and again when the pipeline run closes."""
    parent = client.get_run(parent_run_id)
    tags = parent.data.tags
    kfp_id, kfp_name = tags.get(TAG_PIPELINE_RUN_ID), tags.get(TAG_KFP_RUN_NAME)
    run_ids = [kfp_id] if kfp_id else []
    if train is not None:
        settings, locations = train
        name = _user_run_name(settings) or run_label(
            settings,
            locations,
            suffix=(kfp_id or parent_run_id)[:8],
            run_ids=run_ids,
            first=name_apart(client, parent.info.experiment_id, settings, parent_run_id),
        )
        replaceable = {f"pipeline-{(kfp_id or '')[:8]}"}
        if kfp_name and is_generated_kfp_name(kfp_name):
            replaceable.add(kfp_name)
        _rename_pipeline_run(client, parent, name, replaceable)
    lines = training_note(*train) if train is not None else []
    if evaluation is not None:
        judge, data = evaluation.get("judge_model", "?"), evaluation.get("dataset_name", "?")
        split, n = evaluation.get("dataset_split", "test"), evaluation.get("num_examples", "None")
        rows = "all rows" if n in ("None", "0", "") else f"first {n} rows"
        lines.append(f"- Evaluation: judge `{judge}` on `{data}`, split `{split}`, {rows}")
    if kfp_id:
        lines.append(f"- KFP run: `{kfp_name or '?'}` (id `{kfp_id}`)")
    if lines:
        _describe(client, client.get_run(parent_run_id), "\n".join(lines))


def describe_training_run(
    client: Any,
    run_id: str,
    settings: Mapping[str, str],
    locations: Mapping[str, str],
    *,
    keep_name: bool = False,
) -> None:
    """Name a training run that is not part of a pipeline after its settings (unless ``keep_name``: its
    caller named it, or the config's ``run_name`` did) and describe it."""
    run = client.get_run(run_id)
    if not keep_name:
        first = name_apart(client, run.info.experiment_id, settings, run_id)
        name = _user_run_name(settings) or run_label(settings, locations, suffix=run_id[:8], first=first)
        _rename(client, run, name, {TRAIN_STAGE})
        run = client.get_run(run_id)
    _describe(client, run, "\n".join(training_note(settings, locations)))
