from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rloo.demo.tiny import build_tiny_setup
from rloo.errors import UserError
from rloo.models import load_causal_lm, load_tokenizer
from rloo.training.checkpoint import (
    _load_state,
    checkpoint_problem,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    set_rng_states,
)
from tests.fixtures.planted import plant


@pytest.fixture(scope="module", params=["gpt_neox", "qwen2"])  # qwen2 ties lm_head to the embeddings
def parts(request, tmp_path_factory: pytest.TempPathFactory):
    setup = build_tiny_setup(tmp_path_factory.mktemp(request.param), arch=request.param)
    model = load_causal_lm(str(setup.policy), flag="model_name_or_path")
    tok = load_tokenizer(str(setup.policy))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    # one real step so the optimizer and scheduler have state worth restoring
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    sched.step()
    return model, tok, opt, sched


def _save(parts, out: Path, update: int, **kw) -> Path:
    model, tok, opt, sched = parts
    return save_checkpoint(
        out, update, model=model, tokenizer=tok, optimizer=opt, scheduler=sched,
        state={"update": update}, config={"seed": 1}, **kw,
    )  # fmt: skip


def test_roundtrip_restores_weights_optimizer_and_scheduler(parts, tmp_path: Path) -> None:
    model, _, opt, sched = parts
    path = _save(parts, tmp_path, 7)
    assert checkpoint_problem(path) is None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters() if p in opt.state}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # wreck everything
    opt.state.clear()
    sched.last_epoch = 99
    state = load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    assert state == {"update": 7}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sched.last_epoch == 1
    restored = {id(p): opt.state[p]["exp_avg"] for p in model.parameters() if p in opt.state}
    assert restored.keys() == exp_avg.keys() and all(torch.equal(exp_avg[i], restored[i]) for i in exp_avg)


def test_truncated_checkpoint_is_skipped_with_a_warning(parts, tmp_path: Path, caplog) -> None:
    _save(parts, tmp_path, 1)
    newest = _save(parts, tmp_path, 2)
    weights = next(newest.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # what a full disk or a killed copy leaves
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    assert "skipping" in caplog.text and "checkpoint-2" in caplog.text and "bytes" in caplog.text


def test_unfinished_and_tampered_checkpoints_are_refused(parts, tmp_path: Path) -> None:
    good = _save(parts, tmp_path, 3)
    # a temp dir from a save that died is never a candidate
    (tmp_path / ".checkpoint-4.tmp").mkdir()
    # a directory without a manifest (never completed) is refused
    (tmp_path / "checkpoint-5").mkdir()
    assert checkpoint_problem(tmp_path / "checkpoint-5") == "no manifest (it was never completed)"
    (tmp_path / "checkpoint-5" / "checkpoint_manifest.json").write_text("{}")  # the format before this one
    assert "older rloo" in (checkpoint_problem(tmp_path / "checkpoint-5") or "")
    assert [u for u, _ in list_checkpoints(tmp_path)] == [5, 3]
    assert latest_checkpoint(tmp_path) == good
    # a small state file changed in place (same size) fails its checksum
    state = good / "trainer_state.json"
    state.write_text(state.read_text().replace("3", "9"))
    assert (checkpoint_problem(good) or "").startswith("trainer_state.json fails its SHA-256 check")
    assert latest_checkpoint(tmp_path) is None


def test_total_limit_keeps_the_newest(parts, tmp_path: Path) -> None:
    for u in (1, 2, 3, 4):
        _save(parts, tmp_path, u, total_limit=2)
    assert [u for u, _ in list_checkpoints(tmp_path)] == [4, 3]


def test_state_files_load_with_weights_only_and_restore_every_rng(parts, tmp_path: Path) -> None:
    import random

    import numpy as np

    path = _save(parts, tmp_path, 1)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pt"):
        torch.load(path / name, weights_only=True)  # plain torch: no globals allowlisted
    draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_states(torch.load(path / "rng_state.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == draws


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pt"])
def test_planted_pickle_is_refused_and_never_runs(parts, tmp_path: Path, name: str) -> None:
    model, _, opt, sched = parts
    path = _save(parts, tmp_path / "out", 2)
    marker = tmp_path / "marker"
    planted = plant(path, name, marker)
    assert checkpoint_problem(path) is None  # the manifest was rewritten to match: only loading can tell
    with pytest.raises(UserError) as info:
        load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    msg = str(info.value)
    assert msg.startswith(f"cannot resume from {path}: {name} holds more than tensors"), msg
    assert "(it names getattr)" in msg and "--resume_from_checkpoint none" in msg and "\n" not in msg
    assert not marker.exists()
    # the plant is real: an unrestricted load runs it
    torch.load(planted, weights_only=False)
    assert marker.read_text() == "planted code ran\n"


def test_rng_state_of_the_previous_format_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before this format held numpy's state as a tuple with an array in it."""
    import random

    import numpy as np

    np.random.seed(11)
    old = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    expected = float(np.random.rand())
    torch.save(old, tmp_path / "rng_state.pt")
    np.random.seed(0)
    set_rng_states(_load_state(tmp_path / "rng_state.pt"))
    assert float(np.random.rand()) == expected


def test_disk_full_while_saving_is_one_line_and_leaves_no_partial_checkpoint(
    parts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thin patch, at the one seam: ``torch.save`` raises the OSError a full disk gives (ENOSPC). The real
    full-disk runs are in tests/integration/test_disk_full.py (they need unprivileged mount namespaces)."""
    import errno

    from rloo.diskspace import DiskFullError

    good = _save(parts, tmp_path, 1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(DiskFullError) as info:
        _save(parts, tmp_path, 2)
    msg = str(info.value)
    assert msg.startswith(
        f"no space left on the disk of {tmp_path / 'checkpoint-2'} while writing checkpoint "
    )
    assert "it needs about " in msg and " free now" in msg and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # the temporary one is gone
    assert latest_checkpoint(tmp_path) == good
