"""How each algorithm option changes learning on the toy task, against the defaults
measured in the same invocation.

Every run is ``rloo demo``'s: the tiny random-initialised policy, the toy prompts, the vowel-fraction reward,
the same updates and seeds; only the option differs. For each option it prints the mean score over the first
3 and the last 5 updates (averaged over seeds), the last KL and entropy, its seconds, and whether the
defaults' run reproduced a run with the option's "off" value spelled out (it must, bit for bit).

    .venv/bin/python benchmarks/bench_options.py                    # every option, seeds 0 and 1
    .venv/bin/python benchmarks/bench_options.py --only filter_groups --seeds 0 --updates 10
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# every algorithm variant with a value that turns it on (and what it needs beside it)
OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "filter_groups": {"filter_groups": True},
    "filter_groups+resample": {"filter_groups": True, "max_num_gen_batches": 3},
    "scale_rewards=group": {"scale_rewards": "group"},
    "scale_rewards=batch": {"scale_rewards": "batch"},
    "importance_sampling_level=token": {"importance_sampling_level": "token"},
    "importance_sampling_level=sequence (GSPO)": {"importance_sampling_level": "sequence"},
    "clip_ratio_c=3 (dual-clip)": {"clip_ratio_c": 3.0},
    "delta=1.5": {"delta": 1.5},
    "entropy_coef=0.01": {"entropy_coef": 0.01},
    "top_entropy_quantile=0.2 (token-mean)": {"top_entropy_quantile": 0.2, "loss_agg_mode": "token-mean"},
    "token-mean alone": {"loss_agg_mode": "token-mean"},
    "overlong_buffer_len=4": {"overlong_buffer_len": 4, "stop_token": "eos"},
    "sync_ref_model (every 5)": {"sync_ref_model": True, "ref_model_sync_steps": 5},
    "async_generation (one update ahead)": {"async_generation": True},
    "async_generation + IS correction": {
        "async_generation": True,
        "vllm_importance_sampling_correction": True,
    },
    # the newer surrogates, each beside the aggregation it runs with alone
    "loss_type=cispo (token-mean)": {"loss_type": "cispo", "loss_agg_mode": "token-mean"},
    "seq-mean-token-mean alone": {"loss_agg_mode": "seq-mean-token-mean"},
    "loss_type=sapo (seq-mean-token-mean)": {"loss_type": "sapo", "loss_agg_mode": "seq-mean-token-mean"},
    "loss_type=gmpo (seq-mean-token-mean)": {"loss_type": "gmpo", "loss_agg_mode": "seq-mean-token-mean"},
    # the demo runs 2 PPO epochs: the second is off policy, where the mask acts
    "off_policy_mask_threshold=0.001": {"off_policy_mask_threshold": 0.001},
    "kl_in_loss k3": {"kl_in_loss": True, "kl_estimator": "k3"},
    "kl_in_loss k3 + use_bias_correction_kl": {
        "kl_in_loss": True,
        "kl_estimator": "k3",
        "use_bias_correction_kl": True,
    },
    "use_adaptive_entropy (target 5.0)": {"use_adaptive_entropy": True, "entropy_target": 5.0},
    "bf16 alone": {"bf16": True},
    "cast_lm_head_to_fp32 (bf16)": {"bf16": True, "cast_lm_head_to_fp32": True},
    # the demo weighs its reward model 0: weigh both sources to see how they are combined
    "reward_weights=1,1 (summed)": {"reward_weights": [1.0, 1.0]},
    "multi_objective_aggregation=normalize_then_sum (1,1)": {
        "reward_weights": [1.0, 1.0],
        "multi_objective_aggregation": "normalize_then_sum",
    },
    # on-policy distillation from a teacher that favours the all-vowel tokens (rloo.demo.tiny's
    # build_vowel_teacher): with the letters weighed 0 the teacher is the only signal
    "teacher, no reward (letters weighed 0)": {
        "teacher": True,
        "reward_model_path": None,
        "reward_weights": [0.0],
    },
    "teacher + reward": {"teacher": True},
    "teacher_kl_in_loss (k3), no reward": {
        "teacher": True,
        "teacher_kl_in_loss": True,
        "kl_estimator": "k3",
        "reward_model_path": None,
        "reward_weights": [0.0],
    },
    # an LLM judge as the only weighed reward: tests/eval's scripted OpenAI-compatible judge grading a
    # completion 0-10 by its share of vowel letters (the toy task's own criterion), asked over HTTP
    "judge_reward_coef=1 (pointwise), letters weighed 0": {
        "judge": True,
        "judge_reward_mode": "pointwise",
        "judge_reward_coef": 1.0,
        "reward_weights": [0.0, 0.0],
    },
}
# the defaults spelled out: must give the defaults' metrics exactly
EXPLICIT_OFF: dict[str, Any] = {
    "filter_groups": False,
    "max_num_gen_batches": 1,
    "scale_rewards": "none",
    "importance_sampling_level": "auto",
    "clip_ratio_c": None,
    "delta": None,
    "entropy_coef": 0.0,
    "top_entropy_quantile": 1.0,
    "overlong_buffer_len": 0,
    "sync_ref_model": False,
    "async_generation": False,
    "loss_type": "clip",
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": False,
    "use_adaptive_entropy": False,
    "multi_objective_aggregation": "sum_then_normalize",
    "cast_lm_head_to_fp32": False,
}
# the demo's graded reward (a vowel fraction: groups nearly always have spread), or a pass/fail one (many
# groups without spread at the start: what --filter_groups and --scale_rewards act on)
TASKS: dict[str, dict[str, Any]] = {
    "vowels": {},
    "majority": {"reward_funcs": ["rloo.demo.toy:vowel_majority_reward"]},
}
DETERMINISTIC_KEYS_SKIP = ("time/", "memory/", "throughput/", "eps", "timestamp")


def run_one(
    workdir: Path, name: str, overrides: dict[str, Any], seed: int, updates: int, task: str
) -> dict[str, Any]:
    from rloo.demo.cli import build_config

    out = workdir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}-{seed}"
    cfg = build_config(out, updates=updates, arch="gpt_neox", seed=seed)
    overrides = dict(overrides)
    if overrides.pop("teacher", False):
        from rloo.demo.tiny import build_vowel_teacher

        teacher = build_vowel_teacher(out.parent / f"{out.name}-teacher", cfg.model_name_or_path)
        overrides["teacher_model_path"] = str(teacher)
    with contextlib.ExitStack() as stack:
        if overrides.pop("judge", False):
            overrides.update(_toy_judge(stack))
        return _timed_train(cfg, task, overrides)


def _toy_judge(stack: contextlib.ExitStack) -> dict[str, Any]:
    """tests/eval's scripted judge serving for the run's length, grading by the share of vowel letters; the
    flags that point the run at it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.eval
    from rloo.demo.toy import letter_reward
    from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge

    judge = stack.enter_context(ScriptedJudge(grade=lambda text: letter_reward([text])[0] or 0.0))
    os.environ["RLOO_BENCH_JUDGE_KEY"] = API_KEY
    return {
        "judge_base_url": judge.base_url,
        "judge_model": MODEL,
        "judge_api_key_env": "RLOO_BENCH_JUDGE_KEY",
    }


def _timed_train(cfg: Any, task: str, overrides: dict[str, Any]) -> dict[str, Any]:
    from rloo.training.trainer import train

    cfg = dataclasses.replace(
        cfg, report_to="none", disable_tqdm=True, num_sample_generations=0, **TASKS[task], **overrides
    )
    t0 = time.perf_counter()
    history = train(cfg).history
    return {"seconds": time.perf_counter() - t0, "history": history}


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(DETERMINISTIC_KEYS_SKIP)}  # noqa: E731
    return [keep(m) for m in a] == [keep(m) for m in b]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--only", nargs="*", help="option names (prefixes) to run beside the defaults")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--task", choices=sorted(TASKS), default="vowels", help="the reward (see TASKS)")
    args = parser.parse_args(argv)
    names = [
        n for n in OPTIONS if n == "defaults" or not args.only or any(n.startswith(o) for o in args.only)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fn = (TASKS[args.task].get("reward_funcs") or ["rloo.demo.toy:letter_reward"])[0]
        task_key = f"rewards/{fn.split(':')[1]}/mean"
        base = {s: run_one(work, "defaults", {}, s, args.updates, args.task) for s in args.seeds}
        off = run_one(work, "explicit-off", EXPLICIT_OFF, args.seeds[0], args.updates, args.task)
        reproduced = _same(base[args.seeds[0]]["history"], off["history"])
        for name in names:
            runs = (
                base
                if name == "defaults"
                else {s: run_one(work, name, OPTIONS[name], s, args.updates, args.task) for s in args.seeds}
            )
            first = statistics.mean(
                statistics.mean(m["objective/scores"] for m in r["history"][:3]) for r in runs.values()
            )
            last = statistics.mean(
                statistics.mean(m["objective/scores"] for m in r["history"][-5:]) for r in runs.values()
            )
            # the reward function alone: objective/scores includes penalties (--overlong_buffer_len)
            task_last = statistics.mean(
                statistics.mean(m[task_key] for m in r["history"][-5:]) for r in runs.values()
            )
            rows.append(
                {
                    "option": name,
                    "score_first3": first,
                    "score_last5": last,
                    "task_last5": task_last,
                    "kl_last": statistics.mean(r["history"][-1]["objective/kl"] for r in runs.values()),
                    "entropy_last": statistics.mean(
                        r["history"][-1]["policy/entropy_avg"] for r in runs.values()
                    ),
                    "seconds": statistics.mean(r["seconds"] for r in runs.values()),
                    "extra": {
                        k: statistics.mean(r["history"][-1][k] for r in runs.values())
                        for k in runs[args.seeds[0]]["history"][-1]
                        if k.startswith(
                            (
                                "filter_groups/",
                                "clip_ratio/dual",
                                "policy/top_entropy",
                                "loss/entropy",
                                "entropy_coef",
                                "policy/off_policy",
                                "policy/clipfrac",
                                "teacher/kl",
                            )
                        )
                    },
                }
            )
    print(
        f"toy task ({args.task}), {args.updates} updates, seeds {args.seeds}; defaults == options spelled 'off': {reproduced}"
    )
    base_task = rows[0]["task_last5"]
    print(
        "| option | score, first 3 | score, last 5 | reward fn, last 5 | vs defaults | KL, last | entropy, last "
        "| s/run |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['option']} | {r['score_first3']:.3f} | {r['score_last5']:.3f} | {r['task_last5']:.3f} | "
            f"{r['task_last5'] - base_task:+.3f} | {r['kl_last']:.3f} | {r['entropy_last']:.3f} | "
            f"{r['seconds']:.1f} |"
        )
    for r in rows:
        if r["extra"]:
            print(f"{r['option']}: " + ", ".join(f"{k} {v:.3g}" for k, v in r["extra"].items()))
    if args.json:
        args.json.write_text(json.dumps({"reproduced": reproduced, "rows": rows}, indent=2))
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
