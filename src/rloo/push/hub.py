"""Hugging Face Hub upload: a thin adapter over ``huggingface_hub.HfApi`` (tests inject a recording fake).

Everything that could go wrong in *our* code (which folder, which repo, private or not, which token) is
decided here in plain Python; the HfApi calls themselves are two lines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rloo.errors import ServiceUnavailable, UserError
from rloo.push.config import HF_TOKEN_ENV
from rloo.storage.redact import redact


def hub_token() -> str:
    token = os.environ.get(HF_TOKEN_ENV, "").strip()
    if not token:
        raise UserError(
            f"--hub_repo_id needs a Hub token: set {HF_TOKEN_ENV} (a write token), or drop the flag."
        )
    return token


def upload_to_hub(
    folder: str | Path, repo_id: str, *, private: bool, commit_message: str, api: Any = None
) -> dict[str, str | None]:
    """Create ``repo_id`` if missing (``private`` applies only then) and upload ``folder`` as one commit.

    Returns the repo URL and commit id. Re-uploading identical files changes nothing on the Hub (it
    compares file hashes), which keeps a re-run idempotent.
    """
    token = hub_token()
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    try:
        repo = api.create_repo(
            repo_id=repo_id, repo_type="model", private=private, exist_ok=True, token=token
        )
        commit = api.upload_folder(
            repo_id=repo_id,
            repo_type="model",
            folder_path=str(folder),
            commit_message=commit_message,
            token=token,
        )
    except UserError:
        raise
    except Exception as e:  # HfHubHTTPError, connection errors: one line, token never shown
        from rloo.storage.hub import hub_error

        unreachable = hub_error(e, f"Hub upload to {repo_id}")
        if isinstance(unreachable, ServiceUnavailable):  # exit 75: a retried push step may get through
            raise unreachable from None
        raise UserError(
            f"Hub upload to {repo_id} failed ({redact(' '.join(str(e).split()), [token])[:200]}); check "
            f"{HF_TOKEN_ENV} has write access and the network reaches the Hub."
        ) from None
    return {
        "repo_id": repo_id,
        "url": str(getattr(repo, "url", repo) or ""),
        "commit": getattr(commit, "oid", None),
    }
