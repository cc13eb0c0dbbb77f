"""Config dicts as MLflow params: flattened, secrets redacted, keys and values within MLflow's limits."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import Any

from rloo.storage.redact import MASK, is_secret_name, redact

# MLflow's limits (mlflow.utils.validation): param values 6000 characters, keys 250.
MAX_PARAM_VALUE_LENGTH = 6000
MAX_KEY_LENGTH = 250
_TRUNCATED = "...[truncated]"
# MLflow accepts alphanumerics, underscores, dashes, periods, spaces, colons and slashes in names.
_BAD_KEY_CHARS = re.compile(r"[^\w\-. :/]")


def sanitize_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", str(key))[:MAX_KEY_LENGTH]


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, set)):
        try:
            return json.dumps(list(value), default=str, separators=(",", ":"))
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; secret-named keys masked, long values truncated."""
    out: dict[str, str] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten_params(v, prefix=f"{key}."))
            continue
        text = MASK if (is_secret_name(str(k)) and v not in (None, "")) else redact(_value_text(v))
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            text = text[: MAX_PARAM_VALUE_LENGTH - len(_TRUNCATED)] + _TRUNCATED
        out[sanitize_key(key)] = text
    return out


# ----------------------------------------------------------------------------------------------------
# Settings that say where a run reads or writes rather than how it trains or judges: its outputs, the local
# staging copies and their durable names, a served endpoint. They are kept as tags (TAG_LOCATION_PREFIX in
# rloo.tracking.tags), so that params hold settings only and the UI's "show diff only" between two runs
# shows what was set differently, not ten per-run paths.
LOCATION_FIELDS = frozenset(
    {"output_dir", "local_dir", "checkpoint_uri", "publish_uri", "model_source", "judge_base_url"}
)


def is_location(key: str, value: str, run_ids: Collection[str] = ()) -> bool:
    """Whether flattened param ``key`` = ``value`` is a location, not a setting: a field of
    :data:`LOCATION_FIELDS`, an HTTP(S) endpoint, or a path inside one of ``run_ids``' own directories
    (``<output_uri>/<run id>/sft``: the pipeline's per-run copy of a model). A dataset or reward model path
    the same for every run stays a setting."""
    if key.rsplit(".", 1)[-1] in LOCATION_FIELDS:
        return True
    if value.startswith(("http://", "https://")):
        return True
    if run_ids and "/" in value:
        parts = set(value.split("/"))
        return any(run_id in parts for run_id in run_ids)
    return False


def split_locations(
    flat: Mapping[str, str], run_ids: Collection[str] = ()
) -> tuple[dict[str, str], dict[str, str]]:
    """``flat`` (flattened params) as (settings, locations); unset locations (``None``, empty) are left out."""
    settings: dict[str, str] = {}
    locations: dict[str, str] = {}
    for key, value in flat.items():
        if not is_location(key, value, run_ids):
            settings[key] = value
        elif value not in ("", "None"):
            locations[key] = value
    return settings, locations


# ----------------------------------------------------------------------------------------------------
# What names a training run: these settings, as short labels, when they differ from the training defaults (at
# most NAME_SETTINGS_MAX of them, in this order); the full list of changed settings is in the description.
NAME_SETTINGS = (
    ("learning_rate", "lr"),
    ("rloo_k", "k"),
    ("kl_coef", "kl"),
    ("seed", "seed"),
    ("total_episodes", "episodes"),
    ("use_peft", "lora"),
)
NAME_SETTINGS_MAX = 4
# Settings of the training config that describe the bookkeeping of a run, not the training: never "changed".
_BOOKKEEPING = frozenset(
    {
        "exp_name",
        "run_name",
        "report_to",
        "disable_tqdm",
        "logging_steps",
        "num_sample_generations",
        "save_steps",
        "save_total_limit",
        "resume_from_checkpoint",
        "preemption_grace_seconds",
        "overwrite_output_dir",
    }
)
# The model, the data and the reward have their own lines in a description
_SOURCES = ("model_name_or_path", "sft_model_path", "dataset_name", "reward_model_path", "reward_funcs")


def training_defaults() -> dict[str, str]:
    """The training config's defaults as flattened param text (what a run that left them logs)."""
    import dataclasses

    from rloo.config import RLOOConfig

    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(RLOOConfig):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return flatten_params(defaults)


def changed_settings(settings: Mapping[str, str], defaults: Mapping[str, str]) -> dict[str, str]:
    """The training settings of ``settings`` that differ from ``defaults``, the naming ones first."""
    first = [key for key, _ in NAME_SETTINGS if key in settings]
    rest = [key for key in settings if key not in first]
    return {
        key: settings[key]
        for key in first + rest
        if key in defaults
        and settings[key] != defaults[key]
        and key not in _BOOKKEEPING
        and key not in _SOURCES
        and not is_location(key, settings[key])
    }


def compact_number(text: str) -> str:
    """``"0.0005"`` -> ``"5e-4"``, ``"0.01"`` -> ``"0.01"``, ``"4"`` -> ``"4"``: the shorter spelling."""
    if re.fullmatch(r"-?\d+", text):
        return text
    try:
        value = float(text)
    except ValueError:
        return text
    plain = f"{value:g}".replace("e-0", "e-").replace("e+0", "e+")
    mantissa, exponent = f"{value:e}".split("e")
    sci = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return sci if len(sci) < len(plain) else plain


def human_count(text: str) -> str | None:
    """``"165632"`` -> ``"166K"``, ``"494032768"`` -> ``"494M"``; None if not a count."""
    try:
        n = int(text)
    except ValueError:
        return None
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def model_short_name(
    settings: Mapping[str, str], locations: Mapping[str, str], run_ids: Collection[str] = ()
) -> str:
    """The model a run trained, in a word: the last part of its source (``Qwen/Qwen2.5-0.5B`` ->
    ``Qwen2.5-0.5B``), or its size (``166K-param``) when the source is only a per-run copy (the pipeline's
    ``<output_uri>/<run id>/sft``, whose name says nothing)."""
    for key in ("model_source", "model_name_or_path"):
        source = locations.get(key) or settings.get(key) or ""
        if source in ("", "None"):
            continue
        if not set(source.split("/")) & set(run_ids):
            return source.rstrip("/").rsplit("/", 1)[-1]
        break
    size = human_count(settings.get("model/total_params", ""))
    return f"{size}-param" if size else ""


def run_label(
    settings: Mapping[str, str],
    locations: Mapping[str, str],
    *,
    suffix: str,
    run_ids: Collection[str] = (),
    defaults: Mapping[str, str] | None = None,
    first: Collection[str] = (),
) -> str:
    """A training run's name that says what differs, the settings first (what the runs table, a chart's
    legend and the runs list beside the charts show of a long name): ``lr=5e-4 k=4 on Qwen2.5-0.5B
    (1a2b3c4d)``. ``first``: the settings that tell this run from the others it is compared with
    (:func:`distinguishing_settings`), named before the ones merely changed from the defaults, so that
    two runs that differ only in their seed read ``seed=1 lr=5e-4 ...`` and ``seed=2 lr=5e-4 ...``."""
    changed = changed_settings(settings, training_defaults() if defaults is None else defaults)
    labels = dict(NAME_SETTINGS)
    leading = [key for key in (*labels, *sorted(first)) if key in first and key in settings]
    rest = [key for key in labels if key in changed and key not in leading]
    shown = [
        _setting_label(labels.get(key, key), settings[key])
        for key in dict.fromkeys(leading + rest)
        if key in leading or changed[key] != "False"
    ][: max(NAME_SETTINGS_MAX, len(leading))]
    model = model_short_name(settings, locations, run_ids)
    words = [*(shown or ["defaults"]), *(["on", model] if model else []), f"({suffix})"]
    return " ".join(words)


def _setting_label(label: str, value: str) -> str:
    """``lr=5e-4``; a switch by its label alone when on (``lora``), ``lora=off`` when off."""
    if value == "True":
        return label
    if value == "False":
        return f"{label}=off"
    return f"{label}={compact_number(value)}"


def distinguishing_settings(runs: Collection[Mapping[str, str]]) -> set[str]:
    """The training settings whose values are not the same in all of ``runs`` (their settings, flattened
    params), the bookkeeping, sources and locations aside (:func:`changed_settings`'s rules); a setting a
    run does not have counts as a value of its own."""
    keys = {key for run in runs for key in run}
    return {
        key
        for key in keys
        if len({run.get(key) for run in runs}) > 1
        and key not in _BOOKKEEPING
        and key not in _SOURCES
        and not key.startswith("model/")
        and not any(is_location(key, run[key]) for run in runs if key in run)
    }
