"""The validate step refuses, before any GPU is requested, what a later step would only meet after minutes or
hours: a local SFT model whose weights are damaged (read by their headers, as safetensors' own reader does:
huggingface/safetensors ``safetensors/src/tensor.rs``), named by the user's path, and an output store out of
reach kept as exit 75, the status a retry may heal (botocore ``botocore/retries/standard.py`` gives up on a
connection error after its attempts; a later attempt of the step may find the store back)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.stages.validate import build_plan, check_storage_access
from tests.fixtures.servers import free_port
from tests.stages.test_validate import good


def test_a_damaged_local_sft_model_is_refused_by_its_path(tiny_setup: TinySetup, tmp_path: Path) -> None:
    sft = tmp_path / "sft"
    shutil.copytree(tiny_setup.policy, sft)
    build_plan(good(model=str(sft)), check_paths=True)  # the sound copy passes
    weights = sft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    with pytest.raises(UserError) as err:
        build_plan(good(model=str(sft)), check_paths=True)
    assert err.value.exit_code == 2
    assert str(err.value).startswith(f"model {sft}: model.safetensors is not readable safetensors"), err.value


def test_an_output_store_out_of_reach_exits_75(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(UserError) as err:
        check_storage_access("s3://bucket/runs", what="output_uri")
    assert err.value.exit_code == 75, err.value
    assert str(err.value).startswith("output_uri: ")
