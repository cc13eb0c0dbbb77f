"""The Hub adapter, tested by the calls it would make (no network): a fake HfApi records them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.push.hub import upload_to_hub
from tests.push.conftest import FakeHfApi

TOKEN = "hf_secret_token_0123456789"


def test_creates_private_repo_then_uploads_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (tmp_path / "README.md").write_text("card")
    api = FakeHfApi()
    out = upload_to_hub(tmp_path, "org/model", private=True, commit_message="rloo push k", api=api)
    assert [name for name, _ in api.calls] == ["create_repo", "upload_folder"]
    assert api.calls[0][1] == {
        "repo_id": "org/model",
        "repo_type": "model",
        "private": True,
        "exist_ok": True,  # re-runs reuse the repo
        "token": TOKEN,
    }
    assert api.calls[1][1] == {
        "repo_id": "org/model",
        "repo_type": "model",
        "folder_path": str(tmp_path),
        "commit_message": "rloo push k",
        "token": TOKEN,
    }
    assert out == {"repo_id": "org/model", "url": "https://huggingface.co/org/model", "commit": "c0ffee"}


def test_missing_token_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    api = FakeHfApi()
    with pytest.raises(UserError, match="set HF_TOKEN"):
        upload_to_hub(tmp_path, "org/model", private=True, commit_message="m", api=api)
    assert api.calls == []


def test_failure_is_one_line_without_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(UserError, match="Hub upload to org/model failed") as e:
        upload_to_hub(
            tmp_path, "org/model", private=False, commit_message="m", api=FakeHfApi(fail_upload=True)
        )
    assert TOKEN not in str(e.value) and "\n" not in str(e.value)


def test_default_client_is_huggingface_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an injected api the real HfApi is built with the token (its methods are stubbed: no network)."""
    import huggingface_hub

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    seen: dict[str, object] = {}
    monkeypatch.setattr(
        huggingface_hub.HfApi, "create_repo", lambda self, **kw: seen.update(token=self.token)
    )
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: None)
    out = upload_to_hub(tmp_path, "org/model", private=True, commit_message="m")
    assert seen == {"token": TOKEN} and out["commit"] is None
