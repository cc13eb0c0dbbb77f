"""RLOOConfig defaults, validation and the batch arithmetic of BatchPlan (numbers computed by hand)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from rloo.config import ALIASES, BatchPlan, RLOOConfig
from rloo.errors import UserError
from rloo.options import default_of, rule_of

REQUIRED = {"model_name_or_path": "/models/policy", "dataset_name": "/data/prompts", "reward_funcs": ["m:f"]}


def make(**kw: Any) -> RLOOConfig:
    return RLOOConfig(**{**REQUIRED, **kw})


# The classic RLOO trainer's (TRL <= 0.21) defaults, restated here rather than read from the code.
CLASSIC_DEFAULTS = {
    "rloo_k": 2,
    "kl_coef": 0.05,
    "cliprange": 0.2,
    "num_ppo_epochs": 4,
    "num_mini_batches": 1,
    "local_rollout_forward_batch_size": 64,
    "num_sample_generations": 10,
    "response_length": 53,
    "temperature": 0.7,
    "reward_clip_range": 10.0,
    "missing_eos_penalty": None,
    "top_k": 0,
    "top_p": 1.0,
    "stop_token": None,
    "stop_token_id": None,
    "normalize_reward": False,
    "normalize_advantage": False,
    "token_level_kl": False,
    "kl_estimator": "k1",
    "learning_rate": 3e-6,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "num_train_epochs": 3.0,
    "total_episodes": None,
    "max_steps": -1,
    "dataset_train_split": "train",
    "dataset_test_split": "test",
}


@pytest.mark.parametrize(("name", "value"), sorted(CLASSIC_DEFAULTS.items()))
def test_defaults_are_the_classic_ones(name: str, value: Any) -> None:
    cfg = make()
    assert getattr(cfg, name) == value
    assert type(getattr(cfg, name)) is type(value)


def test_every_field_has_help_text() -> None:
    for f in dataclasses.fields(RLOOConfig):
        assert f.metadata.get("help"), f.name


def test_aliases_map_current_names_to_classic_fields() -> None:
    names = set(RLOOConfig.field_names())
    assert ALIASES["num_generations"] == "rloo_k"
    assert ALIASES["beta"] == "kl_coef"
    assert ALIASES["epsilon"] == "cliprange"
    assert ALIASES["num_iterations"] == "num_ppo_epochs"
    assert ALIASES["steps_per_generation"] == "num_mini_batches"
    assert ALIASES["max_completion_length"] == "response_length"
    for alias, canonical in ALIASES.items():
        assert canonical in names and alias not in names, alias


def test_policy_path_prefers_sft_model_path() -> None:
    assert make().policy_path == "/models/policy"
    assert make(sft_model_path="/models/sft").policy_path == "/models/sft"


def test_to_dict_round_trips() -> None:
    cfg = make(rloo_k=4, reward_weights=[0.5])
    assert RLOOConfig(**cfg.to_dict()) == cfg


# --- validation: every error names the offending field ------------------------------------------------
BAD_VALUES = [
    ("model_name_or_path", None),
    ("dataset_name", ""),
    ("rloo_k", 1),
    ("rloo_k", 0),
    ("per_device_train_batch_size", 0),
    ("per_device_eval_batch_size", 0),
    ("gradient_accumulation_steps", 0),
    ("num_mini_batches", 0),
    ("local_rollout_forward_batch_size", 0),
    ("num_ppo_epochs", 0),
    ("response_length", 0),
    ("logging_steps", 0),
    ("kl_coef", -0.1),
    ("kl_coef", math.nan),
    ("learning_rate", math.inf),
    ("weight_decay", -1.0),
    ("max_grad_norm", -1.0),
    ("warmup_ratio", 1.5),
    ("cliprange", 0.0),
    ("temperature", 0.0),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("save_steps", -1),
    ("num_sample_generations", -1),
    ("warmup_steps", -1),
    ("reward_clip_range", 0.0),
    ("stop_token", "</s>"),
    ("kl_estimator", "k4"),
    ("loss_agg_mode", "seq-sum"),
    ("cliprange_high", 0.1),  # below cliprange (0.2)
    ("cliprange_high", math.inf),
    ("vllm_importance_sampling_cap", 1.0),
    ("vllm_importance_sampling_cap", math.nan),
    ("lr_scheduler_type", "exponential"),
    ("cache_implementation", "paged"),
    ("compile_generation", True),  # without --cache_implementation static: decode shapes change per step
    ("generation_dtype", "float32"),  # 'policy' samples from the policy's own weights
    ("total_episodes", 0),
    ("num_train_epochs", 0.0),
    ("reward_funcs", ["nodotnocolon"]),
    ("reward_weights", [1.0, 2.0]),  # one reward function -> one weight
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_validation_error_names_the_field(name: str, value: Any) -> None:
    with pytest.raises(UserError) as info:
        make(**{name: value})
    msg = str(info.value)
    assert f"--{name}" in msg
    assert "\n" not in msg


def test_loss_options_default_to_the_classic_loss() -> None:
    cfg = make()
    assert cfg.kl_estimator == "k1" and cfg.kl_in_loss is False
    assert cfg.loss_agg_mode == "seq-mean-token-sum"
    assert cfg.cliprange_high is None
    assert cfg.mask_truncated_completions is False
    assert cfg.vllm_importance_sampling_correction is False
    assert cfg.vllm_importance_sampling_cap == 2.0  # TRL GRPOConfig's default
    assert ALIASES["epsilon_high"] == "cliprange_high"


def test_loss_options_accept_good_values() -> None:
    cfg = make(
        kl_estimator="k2",
        kl_in_loss=True,
        loss_agg_mode="seq-mean-token-sum-norm",
        cliprange=0.2,
        cliprange_high=0.28,
        mask_truncated_completions=True,
        stop_token="eos",
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_cap=3.0,
    )
    assert cfg.cliprange_high == 0.28
    assert make(cliprange_high=0.2).cliprange_high == 0.2  # equal to cliprange: a symmetric clip


BAD_COMBINATIONS = [
    (
        {"kl_in_loss": True, "kl_estimator": "k3", "token_level_kl": True},
        r"--kl_in_loss and --token_level_kl",
    ),
    ({"kl_in_loss": True}, r"--kl_in_loss needs --kl_estimator k2 or k3"),
    ({"mask_truncated_completions": True}, r"--mask_truncated_completions needs --stop_token"),
    ({"vllm_importance_sampling_correction": True}, r"--vllm_importance_sampling_correction .* --use_vllm"),
    (
        {"vllm_importance_sampling_correction": True, "use_vllm": True, "top_p": 0.9},
        r"--vllm_importance_sampling_correction needs --top_k 0 and --top_p 1.0",
    ),
]


@pytest.mark.parametrize(("kw", "match"), BAD_COMBINATIONS, ids=[m for _, m in BAD_COMBINATIONS])
def test_bad_combinations_are_one_line_errors(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(UserError, match=match) as info:
        make(**kw)
    assert "\n" not in str(info.value)


def test_reward_source_required() -> None:
    with pytest.raises(UserError, match=r"--reward_model_path.*--reward_funcs"):
        RLOOConfig(model_name_or_path="/m", dataset_name="/d")
    assert RLOOConfig(model_name_or_path="/m", dataset_name="/d", reward_model_path="/rm").reward_funcs == []


def test_generator_options_are_refused_with_vllm() -> None:
    with pytest.raises(UserError, match=r"--cache_implementation.*--use_vllm"):
        make(use_vllm=True, cache_implementation="static")
    assert make(cache_implementation="static", compile_generation=True).compile_generation
    with pytest.raises(UserError, match=r"--generation_dtype bfloat16 copies the policy.*--use_vllm"):
        make(use_vllm=True, generation_dtype="bfloat16")


def test_a_rollout_copy_is_refused_with_lora() -> None:
    # a copy of a PEFT model holds the base twice and refreshes it at every step: 'auto' never does it
    with pytest.raises(UserError, match=r"--generation_dtype float16 .*--use_peft rules out"):
        make(use_peft=True, generation_dtype="float16")
    assert make(use_peft=True, load_in_4bit=True).generation_dtype == "auto"


def test_bf16_and_fp16_are_exclusive() -> None:
    with pytest.raises(UserError, match=r"--bf16.*--fp16"):
        make(bf16=True, fp16=True)


def test_reward_weights_count_the_reward_model_first() -> None:
    cfg = make(reward_model_path="/rm", reward_funcs=["a:b", "c.d"], reward_weights=[1.0, 0.5, 2.0])
    assert cfg.reward_weights == [1.0, 0.5, 2.0]
    with pytest.raises(UserError, match="3 reward sources"):
        make(reward_model_path="/rm", reward_funcs=["a:b", "c.d"], reward_weights=[1.0, 0.5])


# --- BatchPlan ---------------------------------------------------------------------------------------
def test_batch_plan_benchmark_command_line() -> None:
    # The benchmark command: 16 per device x 16 accumulation x 2 mini-batches = 512 completions per rank
    # per update, 512 / k=2 = 256 prompts per rank; 1_000_000 episodes / 512 = 1953.125 -> 1954 updates.
    cfg = make(
        per_device_train_batch_size=16,
        gradient_accumulation_steps=16,
        num_mini_batches=2,
        total_episodes=1_000_000,
    )
    plan = cfg.batch_plan(world_size=1, num_prompts=92_858)
    assert plan.local_batch_size == 512
    assert plan.batch_size == 512
    assert plan.local_mini_batch_size == 256  # 512 / 2 mini-batches
    assert plan.mini_batch_size == 256
    assert plan.prompts_per_rank == 256
    assert plan.total_episodes == 1_000_000  # explicit total wins over the epoch default
    assert plan.num_total_batches == 1954
    # On 8 ranks: 8 x 512 = 4096 completions per update; 1e6 / 4096 = 244.14 -> 245 updates.
    plan8 = cfg.batch_plan(world_size=8)
    assert (plan8.batch_size, plan8.mini_batch_size, plan8.prompts_per_rank) == (4096, 2048, 256)
    assert plan8.num_total_batches == 245


def test_batch_plan_get_started_command_line() -> None:
    # 64 x 1 x 1 = 64 completions per update, 32 prompts with k=2; 10_000 / 64 = 156.25 -> 157 updates.
    cfg = make(per_device_train_batch_size=64, gradient_accumulation_steps=1, total_episodes=10_000)
    plan = cfg.batch_plan(world_size=1)
    assert (plan.local_batch_size, plan.prompts_per_rank, plan.num_total_batches) == (64, 32, 157)


def test_batch_plan_default_total_covers_every_prompt_each_epoch() -> None:
    # 3 epochs x 100 prompts x k=4 = 1200 completions; 8 x 2 x 1 = 16 per update -> 1200 / 16 = 75 updates.
    cfg = make(rloo_k=4, per_device_train_batch_size=8, gradient_accumulation_steps=2)
    plan = cfg.batch_plan(world_size=1, num_prompts=100)
    assert plan.total_episodes == 1200
    assert plan.prompts_per_rank == 4  # 16 / 4
    assert plan.num_total_batches == 75
    # Fractional epochs: 0.5 x 10 prompts x k=2 = 10 completions; 4 per update -> ceil(2.5) = 3 updates.
    half = make(num_train_epochs=0.5, per_device_train_batch_size=4).batch_plan(1, num_prompts=10)
    assert (half.total_episodes, half.num_total_batches) == (10, 3)
    # A tiny dataset still gives at least one update: 1 x 1 x 2 = 2 completions < 8 per update.
    tiny = make(num_train_epochs=1.0).batch_plan(1, num_prompts=1)
    assert (tiny.total_episodes, tiny.num_total_batches) == (2, 1)


def test_batch_plan_max_steps_overrides_total_episodes() -> None:
    # max_steps 5 x 8 completions per update x 2 ranks = 80 episodes, exactly 5 updates.
    plan = make(max_steps=5, total_episodes=1_000).batch_plan(world_size=2, num_prompts=100)
    assert (plan.batch_size, plan.total_episodes, plan.num_total_batches) == (16, 80, 5)


def test_batch_plan_unknown_total_without_prompt_count() -> None:
    plan = make().batch_plan(world_size=1)
    assert plan.total_episodes is None and plan.num_total_batches is None


@pytest.mark.parametrize(
    ("per_device", "accum", "mini", "k"),
    [(3, 1, 1, 2), (4, 1, 1, 3), (2, 3, 1, 4), (5, 1, 3, 2)],
)
def test_batch_plan_indivisible_batch_is_a_user_error(per_device: int, accum: int, mini: int, k: int) -> None:
    kw = {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accum,
        "num_mini_batches": mini,
        "rloo_k": k,
    }
    with pytest.raises(UserError) as info:
        make(**kw)  # validation runs the batch arithmetic at construction
    msg = str(info.value)
    assert f"= {per_device * accum * mini} completions" in msg
    assert f"rloo_k ({k})" in msg and "per_device_train_batch_size" in msg


def test_batch_plan_divisible_products_pass() -> None:
    # 3 x 2 x 1 = 6 completions, k = 3 -> 2 prompts; 6 x 1 x 2 = 12 with k = 4 -> 3 prompts.
    assert (
        make(per_device_train_batch_size=3, gradient_accumulation_steps=2, rloo_k=3)
        .batch_plan(1)
        .prompts_per_rank
        == 2
    )
    plan = make(per_device_train_batch_size=6, num_mini_batches=2, rloo_k=4).batch_plan(1)
    assert (plan.local_batch_size, plan.local_mini_batch_size, plan.prompts_per_rank) == (12, 6, 3)
    assert isinstance(plan, BatchPlan)


# --- algorithm variants (DAPO's group filtering and overlong penalty, GRPO's reward scaling, GSPO, dual-clip
# PPO, two-sided clipping, entropy terms, TR-DPO's reference sync, the reward-hacking monitor) --------------
# Off by default: the classic loss, bit for bit. Restated here rather than read from the code.
ALGORITHM_VARIANTS_OFF: dict[str, Any] = {
    "scale_rewards": "none",
    "filter_groups": False,
    "max_num_gen_batches": 1,
    "importance_sampling_level": "auto",
    "clip_ratio_c": None,
    "delta": None,
    "entropy_coef": 0.0,
    "top_entropy_quantile": 1.0,
    "vllm_importance_sampling_mode": "auto",
    "overlong_buffer_len": 0,
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,  # TRL's
    "ref_model_sync_steps": 512,  # TRL's
    "loss_type": "clip",
    "sapo_temperature_pos": 1.0,  # TRL's
    "sapo_temperature_neg": 1.05,  # TRL's
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": False,  # TRL's default is True: here the classic KL stays unless asked
    "use_adaptive_entropy": False,
    "entropy_target": 0.2,  # TRL's
    "entropy_coef_min": 0.0,  # TRL's
    "entropy_coef_max": 1.0,  # TRL's
    "entropy_coef_delta": 0.005,  # TRL's
    "multi_objective_aggregation": "sum_then_normalize",
    "cast_lm_head_to_fp32": False,
}


def test_algorithm_variants_are_off_by_default() -> None:
    cfg = make()
    assert {name: getattr(cfg, name) for name in ALGORITHM_VARIANTS_OFF} == ALGORITHM_VARIANTS_OFF
    assert cfg.classic_sequence_ratio
    assert (
        ALIASES["entropy_coeff"] == "entropy_coef" and ALIASES["soft_punish_cache"] == "overlong_buffer_len"
    )


def test_the_config_offers_the_values_the_math_takes() -> None:
    """The choices of the algorithm's string options are the very tuples the tensor code checks its arguments
    against (rloo.algo.choices, stdlib only: the config is parsed where torch is not installed), not copies
    that can drift; the vLLM correction's modes are TRL's names (``token_truncate`` ...,
    huggingface/trl trl/trainer/grpo_config.py) made of rloo.algo's."""
    from rloo import algo
    from rloo.algo import kl, losses
    from rloo.config import VLLM_IS_MODES

    choices = {
        f.name: rule.choices for f in dataclasses.fields(RLOOConfig) if (rule := rule_of(f)) is not None
    }
    assert choices["kl_estimator"] is algo.KL_ESTIMATORS is kl.KL_ESTIMATORS
    assert choices["loss_agg_mode"] is algo.LOSS_AGG_MODES is losses.LOSS_AGG_MODES
    assert choices["importance_sampling_level"] is algo.IMPORTANCE_SAMPLING_LEVELS
    assert choices["scale_rewards"] is algo.SCALE_REWARDS_MODES
    assert choices["vllm_importance_sampling_mode"] is VLLM_IS_MODES
    assert VLLM_IS_MODES == ("auto", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def test_algorithm_variants_accept_good_values() -> None:
    cfg = make(
        scale_rewards="group",
        filter_groups=True,
        max_num_gen_batches=3,
        importance_sampling_level="sequence",
        clip_ratio_c=3.0,
        delta=4.0,
        entropy_coef=0.01,
        top_entropy_quantile=0.2,
        overlong_buffer_len=10,
        overlong_penalty_factor=0.5,
        stop_token="eos",
        sync_ref_model=True,
        ref_model_sync_steps=2,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_mask",
    )
    assert not cfg.classic_sequence_ratio
    assert make(loss_agg_mode="token-mean", top_entropy_quantile=0.5).top_entropy_quantile == 0.5


ALGORITHM_VARIANT_BAD_VALUES = [
    ({"scale_rewards": "std"}, r"--scale_rewards must be one of none, group, batch"),
    (
        {"importance_sampling_level": "seq"},
        r"--importance_sampling_level must be one of auto, token, sequence",
    ),
    ({"max_num_gen_batches": 2}, r"--max_num_gen_batches resamples .* add --filter_groups"),
    ({"filter_groups": True, "max_num_gen_batches": 0}, r"--max_num_gen_batches must be >= 1"),
    ({"clip_ratio_c": 1.0}, r"--clip_ratio_c must be a finite number > 1"),
    ({"delta": 1.1}, r"--delta must be a finite number > 1 \+ cliprange_high \(1.2\)"),
    ({"delta": 1.25, "cliprange_high": 0.28}, r"--delta must be .* \(1.28\)"),
    ({"entropy_coef": -0.1}, r"--entropy_coef must be a finite number >= 0"),
    ({"top_entropy_quantile": 0.0}, r"--top_entropy_quantile must be in \(0, 1\]"),
    ({"top_entropy_quantile": 0.2}, r"--top_entropy_quantile .* needs a per-token loss"),
    (
        {
            "use_vllm": True,
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_mask",
        },
        r"token_mask weighs each token, which needs a per-token loss",
    ),
    ({"vllm_importance_sampling_mode": "sequence_mask"}, r"--vllm_importance_sampling_mode applies to"),
    (
        {"overlong_buffer_len": 54, "stop_token": "eos"},
        r"--overlong_buffer_len must be in \[0, response_length=53\]",
    ),
    ({"overlong_buffer_len": 4}, r"--overlong_buffer_len needs --stop_token eos or --stop_token_id"),
    (
        {"sync_ref_model": True, "use_peft": True},
        r"--sync_ref_model cannot move the reference with --use_peft",
    ),
    ({"sync_ref_model": True, "ref_model_mixup_alpha": 0.0}, r"--ref_model_mixup_alpha must be in \(0, 1\]"),
    ({"sync_ref_model": True, "ref_model_sync_steps": 0}, r"--ref_model_sync_steps must be >= 1"),
    ({"ref_model_sync_steps": 8}, r"--ref_model_mixup_alpha and --ref_model_sync_steps set --sync_ref_model"),
    ({"overlong_penalty_factor": 0.5}, r"--overlong_penalty_factor .* --overlong_buffer_len turns on"),
    ({"length_corr_warn_threshold": 1.5}, r"--length_corr_warn_threshold must be a correlation in \[-1, 1\]"),
    (
        {"loss_type": "cispo", "delta": 4.0},
        r"--delta bounds PPO's clipped surrogate, which --loss_type cispo",
    ),
    ({"loss_type": "sapo", "clip_ratio_c": 3.0}, r"--clip_ratio_c bounds PPO's clipped surrogate"),
    ({"loss_type": "cispo", "cliprange_high": 0.28}, r"--loss_type cispo caps its weight .* must be > 1"),
    ({"loss_type": "gmpo", "importance_sampling_level": "token"}, r"--loss_type gmpo takes its own"),
    ({"sapo_temperature_neg": 2.0}, r"--sapo_temperature_neg applies to --loss_type sapo"),
    (
        {"loss_type": "dapo", "loss_agg_mode": "seq-mean-token-mean"},
        r"--loss_type dapo means --loss_agg_mode",
    ),
    ({"entropy_target": 0.5}, r"--entropy_target applies to --use_adaptive_entropy"),
    (
        {"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1},
        r"--entropy_coef_min \(0.5\) is above --entropy_coef_max",
    ),
    ({"use_bias_correction_kl": True}, r"--use_bias_correction_kl .* add --kl_in_loss"),
    ({"multi_objective_aggregation": "normalize_then_sum"}, r"normalize_then_sum .* give two or more"),
    (
        {"use_adaptive_entropy": True, "entropy_coef": 2.0},
        r"--entropy_coef 2.0 is the adaptive coefficient's start, outside \[--entropy_coef_min",
    ),
    (
        {"filter_groups": True, "reward_weights": [0.0]},
        r"--filter_groups .* no reward source weighs anything",
    ),
]


@pytest.mark.parametrize(
    ("loss_type", "agg"),
    [
        ("grpo", "seq-mean-token-mean"),
        ("bnpo", "token-mean"),
        ("dapo", "token-mean"),
        ("dr_grpo", "seq-mean-token-sum-norm"),
    ],
)
def test_trl_aggregation_loss_types_pick_the_aggregation(loss_type: str, agg: str) -> None:
    """TRL's loss_type values that name an aggregation (trl/trainer/grpo_trainer.py, ``_compute_loss``: grpo
    averages each sequence's tokens, bnpo and dapo every token, dr_grpo divides by the completion length)
    run PPO's clipped surrogate with that aggregation."""
    cfg = make(loss_type=loss_type)
    assert (cfg.loss_type, cfg.loss_agg_mode) == ("clip", agg)
    assert make(loss_type=loss_type, loss_agg_mode=agg).loss_agg_mode == agg  # both, agreeing: accepted


@pytest.mark.parametrize(
    ("given", "mode"), [(True, "group"), (False, "none"), ("true", "group"), ("False", "none")]
)
def test_trl_boolean_scale_rewards_name_ours(given: Any, mode: str) -> None:
    """TRL's GRPOConfig takes ``scale_rewards`` True/False (trl/trainer/grpo_config.py: True is "group", False
    "none"), as a YAML config carries them."""
    assert make(scale_rewards=given).scale_rewards == mode


def test_filter_groups_with_a_weighed_source_is_taken() -> None:
    assert make(filter_groups=True, reward_weights=[0.5]).filter_groups


def test_cispo_cap_is_cliprange_high_as_trl_reads_it() -> None:
    assert make(loss_type="cispo").cispo_max == 5.0  # ScaleRL's epsilon_max when not given
    assert make(loss_type="cispo", cliprange_high=4.0).cispo_max == 4.0


@pytest.mark.parametrize(
    ("kw", "match"), ALGORITHM_VARIANT_BAD_VALUES, ids=[m for _, m in ALGORITHM_VARIANT_BAD_VALUES]
)
def test_bad_algorithm_variant_values_are_one_line_errors(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(UserError, match=match) as info:
        make(**kw)
    assert "\n" not in str(info.value)


# --- each setting's own rule is declared on its field -------------------------------------------------
# One value that each field's declared rule refuses. The rule and its message live on the field (option(...,
# choices=, check=)), not in a validation method: the error is the declaration's, word for word.
SINGLE_FIELD_BAD: dict[str, Any] = {
    "model_name_or_path": None,
    "dataset_name": "",
    "output_dir": "",
    "reward_funcs": ["m:f", "nodotnocolon"],
    "judge_reward_coef": -0.5,
    "judge_reward_mode": "listwise",
    "judge_max_tokens": 0,
    "judge_concurrency": 0,
    "judge_max_retries": -1,
    "judge_request_budget": 0,
    "judge_timeout": math.inf,
    "judge_backoff": -1.0,
    "dataset_train_split": " ",
    "dataset_test_split": "",
    "seed": 2**32,
    "per_device_train_batch_size": 0,
    "per_device_eval_batch_size": 0,
    "gradient_accumulation_steps": 0,
    "num_mini_batches": 0,
    "total_episodes": 0,
    "num_train_epochs": math.nan,
    "max_steps": -2,
    "local_rollout_forward_batch_size": 0,
    "rloo_k": 1,
    "num_ppo_epochs": 0,
    "kl_coef": math.inf,
    "kl_estimator": "k4",
    "cliprange": 0.0,
    "loss_agg_mode": "seq-sum",
    "reward_clip_range": -1.0,
    "scale_rewards": "std",
    "max_num_gen_batches": 0,
    "importance_sampling_level": "seq",
    "clip_ratio_c": 1.0,
    "entropy_coef": -0.1,
    "top_entropy_quantile": 0.0,
    "loss_type": "vespo",
    "sapo_temperature_pos": 0.0,
    "sapo_temperature_neg": math.inf,
    "off_policy_mask_threshold": 0.0,
    "entropy_target": -0.1,
    "entropy_coef_min": -1.0,
    "entropy_coef_max": math.nan,
    "entropy_coef_delta": -0.005,
    "multi_objective_aggregation": "sum",
    "overlong_penalty_factor": math.nan,
    "ref_model_mixup_alpha": 1.5,
    "ref_model_sync_steps": 0,
    "length_corr_warn_threshold": -1.5,
    "length_corr_warn_updates": -1,
    "teacher_kl_coef": math.inf,
    "response_length": 0,
    "max_prompt_length": 0,
    "temperature": 0.0,
    "top_k": -1,
    "top_p": 1.01,
    "stop_token": "</s>",
    "num_sample_generations": -1,
    "vllm_mode": "remote",
    "vllm_server_base_url": "localhost:8000",
    "vllm_server_port": 0,
    "max_staleness": 0,
    "tools": ["calculator"],
    "environment": "envs",
    "max_tool_calling_iterations": -1,
    "tool_timeout": 0.0,
    "vllm_server_timeout": 0.0,
    "vllm_gpu_memory_utilization": 0.0,
    "vllm_importance_sampling_mode": "token",
    "vllm_importance_sampling_cap": 1.0,
    "cache_implementation": "paged",
    "generation_dtype": "float32",
    "micro_batch_size": "half",
    "learning_rate": -1e-5,
    "lr_scheduler_type": "exponential",
    "warmup_steps": -1,
    "warmup_ratio": -0.1,
    "weight_decay": math.nan,
    "max_grad_norm": -1.0,
    "lora_r": 0,
    "lora_alpha": 0.0,
    "lora_dropout": 1.0,
    "logging_steps": 0,
    "save_steps": -1,
    "save_total_limit": 0,
    "resume_from_checkpoint": "",
    "preemption_grace_seconds": 0.0,
    "report_to": "wandb",
}
_DECLARED = {f.name: rule for f in dataclasses.fields(RLOOConfig) if (rule := rule_of(f)) is not None}


def test_every_declared_rule_has_a_refused_value_here() -> None:
    assert set(SINGLE_FIELD_BAD) == set(_DECLARED)


@pytest.mark.parametrize(("name", "value"), SINGLE_FIELD_BAD.items(), ids=list(SINGLE_FIELD_BAD))
def test_a_bad_setting_is_refused_by_its_declaration(name: str, value: Any) -> None:
    """The fields are the classic trainer's (huggingface/trl trl/trainer/rloo_config.py), made flags by
    HfArgumentParser (huggingface/transformers src/transformers/hf_argparser.py); each one's own rule is
    declared where the field is, and the error for a value it refuses is the declaration's, word for word."""
    with pytest.raises(UserError) as refused:
        make(**{name: value})
    assert str(refused.value) == _DECLARED[name].problem(f"--{name}", value)


def test_help_and_the_pipeline_table_state_each_declared_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from rloo.parsing.hf import ConfigParser
    from rloo.pipeline.params import markdown_table

    monkeypatch.setenv("COLUMNS", "1000")  # no rule wrapped over two lines
    entries: dict[
        str, str
    ] = {}  # flag -> its entry: the flag's names, then its help on the same line or the next
    for line in ConfigParser(RLOOConfig, prog="rloo train").format_help().splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif entries:
            entries[flag] += line
    for name, rule in _DECLARED.items():
        assert f"(must be {rule.text}" in entries[f"--{name}"], name
    table = {row.split("|")[1].strip(" `"): row for row in markdown_table().splitlines()[2:]}
    assert "Must be >= 2." in table["rloo_k"]
    assert "Must be a finite number >= 0." in table["learning_rate"]


def test_the_pipeline_names_the_parameter_in_the_declared_error() -> None:
    from rloo.stages.validate import train_values

    params = {"dataset_name": "/data/prompts", "reward_model_path": "/rm", "rloo_k": 1}
    with pytest.raises(UserError) as refused:
        train_values(params, "")
    assert str(refused.value) == _DECLARED["rloo_k"].problem("rloo_k", 1)


def test_rules_between_settings_read_the_declared_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # --ref_model_mixup_alpha is refused without --sync_ref_model when it is not the default: which value
    # that is, the field says (a second copy of 0.6 in the rule would keep refusing a new default)
    (alpha,) = [f for f in dataclasses.fields(RLOOConfig) if f.name == "ref_model_mixup_alpha"]
    monkeypatch.setattr(alpha, "default", 0.7)
    assert default_of(RLOOConfig, "ref_model_mixup_alpha") == 0.7
    assert make(ref_model_mixup_alpha=0.7).ref_model_mixup_alpha == 0.7
    with pytest.raises(
        UserError, match="--ref_model_mixup_alpha and --ref_model_sync_steps set --sync_ref_model"
    ):
        make(ref_model_mixup_alpha=0.6)


def test_a_micro_batch_size_must_cut_the_mini_batch_into_equal_parts() -> None:
    """--micro_batch_size lays the local mini-batch (per_device_train_batch_size x
    gradient_accumulation_steps) out in memory; only a divisor keeps each micro-batch's loss an equal share
    of the mean, so another size is one line naming the sizes that fit."""
    assert (
        make(
            per_device_train_batch_size=8, gradient_accumulation_steps=2, micro_batch_size="4"
        ).micro_batch_size
        == "4"
    )
    assert make(micro_batch_size="auto").micro_batch_size == "auto"
    with pytest.raises(
        UserError, match=r"--micro_batch_size 3 does not divide the 16 completions.*1, 2, 4, 8, 16, or auto"
    ):
        make(per_device_train_batch_size=8, gradient_accumulation_steps=2, micro_batch_size="3")
    with pytest.raises(UserError, match=r"--micro_batch_size must be a whole number >= 1 or 'auto'"):
        make(micro_batch_size="0")
