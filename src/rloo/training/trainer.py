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

Steps 1-4 are :class:`~rloo.training.experience.ExperienceProducer`, which returns one typed ``Experience``;
step 5 is :class:`~rloo.training.update.PolicyUpdater`, which reads that batch and nothing else. This module
sets up their handles and runs the loop around them: checkpoints, resume, preemption, metrics and reports.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rloo.agents.episodes import EpisodeRunner, make_episode_runner
from rloo.config import BatchPlan, RLOOConfig, local_output_dir, mirror_uri, output_location
from rloo.data import (
    TRAINING_DATASET_FILE,
    format_prompts,
    load_prompt_dataset,
    tokenize_prompts,
)
from rloo.diskspace import write_bytes_atomic
from rloo.errors import UserError
from rloo.generation import (
    GenerationInterrupted,
    TransformersGenerator,
)
from rloo.models import (
    check_model_source,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    position_limit,
)
from rloo.tracking.base import Status
from rloo.training import (
    deepspeed_utils,
    frozen,
    judge_reward,
    lora,
    precision,
    process_group,
    ref_sync,
    teacher,
)
from rloo.training.async_rollout import AHEAD_FILE, RolloutsAhead
from rloo.training.checkpoint_manager import CheckpointManager
from rloo.training.collectives import Collectives
from rloo.training.compile import compile_decoder_layers
from rloo.training.completion_logprobs import LogProbs, NonFiniteGuard
from rloo.training.experience import ExperienceProducer, Prompts
from rloo.training.metrics import MetricsLogger
from rloo.training.micro_batch import apply_micro_batches
from rloo.training.optim import make_adamw
from rloo.training.output_lock import OutputLock
from rloo.training.preemption import Preempted, Preemption
from rloo.training.prompts import fit_prompts, warn_if_batch_exceeds_prompts
from rloo.training.rewards import (
    EnvironmentRewardSource,
    RewardFunctionSource,
    RewardModelSource,
    TrainerState,
)
from rloo.training.rollout_backend import make_rollout_generator
from rloo.training.sampler import PromptSampler
from rloo.training.step_timer import StepTimer
from rloo.training.update import PolicyUpdater
from rloo.training.vllm_server import GeneratorLost

log = logging.getLogger(__name__)

# Called as hook(update index, phase name) at each safe point, before the preemption check: "generation" and
# "optimization" of each update, "samples" before a sample table, "finish" before the final model.
# Empty in production; the resume tests add one that SIGKILLs the process (tests/fixtures/kill_at.py).
PHASE_HOOKS: list[Callable[[int, str], None]] = []


class RLOOTrainer:
    """Loads everything up front (so bad input fails before anything is written), then ``train()``."""

    def __init__(self, cfg: RLOOConfig) -> None:
        # Set-up in the order that fails cheapest first: flags and locations, reporting (an unreachable
        # MLflow server or a malformed URI is one line before any model loads), data, then models.
        self.cfg = cfg
        self.output_lock: OutputLock | None = None
        self.remote = check_locations(cfg)
        seed_everything(cfg.seed)
        # whatever ends this process (a finished run, a refusal, an error), its ranks' process groups are
        # destroyed before the interpreter's teardown, where gloo would abort it
        process_group.release_at_exit()
        self._setup_accelerator()
        # before anything is loaded: a second run on the same output is refused in seconds
        self._lock_output()
        try:
            self.sinks, self.mirror = reporting(cfg, self.remote, self.accelerator.is_main_process)
            self._setup_data()
            self._setup_models()
            self._setup_rewards()
            self._setup_prompts()
            self._setup_optimization()
            self._setup_distributed()
            self._setup_generation()
            self._setup_run_state()
            self._setup_experience()
        except BaseException:
            self.release_output()
            raise

    def _lock_output(self) -> None:
        """One run per output at a time (:mod:`rloo.training.output_lock`): the main process locks it, and
        a refusal there is raised on every rank."""
        cfg = self.cfg
        failure: UserError | None = None
        if self.accelerator.is_main_process:
            flag = "--local_dir" if self.remote is not None and cfg.local_dir else "--output_dir"
            try:
                self.output_lock = OutputLock.acquire(local_output_dir(cfg), self.remote, local_dir_flag=flag)
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
        warn_if_batch_exceeds_prompts(
            self.plan, self.cfg.rloo_k, self.train_ds, self.accelerator.is_main_process
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
        if cfg.cast_lm_head_to_fp32:  # after LoRA, whose adapter on the head it refuses (reference: frozen)
            precision.lm_head_in_fp32(self.policy)
        self.stop_token_id = stop_token_id(cfg, self.tokenizer)

    def _setup_rewards(self) -> None:
        """Reward sources: a reward model, reward functions, an environment's, an LLM judge's; their weights."""
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
        self.episodes = episode_runner(cfg, self.tokenizer)  # None: single-turn rollouts
        self.sources += environment_source(
            self.episodes, others=len(self.sources) + bool(cfg.teacher_model_path or cfg.judge_reward_coef)
        )
        weights = (cfg.reward_weights or [1.0] * len(self.sources)) + [1.0]  # the environment's: 1 by default
        self.sources, self.reward_weights = judge_reward.with_judge(cfg, self.train_ds, self.sources, weights)

    def _setup_prompts(self) -> None:
        """Prompts formatted and tokenised once, cut to the model's length."""
        tools = self.episodes.schemas() if self.episodes is not None else None  # shown to the model
        self.train_texts = format_prompts(self.train_ds.prompts, self.tokenizer, tools=tools)
        self.train_ids = tokenize_prompts(self.train_texts, self.tokenizer, chat=self.train_ds.conversational)
        self.eval_texts = format_prompts(self.eval_ds.prompts, self.tokenizer, tools=tools)
        self.eval_ids = tokenize_prompts(self.eval_texts, self.tokenizer, chat=self.eval_ds.conversational)
        if any(len(ids) == 0 for ids in self.train_ids):
            raise UserError("a training prompt tokenises to nothing; drop empty prompts from the dataset.")
        self.train_ids, self.eval_ids, self.truncated_prompts = fit_prompts(
            self.cfg, position_limit(self.policy.config, self.tokenizer), self.train_ids, self.eval_ids
        )

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
        """Collectives, DeepSpeed or plain placement of the policy, reference, teacher and reward models."""
        cfg = self.cfg
        from accelerate.utils import DistributedType

        self.comm = Collectives(self.accelerator)
        self.world, self.rank = self.comm.world, self.comm.rank
        self.deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        self.micro = apply_micro_batches(cfg, self.accelerator, self.policy, self.train_ids, comm=self.comm)
        if self.deepspeed:
            self.policy, self.optimizer = self.accelerator.prepare(self.policy, self.optimizer)
        else:
            # Not wrapped in DDP: gradients are averaged by Collectives.average_gradients (see there for why).
            self.policy.to(self.device)
            self.optimizer = self.accelerator.prepare(self.optimizer)
        self.ref_policy = frozen.place_reference(self.ref_policy, self.accelerator, cfg, self.deepspeed)
        self.teacher = teacher.load_teacher(cfg, self.tokenizer, self.accelerator)  # None: no distillation
        for src in self.sources:
            if isinstance(src, RewardModelSource):
                src.model = deepspeed_utils.prepare_reference_model(src.model, self.accelerator)

    def _setup_generation(self) -> None:
        """The sampling backend: vLLM or the built-in transformers generator."""
        cfg = self.cfg
        self.generator = make_rollout_generator(
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
        self.generator.weights_version = 0  # the updater's optimizer steps (see _update)

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
            extra_state=lambda: {AHEAD_FILE: self.ahead.state()} if self.ahead is not None else {},
        )
        warn_if_reference_never_moves(cfg, self.num_updates)
        self.state = TrainerState(max_steps=self.num_updates)
        self.sampler = PromptSampler(len(self.train_ds), cfg.seed)
        self._num_tokens = 0.0
        self._length_corr_streak = 0
        # the update whose sample table is owed: set from its safe point until the table is logged, so that a
        # preemption in between checkpoints it as owed and the resumed run logs it first
        self._samples_due: int | None = None
        self.sample_freq = (
            max(1, self.num_updates // cfg.num_sample_generations) if cfg.num_sample_generations > 0 else 0
        )
        log_plan(cfg, self.plan, self.num_updates)

    def _setup_experience(self) -> None:
        """The producer of each update's experience and the updater that consumes it, each handed what it
        reads."""
        cfg = self.cfg
        self.logprobs = LogProbs(
            self.accelerator,
            self.policy,
            temperature=cfg.temperature,
            cache_free=cfg.gradient_checkpointing or cfg.torch_compile,
            compiled_layers=cfg.torch_compile,
            rloo_k=cfg.rloo_k,
            chunk_size=cfg.local_rollout_forward_batch_size,
        )
        guard = NonFiniteGuard(
            self.comm, self.device, num_updates=self.num_updates, learning_rate=cfg.learning_rate
        )
        self.producer = ExperienceProducer(
            cfg,
            plan=self.plan,
            generator=self.generator,
            sources=self.sources,
            reward_weights=self.reward_weights,
            tokenizer=self.tokenizer,
            train=Prompts(self.train_ds, self.train_texts, self.train_ids),
            eval=Prompts(self.eval_ds, self.eval_texts, self.eval_ids),
            truncated_prompts=self.truncated_prompts,
            sampler=self.sampler,
            state=self.state,
            policy=self.policy,
            ref_policy=self.ref_policy,
            logprobs=self.logprobs,
            comm=self.comm,
            accelerator=self.accelerator,
            guard=guard,
            stop_token_id=self.stop_token_id,
            episodes=self.episodes,
            teacher_model=self.teacher,
            gather_for_generation=self.gather_for_generation,
            deepspeed=self.deepspeed,
            # one optimizer step per batch: the sampler's log-probs are the policy's
            on_policy=cfg.num_ppo_epochs * cfg.num_mini_batches == 1,
        )
        self.ahead = RolloutsAhead.for_run(cfg, self.producer, self.num_updates)
        self.updater = PolicyUpdater(
            cfg,
            micro_batch_size=self.micro.size,
            policy=self.policy,
            optimizer=self.optimizer,
            accelerator=self.accelerator,
            comm=self.comm,
            logprobs=self.logprobs,
            guard=guard,
            deepspeed=self.deepspeed,
        )

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
        out_dir = local_output_dir(cfg)
        start = time.perf_counter()
        if self.remote is not None:
            log.info("output %s, staged in %s", self.remote.uri, out_dir)
        if self.checkpoints.already_complete(out_dir):
            return TrainResult(
                output_dir=out_dir, history=[], seconds=0.0, episodes=self.num_updates * self.plan.batch_size
            )
        resumed = self._resume(out_dir)
        logger = open_logger(
            cfg,
            self.sinks,
            self.num_updates,
            self.param_counts,
            out_dir,
            resumed,
            main=self.accelerator.is_main_process,
        )
        preemption = Preemption(cfg.preemption_grace_seconds)
        preemption.install()
        # in-loop checks would desynchronise ranks (multi-process checks between phases), and a batch generated
        # ahead is finished, so that the checkpoint holds it
        if self.world == 1 and self.ahead is None:
            self.generator.should_stop = preemption.requested
        status: Status = "FAILED"
        # the updates whose weights are in the model: a preemption checkpoints the run at this point
        self.position = resumed or 0
        if self.ahead is not None:
            self.ahead.load(self.checkpoints.resumed_from)
        try:
            if self._samples_due is not None:  # preempted before its sample table: owed first
                self._sample_table(logger, self._samples_due, preemption)
            for update in range(resumed or 0, self.num_updates):
                metrics = self._update(update, preemption)
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
                where = cfg.publish_uri or (self.remote.uri if self.remote is not None else out_dir)
                preemption.exit_finished(where)
        except Preempted:
            status = "KILLED"
            signal_name = "Ctrl-C" if preemption.signal_name == "SIGINT" else "SIGTERM"
            self._checkpoint_at(out_dir, logger, self.position, signal_name)  # within SIGTERM's grace period
            preemption.cancel_deadline()
            raise SystemExit(preemption.exit_code) from None
        except GeneratorLost:  # exit 75: a retried step resumes here once the server answers again
            self._checkpoint_at(out_dir, logger, self.position, "rollout generation is lost")
            raise
        finally:
            preemption.uninstall()
            self.generator.should_stop = None
            if self.ahead is not None:
                self.ahead.close()
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

    def _update(self, update: int, preemption: Preemption) -> dict[str, Any]:
        """One RLOO update: rollout, optimization, scheduler step; its metrics. A preemption before the
        optimization leaves the run where this update started (Preempted)."""
        cfg = self.cfg
        timer = StepTimer(self.device)
        t0 = time.perf_counter()
        if self.ahead is not None:  # the batches not generated ahead (the run's start): now
            self.ahead.fill(update)
        data_position = self.sampler.state_dict()
        self.state.global_step = update
        self.state.epoch = self.state.episode / max(1, len(self.train_ds) * cfg.rloo_k)
        self._phase("generation", update, preemption)
        try:
            ahead = self.ahead.take(update) if self.ahead is not None else None
            experience = self.producer.produce(update, timer, ahead)
            self._phase("optimization", update, preemption)
        except (Preempted, GenerationInterrupted, GeneratorLost) as e:
            # nothing of this update reached the weights: checkpoint the state it started from (lost: exit 75)
            self.sampler.load_state_dict(data_position)
            if isinstance(e, GeneratorLost):
                raise
            raise Preempted from None
        if self.ahead is not None:  # the batch of update + staleness, from these weights, while they train
            self.ahead.consumed(update)
            self.ahead.launch(update + self.ahead.staleness)
        with timer("optimization"):
            opt_metrics = self.updater.update(experience)
        # the engine's copy (vLLM) is stale now: the next generation pushes, resampling rounds before it do not
        self.generator.weights_version = self.updater.version
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
        self._length_corr_streak = watch_length_correlation(
            cfg,
            self._length_corr_streak,
            update,
            experience.metrics["monitor/score_length_corr"],
            self.accelerator.is_main_process,
        )
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.state.episode += self.plan.batch_size
        self.position = update + 1
        if self.ahead is not None:
            experience.metrics["time/generation_wait_s"] = self.ahead.wait()
        dt = time.perf_counter() - t0
        gen_tokens = experience.metrics.pop("tokens/completion")
        prompt_tokens = experience.metrics.pop("tokens/prompt")
        self._num_tokens += gen_tokens + prompt_tokens
        metrics: dict[str, Any] = {
            "update": update + 1,
            "episode": self.state.episode,
            "epoch": self.state.episode / max(1, len(self.train_ds) * cfg.rloo_k),
            "lr": lr,
            "eps": self.plan.batch_size / dt,
            "num_tokens": self._num_tokens,
            **experience.metrics,
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

    def _sample_table(self, logger: MetricsLogger, step: int, preemption: Preemption) -> None:
        """The sample generations after update ``step``, logged. A preemption before or during them
        checkpoints the run after update ``step`` with the table owed (Preempted): the resumed run, holding
        the same weights, generates and logs it before its next update."""
        self._samples_due = step
        self._phase("samples", step - 1, preemption)
        try:
            rows = self.producer.sample_generations(step)
        except GenerationInterrupted:
            raise Preempted from None
        if self.accelerator.is_main_process:
            logger.samples(step, rows)
        self._samples_due = None

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

    def _checkpoint_at(self, out_dir: Path, logger: MetricsLogger, update: int, why: str) -> None:
        """The run stops after ``update`` updates (``why``): checkpointed (the periodic checkpoint of that
        update when nothing has happened since) and mirrored, for the same command to resume."""
        if self.accelerator.is_main_process and logger.output_dir is None:
            logger.open(out_dir, keep_until_update=update)
        path = self.checkpoints.save_to_resume(out_dir, update, reuse=self._samples_due is None)
        log.warning(
            "%s: saved %s after %d of %d updates; run the same command again to resume",
            *(why, path, update, self.num_updates),
        )

    def _phase(self, name: str, update: int, preemption: Preemption) -> None:
        """A safe point between phases: run the phase hooks, then honour SIGTERM or Ctrl-C (agreed across
        ranks)."""
        for hook in PHASE_HOOKS:
            hook(update, name)
        if self.comm.any(preemption.requested(), self.device):
            raise Preempted

    def _trainer_state(self, update: int) -> dict[str, Any]:
        return {
            "update": update,
            "num_updates": self.num_updates,
            "episode": self.state.episode,
            "num_tokens": self._num_tokens,
            "length_corr_streak": self._length_corr_streak,
            "samples_due": self._samples_due,
            "policy_version": self.updater.version,  # optimizer steps: what a batch's rows are compared with
            **self.sampler.state_dict(),
            **self.updater.entropy.state_dict(),
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
        self.updater.entropy.load_state_dict(st)
        self.updater.version = self.generator.weights_version = int(st.get("policy_version", 0))
        return int(st["update"])


def open_logger(
    cfg: RLOOConfig,
    sinks: list[Any],
    num_updates: int,
    param_counts: tuple[int, int],
    out_dir: Path,
    resumed: int | None,
    *,
    main: bool,
) -> MetricsLogger:
    """The metrics logger, its parameters held until the first update; a resumed run's history kept (on the
    ``main`` process: the others log nothing)."""
    logger = MetricsLogger(
        total_updates=num_updates,
        show_progress=main and not cfg.disable_tqdm,
        sinks=sinks,
        progress_start=resumed or 0,
    )
    trainable, total = param_counts
    # held until open(): nothing reaches MLflow before update 1
    logger.log_params({**cfg.recorded(), "model/trainable_params": trainable, "model/total_params": total})
    if resumed is not None and main:
        logger.open(out_dir, keep_until_update=resumed)
    return logger


def check_locations(cfg: RLOOConfig) -> Any:
    """Flags the machine cannot honour and an output location that is a file: one line each; the s3:// output
    (None: a local one)."""
    if cfg.fp16 and not torch.cuda.is_available():
        raise UserError("--fp16 needs a CUDA GPU; use --bf16 (or neither) on CPU.")
    # an s3:// output_dir is staged locally (checkpoints mirrored, the result uploaded at the end)
    remote = output_location(cfg)
    out = local_output_dir(cfg)
    if out.exists() and not out.is_dir():
        flag = "--local_dir" if remote is not None and cfg.local_dir else "--output_dir"
        raise UserError(f"{flag} {out} is a file; pass a directory.")
    # a mistyped local model path is one line now, not after the datasets have loaded
    for name in ("model_name_or_path", "sft_model_path", "reward_model_path", "teacher_model_path"):
        if getattr(cfg, name):
            check_model_source(name, getattr(cfg, name))
    return remote


def reporting(cfg: RLOOConfig, remote: Any, main: bool) -> tuple[list[Any], Any]:
    """Metric sinks (main process), the s3:// output's access check and the checkpoint mirror."""
    from rloo.tracking import sinks_from_env

    sinks = sinks_from_env(cfg.report_to, stage="train") if main else []
    if remote is not None:
        from rloo.storage.backends import backend_for
        from rloo.tracking.tags import TAG_OUTPUT_DIR

        # one request now: wrong credentials, a missing bucket or an unreachable endpoint are one line
        # before any model is loaded, not a failure after hours of training
        backend_for(remote).check_access(create=False)
        for sink in sinks:  # runs are identified by the prefix, not by this machine's staging dir
            if hasattr(sink, "tags"):
                sink.tags[TAG_OUTPUT_DIR] = remote.uri
    elif cfg.publish_uri:
        from rloo.tracking.tags import TAG_OUTPUT_DIR

        for sink in sinks:  # the pipeline uploads output_dir there: the durable name of this run
            if hasattr(sink, "tags"):
                sink.tags[TAG_OUTPUT_DIR] = cfg.publish_uri
    mirror, uri = None, mirror_uri(cfg)
    if uri and main:
        from rloo.storage import CheckpointMirror

        mirror = CheckpointMirror(uri, keep_last=cfg.save_total_limit)
    return sinks, mirror


def stop_token_id(cfg: RLOOConfig, tokenizer: Any) -> int | None:
    """The token a completion stops at: --stop_token_id, else EOS with --stop_token eos or with episodes (a
    turn of an agent ends there: --tools, --environment), else None (completions run to the length)."""
    if cfg.stop_token_id is not None:
        return cfg.stop_token_id
    agents = bool(cfg.tools or cfg.environment)
    return int(tokenizer.eos_token_id) if cfg.stop_token == "eos" or agents else None


def episode_runner(cfg: RLOOConfig, tokenizer: Any) -> EpisodeRunner | None:
    """What runs each rollout as a multi-turn episode with --tools / --environment; None without them."""
    runner = make_episode_runner(
        tokenizer, cfg, budget=cfg.response_length, max_prompt_length=cfg.max_prompt_length
    )
    if runner is not None:
        rounds = cfg.max_tool_calling_iterations
        log.info(
            "agents: each rollout is an episode; tools %s; %s rounds of tool calls, %g s each; %d tokens after "
            "the prompt, the tools' included",
            ", ".join(s["function"]["name"] for s in runner.schemas()) or "none",
            "unlimited" if rounds is None else f"at most {rounds}",
            cfg.tool_timeout,
            cfg.response_length,
        )
    return runner


def environment_source(episodes: EpisodeRunner | None, *, others: int) -> list[EnvironmentRewardSource]:
    """The environment's reward source when it owns one (its get_reward), else none; one line when it has
    none and there is no ``other`` source."""
    env = episodes.environment if episodes is not None else None
    if env is None:
        return []
    if not env.owns_reward and not others:
        raise UserError(
            f"--environment {env.name} has no get_reward method and no other reward source is given: add "
            "get_reward(self) to it, or pass --reward_funcs / --reward_model_path."
        )
    return [EnvironmentRewardSource(env.name)] if env.owns_reward else []


def watch_length_correlation(cfg: RLOOConfig, streak: int, update: int, corr: float, main: bool) -> int:
    """One warning when the score-length correlation has stayed above the threshold for
    --length_corr_warn_updates updates in a row (the count survives a resume); the count after ``corr``."""
    streak = streak + 1 if corr > cfg.length_corr_warn_threshold else 0
    warn = cfg.length_corr_warn_updates and streak == cfg.length_corr_warn_updates
    if warn and main:
        log.warning(
            "update %d: the score has correlated with completion length above %g for %d updates in a "
            "row (monitor/score_length_corr %.2f): the policy may be gaining reward by length, not by "
            "the task. Look at the samples; --overlong_buffer_len or a length-aware reward counter it.",
            update + 1,
            cfg.length_corr_warn_threshold,
            streak,
            corr,
        )
    return streak


def warn_if_reference_never_moves(cfg: RLOOConfig, num_updates: int) -> None:
    if cfg.sync_ref_model and cfg.ref_model_sync_steps > num_updates:
        log.warning(
            "--ref_model_sync_steps %d is more than the run's %d updates: the reference never moves",
            cfg.ref_model_sync_steps,
            num_updates,
        )


def log_plan(cfg: RLOOConfig, plan: BatchPlan, num_updates: int) -> None:
    """The run's plan in one line."""
    steps = cfg.num_ppo_epochs * cfg.num_mini_batches
    log.info(
        "RLOO: %d updates x %d completions (%d prompts x k=%d) = %d episodes; %d optimizer %s per update",
        num_updates,
        plan.batch_size,
        plan.batch_size // cfg.rloo_k,
        cfg.rloo_k,
        num_updates * plan.batch_size,
        steps,
        "step" if steps == 1 else "steps",
    )


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
    result = RLOOTrainer(cfg).train()
    process_group.release()
    return result
