"""Config dicts as MLflow params: flattened, secrets redacted, keys and values within MLflow's limits."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
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
