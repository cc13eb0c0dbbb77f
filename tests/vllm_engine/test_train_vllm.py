"""``rloo train --use_vllm`` with a real colocated vLLM engine (``external_launcher``), on CPU.

The proof that the engine samples from the policy being trained: with
``--vllm_importance_sampling_correction`` every update logs ``objective/vllm_logp_diff_abs_mean``, the mean
|log pi_trainer - log pi_vLLM| over the sampled tokens, with the trainer's forward taken on the weights the
rollout was generated with (one PPO epoch, one minibatch). Both sides run float32, so the gap is rounding:
measured 2e-7 to 4e-7 per token at every update, on one process and on two. ``TOLERANCE`` is 1e-4. An
engine that missed the pushes (``stale_engine.py``) shows a gap that grows update after update, far above it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo.demo.tiny import TinySetup
from rloo.demo.toy import write_toy_dataset
from tests.vllm_engine.conftest import metrics, needs_vllm, refusal, rloo

pytestmark = needs_vllm

TOLERANCE = 1e-4
GAP = "objective/vllm_logp_diff_abs_mean"
CAPPED = "objective/vllm_is_capped_frac"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_dataset(tmp_path_factory.mktemp("prompts"), num_train=32, num_test=4)


def train_args(qwen: TinySetup, data: Path, out: Path, *extra: str, steps: int = 5) -> list[str]:
    return [
        "train", "--disable_tqdm",
        "--model_name_or_path", str(qwen.policy),
        "--reward_funcs", "rloo.demo.toy:letter_reward",
        "--dataset_name", str(data),
        "--output_dir", str(out),
        "--per_device_train_batch_size", "4",
        "--rloo_k", "2",
        "--num_ppo_epochs", "1",
        "--response_length", "8",
        "--learning_rate", "3e-3",
        "--max_steps", str(steps),
        "--num_sample_generations", "0",
        "--seed", "5",
        "--use_vllm",
        "--vllm_importance_sampling_correction",
        *extra,
    ]  # fmt: skip


def _ok(proc: object) -> None:
    rc, err = proc.returncode, proc.stderr
    assert rc == 0, err[-4000:]


def _gaps(out: Path) -> list[float]:
    rows = metrics(out)
    assert [r["update"] for r in rows] == list(range(1, len(rows) + 1))
    return [r[GAP] for r in rows]


def test_the_engine_samples_from_the_policy_at_every_update(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    _ok(rloo(train_args(qwen, prompts, out), vllm_env))
    rows = metrics(out)
    gaps = _gaps(out)
    assert len(gaps) == 5 and max(gaps) < TOLERANCE, gaps
    # the importance-sampling correction has nothing to correct: no token's ratio reaches the cap
    assert all(r[CAPPED] == 0.0 for r in rows)
    # and the policy did move (otherwise a missed push would go unseen): its KL to the start grows
    assert rows[-1]["objective/kl"] > rows[0]["objective/kl"]


def test_an_engine_that_misses_the_pushes_is_seen(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """The check above can fail: with the weights pushed only once the gap grows past the tolerance."""
    out = tmp_path / "out"
    _ok(rloo(train_args(qwen, prompts, out), vllm_env, module="tests.vllm_engine.stale_engine"))
    gaps = _gaps(out)
    assert gaps[0] < TOLERANCE, gaps  # the first rollout had the pushed weights
    # every later update is far off (measured 0.35, 0.49, 0.39, 0.55), and further off at the end
    assert min(gaps[1:]) > 100 * TOLERANCE and gaps[-1] > gaps[1], gaps


def test_two_processes_under_torchrun_with_sleep_mode(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """Two ranks (gloo), an engine each in its rank's process group; --vllm_enable_sleep_mode runs the
    sleep / wake / push sequence, which vLLM's CPU worker accepts and ignores (it has no sleep mode)."""
    out = tmp_path / "out"
    launcher = ["--standalone", "--nproc_per_node", "2", "-m", "rloo.cli"]
    args = train_args(qwen, prompts, out, "--vllm_enable_sleep_mode", steps=4)
    args[args.index("--per_device_train_batch_size") + 1] = "2"  # the same 4 prompts per update, 2 a rank
    proc = rloo([*launcher, *args], vllm_env, module="torch.distributed.run")
    _ok(proc)
    gaps = _gaps(out)
    assert len(gaps) == 4 and max(gaps) < TOLERANCE, gaps
    assert "vLLM on CPU has no sleep mode" in proc.stdout + proc.stderr


def test_lora_pushes_the_merged_weights(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """The engine holds the base model; each rollout it gets base + adapter merged, so its log-probs are the
    adapted policy's (the adapter's B starts at zero: a missed merge shows once it has learnt something)."""
    out = tmp_path / "out"
    _ok(rloo(train_args(qwen, prompts, out, "--use_peft", "--lora_r", "8", "--lora_alpha", "16"), vllm_env))
    rows = metrics(out)
    gaps = _gaps(out)
    assert max(gaps) < TOLERANCE, gaps
    assert rows[-1]["objective/kl"] > 0  # the adapter moved the policy away from the base


def test_resume_pushes_the_checkpointed_weights(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """A resumed run starts its engine from the SFT checkpoint again; the first push must bring it the
    trained weights of the checkpoint, or update 4 would sample from the wrong policy."""
    out = tmp_path / "out"
    _ok(rloo(train_args(qwen, prompts, out, "--save_steps", "1", steps=3), vllm_env))
    proc = rloo(train_args(qwen, prompts, out, "--save_steps", "1", steps=5), vllm_env)
    _ok(proc)
    gaps = _gaps(out)
    assert len(gaps) == 5 and max(gaps) < TOLERANCE, gaps
    assert "resum" in (proc.stdout + proc.stderr).lower()


def test_algorithm_variants_with_the_engine(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """The algorithm variants with a real engine: --filter_groups resamples through vLLM (extra generate calls
    between two pushes, from the same weights), sequence_mask drops completions whose vLLM ratio passes the
    cap, and the moved reference needs no push (the engine holds the policy only)."""
    out = tmp_path / "out"
    flags = [
        "--filter_groups", "--max_num_gen_batches", "3",
        "--importance_sampling_level", "sequence", "--loss_agg_mode", "seq-mean-token-mean",
        "--vllm_importance_sampling_mode", "sequence_mask",
        "--clip_ratio_c", "3", "--entropy_coef", "0.01", "--top_entropy_quantile", "0.5",
        "--overlong_buffer_len", "2", "--stop_token", "eos", "--scale_rewards", "batch",
        "--sync_ref_model", "--ref_model_sync_steps", "2",
    ]  # fmt: skip
    args = train_args(qwen, prompts, out, *flags)
    args[args.index("--reward_funcs") + 1] = "rloo.demo.toy:vowel_majority_reward"  # flat groups occur
    _ok(rloo(args, vllm_env))
    rows = metrics(out)
    gaps = _gaps(out)
    # every round of every update sampled from the current weights: the rollout's gap stays rounding
    assert len(gaps) == 5 and max(gaps) < TOLERANCE, gaps
    assert all(r["objective/vllm_is_masked_frac"] == 0.0 for r in rows)  # nothing near the cap
    assert max(r["filter_groups/rounds"] for r in rows) > 1  # the pass/fail reward left flat groups
    assert all(0.0 <= r["filter_groups/kept_frac"] <= 1.0 for r in rows)


def test_a_model_the_cpu_kernels_cannot_run_is_one_line(
    tiny_setup: TinySetup, prompts: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """The default tiny models have head size 16, which vLLM's CPU attention has no kernel for: one line
    before the engine starts, not the engine's traceback, and no output directory."""
    out = tmp_path / "out"
    last = refusal(rloo(train_args(tiny_setup, prompts, out), vllm_env), out)
    assert "head size is 16" in last and "drop --use_vllm" in last


def test_async_generation_with_the_colocated_engine(
    qwen: TinySetup, prompts: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """The colocated engine generates the next batch on the trainer's worker thread from the weights pushed
    before the update trains; the first rollout is sampled from the weights being trained (gap at rounding),
    the later ones from one step older weights, and the run trains."""
    out = tmp_path / "out"
    proc = rloo(train_args(qwen, prompts, out, "--async_generation", steps=3), vllm_env)
    _ok(proc)
    rows = metrics(out)
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0][GAP] < TOLERANCE < rows[2][GAP], [r[GAP] for r in rows]
    assert rows[-1]["objective/kl"] != 0.0
