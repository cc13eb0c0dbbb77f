"""Keep credentials out of logs, error messages, MLflow params and artifacts.

Three kinds of leaks are covered: values of secret-looking environment variables (``AWS_SECRET_ACCESS_KEY``,
``MLFLOW_TRACKING_PASSWORD``, ``HF_TOKEN``, ...) appearing anywhere in a text, ``user:password@`` in URLs,
and signed-URL query parameters (``X-Amz-Signature``, ``X-Amz-Credential``, ...).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

MASK = "***"

# Names (env vars, config keys) whose values are credentials. "key" alone is too broad (reward keys,
# metric keys); access keys are matched explicitly. "token" only as the last word of a name (HF_TOKEN,
# hub_token, AWS_SESSION_TOKEN): max_new_tokens, token_level_kl and stop_token are settings, and a name
# ending in _env (judge_api_key_env) holds the name of a variable, not its value.
SECRET_NAME_RE = re.compile(
    r"(secret|passw(or)?d|passwd|api[_-]?key|access[_-]?key|credential|private[_-]?key|authorization"
    r"|(^|[_.\-])token$)",
    re.IGNORECASE,
)
_NOT_SECRET_RE = re.compile(r"(_env$|(^|_)(stop|pad|eos|bos|unk|sep|cls|mask)_token$)", re.IGNORECASE)
_URL_USERINFO_RE = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^/@\s]+)@")
_SIGNED_QUERY_RE = re.compile(
    r"(?i)\b(X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature|AWSAccessKeyId|access_token|token)"
    r"=([^&\s\"'<>]+)"
)
# Secret values shorter than this are not substring-replaced: masking every "1" or "true" in a text would
# make messages unreadable, and such values are not credentials anyway.
_MIN_SECRET_LEN = 6


def is_secret_name(name: str) -> bool:
    """True for names like ``AWS_SECRET_ACCESS_KEY``, ``hub_token`` or ``db.password``; False for settings
    that merely mention tokens (``max_new_tokens``, ``stop_token``) or name a variable (``*_env``)."""
    return bool(SECRET_NAME_RE.search(name)) and not _NOT_SECRET_RE.search(name)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-looking environment variables, longest first (so substrings mask last)."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if is_secret_name(k) and len(v) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact(text: str, extra_secrets: Iterable[str] = ()) -> str:
    """``text`` with credentials replaced by ``***``."""
    out = _URL_USERINFO_RE.sub(lambda m: f"{m['scheme']}{MASK}@", str(text))
    out = _SIGNED_QUERY_RE.sub(lambda m: f"{m[1]}={MASK}", out)
    secrets = [s for s in extra_secrets if s and len(s) >= _MIN_SECRET_LEN]
    for value in sorted({*secrets, *secret_values()}, key=len, reverse=True):
        out = out.replace(value, MASK)
    return out


def redact_url(url: str | None) -> str:
    """An endpoint URL safe to print (``None`` prints as the AWS default)."""
    return "the AWS default endpoint" if not url else redact(url)
