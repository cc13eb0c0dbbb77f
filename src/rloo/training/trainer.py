"""The RLOO trainer, top to bottom: rollout -> rewards -> leave-one-out advantages -> PPO-clip updates.

One update:
1. take ``prompts_per_rank`` prompts, sample ``rloo_k`` completions each (prompt-major: row p*K + k);
2. recompute the sampling ("old") policy's log-probs with a training-mode forward, and the frozen
   reference's, at the sampling temperature;
3. score every completion with the reward model and/or reward functions, apply the EOS penalty, the
   optional normalisation, and the KL penalty (sequence level, or per token with returns-to-go);
4. leave-one-out advantages per prompt group;
5. ``num_ppo_epochs`` passes of ``num_mini_batches`` optimizer steps, each accumulating
   ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size`` completions.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rloo import algo
from rloo.config import BatchPlan, RLOOConfig
from rloo.data import (
    TRAINING_DATASET_FILE,
    PromptDataset,
    format_prompts,
    load_prompt_dataset,
    tokenize_prompts,
)
from rloo.diskspace import write_bytes_atomic
from rloo.errors import UserError
from rloo.forward import response_logits
from rloo.generation import (
    GenerationInterrupted,
    SamplingParams,
    TransformersGenerator,
    left_pad,
    row_seeds,
    scoring_temperature,
)
from rloo.models import (
    check_model_source,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    position_limit,
)
from rloo.tracking.base import Status
from rloo.training import deepspeed_utils, group_filter, lora, precision, ref_sync
from rloo.training.checkpoint_manager import CheckpointManager
from rloo.training.collectives import Collectives
from rloo.training.compile import compile_decoder_layers
from rloo.training.loss_stats import LossStats
from rloo.training.metrics import MetricsLogger
from rloo.training.minibatches import minibatch_rows
from rloo.training.optim import make_adamw
from rloo.training.output_lock import OutputLock
from rloo.training.rewards import (
    RewardBatch,
    RewardFunctionSource,
    RewardModelSource,
    TrainerState,
    score_all,
)
from rloo.training.rollout import Rollout, RolloutStats, Sampled, rollout_metrics
from rloo.training.sampler import PromptSampler
from rloo.training.vllm_backend import make_generator

log = logging.getLogger(__name__)

# Called as hook(update index, phase name) at each safe point, before the preemption check: "generation" and
# "optimization" of each update, "samples" before a sample table, "finish" before the final model.
# Empty in production; the resume tests add one that SIGKILLs the process (tests/fixtures/kill_at.py).
PHASE_HOOKS: list[Callable[[int, str], None]] = []


class _Timer:
    """Wall time and peak memory of each phase of an update.

    Peak memory is ``torch.cuda.max_memory_allocated`` on GPU and the resident-set high-water mark on
    CPU (Linux ``VmHWM``, reset at each phase start through ``/proc/self/clear_refs``), in GiB.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.peak_gib: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()
        t0 = time.perf_counter()
        try:
            # a named range in torch.profiler traces (benchmarks/profile_gpu.py); a no-op without a profiler
            with torch.profiler.record_function(f"phase/{name}"):
                yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                peak: float = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = _peak_rss()
            self.seconds[name] += time.perf_counter() - t0
            self.peak_gib[name] = max(self.peak_gib[name], peak / 2**30)


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then covers the whole process so far
        pass


def _peak_rss() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class RLOOTrainer:
    """Loads everything up front (so bad input fails before anything is written), then ``train()``."""

    def __init__(self, cfg: RLOOConfig) -> None:
        # Set-up in the order that fails cheapest first: flags and locations, reporting (an unreachable
        # MLflow server or a malformed URI is one line before any model loads), data, then models.
        self.cfg = cfg
        self.output_lock: OutputLock | None = None
        self._check_locations()
        seed_everything(cfg.seed)
        self._setup_accelerator()
        # before anything is loaded: a second run on the same output is refused in seconds
        self._lock_output()
        try:
            self._setup_reporting()
            self._setup_data()
            self._setup_models()
            self._setup_rewards()
            self._setup_prompts()
            self._setup_optimization()
            self._setup_distributed()
            self._setup_generation()
            self._setup_run_state()
        except BaseException:
            self.release_output()
            raise

    def _check_locations(self) -> None:
        """Flags the machine cannot honour and an output location that is a file: one line each."""
        cfg = self.cfg
        if cfg.fp16 and not torch.cuda.is_available():
            raise UserError("--fp16 needs a CUDA GPU; use --bf16 (or neither) on CPU.")
        # an s3:// output_dir is staged locally (checkpoints mirrored, the result uploaded at the end)
        self.remote = cfg.remote_output
        out = cfg.local_output_dir
        if out.exists() and not out.is_dir():
            flag = "--local_dir" if self.remote is not None and cfg.local_dir else "--output_dir"
            raise UserError(f"{flag} {out} is a file; pass a directory.")
        # a mistyped local model path is one line now, not after the datasets have loaded
        for name in ("model_name_or_path", "sft_model_path", "reward_model_path"):
            if getattr(cfg, name):
                check_model_source(name, getattr(cfg, name))

    def _lock_output(self) -> None:
        """One run per output at a time (:mod:`rloo.training.output_lock`): the main process locks it, and
        a refusal there is raised on every rank."""
        cfg = self.cfg
        failure: UserError | None = None
        if self.accelerator.is_main_process:
            flag = "--local_dir" if self.remote is not None and cfg.local_dir else "--output_dir"
            try:
                self.output_lock = OutputLock.acquire(cfg.local_output_dir, self.remote, local_dir_flag=flag)
            except UserError as e:
                failure = e
        failure = Collectives(self.accelerator).broadcast(failure)
        if failure is not None:
            raise failure

    def release_output(self) -> None:
        """Let the output's lock go (``train()`` does when it ends; idempotent)."""
        if self.output_lock is not None:
            self.output_lock.release()
            self.output_lock = None

    def _setup_accelerator(self) -> None:
        """The accelerate state: precision, gradient accumulation, device."""
        cfg = self.cfg
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        # accelerate keeps the precision in a process-wide singleton; a second run in the same process
        # (a notebook, a sweep, the tests) with another precision must not inherit the first one's.
        # The distributed (partial) state is kept: the process group outlives one run.
        AcceleratorState._reset_state(reset_partial_state=False)
        self.accelerator = Accelerator(
            # None: an accelerate launch config (e.g. the DeepSpeed ones, bf16) decides
            mixed_precision="bf16" if cfg.bf16 else "fp16" if cfg.fp16 else None,
            # accelerate divides the loss by this (DeepSpeed also uses it for its step boundary)
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            # accelerate only forms a CPU process group (gloo) when told it runs on CPU
            cpu=not torch.cuda.is_available(),
        )
        self.device = self.accelerator.device

    def _setup_reporting(self) -> None:
        """Metric sinks (main process), the s3:// output's access check and the checkpoint mirror."""
        cfg = self.cfg
        main = self.accelerator.is_main_process
        from rloo.tracking import sinks_from_env

        self.sinks = sinks_from_env(cfg.report_to, stage="train") if main else []
        if self.remote is not None:
            from rloo.storage.backends import backend_for
            from rloo.tracking.runs import TAG_OUTPUT_DIR

            # one request now: wrong credentials, a missing bucket or an unreachable endpoint are one line
            # before any model is loaded, not a failure after hours of training
            backend_for(self.remote).check_access(create=False)
            for sink in self.sinks:  # runs are identified by the prefix, not by this machine's staging dir
                if hasattr(sink, "tags"):
                    sink.tags[TAG_OUTPUT_DIR] = self.remote.uri
        elif cfg.publish_uri:
            from rloo.tracking.runs import TAG_OUTPUT_DIR

            for sink in self.sinks:  # the pipeline uploads output_dir there: the durable name of this run
                if hasattr(sink, "tags"):
                    sink.tags[TAG_OUTPUT_DIR] = cfg.publish_uri
        self.mirror = None
        if cfg.mirror_uri and main:
            from rloo.storage import CheckpointMirror

            self.mirror = CheckpointMirror(cfg.mirror_uri, keep_last=cfg.save_total_limit)

    def _setup_data(self) -> None:
        """The train and eval prompt datasets and the batch plan they give."""
        cfg = self.cfg
        assert cfg.dataset_name is not None and cfg.model_name_or_path is not None  # RLOOConfig.validate()
        self.train_ds = load_prompt_dataset(
            cfg.dataset_name, cfg.dataset_train_split, config=cfg.dataset_config
        )
        self.eval_ds = load_prompt_dataset(
            cfg.dataset_name,
            cfg.dataset_test_split,
            config=cfg.dataset_config,
            fallback_split=self.train_ds.split,
        )
        self.plan: BatchPlan = cfg.batch_plan(self.accelerator.num_processes, num_prompts=len(self.train_ds))
        self._warn_if_batch_exceeds_prompts()

    def _warn_if_batch_exceeds_prompts(self) -> None:
        """One warning when an update takes more prompts than the split holds: the sampler then draws some
        prompts twice in one update, with the same seeds and so the same completions, which weighs them
        double and teaches nothing new (it trains; the batch is just larger than the data can fill)."""
        per_update = self.plan.batch_size // self.cfg.rloo_k
        have = len(self.train_ds)
        if per_update > have and self.accelerator.is_main_process:
            log.warning(
                "each update takes %d prompts (batch %d / rloo_k %d) but the %r split holds %d: some prompts are "
                "drawn twice per update and sample the same completions twice; use a batch of at most %d "
                "completions (per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches x "
                "processes), or more prompts.",
                per_update,
                self.plan.batch_size,
                self.cfg.rloo_k,
                self.train_ds.split,
                have,
                have * self.cfg.rloo_k,
            )

    def _setup_models(self) -> None:
        """Tokenizer, policy (with LoRA adapters if asked), reference policy and stop token."""
        cfg = self.cfg
        assert cfg.model_name_or_path is not None  # RLOOConfig.validate()
        self.tokenizer = load_tokenizer(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
        policy_flag = "sft_model_path" if cfg.sft_model_path else "model_name_or_path"
        self.policy = load_causal_lm(
            cfg.policy_path,
            flag=policy_flag,
            trust_remote_code=cfg.trust_remote_code,
            **lora.quantization_kwargs(cfg.load_in_4bit, bf16=cfg.bf16),
        )
        # LoRA: the reference is the policy with its adapters off (lora.adapter_disabled), not a copy
        self.ref_policy: Any = None
        if cfg.use_peft:
            self.policy = lora.wrap_with_lora(
                self.policy,
                r=cfg.lora_r,
                alpha=cfg.lora_alpha,
                dropout=cfg.lora_dropout,
                target_modules=cfg.lora_target_modules,
                gradient_checkpointing=cfg.gradient_checkpointing,
                quantized=cfg.load_in_4bit,
            )
            trainable, total = self.param_counts = lora.parameter_counts(self.policy)
            log.info(
                "LoRA: %s of %s parameters trainable (%.2f%%)",
                f"{trainable:,}",
                f"{total:,}",
                100 * trainable / total,
            )
        else:
            self.param_counts = lora.parameter_counts(self.policy)  # (trainable, total): all of them
            self.ref_policy = load_causal_lm(
                cfg.policy_path, flag=policy_flag, trust_remote_code=cfg.trust_remote_code
            )
            self.ref_policy.eval().requires_grad_(False)
        self.stop_token_id = (
            cfg.stop_token_id
            if cfg.stop_token_id is not None
            else (self.tokenizer.eos_token_id if cfg.stop_token == "eos" else None)
        )

    def _setup_rewards(self) -> None:
        """Reward sources: a reward model and/or reward functions, with their weights."""
        cfg = self.cfg
        self.sources: list[Any] = []
        if cfg.reward_model_path:
            rm, rm_tok = load_reward_model(cfg.reward_model_path, trust_remote_code=cfg.trust_remote_code)
            self.sources.append(
                RewardModelSource(
                    rm,
                    rm_tok,
                    batch_size=cfg.local_rollout_forward_batch_size,
                    device=self.device,
                    autocast=self.accelerator.autocast,
                )
            )
        self.sources += [RewardFunctionSource(spec) for spec in cfg.reward_funcs]
        self.reward_weights = torch.tensor(
            cfg.reward_weights or [1.0] * len(self.sources), dtype=torch.float32
        )

    def _setup_prompts(self) -> None:
        """Prompts formatted and tokenised once, cut to the model's length."""
        self.train_texts = format_prompts(self.train_ds.prompts, self.tokenizer)
        self.train_ids = tokenize_prompts(self.train_texts, self.tokenizer, chat=self.train_ds.conversational)
        self.eval_texts = format_prompts(self.eval_ds.prompts, self.tokenizer)
        self.eval_ids = tokenize_prompts(self.eval_texts, self.tokenizer, chat=self.eval_ds.conversational)
        if any(len(ids) == 0 for ids in self.train_ids):
            raise UserError("a training prompt tokenises to nothing; drop empty prompts from the dataset.")
        self.truncated_prompts = self._fit_prompts()

    def _setup_optimization(self) -> None:
        """Activation checkpointing, the optimizer over the trainable parameters, the schedule."""
        cfg = self.cfg
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.policy)
        if cfg.torch_compile:
            if deepspeed_utils.is_zero3(self.accelerator):
                raise UserError(
                    "--torch_compile compiles the policy's layers, whose parameters ZeRO-3 gathers inside them: "
                    "drop --torch_compile under ZeRO-3 (or train with ZeRO-2)."
                )
            log.info(
                "torch.compile: %d decoder layers, one graph (compiled at the first forward)",
                compile_decoder_layers(self.policy),
            )
        self.optimizer = make_adamw(
            # the trainable ones: with LoRA only the adapters (every parameter otherwise, in the same order)
            [q for q in self.policy.parameters() if q.requires_grad],
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_epsilon,
            weight_decay=cfg.weight_decay,
        )
        from transformers import get_scheduler

        self.num_updates = int(self.plan.num_total_batches or 1)
        warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * self.num_updates)
        # One scheduler step per update, as the reference does.
        self.scheduler = get_scheduler(
            cfg.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=warmup,
            num_training_steps=self.num_updates,
        )

    def _setup_distributed(self) -> None:
        """Collectives, DeepSpeed or plain placement of the policy, reference and reward models."""
        cfg = self.cfg
        from accelerate.utils import DistributedType

        self.comm = Collectives(self.accelerator)
        self.world, self.rank = self.comm.world, self.comm.rank
        self.deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        if self.deepspeed:
            deepspeed_utils.fill_deepspeed_config(
                self.accelerator,
                micro_batch_size=cfg.per_device_train_batch_size,
                gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                max_grad_norm=cfg.max_grad_norm,
            )
            self.policy, self.optimizer = self.accelerator.prepare(self.policy, self.optimizer)
        else:
            # Not wrapped in DDP: gradients are averaged by Collectives.average_gradients (see there for why).
            self.policy.to(self.device)
            self.optimizer = self.accelerator.prepare(self.optimizer)
        ref_dtype = precision.reference_dtype(self.accelerator, moving=cfg.sync_ref_model)
        if self.ref_policy is not None and ref_dtype is not None:
            precision.cast_parameters(self.ref_policy, ref_dtype)  # what autocast casts at every call, once
            log.info("reference model: weights in %s", str(ref_dtype).removeprefix("torch."))
        # under ZeRO-3 the frozen models become DeepSpeed inference engines; otherwise just moved
        if self.ref_policy is not None and (self.deepspeed or not cfg.offload_ref_model):
            self.ref_policy = deepspeed_utils.prepare_reference_model(self.ref_policy, self.accelerator)
        for src in self.sources:
            if isinstance(src, RewardModelSource):
                src.model = deepspeed_utils.prepare_reference_model(src.model, self.accelerator)

    def _setup_generation(self) -> None:
        """The sampling backend: vLLM or the built-in transformers generator."""
        cfg = self.cfg
        self.generator = make_generator(
            cfg.generation_settings(),
            self.policy,
            accelerator=self.accelerator,
            batch_size=cfg.local_rollout_forward_batch_size,
            autocast=self.accelerator.autocast,
            max_model_len=max(map(len, self.train_ids + self.eval_ids)) + cfg.response_length,
            # one rollout of this rank is the most sequences the engine ever holds at once
            max_num_seqs=self.plan.prompts_per_rank * cfg.rloo_k,
        )
        if isinstance(self.generator, TransformersGenerator):
            log.info("rollouts: %s", self.generator.describe())
        self.gather_for_generation = cfg.ds3_gather_for_generation and not cfg.use_vllm
        self.generator.weights_version = 0  # counted by the optimizer steps (see _optimizer_step)

    def _setup_run_state(self) -> None:
        """Checkpoints, the trainer's position in the run (sampler, counters) and the plan, logged."""
        cfg = self.cfg
        self.checkpoints = CheckpointManager(
            accelerator=self.accelerator,
            cfg=cfg,
            policy=self.policy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            tokenizer=self.tokenizer,
            num_updates=self.num_updates,
            trainer_state=self._trainer_state,
            mirror=self.mirror,
            remote=self.remote,
            deepspeed=self.deepspeed,
            comm=self.comm,
            # a moving reference is part of the run's state: a resume must not measure KL to the SFT model
            reference=self.ref_policy if cfg.sync_ref_model else None,
        )
        if cfg.sync_ref_model and cfg.ref_model_sync_steps > self.num_updates:
            log.warning(
                "--ref_model_sync_steps %d is more than the run's %d updates: the reference never moves",
                cfg.ref_model_sync_steps,
                self.num_updates,
            )
        self.state = TrainerState(max_steps=self.num_updates)
        # Options that can leave a micro-batch with no token to train on: its ratio stats are left out.
        self.masks_loss = cfg.mask_truncated_completions or cfg.filter_groups or cfg.top_entropy_quantile < 1
        # One optimizer step per rollout: the policy is never updated between sampling and its loss.
        self.on_policy = cfg.num_ppo_epochs * cfg.num_mini_batches == 1
        self.sampler = PromptSampler(len(self.train_ds), cfg.seed)
        self._num_tokens = 0.0
        self._length_corr_streak = 0
        self._warned_nothing_kept = False
        # the update whose sample table is owed: set from its safe point until the table is logged, so that a
        # preemption in between checkpoints it as owed and the resumed run logs it first
        self._samples_due: int | None = None
        self.sample_freq = (
            max(1, self.num_updates // cfg.num_sample_generations) if cfg.num_sample_generations > 0 else 0
        )
        log.info(
            "RLOO: %d updates x %d completions (%d prompts x k=%d) = %d episodes; %d optimizer steps per update",
            self.num_updates,
            self.plan.batch_size,
            self.plan.batch_size // cfg.rloo_k,
            cfg.rloo_k,
            self.num_updates * self.plan.batch_size,
            cfg.num_ppo_epochs * cfg.num_mini_batches,
        )

    def _fit_prompts(self) -> set[int]:
        """Cut prompts to ``max_prompt_length`` tokens, keeping their end (where the task is asked): past the
        model's positions a learned-position model fails with IndexError and a rotary one trains on positions
        it never saw. Returns the training prompts that were cut."""
        cfg = self.cfg
        found = position_limit(self.policy.config, self.tokenizer)
        keep = cfg.max_prompt_length
        if found is not None:
            limit, source = found
            if limit <= cfg.response_length:
                raise UserError(
                    f"--response_length {cfg.response_length} leaves no room for a prompt: the model takes "
                    f"{limit} positions ({source}); use a response_length below {limit}."
                )
            if keep is None:
                keep = limit - cfg.response_length
            elif keep + cfg.response_length > limit:
                raise UserError(
                    f"--max_prompt_length {keep} + --response_length {cfg.response_length} exceeds the model's "
                    f"{limit} positions ({source}); use a max_prompt_length of at most "
                    f"{limit - cfg.response_length}, or omit it."
                )
        if keep is None:
            return set()
        truncated = {i for i, ids in enumerate(self.train_ids) if len(ids) > keep}
        if truncated:
            longest = max(len(self.train_ids[i]) for i in truncated)
            log.warning(
                "%d of %d training prompts are longer than max_prompt_length (%d tokens, the longest %d): "
                "their beginning is cut off",
                len(truncated),
                len(self.train_ids),
                keep,
                longest,
            )
        self.train_ids = [ids[-keep:] for ids in self.train_ids]
        self.eval_ids = [ids[-keep:] for ids in self.eval_ids]
        return truncated

    # ------------------------------------------------------------------------------------------------
    def forward_logprobs(
        self,
        model: Any,
        ro: Sampled,
        idx: torch.Tensor,
        *,
        entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (b, T) of completions ``idx`` at the sampling temperature, optionally entropies (with
        their gradient for the entropy bonus)."""
        # Activation checkpointing and a KV cache do not mix in transformers, and a compiled layer runs a
        # cache call eager: full rows then. None: sharing each prompt's cache decided by cost.
        whole_rows = self.cfg.gradient_checkpointing or self.cfg.torch_compile
        share = False if model is self.policy and whole_rows else None
        # one autocast region for the micro-batch: the share-prefix path's two model calls cast each weight
        # once, not once per call (autocast caches a weight's cast within its region)
        with self.accelerator.autocast():
            logits = response_logits(
                model, ro.prompt_ids, ro.prompt_mask, ro.rows[idx], ro.responses[idx], share_prefix=share
            )  # (b, T, V)
        # (b, T, V) in the compute dtype: the log-prob and entropy functions divide by the temperature and
        # upcast one chunk of rows at a time, never the whole tensor (2 GB of fp32 at 64 x 53 x 151,936)
        divisor = scoring_temperature(self.cfg.temperature)
        logprobs = algo.selective_log_softmax(logits, ro.responses[idx], temperature=divisor)  # (b, T)
        ent = None
        if entropy and entropy_grad:
            ent = algo.entropy_with_grad(logits, temperature=divisor)  # (b, T)
        elif entropy:
            with torch.no_grad():
                ent = algo.entropy_from_logits(logits.detach(), temperature=divisor)  # (b, T)
        return logprobs, ent

    def batched_logprobs(self, model: Any, ro: Sampled) -> torch.Tensor:
        """No-grad log-probs (B, T), whole prompt groups per chunk of ~local_rollout_forward_batch_size."""
        k = self.cfg.rloo_k
        bs = max(k, self.cfg.local_rollout_forward_batch_size // k * k)
        b = ro.responses.size(0)
        # inference_mode dispatches cheaper than no_grad, but under ZeRO-3 a small (persistent) parameter
        # first gathered here would stay an inference tensor, which the training forward cannot save
        no_grad = torch.no_grad if deepspeed_utils.is_zero3(self.accelerator) else torch.inference_mode
        with no_grad():
            out = torch.cat(
                [
                    self.forward_logprobs(model, ro, torch.arange(i, min(i + bs, b)))[0]
                    for i in range(0, b, bs)
                ]
            )
        return out.clone()  # a normal tensor again: inference tensors may not meet autograd later

    # ------------------------------------------------------------------------------------------------
    def _reward_batch(
        self,
        ds: PromptDataset,
        texts: list[str],
        index: list[int],
        k: int,
        responses: torch.Tensor,
        mask: torch.Tensor,
    ) -> RewardBatch:
        tok = self.tokenizer
        ids = [r[m].tolist() for r, m in zip(responses.cpu(), mask.cpu(), strict=True)]
        completion_texts = tok.batch_decode(ids, skip_special_tokens=True)
        raw = tok.batch_decode(ids, skip_special_tokens=False)
        prompts = [ds.prompts[i] for i in index for _ in range(k)]
        prompt_texts = [texts[i] for i in index for _ in range(k)]
        completions: list[Any] = completion_texts
        if ds.conversational:
            completions = [[{"role": "assistant", "content": c}] for c in completion_texts]
        extra = {c: [v for v in vals for _ in range(k)] for c, vals in ds.extra_for(index).items()}
        return RewardBatch(
            prompts=prompts,
            prompt_texts=prompt_texts,
            completions=completions,
            completion_texts=completion_texts,
            completion_ids=ids,
            scoring_texts=[p + r for p, r in zip(prompt_texts, raw, strict=True)],
            extra=extra,
            trainer_state=self.state,
        )

    def rollout(self, update: int, timer: _Timer) -> Rollout:
        """One update's experience: sample K completions of this rank's prompts and score them (again for
        fresh prompts with --filter_groups), take the policy's and the reference's log-probs of them, and
        turn the scores into advantages."""
        cfg, dev = self.cfg, self.device
        k = cfg.rloo_k
        first = self._sample_and_score(update, timer, 0)
        got, rounds, replaced = first, 1, 0
        while cfg.filter_groups and rounds < cfg.max_num_gen_batches:
            # every rank samples as many rounds: generation's collectives (ZeRO-3, vLLM) stay in step
            if not self.comm.any(bool((~got.informative(k)).any()), dev):
                break
            fresh = self._sample_and_score(update, timer, rounds)
            got, n = group_filter.replace_groups(got, fresh, k, self.train_ids, self.tokenizer.pad_token_id)
            rounds, replaced = rounds + 1, replaced + n
        sampled, index = got.sampled, got.index
        mask = sampled.mask  # (B, T)
        kept = got.informative(k).repeat_interleave(k) if cfg.filter_groups else None  # (B,)
        if kept is not None:
            sampled.loss_mask = sampled.loss_mask & kept[:, None]  # (B, T)
        with timer("logprobs"):
            old_logprobs, ref_logprobs = self._logprobs(update, sampled, got.gen_logprobs)

        with timer("scoring"):
            scores, valid = got.scores, got.valid
            raw_scores = scores.clone()
            if cfg.normalize_reward:  # statistics over the global batch, whatever the process count
                g_scores = algo.normalize_and_clip_scores(
                    self.comm.gather(scores), cfg.reward_clip_range, self.comm.gather(valid)
                )
                scores = self.comm.local(g_scores)
            kl = algo.per_token_kl(old_logprobs, ref_logprobs, mask, cfg.kl_estimator)  # (B, T)
            # objective/kl and kl keep the classic meaning (k1 summed per sequence) whatever the estimator
            kl_k1 = kl if cfg.kl_estimator == "k1" else algo.per_token_kl(old_logprobs, ref_logprobs, mask)
            advantages, rlhf_reward, non_score = self._advantages(scores, valid, kl, mask)

        stats = RolloutStats(
            scores=raw_scores,
            valid=valid,
            kl=algo.sequence_kl(kl_k1, mask),
            neg_logprob=-algo.masked_sum(old_logprobs, mask, dim=1),
            non_score_reward=non_score,
            rlhf_reward=rlhf_reward,
            contains_eos=got.contains_eos,
            length=mask.sum(1),
            prompt_length=sampled.prompt_mask.sum(1).repeat_interleave(k),
        )
        # one gather for all of them; the metrics are over the global batch whatever the process count
        metrics = rollout_metrics(
            RolloutStats.unstack(self.comm.gather(stats.stack())),
            self.comm.gather(got.per_source),
            [src.name for src in self.sources],
            k,
            response_length=cfg.response_length,
        )
        num_cut = torch.tensor([float(sum(i in self.truncated_prompts for i in index))], device=dev)
        metrics["prompts/num_truncated"] = float(self.comm.gather(num_cut).sum())  # global batch
        if kept is not None:
            g_kept = self.comm.gather(kept)
            counts = self.comm.sum(
                torch.tensor([float((~first.informative(k)).sum()), float(replaced)], device=dev)
            )
            n_groups = g_kept.numel() // k
            metrics["filter_groups/kept_frac"] = float(g_kept.float().mean())
            metrics["filter_groups/first_round_zero_std_frac"] = float(counts[0]) / n_groups
            metrics["filter_groups/replaced"] = float(counts[1])
            metrics["filter_groups/rounds"] = float(rounds)
            if not self._warned_nothing_kept and not bool(g_kept.any()) and self.accelerator.is_main_process:
                self._warned_nothing_kept = True
                log.warning(
                    "update %d: --filter_groups kept no group (every prompt's completions scored the same): this "
                    "update trains nothing. If filter_groups/kept_frac stays 0, the reward does not tell the "
                    "completions apart; raise --max_num_gen_batches or check the reward (said once).",
                    update + 1,
                )
        return Rollout.of(
            sampled,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            advantages=advantages,
            metrics=metrics,
            kept=kept,
        )

    def _sample_and_score(self, update: int, timer: _Timer, round_: int) -> group_filter.Scored:
        """This rank's slice of the next prompts of the global order, sampled and scored. ``round_`` > 0
        (--max_num_gen_batches) draws other seeds, so a prompt met again samples anew."""
        # every rank draws the same global list and keeps its slice: the data order, and so the run,
        # does not depend on the number of processes
        ppr = self.plan.prompts_per_rank
        index = self.sampler.next(ppr * self.world)[self.rank * ppr : (self.rank + 1) * ppr]
        with timer("generation"):
            sampled, gen_logprobs = self._sample(update, index, round_)
        with timer("scoring"):
            per_source, scores, valid, contains_eos = self._score(index, sampled)  # (B, S), (B,) x 3
        return group_filter.Scored(index, sampled, gen_logprobs, per_source, scores, valid, contains_eos)

    def _score(
        self, index: list[int], sampled: Sampled
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every reward source's scores of the completions (B, S), their weighted sum with the missing-EOS
        penalty (B,), which completions every source could score (B,), which hold an EOS token (B,)."""
        cfg, dev = self.cfg, self.device
        responses, mask = sampled.responses, sampled.mask  # (B, T)
        batch = self._reward_batch(self.train_ds, self.train_texts, index, cfg.rloo_k, responses, mask)
        per_source = score_all(self.sources, batch).to(dev)  # (B, S)
        scores, valid = algo.combine_reward_sources(per_source, self.reward_weights.to(dev))  # (B,), (B,)
        contains_eos = ((responses == self.tokenizer.eos_token_id) & mask).any(1)  # (B,)
        scores = algo.apply_missing_eos_penalty(scores, contains_eos, cfg.missing_eos_penalty)
        if cfg.overlong_buffer_len:
            lengths = sampled.mask.sum(1)  # (B,)
            scores = scores + algo.soft_overlong_penalty(
                lengths, cfg.response_length, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
            ).to(scores.dtype)
        return per_source, scores, valid, contains_eos

    def _advantages(
        self, scores: torch.Tensor, valid: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Leave-one-out advantages, (B,) or per token (B, T), and the RLHF reward and its KL part (B,), (B,)
        the KL placement asks for (in the reward, per token, or in the loss)."""
        cfg = self.cfg
        k = cfg.rloo_k
        p, t = scores.numel() // k, mask.size(1)
        if cfg.kl_in_loss:
            # The KL is a loss term on the current policy (see optimize): the reward is the score alone.
            rlhf_reward, non_score = scores, torch.zeros_like(scores)  # (B,), (B,)
            advantages = algo.leave_one_out_advantages(rlhf_reward.view(p, k), valid.view(p, k)).view(-1)
            adv_mask = valid
        elif cfg.token_level_kl:
            adv, non_score = algo.token_level_advantages(
                scores.view(p, k), kl.view(p, k, t), mask.view(p, k, t), cfg.kl_coef, valid.view(p, k)
            )
            advantages, non_score = adv.reshape(p * k, t), non_score.reshape(-1)  # (B, T), (B,)
            rlhf_reward = scores + non_score
            adv_mask = mask & valid[:, None]
        else:
            rlhf_reward, non_score = algo.sequence_level_rewards(scores, kl, mask, cfg.kl_coef)  # (B,), (B,)
            advantages = algo.leave_one_out_advantages(rlhf_reward.view(p, k), valid.view(p, k)).view(-1)
            adv_mask = valid
        if cfg.scale_rewards != "none":
            # by the spread of the task scores, as GRPO (whose KL is in the loss): the KL penalty in the
            # reward would give a group of equal scores a tiny std, and its KL noise full-size advantages
            advantages = self._scale_advantages(advantages, scores, valid)
        if cfg.normalize_advantage:  # statistics over the global batch, whatever the process count
            width = advantages.size(-1) if advantages.dim() == 2 else None
            g_adv = algo.normalize_advantages(self.comm.gather(advantages), self.comm.gather(adv_mask))
            advantages = self.comm.local(g_adv)
            if width is not None:
                advantages = advantages[:, :width]
        return advantages, rlhf_reward, non_score

    def _scale_advantages(
        self, advantages: torch.Tensor, rewards: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """--scale_rewards: advantages (B,) or (B, T) divided by the std of their group's or of the global
        batch's scores (B,)."""
        k, mode = self.cfg.rloo_k, self.cfg.scale_rewards
        if mode == "batch":  # statistics over the global batch, whatever the process count
            rewards, valid = self.comm.gather(rewards), self.comm.gather(valid)
        r, v = rewards.view(-1, k), valid.view(-1, k)  # (P, K)
        # each completion's factor, found on ones. Where the scores have no spread (the group's, or the
        # batch's) the advantages stay as they are: they hold only the KL penalty, which 1 / eps would blow up
        factor = algo.scale_advantages(torch.ones_like(r), r, v, mode)  # (P, K)
        spread = (
            algo.informative_groups(r, v)
            if mode == "group"
            else algo.informative_groups(r.reshape(1, -1), v.reshape(1, -1))
        )
        factor = torch.where(spread[:, None], factor, 1.0).view(-1)  # (B,)
        if mode == "batch":
            factor = self.comm.local(factor)
        return advantages * (factor[:, None] if advantages.dim() == 2 else factor)  # (B,) or (B, T)

    def _sample(self, update: int, index: list[int], round_: int = 0) -> tuple[Sampled, torch.Tensor | None]:
        """K completions of each prompt of ``index``, masked after the stop token, and the sampler's own
        log-probs of them (B, T) when it returned them (else None)."""
        cfg, tok, dev = self.cfg, self.tokenizer, self.device
        k, p = cfg.rloo_k, len(index)
        prompt_ids, prompt_mask = left_pad(
            [self.train_ids[i] for i in index], tok.pad_token_id, dev
        )  # (P, L)
        params = SamplingParams(
            max_new_tokens=cfg.response_length,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop_token_id=self.stop_token_id,
            pad_token_id=tok.pad_token_id,
        )
        self.policy.eval()
        seeds = row_seeds(cfg.seed + round_ * 1_000_003, update, torch.tensor(index), k)
        with deepspeed_utils.gather_for_generation(self.policy, self.accelerator, self.gather_for_generation):
            gen = self.generator.generate(
                prompt_ids,
                prompt_mask,
                k,
                params,
                seeds,
                return_logprobs=self.on_policy or cfg.vllm_importance_sampling_correction,
            )
        responses = gen.tokens  # (B, T)
        mask = algo.completion_mask(responses, self.stop_token_id)  # (B, T)
        loss_mask = mask
        if cfg.mask_truncated_completions:  # the config requires a stop token with this flag
            assert self.stop_token_id is not None
            truncated = algo.truncated_completions(responses, self.stop_token_id)  # (B,)
            loss_mask = mask & ~truncated[:, None]  # (B, T)
        if self.stop_token_id is not None:
            responses = algo.truncate_after_stop(responses, self.stop_token_id, tok.pad_token_id)
        gen_logprobs = None if gen.logprobs is None else gen.logprobs.masked_fill(~mask, 0.0)  # (B, T)
        # the config refuses top-k/top-p with this flag; nothing else drops the engine's log-probs
        if cfg.vllm_importance_sampling_correction and gen_logprobs is None:
            raise RuntimeError("the vLLM engine returned no log-probs for the importance sampling correction")
        sampled = Sampled(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            rows=torch.arange(p * k, device=dev) // k,
            responses=responses,
            mask=mask,
            loss_mask=loss_mask,
            sampling_logprobs=gen_logprobs if cfg.vllm_importance_sampling_correction else None,
        )
        return sampled, gen_logprobs

    def _logprobs(
        self, update: int, sampled: Sampled, gen_logprobs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's ("old") and the reference's log-probs of the samples, each (B, T); training stops
        here (one line) on a non-finite value."""
        cfg, dev, mask = self.cfg, self.device, sampled.mask
        if self.on_policy and gen_logprobs is not None:
            # On-policy: the loss takes its "old" log-probs from its own forward (see optimize), so
            # these generation-time values only feed the KL penalty and the entropy metric.
            old_logprobs = gen_logprobs  # (B, T)
        else:
            self.policy.train()  # the same mode as the optimisation forward: ratios start at exactly 1
            old_logprobs = self.batched_logprobs(self.policy, sampled)  # (B, T)
        if self.ref_policy is None:  # LoRA: the base model is the policy with its adapters off
            with lora.adapter_disabled(self.policy) as base:
                ref_logprobs = self.batched_logprobs(base, sampled)  # (B, T)
        else:
            offload = cfg.offload_ref_model and not self.deepspeed  # ZeRO places it itself
            if offload:
                self.ref_policy.to(dev)
            ref_logprobs = self.batched_logprobs(self.ref_policy, sampled)  # (B, T)
            if offload:
                self.ref_policy.to("cpu")  # its GPU memory goes back to the policy's optimisation
        # NaN logits still sample (inverse-CDF sampling never fails): stop here, before they reach the loss
        self._stop_if_nonfinite(
            update,
            {
                "rollout/logprobs": ~(
                    torch.isfinite(old_logprobs.masked_fill(~mask, 0.0)).all()
                    & torch.isfinite(ref_logprobs.masked_fill(~mask, 0.0)).all()
                )
            },
        )
        return old_logprobs, ref_logprobs

    def _token_mean_denominator(self, ro: Rollout, mb: torch.Tensor) -> torch.Tensor | None:
        """With ``token-mean``: the global mini-batch's trained tokens / (micro-batches x ranks), else None.

        Each micro-batch loss is divided by gradient_accumulation_steps and the gradients are averaged over
        ranks, so dividing each micro-batch's token sum by this makes the step's gradient the mean over
        every token of the mini-batch on all ranks: the same whatever the micro-batch size or process count.
        """
        if self.cfg.loss_agg_mode != "token-mean":
            return None
        n = ro.loss_mask[mb.to(ro.loss_mask.device)].sum().float()  # this rank's tokens in the mini-batch
        n = self.comm.sum(n)
        micro_batches = math.ceil(mb.numel() / self.cfg.per_device_train_batch_size)
        # clamp: a mini-batch without tokens has a zero sum; 0 / 1 keeps the loss finite
        return (n / (micro_batches * self.world)).clamp(min=1.0 / (micro_batches * self.world))

    # ------------------------------------------------------------------------------------------------
    def optimize(self, ro: Rollout, update: int) -> dict[str, float]:
        """``num_ppo_epochs`` passes of mini-batch optimizer steps over one rollout; the loss metrics."""
        cfg = self.cfg
        stats = LossStats()
        g = torch.Generator().manual_seed(cfg.seed * 7919 + update)
        self.policy.train()
        for _ in range(cfg.num_ppo_epochs):
            # Mini-batches from global positions (see minibatches.py): the same optimizer steps over the
            # same completions on 1 or N processes; whole groups, so each prompt is computed once per
            # micro-batch (see forward.response_logits).
            for mb in minibatch_rows(
                local_batch_size=ro.prompt_ids.size(0) * cfg.rloo_k,
                world_size=self.world,
                rank=self.rank,
                rloo_k=cfg.rloo_k,
                num_mini_batches=cfg.num_mini_batches,
                generator=g,
            ):
                scale = self._kept_scale(ro, mb)
                if scale is None:  # every group of this mini-batch filtered out, on every rank: no step
                    stats.skip(self.device, optional=self._optional_stats(stats, ro))
                    continue
                num_tokens = self._token_mean_denominator(ro, mb)
                loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)
                for mc_start in range(0, mb.numel(), cfg.per_device_train_batch_size):
                    idx = mb[mc_start : mc_start + cfg.per_device_train_batch_size].to(self.device)
                    loss = self._micro_batch_loss(ro, idx, num_tokens, stats)
                    if scale != 1.0:  # --filter_groups: the mean over the kept sequences, not over all
                        loss = loss * scale
                    if self.deepspeed:  # DeepSpeed decides the optimizer-step boundary itself
                        with self.accelerator.accumulate(self.policy):
                            self.accelerator.backward(loss)
                    else:
                        self.accelerator.backward(loss)  # divided by gradient_accumulation_steps
                    loss_bad |= ~torch.isfinite(loss.detach())  # on device: no sync per micro-batch
                self._optimizer_step(update, loss_bad, stats)
        metrics = stats.metrics(
            self.comm, self.device, skip_nan=self.masks_loss, dual_clip=cfg.clip_ratio_c is not None
        )
        if ro.kept is not None:
            metrics["filter_groups/skipped_steps"] = float(stats.skipped_steps)
        return metrics

    def _optional_stats(self, stats: LossStats, ro: Rollout) -> tuple[list[torch.Tensor], ...]:
        """The loss statistics this run's options fill at every micro-batch."""
        cfg, lists = self.cfg, []
        if cfg.kl_in_loss:
            lists.append(stats.kl_loss)
        if cfg.entropy_coef > 0:
            lists.append(stats.entropy_bonus)
        if cfg.top_entropy_quantile < 1:
            lists += [stats.top_entropy_threshold, stats.top_entropy_kept]
        if ro.sampling_logprobs is not None:
            lists += [stats.vllm_logp_diff_abs, stats.vllm_is_capped, stats.vllm_is_masked]
        return tuple(lists)

    def _kept_scale(self, ro: Rollout, mb: torch.Tensor) -> float | None:
        """--filter_groups: the factor that makes this mini-batch's mean over sequences a mean over its kept
        ones (all ranks counted; :func:`group_filter.loss_scale`), or None when it keeps none. 1.0 without
        the option."""
        if ro.kept is None:
            return 1.0
        num_kept = float(self.comm.sum(ro.kept[mb.to(ro.kept.device)].sum().float()))
        if num_kept == 0:
            return None
        return group_filter.loss_scale(num_kept, mb.numel() * self.world, self.cfg.loss_agg_mode)

    def _micro_batch_loss(
        self,
        ro: Rollout,
        idx: torch.Tensor,
        num_tokens: torch.Tensor | None,
        stats: LossStats,
    ) -> torch.Tensor:
        """The loss of completions ``idx`` (a forward with gradients), its diagnostics appended to ``stats``."""
        cfg = self.cfg
        bonus = cfg.entropy_coef > 0
        logprobs, ent = self.forward_logprobs(
            self.policy, ro, idx, entropy=True, entropy_grad=bonus
        )  # (b, T)
        assert ent is not None  # entropy=True
        # On-policy the weights that sampled the rollout are the ones in this forward, so its own detached
        # log-probs are the exact "old" ones: ratio 1, no extra forward.
        old = logprobs.detach() if self.on_policy else ro.old_logprobs[idx]
        loss_mask = ro.loss_mask[idx]  # (b, T)
        is_weights = self._sampling_weights(ro, idx, old, stats)
        policy_mask = (
            self._top_entropy(ent.detach(), loss_mask, stats) if cfg.top_entropy_quantile < 1 else loss_mask
        )
        loss, st = algo.policy_loss(
            logprobs,
            old,
            ro.advantages[idx],
            policy_mask,
            cfg.cliprange,
            cliprange_high=cfg.cliprange_high,
            loss_agg_mode=cfg.loss_agg_mode,
            max_response_length=cfg.response_length,
            num_tokens=num_tokens,
            is_weights=is_weights,
            importance_sampling_level=cfg.importance_sampling_level,
            clip_ratio_c=cfg.clip_ratio_c,
            delta=cfg.delta,
            # GSPO's ratio measures the whole completion, even where only its high-entropy tokens train
            ratio_mask=None if policy_mask is loss_mask else loss_mask,
        )
        stats.policy_loss.append(loss.detach())
        if cfg.kl_in_loss:
            kl_term = algo.kl_loss(
                logprobs,
                ro.ref_logprobs[idx],
                loss_mask,
                cfg.kl_estimator,
                cfg.loss_agg_mode,
                cfg.response_length,
                num_tokens,
            )
            stats.kl_loss.append(kl_term.detach())
            loss = loss + cfg.kl_coef * kl_term
        if bonus:
            ent_term = algo.agg_loss(ent, loss_mask, cfg.loss_agg_mode, cfg.response_length, num_tokens)
            stats.entropy_bonus.append(ent_term.detach())
            loss = loss - cfg.entropy_coef * ent_term
        stats.entropy.append(algo.masked_mean(ent.detach(), ro.mask[idx]))
        stats.add_policy(st, trained=not self.masks_loss or bool(policy_mask.any()))
        return loss

    def _sampling_weights(
        self, ro: Rollout, idx: torch.Tensor, old: torch.Tensor, stats: LossStats
    ) -> torch.Tensor | None:
        """--vllm_importance_sampling_correction: the weights pi_train / pi_vllm of the sampled tokens, per
        sequence for the classic sequence ratio (whose tokens have no surrogate of their own), per token
        otherwise, unless the mode says; truncated at the cap or masked above it. None without the flag."""
        if ro.sampling_logprobs is None:
            return None
        cfg = self.cfg
        mode = cfg.vllm_importance_sampling_mode
        weights, mismatch = algo.truncated_importance_weights(
            old,
            ro.sampling_logprobs[idx],
            ro.mask[idx],
            cfg.vllm_importance_sampling_cap,
            per_sequence=cfg.classic_sequence_ratio if mode == "auto" else mode.startswith("sequence_"),
            mode="mask" if mode.endswith("_mask") else "truncate",
        )
        stats.vllm_logp_diff_abs.append(mismatch.logp_diff_abs_mean)
        stats.vllm_is_capped.append(mismatch.capped_frac)
        stats.vllm_is_masked.append(mismatch.masked_frac)
        return weights

    def _top_entropy(self, ent: torch.Tensor, loss_mask: torch.Tensor, stats: LossStats) -> torch.Tensor:
        """--top_entropy_quantile: the trained tokens (b, T) whose entropy is in the top quantile of this
        micro-batch's on every rank (as TRL: the threshold over all ranks' tokens)."""
        q = self.cfg.top_entropy_quantile
        # NaN where no token is, padded to the full response length here: a rank whose completions all
        # stopped early has fewer columns, and the gather's own padding (0) would read as zero entropy
        local = torch.where(loss_mask, ent, math.nan)  # (b, T)
        local = torch.nn.functional.pad(local, (0, self.cfg.response_length - local.size(1)), value=math.nan)
        gathered = self.comm.gather(local)  # (world * b, response_length)
        values = gathered[~gathered.isnan()]
        threshold = algo.entropy_quantile_threshold(values, q)
        mask, threshold = algo.top_entropy_mask(ent, loss_mask, q, threshold)
        # NaN where no rank has a token to train on: left out of the update's means, like the ratio stats
        empty = values.numel() == 0
        stats.top_entropy_threshold.append(
            torch.full_like(threshold.float(), math.nan) if empty else threshold.float()
        )
        n = loss_mask.sum().float()
        stats.top_entropy_kept.append(torch.where(n > 0, mask.sum().float() / n.clamp(min=1), math.nan))
        return mask

    def _optimizer_step(self, update: int, loss_bad: torch.Tensor, stats: LossStats) -> None:
        """Average and clip the gradients, stop on a non-finite loss or norm, step."""
        if not self.deepspeed:  # DeepSpeed reduces its gradients itself
            self.comm.average_gradients(self.policy)
        checks = {"loss": loss_bad}
        if self.cfg.max_grad_norm > 0:
            gn = self.accelerator.clip_grad_norm_(self.policy.parameters(), self.cfg.max_grad_norm)
            if gn is not None:  # DeepSpeed clips inside its step and reports nothing here
                stats.grad_norm.append(torch.as_tensor(gn).float())
                checks["grad norm"] = ~torch.isfinite(torch.as_tensor(gn))
        # before the step: a NaN gradient would otherwise turn every weight into NaN
        self._stop_if_nonfinite(update, checks)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the engine's copy (vLLM) is stale now: the next generation pushes, resampling rounds before it do not
        self.generator.weights_version = (self.generator.weights_version or 0) + 1

    def _stop_if_nonfinite(self, update: int, checks: dict[str, torch.Tensor]) -> None:
        """Stop training (one line) when a check of ``checks`` (phase -> 0-dim bool "is bad") is true on any
        rank; one host sync and, on several processes, one all-reduce, so every rank stops together."""
        flags = torch.stack([c.reshape(()).to(self.device, torch.float32) for c in checks.values()])
        flags = self.comm.sum(flags)
        bad = [phase for phase, f in zip(checks, flags.tolist(), strict=True) if f > 0]
        if bad:
            what = {
                "rollout/logprobs": "policy or reference log-probs of the rollout",
                "loss": "policy loss",
                "grad norm": "gradient norm",
            }
            raise UserError(
                f"update {update + 1} of {self.num_updates}: non-finite {what[bad[0]]} (phase {bad[0]}); "
                "training stopped, no model saved (checkpoints written before it are intact): lower "
                f"--learning_rate (got {self.cfg.learning_rate:g}) or check the model and the rewards."
            )

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample_generations(self, update: int) -> list[dict[str, Any]]:
        """Near-greedy completions of the first eval prompts, scored, for a human to read."""
        cfg, tok = self.cfg, self.tokenizer
        n = min(cfg.per_device_eval_batch_size, len(self.eval_ds))
        index = list(range(n))
        prompt_ids, prompt_mask = left_pad([self.eval_ids[i] for i in index], tok.pad_token_id, self.device)
        params = SamplingParams(
            max_new_tokens=cfg.response_length,
            stop_token_id=self.stop_token_id,
            pad_token_id=tok.pad_token_id,
            greedy=True,
        )
        self.policy.eval()
        with deepspeed_utils.gather_for_generation(self.policy, self.accelerator, self.gather_for_generation):
            responses = self.generator.generate(
                prompt_ids, prompt_mask, 1, params, torch.zeros(n, dtype=torch.long)
            ).tokens
        mask = algo.completion_mask(responses, self.stop_token_id)
        batch = self._reward_batch(self.eval_ds, self.eval_texts, index, 1, responses, mask)
        scores, valid = algo.combine_reward_sources(score_all(self.sources, batch), self.reward_weights)
        return [
            {
                "query": self.eval_texts[i],
                "response": batch.completion_texts[i],
                "score": float(s) if v else None,
            }
            for i, (s, v) in enumerate(zip(scores.tolist(), valid.tolist(), strict=True))
        ]

    # ------------------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Resume where a previous run stopped, run the remaining updates (rollout, then optimization),
        checkpoint, and publish the final model; on SIGTERM (or a first Ctrl-C), checkpoint and exit with 143
        (130). The output's lock is released at the end, whatever the end."""
        try:
            return self._train()
        finally:
            self.release_output()

    def _train(self) -> TrainResult:
        cfg = self.cfg
        out_dir = cfg.local_output_dir
        start = time.perf_counter()
        if self.remote is not None:
            log.info("output %s, staged in %s", self.remote.uri, out_dir)
        if self.checkpoints.already_complete(out_dir):
            return TrainResult(
                output_dir=out_dir, history=[], seconds=0.0, episodes=self.num_updates * self.plan.batch_size
            )
        resumed = self._resume(out_dir)
        logger = self._open_logger(out_dir, resumed)
        preemption = _Preemption(cfg.preemption_grace_seconds)
        preemption.install()
        if self.world == 1:  # in-loop checks would desynchronise ranks: multi-process checks between phases
            self.generator.should_stop = preemption.requested
        status: Status = "FAILED"
        # the updates whose weights are in the model: a preemption checkpoints the run at this point
        position = resumed or 0
        try:
            if self._samples_due is not None:  # preempted before its sample table: owed first
                self._sample_table(logger, self._samples_due, preemption)
            for update in range(resumed or 0, self.num_updates):
                metrics = self._update(update, preemption)
                position = update + 1
                self._report(logger, update, metrics, out_dir, first_of_run=resumed is None and update == 0)
                if self.sample_freq and update % self.sample_freq == 0:
                    self._sample_table(logger, update + 1, preemption)
                if cfg.save_steps and (update + 1) % cfg.save_steps == 0 and update + 1 < self.num_updates:
                    self.checkpoints.save(out_dir, update + 1)
            # a signal during the last update's reports: the checkpoint spares the final save's grace period
            self._phase("finish", self.num_updates, preemption)
            self._finish(out_dir, logger)
            status = "FINISHED"
            if self.comm.any(preemption.requested(), self.device):
                self._finished_when_preempted(out_dir, preemption)
        except _Preempted:
            status = "KILLED"
            self._checkpoint_preempted(out_dir, logger, position, preemption)
            raise SystemExit(preemption.exit_code) from None
        finally:
            preemption.uninstall()
            self.generator.should_stop = None
            # process groups torn down explicitly: gloo otherwise aborts now and then at interpreter exit
            if self.mirror is not None:
                self.mirror.close()
            self.accelerator.end_training()
            if self.accelerator.is_main_process:
                logger.close(status=status)
        elapsed = time.perf_counter() - start
        if self.accelerator.is_main_process:
            where = cfg.publish_uri or (self.remote.uri if self.remote is not None else str(out_dir))
            last = logger.history[-1] if logger.history else {}
            log.info(
                "done in %.0fs: %d update%s, %d episodes%s; the model is in %s",
                elapsed,
                self.num_updates,
                "" if self.num_updates == 1 else "s",
                self.state.episode,
                f", last reward {last['objective/scores']:.4g}, kl {last['objective/kl']:.4g}"
                if last
                else "",
                where,
            )
        return TrainResult(
            output_dir=out_dir, history=logger.history, seconds=elapsed, episodes=self.state.episode
        )

    def _open_logger(self, out_dir: Path, resumed: int | None) -> MetricsLogger:
        """The metrics logger, its parameters held until the first update; a resumed run's history kept."""
        main = self.accelerator.is_main_process
        logger = MetricsLogger(
            total_updates=self.num_updates,
            show_progress=main and not self.cfg.disable_tqdm,
            sinks=self.sinks,
            progress_start=resumed or 0,
        )
        trainable, total = self.param_counts
        # held until open(): nothing reaches MLflow before update 1
        logger.log_params(
            {**self.cfg.recorded(), "model/trainable_params": trainable, "model/total_params": total}
        )
        if resumed is not None and main:
            logger.open(out_dir, keep_until_update=resumed)
        return logger

    def _update(self, update: int, preemption: _Preemption) -> dict[str, Any]:
        """One RLOO update: rollout, optimization, scheduler step; its metrics. A preemption before the
        optimization leaves the run where this update started (_Preempted)."""
        cfg = self.cfg
        timer = _Timer(self.device)
        t0 = time.perf_counter()
        data_position = self.sampler.state_dict()
        self.state.global_step = update
        self.state.epoch = self.state.episode / max(1, len(self.train_ds) * cfg.rloo_k)
        self._phase("generation", update, preemption)
        try:
            ro = self.rollout(update, timer)
            self._phase("optimization", update, preemption)
        except (_Preempted, GenerationInterrupted):
            # nothing of this update reached the weights: checkpoint the state it started from
            self.sampler.load_state_dict(data_position)
            raise _Preempted from None
        with timer("optimization"):
            opt_metrics = self.optimize(ro, update)
        if cfg.sync_ref_model and ref_sync.should_sync(update, cfg.ref_model_sync_steps):
            with timer("ref_sync"):
                ref_sync.sync_reference(
                    self.ref_policy,
                    self.policy,
                    cfg.ref_model_mixup_alpha,
                    accelerator=self.accelerator,
                    deepspeed=self.deepspeed,
                )
            if self.accelerator.is_main_process:
                log.info(
                    "update %d: the reference model moved toward the policy (alpha %g)",
                    update + 1,
                    cfg.ref_model_mixup_alpha,
                )
        self._watch_length_correlation(update, ro.metrics["monitor/score_length_corr"])
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.state.episode += self.plan.batch_size
        dt = time.perf_counter() - t0
        gen_tokens = ro.metrics.pop("tokens/completion")
        prompt_tokens = ro.metrics.pop("tokens/prompt")
        self._num_tokens += gen_tokens + prompt_tokens
        metrics: dict[str, Any] = {
            "update": update + 1,
            "episode": self.state.episode,
            "epoch": self.state.episode / max(1, len(self.train_ds) * cfg.rloo_k),
            "lr": lr,
            "eps": self.plan.batch_size / dt,
            "num_tokens": self._num_tokens,
            **ro.metrics,
            **opt_metrics,
            "time/update_s": dt,
            **{f"time/{name}_s": s for name, s in timer.seconds.items()},
            **{f"memory/{name}_peak_gib": g for name, g in timer.peak_gib.items()},
            "throughput/generated_tokens_per_s": gen_tokens / max(timer.seconds["generation"], 1e-9),
            "throughput/train_tokens_per_s": (gen_tokens + prompt_tokens)
            * cfg.num_ppo_epochs
            / max(timer.seconds["optimization"], 1e-9),
        }
        return metrics

    def _sample_table(self, logger: MetricsLogger, step: int, preemption: _Preemption) -> None:
        """The sample generations after update ``step``, logged. A preemption before or during them
        checkpoints the run after update ``step`` with the table owed (_Preempted): the resumed run, holding
        the same weights, generates and logs it before its next update."""
        self._samples_due = step
        self._phase("samples", step - 1, preemption)
        try:
            rows = self.sample_generations(step)
        except GenerationInterrupted:
            raise _Preempted from None
        if self.accelerator.is_main_process:
            logger.samples(step, rows)
        self._samples_due = None

    def _watch_length_correlation(self, update: int, corr: float) -> None:
        """One warning when the score-length correlation has stayed above the threshold for
        --length_corr_warn_updates updates in a row (the count survives a resume)."""
        cfg = self.cfg
        self._length_corr_streak = (
            self._length_corr_streak + 1 if corr > cfg.length_corr_warn_threshold else 0
        )
        warn = cfg.length_corr_warn_updates and self._length_corr_streak == cfg.length_corr_warn_updates
        if warn and self.accelerator.is_main_process:
            log.warning(
                "update %d: the score has correlated with completion length above %g for %d updates in a "
                "row (monitor/score_length_corr %.2f): the policy may be gaining reward by length, not by "
                "the task. Look at the samples; --overlong_buffer_len or a length-aware reward counter it.",
                update + 1,
                cfg.length_corr_warn_threshold,
                self._length_corr_streak,
                corr,
            )

    def _report(
        self,
        logger: MetricsLogger,
        update: int,
        metrics: dict[str, Any],
        out_dir: Path,
        *,
        first_of_run: bool,
    ) -> None:
        """Metrics every ``logging_steps`` (and the last), the progress bar: main process only."""
        if not self.accelerator.is_main_process:
            return
        if (update + 1) % self.cfg.logging_steps == 0 or update + 1 == self.num_updates:
            logger.log(metrics)
        if first_of_run:
            logger.open(out_dir)  # the first update succeeded: from here on, output is kept
        logger.progress(1, reward=metrics["objective/scores"], kl=metrics["objective/kl"])

    def _finish(self, out_dir: Path, logger: MetricsLogger) -> None:
        """The final model and its plots; an s3:// output_dir counts as done once its manifest is there."""
        self.checkpoints.save_final(out_dir)
        if self.mirror is not None:
            self.mirror.wait()  # the newest checkpoint must be safe before the run counts as done
        if self.accelerator.is_main_process:
            logger.write_plots()
            if self.train_ds.record is not None:  # what this model was trained on, digest included
                write_bytes_atomic(
                    out_dir / TRAINING_DATASET_FILE,
                    self.train_ds.record.to_json().encode(),
                    "the dataset record",
                )
        self.checkpoints.publish(out_dir)

    def _checkpoint_preempted(
        self, out_dir: Path, logger: MetricsLogger, update: int, preemption: _Preemption
    ) -> None:
        """SIGTERM or Ctrl-C: checkpoint the run after ``update`` updates (after SIGTERM within the grace
        period); the periodic checkpoint of that update serves when nothing has happened since."""
        if self.accelerator.is_main_process and logger.output_dir is None:
            logger.open(out_dir, keep_until_update=update)
        path = self.checkpoints.saved(update) if self._samples_due is None else None
        path = path or self.checkpoints.save(out_dir, update)
        if self.mirror is not None:
            self.mirror.wait()  # a fresh pod resumes from the mirror: it must hold this checkpoint
        preemption.cancel_deadline()
        log.warning(
            "%s: saved %s after %d of %d updates; run the same command again to resume",
            "Ctrl-C" if preemption.signal_name == "SIGINT" else "SIGTERM",
            path,
            update,
            self.num_updates,
        )

    def _finished_when_preempted(self, out_dir: Path, preemption: _Preemption) -> None:
        """SIGTERM or Ctrl-C while the final model was written: it is complete, so that is the checkpoint;
        exit as a preempted run does (the same command then finds nothing to do)."""
        preemption.cancel_deadline()
        log.warning(
            "%s: the run had finished: the model is in %s",
            "Ctrl-C" if preemption.signal_name == "SIGINT" else "SIGTERM",
            self.cfg.publish_uri or (self.remote.uri if self.remote is not None else out_dir),
        )
        raise SystemExit(preemption.exit_code)

    # ------------------------------------------------------------------------------------------------
    # checkpoints, resume, preemption
    def _phase(self, name: str, update: int, preemption: _Preemption) -> None:
        """A safe point between phases: run the phase hooks, then honour SIGTERM or Ctrl-C (agreed across
        ranks)."""
        for hook in PHASE_HOOKS:
            hook(update, name)
        if self.comm.any(preemption.requested(), self.device):
            raise _Preempted

    def _trainer_state(self, update: int) -> dict[str, Any]:
        return {
            "update": update,
            "num_updates": self.num_updates,
            "episode": self.state.episode,
            "num_tokens": self._num_tokens,
            "length_corr_streak": self._length_corr_streak,
            "samples_due": self._samples_due,
            **self.sampler.state_dict(),
            "world_size": self.world,
            "seed": self.cfg.seed,
        }

    def _resume(self, out_dir: Path) -> int | None:
        """Restore the newest (or the given) checkpoint and this trainer's position in the run; return the
        update it was taken at, or None for a fresh run."""
        st = self.checkpoints.resume(out_dir)
        if st is None:
            return None
        self.state.episode = int(st["episode"])
        self._num_tokens = float(st["num_tokens"])
        self._length_corr_streak = int(st.get("length_corr_streak", 0))  # older checkpoints: none
        due = st.get("samples_due")
        self._samples_due = None if due is None else int(due)
        self.sampler.load_state_dict(st)
        return int(st["update"])


class _Preempted(Exception):
    """Raised at a safe point after SIGTERM or a first Ctrl-C: checkpoint and exit."""


class _Preemption:
    """SIGTERM or a first Ctrl-C (SIGINT) sets a flag the loop checks at safe points; a second Ctrl-C quits at
    once, without a checkpoint (KeyboardInterrupt). After SIGTERM a watchdog bounds the time to exit.

    Kubernetes sends SIGTERM before evicting a pod and SIGKILL ``terminationGracePeriodSeconds`` later.
    The loop checkpoints at its next safe point (between decode steps on one process, between phases on
    several); if that has not finished within the grace period, the watchdog exits anyway: the newest
    complete checkpoint is still there, only the current update is lost. Ctrl-C has no SIGKILL behind it:
    the person who pressed it can press it again.
    """

    def __init__(self, grace_seconds: float) -> None:
        self.grace_seconds = grace_seconds
        self._flag = threading.Event()
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}
        # the signal that asked to stop on this process (None: another rank's, agreed through the collectives)
        self.signal_name: str | None = None

    def requested(self) -> bool:
        return self._flag.is_set()

    @property
    def exit_code(self) -> int:
        return 128 + (signal.SIGINT if self.signal_name == "SIGINT" else signal.SIGTERM)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
        # a process started with Ctrl-C ignored (nohup, a background job) keeps ignoring it
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        first = not self._flag.is_set()
        if signum == signal.SIGINT:
            if not first:
                log.warning("Ctrl-C again: quitting now, without a checkpoint")
                raise KeyboardInterrupt
            self.signal_name = "SIGINT"
            self._flag.set()
            log.warning(
                "Ctrl-C (SIGINT) received: checkpointing at the next safe point, then exiting (run the same "
                "command again to resume); press Ctrl-C again to quit at once without a checkpoint"
            )
            return
        self.signal_name = "SIGTERM"
        self._flag.set()
        if self._timer is not None:
            return
        log.warning(
            "SIGTERM received: checkpointing at the next safe point (at most %.0fs)", self.grace_seconds
        )
        self._timer = threading.Timer(self.grace_seconds, self._deadline)
        self._timer.daemon = True
        self._timer.start()

    def cancel_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _deadline(self) -> None:
        log.error("no checkpoint within %.0fs of SIGTERM: exiting without one", self.grace_seconds)
        os._exit(143)


@dataclass
class TrainResult:
    output_dir: Path
    history: list[dict[str, Any]]
    seconds: float
    episodes: int


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute activations in backward (non-reentrant), whichever name this transformers uses."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def train(cfg: RLOOConfig) -> TrainResult:
    """Run ``rloo train`` for a validated config."""
    return RLOOTrainer(cfg).train()
