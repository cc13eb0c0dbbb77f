"""Producing experience: sample completions, score them, take the old and reference log-probs, and turn the
scores into advantages; one typed :class:`Experience` per update, which is all the update reads.

The producer gets its handles passed in (the config, the generator, the reward sources, the tokenizer, the
prompts, the policy and reference, the collectives) and sets nothing on the trainer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from rloo import algo
from rloo.agents.episodes import EpisodeRunner, Episodes, episode_text
from rloo.config import BatchPlan, RLOOConfig
from rloo.data import PromptDataset
from rloo.generation import Generated, SamplingParams, left_pad, row_seeds
from rloo.training import deepspeed_utils, group_filter, lora, teacher
from rloo.training.collectives import Collectives
from rloo.training.completion_logprobs import LogProbs, NonFiniteGuard
from rloo.training.rewards import RewardBatch, TrainerState, score_all
from rloo.training.rollout import RolloutStats, Sampled, rollout_metrics
from rloo.training.sampler import PromptSampler
from rloo.training.step_timer import StepTimer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Experience:
    """One update's experience on this rank: B completions in groups of K (prompt-major, row p*K + k), each a
    row of ``(B, T)`` tensors after its prompt, with everything the update's loss reads.

    Two producers it is written for besides the synchronous one:

    - A producer running ahead (asynchronous generation) samples the batch of update t+1 while update t
      trains. Each row records ``policy_version``, the optimizer steps the sampling weights had taken; the
      update compares it with its own count and takes its ratio's denominator from ``old_logprobs`` whenever
      the batch is older than the weights (it only reuses its own forward when they are the same).
    - A multi-turn episode (assistant turns with tool calls and the tools' results between them) is one row:
      ``responses`` holds the whole episode after the prompt, ``mask`` every token of it (log-probs, KL and
      lengths count there), ``loss_mask`` only the policy's own tokens: a tool's result is zero there, so it
      adds nothing to the loss nor to its gradient. ``advantages`` may be per token (B, T) for per-turn credit.
    """

    update: int  # the update this batch was produced for (seeds the mini-batch order)
    prompt_ids: torch.Tensor  # (P, L) left-padded
    prompt_mask: torch.Tensor  # (P, L)
    rows: torch.Tensor  # (B,) prompt of each completion: b // K
    responses: torch.Tensor  # (B, T) truncated after the stop token
    mask: torch.Tensor  # (B, T) bool: response tokens that count
    # (B, T) bool: the tokens the loss trains on: mask less truncated completions (--mask_truncated_completions),
    # less filtered groups (--filter_groups), less a multi-turn episode's tool tokens
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor  # (B, T) of the policy that sampled
    ref_logprobs: torch.Tensor  # (B, T) of the reference
    # (B, T) the sampler's (vLLM's) own log-probs for --vllm_importance_sampling_correction; else None
    sampling_logprobs: torch.Tensor | None
    scores: torch.Tensor  # (B,) task score, after the penalties, before normalisation and the KL part
    advantages: torch.Tensor  # (B,) or (B, T) with token-level KL
    policy_version: torch.Tensor  # (B,) long on CPU: optimizer steps of the weights that sampled each row
    metrics: dict[str, float]  # the rollout's metrics over the global batch
    # (B,) bool with --filter_groups: the completions of groups with spread, the ones the loss keeps
    kept: torch.Tensor | None = None
    # (B, T) the teacher's log-probs with --teacher_kl_in_loss (the loss's distillation term); else None
    teacher_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class Prompts:
    """A split's prompts: the dataset, the formatted texts and their (cut) token ids."""

    ds: PromptDataset
    texts: list[str]
    ids: list[list[int]]


@dataclass
class Rollout:
    """One batch's completions as the generator returned them, before anything is scored: what asynchronous
    generation hands over (and a checkpoint holds while it is in flight)."""

    update: int  # the update it is generated for (its seeds)
    index: list[int]  # (P,) this rank's global prompt indices
    generated: Generated  # tokens (B, T), log-probs (B, T) or None
    version: int  # optimizer steps of the weights that sampled it
    seconds: float = 0.0  # the generation's wall time


class ExperienceProducer:
    """Samples, scores and measures one update's batch: :meth:`produce` gives its :class:`Experience`."""

    def __init__(
        self,
        cfg: RLOOConfig,
        *,
        plan: BatchPlan,
        generator: Any,
        sources: list[Any],
        reward_weights: torch.Tensor,
        tokenizer: Any,
        train: Prompts,
        eval: Prompts,
        truncated_prompts: set[int],
        sampler: PromptSampler,
        state: TrainerState,
        policy: Any,
        ref_policy: Any,
        logprobs: LogProbs,
        comm: Collectives,
        accelerator: Any,
        guard: NonFiniteGuard,
        stop_token_id: int | None,
        gather_for_generation: bool,
        deepspeed: bool,
        on_policy: bool,
        episodes: EpisodeRunner | None = None,
        teacher_model: Any = None,
    ) -> None:
        self.cfg, self.plan = cfg, plan
        self.generator, self.sources, self.reward_weights = generator, sources, reward_weights
        self.tokenizer, self.train, self.eval = tokenizer, train, eval
        self.truncated_prompts, self.sampler, self.state = truncated_prompts, sampler, state
        # ref_policy None: LoRA, whose reference is the policy with its adapters off
        self.policy, self.ref_policy, self.logprobs = policy, ref_policy, logprobs
        self.comm, self.accelerator, self.guard = comm, accelerator, guard
        self.device = accelerator.device
        self.world, self.rank = comm.world, comm.rank
        self.stop_token_id = stop_token_id
        self.gather_for_generation = gather_for_generation
        self.deepspeed = deepspeed
        # One optimizer step per batch: the sampler's own log-probs serve as the old ones
        self.on_policy = on_policy
        self.episodes = episodes  # --tools / --environment: each rollout a multi-turn episode
        self.teacher = teacher_model  # --teacher_model_path: on-policy distillation; else None
        self._warned_nothing_kept = False

    def produce(self, update: int, timer: StepTimer, ahead: Rollout | None = None) -> Experience:
        """One update's experience: sample K completions of this rank's prompts (``ahead``: generated
        beforehand, possibly from older weights) and score them (again for fresh prompts with
        --filter_groups), take the policy's and the reference's log-probs of them, and turn the scores into
        advantages."""
        cfg, dev = self.cfg, self.device
        k = cfg.rloo_k
        current = self.generator.weights_version or 0  # the optimizer steps of the weights now
        first = self._sample_and_score(update, timer, 0, ahead)
        got, rounds, replaced = first, 1, 0
        while cfg.filter_groups and rounds < cfg.max_num_gen_batches:
            # every rank samples as many rounds: generation's collectives (ZeRO-3, vLLM) stay in step
            if not self.comm.any(bool((~got.informative(k)).any()), dev):
                break
            fresh = self._sample_and_score(update, timer, rounds)
            got, n = group_filter.replace_groups(got, fresh, k, self.train.ids, self.tokenizer.pad_token_id)
            rounds, replaced = rounds + 1, replaced + n
        sampled, index = got.sampled, got.index
        mask = sampled.mask  # (B, T)
        kept = got.informative(k).repeat_interleave(k) if cfg.filter_groups else None  # (B,)
        if kept is not None:
            sampled.loss_mask = sampled.loss_mask & kept[:, None]  # (B, T)
        stale = bool((got.version != current).any())
        with timer("logprobs"):
            old_logprobs, ref_logprobs = self._logprobs(update, sampled, got.gen_logprobs, stale=stale)
            teacher_logprobs = (
                None
                if self.teacher is None
                else teacher.completion_logprobs(self.teacher, self.logprobs, sampled, self.guard, update)
            )  # (B, T)

        with timer("scoring"):
            scores, valid = got.scores, got.valid
            raw_scores = scores.clone()
            if cfg.multi_objective_aggregation == "normalize_then_sum":
                scores = normalized_sum(got.per_source, scores, self.reward_weights.to(dev), k)
            if cfg.normalize_reward:  # statistics over the global batch, whatever the process count
                g_scores = algo.normalize_and_clip_scores(
                    self.comm.gather(scores), cfg.reward_clip_range, self.comm.gather(valid)
                )
                scores = self.comm.local(g_scores)
            kl = algo.per_token_kl(old_logprobs, ref_logprobs, mask, cfg.kl_estimator)  # (B, T)
            # objective/kl and kl keep the classic meaning (k1 summed per sequence) whatever the estimator
            kl_k1 = kl if cfg.kl_estimator == "k1" else algo.per_token_kl(old_logprobs, ref_logprobs, mask)
            # the teacher's KL (k1, like objective/kl) in the reward, or in the loss with --teacher_kl_in_loss
            teacher_kl = (
                None if teacher_logprobs is None else algo.per_token_kl(old_logprobs, teacher_logprobs, mask)
            )  # (B, T)
            in_reward = None if cfg.teacher_kl_in_loss else teacher_kl
            advantages, rlhf_reward, non_score = self._advantages(scores, valid, kl, mask, in_reward)

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
            weights=self.reward_weights,
        )
        if teacher_kl is not None:
            metrics.update(teacher.teacher_metrics(self.comm.gather(algo.sequence_kl(teacher_kl, mask))))
        if sampled.episodes is not None:
            metrics.update(episode_metrics(self.comm.gather(episode_stats(sampled.episodes).to(dev))))
        if cfg.async_generation:  # optimizer steps between the weights that sampled a row and today's
            lag = self.comm.gather((current - got.version).float().to(dev))  # (global B,)
            metrics["async/staleness"] = float(lag.mean())
            metrics["async/staleness_max"] = float(lag.max())
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
        return Experience(
            update=update,
            prompt_ids=sampled.prompt_ids,
            prompt_mask=sampled.prompt_mask,
            rows=sampled.rows,
            responses=sampled.responses,
            mask=mask,
            loss_mask=sampled.loss_mask,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            sampling_logprobs=sampled.sampling_logprobs,
            scores=raw_scores,
            advantages=advantages,
            policy_version=got.version,
            metrics=metrics,
            kept=kept,
            teacher_logprobs=teacher_logprobs if cfg.teacher_kl_in_loss else None,
        )

    def _sample_and_score(
        self, update: int, timer: StepTimer, round_: int, ahead: Rollout | None = None
    ) -> group_filter.Scored:
        """This rank's slice of the next prompts of the global order, sampled (or generated ``ahead``) and
        scored. ``round_`` > 0 (--max_num_gen_batches) draws other seeds, so a prompt met again samples anew."""
        if ahead is None:
            index = self.draw()
            # the weights every round of this batch samples from
            version = self.generator.weights_version or 0
            with timer("generation"):
                self.policy.eval()
                with deepspeed_utils.gather_for_generation(
                    self.policy, self.accelerator, self.gather_for_generation
                ):
                    gen = self.generate(update, index, round_)
        else:
            index, gen, version = ahead.index, ahead.generated, ahead.version
            timer.seconds["generation"] += ahead.seconds
        sampled, gen_logprobs = self._sampled(index, gen)
        with timer("scoring"):
            per_source, scores, valid, contains_eos = self._score(index, sampled)  # (B, S), (B,) x 3
        versions = torch.full((sampled.responses.size(0),), version, dtype=torch.long)  # (B,)
        return group_filter.Scored(
            index, sampled, gen_logprobs, per_source, scores, valid, contains_eos, versions
        )

    def draw(self) -> list[int]:
        """This rank's slice of the next prompts of the global order: every rank draws the same global list
        and keeps its slice, so the data order, and so the run, does not depend on the number of processes."""
        ppr = self.plan.prompts_per_rank
        return self.sampler.next(ppr * self.world)[self.rank * ppr : (self.rank + 1) * ppr]

    def _score(
        self, index: list[int], sampled: Sampled
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every reward source's scores of the completions (B, S), their weighted sum with the missing-EOS
        penalty (B,), which completions every source could score (B,), which hold an EOS token (B,)."""
        cfg, dev = self.cfg, self.device
        responses, mask = sampled.responses, sampled.mask  # (B, T)
        batch = self._reward_batch(
            self.train.ds, self.train.texts, index, cfg.rloo_k, responses, mask, sampled.episodes
        )
        per_source = score_all(self.sources, batch).to(dev)  # (B, S)
        scores, valid = algo.combine_reward_sources(per_source, self.reward_weights.to(dev))  # (B,), (B,)
        if not self.sources:  # a teacher alone (pure distillation): every completion scores 0, and counts
            valid = torch.ones_like(valid)
        if sampled.episodes is not None:  # an episode's turns end with the stop token: did the last one?
            contains_eos = sampled.episodes.finished.to(dev)  # (B,)
        else:
            contains_eos = ((responses == self.tokenizer.eos_token_id) & mask).any(1)  # (B,)
        scores = algo.apply_missing_eos_penalty(scores, contains_eos, cfg.missing_eos_penalty)
        if cfg.overlong_buffer_len:
            lengths = sampled.mask.sum(1)  # (B,)
            scores = scores + algo.soft_overlong_penalty(
                lengths, cfg.response_length, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
            ).to(scores.dtype)
        return per_source, scores, valid, contains_eos

    def _advantages(
        self,
        scores: torch.Tensor,
        valid: torch.Tensor,
        kl: torch.Tensor,
        mask: torch.Tensor,
        teacher_kl: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Leave-one-out advantages, (B,) or per token (B, T), and the RLHF reward and its KL part (B,), (B,)
        the KL placement asks for (in the reward, per token, or in the loss). ``teacher_kl`` (B, T): the
        teacher's KL, a penalty of the reward beside the reference's (per token with --token_level_kl)."""
        cfg = self.cfg
        k = cfg.rloo_k
        p, t = scores.numel() // k, mask.size(1)
        kl_coef = cfg.kl_coef
        if teacher_kl is not None:  # without a teacher the reward is computed as it always was, bit for bit
            kl, kl_coef = teacher.reward_penalty(cfg, kl, teacher_kl)  # (B, T)
        if cfg.kl_in_loss and teacher_kl is None:
            # The KL is a loss term on the current policy (see PolicyUpdater): the reward is the score alone.
            rlhf_reward, non_score = scores, torch.zeros_like(scores)  # (B,), (B,)
            advantages = algo.leave_one_out_advantages(rlhf_reward.view(p, k), valid.view(p, k)).view(-1)
            adv_mask = valid
        elif cfg.token_level_kl:
            adv, non_score = algo.token_level_advantages(
                scores.view(p, k), kl.view(p, k, t), mask.view(p, k, t), kl_coef, valid.view(p, k)
            )
            advantages, non_score = adv.reshape(p * k, t), non_score.reshape(-1)  # (B, T), (B,)
            rlhf_reward = scores + non_score
            adv_mask = mask & valid[:, None]
        else:
            rlhf_reward, non_score = algo.sequence_level_rewards(scores, kl, mask, kl_coef)  # (B,), (B,)
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

    def _sampling_params(self) -> SamplingParams:
        cfg, tok = self.cfg, self.tokenizer
        return SamplingParams(
            max_new_tokens=cfg.response_length,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop_token_id=self.stop_token_id,
            pad_token_id=tok.pad_token_id,
        )

    def _prompt_batch(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The training prompts ``index``, left-padded: ids and attention mask, each (P, L)."""
        return left_pad([self.train.ids[i] for i in index], self.tokenizer.pad_token_id, self.device)

    def generate(self, update: int, index: list[int], round_: int = 0) -> Generated:
        """K completions of each prompt of ``index`` for ``update``, as the generator returns them. Nothing
        but the generator is touched: asynchronous generation runs this on another thread."""
        cfg = self.cfg
        seeds = row_seeds(cfg.seed + round_ * 1_000_003, update, torch.tensor(index), cfg.rloo_k)
        if self.episodes is not None:
            ds = self.train.ds
            return self.episodes.run(
                self.generator,
                [self.train.ids[i] for i in index],
                cfg.rloo_k,
                self._sampling_params(),
                seeds,
                return_logprobs=self.on_policy or cfg.vllm_importance_sampling_correction,
                prompts=[ds.prompts[i] for i in index],
                rows=dataset_rows(ds, index),
                device=self.device,
            )
        prompt_ids, prompt_mask = self._prompt_batch(index)  # (P, L)
        return self.generator.generate(
            prompt_ids,
            prompt_mask,
            cfg.rloo_k,
            self._sampling_params(),
            seeds,
            return_logprobs=self.on_policy or cfg.vllm_importance_sampling_correction,
        )

    def _sampled(self, index: list[int], gen: Generated) -> tuple[Sampled, torch.Tensor | None]:
        """The completions ``gen`` of the prompts ``index``, masked after the stop token, and the sampler's own
        log-probs of them (B, T) when it returned them (else None)."""
        cfg, tok, dev = self.cfg, self.tokenizer, self.device
        k, p = cfg.rloo_k, len(index)
        responses = gen.tokens.to(dev)  # (B, T)
        episodes = gen.episodes
        if episodes is not None:  # the model's tokens count, the tools' results do not (nor in the KL)
            prompt_ids, prompt_mask = left_pad(episodes.prompt_ids, tok.pad_token_id, dev)  # (P, L)
            mask = episodes.policy_mask.to(dev)  # (B, T)
            finished = episodes.finished.to(dev)  # (B,)
            loss_mask = mask & finished[:, None] if cfg.mask_truncated_completions else mask
        else:
            prompt_ids, prompt_mask = self._prompt_batch(index)  # (P, L)
            mask = algo.completion_mask(responses, self.stop_token_id)  # (B, T)
            loss_mask = mask
            if cfg.mask_truncated_completions:  # the config requires a stop token with this flag
                assert self.stop_token_id is not None
                truncated = algo.truncated_completions(responses, self.stop_token_id)  # (B,)
                loss_mask = mask & ~truncated[:, None]  # (B, T)
            if self.stop_token_id is not None:
                responses = algo.truncate_after_stop(responses, self.stop_token_id, tok.pad_token_id)
        gen_logprobs = (
            None if gen.logprobs is None else gen.logprobs.to(dev).masked_fill(~mask, 0.0)
        )  # (B, T)
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
            sampling_logprobs=gen_logprobs if sampler_logprobs_used(cfg) else None,
            episodes=episodes,
        )
        return sampled, gen_logprobs

    def _logprobs(
        self, update: int, sampled: Sampled, gen_logprobs: torch.Tensor | None, *, stale: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's ("old") and the reference's log-probs of the samples, each (B, T); training stops
        here (one line) on a non-finite value. ``stale``: older weights than today's sampled some of them
        (asynchronous generation), whose log-probs are then not the policy's."""
        cfg, dev, mask = self.cfg, self.device, sampled.mask
        if self.on_policy and gen_logprobs is not None and not stale:
            # On-policy: the loss takes its "old" log-probs from its own forward (see PolicyUpdater), so
            # these generation-time values only feed the KL penalty and the entropy metric.
            old_logprobs = gen_logprobs  # (B, T)
        else:
            self.policy.train()  # the same mode as the optimisation forward: ratios start at exactly 1
            old_logprobs = self.logprobs.batched(self.policy, sampled)  # (B, T)
        if self.ref_policy is None:  # LoRA: the base model is the policy with its adapters off
            with lora.adapter_disabled(self.policy) as base:
                ref_logprobs = self.logprobs.batched(base, sampled)  # (B, T)
        else:
            offload = cfg.offload_ref_model and not self.deepspeed  # ZeRO places it itself
            if offload:
                self.ref_policy.to(dev)
            ref_logprobs = self.logprobs.batched(self.ref_policy, sampled)  # (B, T)
            if offload:
                self.ref_policy.to("cpu")  # its GPU memory goes back to the policy's optimisation
        # NaN logits still sample (inverse-CDF sampling never fails): stop here, before they reach the loss
        self.guard.check(
            update,
            {
                "rollout/logprobs": ~(
                    torch.isfinite(old_logprobs.masked_fill(~mask, 0.0)).all()
                    & torch.isfinite(ref_logprobs.masked_fill(~mask, 0.0)).all()
                )
            },
        )
        return old_logprobs, ref_logprobs

    def _reward_batch(
        self,
        ds: PromptDataset,
        texts: list[str],
        index: list[int],
        k: int,
        responses: torch.Tensor,
        mask: torch.Tensor,
        episodes: Episodes | None = None,
    ) -> RewardBatch:
        tok = self.tokenizer
        if episodes is not None:
            return episode_reward_batch(tok, episodes, ds, index, k, responses, self.state)
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

    @torch.no_grad()
    def sample_generations(self, update: int) -> list[dict[str, Any]]:
        """Near-greedy completions of the first eval prompts, scored, for a human to read."""
        cfg, tok = self.cfg, self.tokenizer
        n = min(cfg.per_device_eval_batch_size, len(self.eval.ds))
        index = list(range(n))
        prompt_ids, prompt_mask = left_pad([self.eval.ids[i] for i in index], tok.pad_token_id, self.device)
        params = SamplingParams(
            max_new_tokens=cfg.response_length,
            stop_token_id=self.stop_token_id,
            pad_token_id=tok.pad_token_id,
            greedy=True,
        )
        self.policy.eval()
        seeds = torch.zeros(n, dtype=torch.long)
        with deepspeed_utils.gather_for_generation(self.policy, self.accelerator, self.gather_for_generation):
            if self.episodes is not None:  # the whole episode: the model's turns and the tools' results
                gen = self.episodes.run(
                    self.generator,
                    [self.eval.ids[i] for i in index],
                    1,
                    params,
                    seeds,
                    return_logprobs=False,
                    prompts=[self.eval.ds.prompts[i] for i in index],
                    rows=dataset_rows(self.eval.ds, index),
                    device=self.device,
                )
            else:
                gen = self.generator.generate(prompt_ids, prompt_mask, 1, params, seeds)
        responses = gen.tokens
        episodes = gen.episodes
        mask = (
            algo.completion_mask(responses, self.stop_token_id) if episodes is None else episodes.policy_mask
        )
        batch = self._reward_batch(self.eval.ds, self.eval.texts, index, 1, responses, mask, episodes)
        scores, valid = algo.combine_reward_sources(score_all(self.sources, batch), self.reward_weights)
        if not self.sources:  # a teacher alone: every completion scores 0, as in training
            valid = torch.ones_like(valid)
        return [
            {
                "query": self.eval.texts[i],
                "response": batch.completion_texts[i],
                "score": float(s) if v else None,
            }
            for i, (s, v) in enumerate(zip(scores.tolist(), valid.tolist(), strict=True))
        ]


def sampler_logprobs_used(cfg: RLOOConfig) -> bool:
    """Whether the loss reads the generator's own log-probs of its samples: the importance sampling correction
    does, and the off-policy mask does where they are comparable with the trainer's (no top-k/top-p, which
    renormalise them), so it sees how far the sampling weights (vLLM's, or an older policy's with
    --async_generation) are from today's."""
    comparable = cfg.top_k == 0 and cfg.top_p == 1.0
    return cfg.vllm_importance_sampling_correction or (
        cfg.off_policy_mask_threshold is not None and comparable
    )


def normalized_sum(
    per_source: torch.Tensor, scores: torch.Tensor, weights: torch.Tensor, k: int
) -> torch.Tensor:
    """--multi_objective_aggregation normalize_then_sum (GDPO): the weighted sum of the reward sources each
    standardised within its group (:func:`rloo.algo.normalize_reward_sources`), plus what ``scores`` (B,)
    adds to the plain weighted sum of ``per_source`` (B, S): the missing-EOS and overlong penalties."""
    plain, _ = algo.combine_reward_sources(per_source, weights)  # (B,)
    normed, _ = algo.combine_reward_sources(algo.normalize_reward_sources(per_source, k), weights)  # (B,)
    return normed + (scores - plain)  # (B,)


def dataset_rows(ds: PromptDataset, index: list[int]) -> list[dict[str, Any]]:
    """The dataset's rows ``index`` (the prompt and the other columns): what an environment is reset with."""
    extra = ds.extra_for(index)
    return [{"prompt": ds.prompts[i], **{c: v[j] for c, v in extra.items()}} for j, i in enumerate(index)]


def episode_reward_batch(
    tok: Any,
    episodes: Episodes,
    ds: PromptDataset,
    index: list[int],
    k: int,
    responses: torch.Tensor,
    state: TrainerState,
) -> RewardBatch:
    """What reward sources read of episodes: the prompt as the episode saw it (with the environment's text),
    each episode's messages (the model's turns and the tools' results, TRL's ``completions`` of a tool-calling
    run) and its whole text, the environment's rewards."""
    ids = [r[:n].tolist() for r, n in zip(responses.cpu(), episodes.lengths.tolist(), strict=True)]
    texts = [episode_text(m) for m in episodes.messages]  # the turns on their lines, the results marked
    raw = tok.batch_decode(ids, skip_special_tokens=False)
    prompt_texts = [
        tok.decode(episodes.prompt_ids[b // k], skip_special_tokens=False) for b in range(len(ids))
    ]
    extra = {c: [v for v in vals for _ in range(k)] for c, vals in ds.extra_for(index).items()}
    return RewardBatch(
        prompts=[episodes.prompts[b // k] or ds.prompts[index[b // k]] for b in range(len(ids))],
        prompt_texts=prompt_texts,
        completions=episodes.messages,
        completion_texts=texts,
        completion_ids=ids,
        scoring_texts=[p + r for p, r in zip(prompt_texts, raw, strict=True)],
        extra=extra,
        trainer_state=state,
        environment_rewards=episodes.env_rewards,
    )


def episode_stats(episodes: Episodes) -> torch.Tensor:
    """(B, 5) per episode: tool calls, failed calls, the model's turns, its tokens, the tools' tokens."""
    model = episodes.policy_mask.sum(1)  # (B,)
    tool = episodes.lengths - model  # (B,)
    return torch.stack(
        [episodes.tool_calls, episodes.tool_errors, episodes.turns, model, tool], dim=1
    ).float()


def episode_metrics(stats: torch.Tensor) -> dict[str, float]:
    """The episodes' metrics over the global batch from :func:`episode_stats` rows: TRL's
    ``tools/call_frequency`` (calls per episode) and ``tools/failure_frequency`` (failed calls per call), the
    turns per episode and the episode's length in tokens, and the share of them the tools wrote."""
    calls, errors, turns, model, tool = stats.unbind(1)  # (B,) each
    total = model + tool
    return {
        "tools/call_frequency": float(calls.mean()),
        "tools/failure_frequency": float(errors.sum() / calls.sum()) if calls.sum() > 0 else 0.0,
        "tools/turns": float(turns.mean()),
        "tools/episode_length": float(total.mean()),
        "tools/tool_token_frac": float(tool.sum() / total.sum().clamp(min=1)),
    }
