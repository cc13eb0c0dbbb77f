"""DeepSpeed runs killed after a checkpoint and resumed: real DeepSpeed (ZeRO-2 and ZeRO-3, CPU, gloo), two
processes started as ``accelerate launch`` starts them (tests/fixtures/ranks.py; one run by the launcher
itself) with the project's DeepSpeed configs (their bf16 included), through tests/fixtures/deepspeed_cpu.py (DeepSpeed on CPU; every ZeRO-3 parameter kept partitioned, as a
real model's large ones are); skipped without deepspeed.

A ZeRO checkpoint holds the policy's full weights (``model.safetensors``, gathered from the shards) and the
engine's own checkpoint (``deepspeed/``: each rank's partition of the optimizer state and fp32 weights); the
resumed run must end where an uninterrupted one ends, bit for bit (CPU, one thread per process, two ranks
both times: the same reductions in the same order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rloo.models import load_causal_lm
from rloo.training.checkpoint import ENGINE_DIR, ENGINE_TAG, MANIFEST, checkpoint_problem
from tests.fixtures import ranks
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "accelerate"
LAUNCHER = ROOT / "tests" / "fixtures" / "deepspeed_cpu.py"
TIMING = ("time/", "memory/", "throughput/", "eps", "timestamp")  # measurements, not results


def _args(tiny, toy_data: Path, out: Path) -> list[str]:
    flags: dict[str, object] = {
        "model_name_or_path": tiny.policy,
        "reward_funcs": "rloo.demo.toy:letter_reward",
        "dataset_name": toy_data,
        "output_dir": out,
        "per_device_train_batch_size": 4,  # x 2 processes: 2 prompts x k=4 per update
        "rloo_k": 4,
        "num_ppo_epochs": 2,
        "response_length": 6,
        "learning_rate": 5e-3,
        "temperature": 1.0,
        "max_steps": 4,
        "save_steps": 2,
        "num_sample_generations": 0,
        "seed": 5,
    }
    argv = ["train", "--disable_tqdm"]
    for k, v in flags.items():
        argv += [f"--{k}", str(v)]
    return argv


def _launch(
    config: str, argv: list[str], kill_at: str = "never", *, real_launcher: bool = False, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    """``rloo`` on two DeepSpeed processes (the config's ZeRO stage and bf16), SIGKILLed at ``kill_at``: the
    ranks forked as ``accelerate launch`` would start them (tests/fixtures/ranks.py), or by ``accelerate
    launch`` itself with ``real_launcher``."""
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # DeepSpeed's CPU accelerator, gloo between the ranks
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
        **extra_env,
    }
    args = [str(LAUNCHER), kill_at, *argv]
    if not real_launcher:
        return ranks.launch(2, args, env=env, accelerate_config=CONFIGS / config, cwd=ROOT, timeout=900)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)]
    cmd += ["--num_processes", "2", "--main_process_port", str(free_port())]
    return subprocess.run(
        [*cmd, *args], env=env, capture_output=True, text=True, timeout=900, check=False, cwd=ROOT
    )


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _shapes(file: Path) -> dict[str, list[int]]:
    with safe_open(str(file), framework="pt") as f:
        return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(("config", "stage"), [("deepspeed_zero3.yaml", 3), ("deepspeed_zero2.yaml", 2)])
def test_killed_deepspeed_run_resumes_to_the_same_weights(
    tiny, toy_data: Path, tmp_path: Path, config: str, stage: int
) -> None:
    pytest.importorskip("deepspeed")
    straight, out = tmp_path / "straight", tmp_path / "out"
    proc = _launch(config, _args(tiny, toy_data, straight))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # killed in update index 3 (the 4th), on both ranks: checkpoint-2 is the newest complete one
    killed = _launch(config, _args(tiny, toy_data, out), kill_at="3:optimization")
    assert killed.returncode != 0  # the launcher's, for its SIGKILLed processes
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    ckpt = out / "checkpoint-2"
    assert checkpoint_problem(ckpt) is None
    # the policy's full weights, gathered from the shards: what transformers loads from a checkpoint
    initial = _shapes(Path(tiny.policy) / "model.safetensors")
    saved = _shapes(ckpt / "model.safetensors")
    assert saved == initial, (saved, initial)  # full-size tensors, not ZeRO-3's empty shards
    trained, start = (
        load_file(str(ckpt / "model.safetensors")),
        load_file(str(Path(tiny.policy) / "model.safetensors")),
    )
    assert any(not torch.equal(trained[k], start[k].to(trained[k].dtype)) for k in start)  # trained ones
    model = load_causal_lm(str(ckpt), flag="model_name_or_path")  # transformers reads them
    embed = trained["gpt_neox.embed_in.weight"]
    assert torch.equal(model.get_input_embeddings().weight.detach().to(embed.dtype), embed)

    resumed = _launch(config, _args(tiny, toy_data, out))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    # the layout: no optimizer.pt; the engine's checkpoint, one optimizer-state partition per rank, sealed
    assert not (ckpt / "optimizer.pt").exists()
    engine = ckpt / ENGINE_DIR / ENGINE_TAG
    modules = sorted(p.name for p in engine.glob("*model_states.pt"))
    assert modules == (  # ZeRO-3: each rank's module shards; ZeRO-2: the (whole) module once
        [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]
        if stage == 3
        else ["mp_rank_00_model_states.pt"]
    ), modules
    partitions = sorted(p.name for p in engine.glob("*optim_states.pt"))
    assert partitions == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], partitions
    sealed = (ckpt / MANIFEST).read_text()
    assert all(f"{ENGINE_DIR}/{ENGINE_TAG}/{name}" in sealed for name in modules + partitions)

    # the resumed run ends where the uninterrupted one does, bit for bit
    w_straight, w_resumed = (
        load_file(str(straight / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    assert w_straight.keys() == w_resumed.keys()
    assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight), [
        k for k in w_straight if not torch.equal(w_straight[k], w_resumed[k])
    ]
    assert _metrics(out) == _metrics(straight)
    assert [m["update"] for m in _metrics(out)] == [1, 2, 3, 4]


@pytest.mark.parametrize("gather", ["true", "false"], ids=["gathered_generation", "generation_from_shards"])
def test_zero3_off_policy_run_with_persistent_parameters_trains(
    tiny, toy_data: Path, tmp_path: Path, gather: str
) -> None:
    """DeepSpeed's default persistence threshold keeps small parameters (a real model's biases and norms)
    whole once gathered. Gathered first inside the no-grad rollout forward of an off-policy run (two epochs),
    or inside generation from the shards, under inference_mode they became inference tensors, and the first
    training step failed with "Inference tensors cannot be saved for backward"."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    argv = _args(tiny, toy_data, out)
    argv[argv.index("--max_steps") + 1] = "2"
    argv += ["--ds3_gather_for_generation", gather]
    # one of the suite's DeepSpeed runs started by accelerate's own launcher
    real = gather == "true"
    proc = _launch("deepspeed_zero3.yaml", argv, real_launcher=real, DS_PERSISTENCE_THRESHOLD="100000")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [m["update"] for m in _metrics(out)] == [1, 2]


def test_zero3_run_with_the_newer_options_and_a_teacher(tiny, toy_data: Path, tmp_path: Path) -> None:
    """The newer algorithm options under ZeRO-3 on two ranks: CISPO, the off-policy mask (the second epoch
    drifts), the bias-corrected KL, the adaptive entropy (its entropy summed over both ranks), fp32 logits
    from a partitioned LM head, and a teacher placed as the reference is (a DeepSpeed inference engine)."""
    pytest.importorskip("deepspeed")
    from rloo.demo.tiny import build_vowel_teacher

    teacher = build_vowel_teacher(tmp_path / "teacher", tiny.tokenizer)
    out = tmp_path / "out"
    argv = _args(tiny, toy_data, out)
    argv[argv.index("--max_steps") + 1] = "2"
    argv += [
        *("--loss_type", "cispo", "--loss_agg_mode", "token-mean"),
        *("--off_policy_mask_threshold", "0.001"),
        *("--kl_in_loss", "true", "--kl_estimator", "k3", "--use_bias_correction_kl", "true"),
        *("--use_adaptive_entropy", "true", "--entropy_coef", "0.01", "--entropy_target", "100"),
        *("--cast_lm_head_to_fp32", "true"),
        *("--teacher_model_path", str(teacher)),
    ]
    proc = _launch("deepspeed_zero3.yaml", argv)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    metrics = _metrics(out)
    assert [m["update"] for m in metrics] == [1, 2]
    # two optimizer steps per update (two epochs), each 0.005 up: the same on both ranks, or the run would hang
    assert [m["entropy_coef"] for m in metrics] == pytest.approx([0.02, 0.03])
    assert all(m["teacher/kl"] > 0 and 0 <= m["policy/off_policy_masked_frac"] <= 1 for m in metrics)


def test_zero2_micro_batches_apart_from_the_batch_arithmetic_take_the_same_steps(
    tiny, toy_data: Path, tmp_path: Path
) -> None:
    """--micro_batch_size cuts each rank's mini-batch into more forward/backward passes without changing
    the optimizer's arithmetic. DeepSpeed scales each micro-batch's loss by its gradient_accumulation_steps
    and steps at that boundary (deepspeed/runtime/engine.py, ``is_gradient_accumulation_boundary``), so the
    trainer hands it the micro-batch count: the same updates as one pass per mini-batch, up to float order
    (fp32 here: bf16 rounds a matmul differently at another batch size, which two epochs amplify)."""
    pytest.importorskip("deepspeed")
    fp32 = tmp_path / "deepspeed_zero2_fp32.yaml"
    fp32.write_text(
        (CONFIGS / "deepspeed_zero2.yaml")
        .read_text()
        .replace("mixed_precision: bf16", "mixed_precision: 'no'")
    )
    runs = []
    for micro in ("4", "2"):
        out = tmp_path / f"out-{micro}"
        argv = _args(tiny, toy_data, out)
        argv[argv.index("--max_steps") + 1] = "2"
        proc = _launch(str(fp32), [*argv, "--micro_batch_size", micro])
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        said = proc.stdout + proc.stderr
        assert f"micro-batches of {micro} completions, {4 // int(micro)} per optimizer step" in said
        runs.append(_metrics(out))
    whole, halves = runs
    # A wrong boundary (a DeepSpeed step per micro-batch) would take twice the steps: the second update's KL
    # to the reference and the second epoch's ratios would move far more than float order.
    for a, b in zip(whole, halves, strict=True):
        for key in (
            "loss/policy_avg",
            "objective/kl",
            "objective/scores",
            "policy/approxkl_avg",
            "val/ratio",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
