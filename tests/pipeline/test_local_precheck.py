"""What 'rloo pipeline run --local' refuses before kfp.local starts, beyond the validate step's checks: what
only this machine can tell, and what the embedded defaults would otherwise do behind the user's back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rloo.errors import UserError
from rloo.pipeline.local import run_pipeline_locally


def _embedded(work: Path) -> dict[str, Any]:
    """Stands in for the demo's embedded defaults (rloo.demo.pipeline.embedded_params), without building models."""
    return {
        "model": "org/sft",
        "dataset_name": "org/prompts",
        "eval_dataset_name": "org/eval",
        "reward_model_path": "org/rm",
        "judge_base_url": "http://judge.invalid/v1",
        "judge_model": "j",
        "gpu_count": 0,
        "learning_rate": 5e-3,  # the demo's own value of a parameter
        "extra_train_args": "--num_sample_generations 3 --num_ppo_epochs 2",
    }


def _refused(work: Path, params: dict[str, Any]) -> str:
    with pytest.raises(UserError) as err:
        run_pipeline_locally(work, params, defaults=_embedded)
    assert not work.exists() or not any(work.iterdir()), "a refused run leaves nothing behind"
    assert "\n" not in str(err.value)
    return str(err.value)


def test_the_users_extra_train_args_add_to_the_embedded_recipe(tmp_path: Path) -> None:
    """The demo's own flags stay and the user's come after them: shown by the one clash the parser refuses,
    two spellings of one setting (--num_ppo_epochs, which the embedded flags set, and its alias)."""
    from rloo.config import RLOOConfig
    from rloo.options import aliases_of

    alias = next(a for a, f in aliases_of(RLOOConfig).items() if f == "num_ppo_epochs")
    message = _refused(tmp_path / "w", {"extra_train_args": f"--{alias} 3"})
    assert "--num_ppo_epochs 2" in message and f"--{alias} 3" in message, message


def test_the_users_flag_wins_over_the_demos_parameter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flag in extra_train_args for a setting the demo passed as a parameter (learning_rate) is the user's
    choice: it wins, where a parameter the user gave would clash."""
    import rloo.pipeline.local as local

    seen: dict[str, Any] = {}

    def stop(params: dict[str, Any], *, own_model: bool) -> None:
        seen.update(params)
        raise UserError("stop here")

    monkeypatch.setattr(local, "_precheck", stop)
    _refused(tmp_path / "w", {"extra_train_args": "--learning_rate 1e-3"})
    assert "learning_rate" not in seen and seen["extra_train_args"].endswith("--learning_rate 1e-3")
    assert seen["extra_train_args"].startswith("--num_sample_generations 3 --num_ppo_epochs 2")


def test_a_local_run_is_one_node_on_the_gpus_this_machine_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    message = _refused(tmp_path / "w", {"num_nodes": 2})
    assert message.startswith(
        "num_nodes 2: a local run trains on this machine alone; pass --param num_nodes=1"
    )
    message = _refused(tmp_path / "w", {"gpu_count": 1})
    assert (
        message
        == "gpu_count 1: this machine has 0 CUDA GPU(s); pass --param gpu_count=0 (0 trains on the CPU)."
    )


def test_an_own_model_says_the_embedded_data_is_not_used(tmp_path: Path) -> None:
    message = _refused(tmp_path / "w", {"model": "org/mine"})
    assert message.startswith("missing pipeline parameter(s) dataset_name, eval_dataset_name")
    assert "with a model of your own, the demo's embedded datasets and reward model are not used" in message


def test_an_own_model_names_every_missing_input_at_once(tmp_path: Path) -> None:
    """With a model of one's own the datasets and the reward source are all missing: one line lists them all,
    not one error per attempt; a reward source given (a reward model, or reward functions) is not asked for."""
    message = _refused(tmp_path / "w", {"model": "org/mine"})
    assert "also a reward source: reward_model_path, or --reward_funcs" in message
    given = _refused(tmp_path / "w2", {"model": "org/mine", "reward_model_path": "org/rm"})
    assert given.startswith("missing pipeline parameter(s) dataset_name") and "reward source" not in given
    funcs = _refused(tmp_path / "w3", {"model": "org/mine", "extra_train_args": "--reward_funcs a.b:c"})
    assert "reward source" not in funcs
