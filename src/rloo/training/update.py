"""The update: ``num_ppo_epochs`` passes of ``num_mini_batches`` optimizer steps over one :class:`Experience`,
each accumulating the losses of its micro-batches (micro_batch.py). It reads the batch and nothing else of
how the batch was produced."""

from __future__ import annotations

import math
from typing import Any

import torch

from rloo import algo
from rloo.config import RLOOConfig
from rloo.training import group_filter
from rloo.training.collectives import Collectives
from rloo.training.completion_logprobs import LogProbs, NonFiniteGuard
from rloo.training.experience import Experience
from rloo.training.loss_stats import LossStats
from rloo.training.minibatches import minibatch_rows


class PolicyUpdater:
    """Optimizes the policy on batches of experience; ``version`` counts its optimizer steps (the weights'
    version that a batch's ``policy_version`` is compared with)."""

    def __init__(
        self,
        cfg: RLOOConfig,
        *,
        micro_batch_size: int,
        policy: Any,
        optimizer: Any,
        accelerator: Any,
        comm: Collectives,
        logprobs: LogProbs,
        guard: NonFiniteGuard,
        deepspeed: bool,
    ) -> None:
        self.cfg = cfg
        self.micro_batch_size = micro_batch_size  # completions per forward/backward (micro_batch.py)
        self.policy, self.optimizer, self.accelerator = policy, optimizer, accelerator
        self.comm, self.logprobs, self.guard = comm, logprobs, guard
        self.device = accelerator.device
        self.world, self.rank = comm.world, comm.rank
        self.deepspeed = deepspeed
        # Options that can leave a micro-batch with no token to train on: its ratio stats are left out.
        self.masks_loss = (
            cfg.mask_truncated_completions
            or cfg.filter_groups
            or cfg.top_entropy_quantile < 1
            or cfg.off_policy_mask_threshold is not None
        )
        # One optimizer step per batch: the policy is never updated between sampling and its loss.
        self.on_policy = cfg.num_ppo_epochs * cfg.num_mini_batches == 1
        self._reuse_forward = self.on_policy
        self.version = 0
        self.entropy = EntropyControl(cfg)

    def update(self, batch: Experience) -> dict[str, float]:
        """``num_ppo_epochs`` passes of mini-batch optimizer steps over one batch of experience; the loss
        metrics."""
        cfg, update = self.cfg, batch.update
        # the loss may take its "old" log-probs from its own forward only when these weights sampled the batch
        self._reuse_forward = self.on_policy and bool((batch.policy_version == self.version).all())
        stats = LossStats()
        g = torch.Generator().manual_seed(cfg.seed * 7919 + update)
        self.policy.train()
        for _ in range(cfg.num_ppo_epochs):
            # Mini-batches from global positions (see minibatches.py): the same optimizer steps over the
            # same completions on 1 or N processes; whole groups, so each prompt is computed once per
            # micro-batch (see forward.response_logits).
            for mb in minibatch_rows(
                local_batch_size=batch.responses.size(0),
                world_size=self.world,
                rank=self.rank,
                rloo_k=cfg.rloo_k,
                num_mini_batches=cfg.num_mini_batches,
                generator=g,
            ):
                scale = self._kept_scale(batch, mb)
                if scale is None:  # every group of this mini-batch filtered out, on every rank: no step
                    stats.skip(self.device, optional=self._optional_stats(stats, batch))
                    continue
                num_tokens = self._token_mean_denominator(batch, mb)
                loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)
                for mc_start in range(0, mb.numel(), self.micro_batch_size):
                    idx = mb[mc_start : mc_start + self.micro_batch_size].to(self.device)
                    loss = self._micro_batch_loss(batch, idx, num_tokens, stats)
                    if scale != 1.0:  # --filter_groups: the mean over the kept sequences, not over all
                        loss = loss * scale
                    if self.deepspeed:  # DeepSpeed decides the optimizer-step boundary itself
                        with self.accelerator.accumulate(self.policy):
                            self.accelerator.backward(loss)
                    else:
                        self.accelerator.backward(loss)  # divided by the micro-batches per step
                    loss_bad |= ~torch.isfinite(loss.detach())  # on device: no sync per micro-batch
                self._optimizer_step(update, loss_bad, stats)
        metrics = stats.metrics(
            self.comm, self.device, skip_nan=self.masks_loss, dual_clip=cfg.clip_ratio_c is not None
        )
        if cfg.use_adaptive_entropy:
            metrics["entropy_coef"] = self.entropy.coef  # TRL's name: the coefficient after this update
        if batch.kept is not None:
            metrics["filter_groups/skipped_steps"] = float(stats.skipped_steps)
        return metrics

    def _token_mean_denominator(self, batch: Experience, mb: torch.Tensor) -> torch.Tensor | None:
        """With ``token-mean``: the global mini-batch's trained tokens / (micro-batches x ranks), else None.

        Each micro-batch loss is divided by gradient_accumulation_steps and the gradients are averaged over
        ranks, so dividing each micro-batch's token sum by this makes the step's gradient the mean over
        every token of the mini-batch on all ranks: the same whatever the micro-batch size or process count.
        """
        if self.cfg.loss_agg_mode != "token-mean":
            return None
        n = (
            batch.loss_mask[mb.to(batch.loss_mask.device)].sum().float()
        )  # this rank's tokens in the mini-batch
        n = self.comm.sum(n)
        micro_batches = math.ceil(mb.numel() / self.micro_batch_size)
        # clamp: a mini-batch without tokens has a zero sum; 0 / 1 keeps the loss finite
        return (n / (micro_batches * self.world)).clamp(min=1.0 / (micro_batches * self.world))

    def _optional_stats(self, stats: LossStats, batch: Experience) -> tuple[list[torch.Tensor], ...]:
        """The loss statistics this run's options fill at every micro-batch."""
        cfg, lists = self.cfg, []
        if cfg.kl_in_loss:
            lists.append(stats.kl_loss)
        if cfg.teacher_kl_in_loss:
            lists.append(stats.teacher_kl_loss)
        if cfg.entropy_bonus:
            lists.append(stats.entropy_bonus)
        if cfg.off_policy_mask_threshold is not None:
            lists.append(stats.off_policy_masked)
        if cfg.top_entropy_quantile < 1:
            lists += [stats.top_entropy_threshold, stats.top_entropy_kept]
        if cfg.vllm_importance_sampling_correction:
            lists += [stats.vllm_logp_diff_abs, stats.vllm_is_capped, stats.vllm_is_masked]
        return tuple(lists)

    def _kept_scale(self, batch: Experience, mb: torch.Tensor) -> float | None:
        """--filter_groups: the factor that makes this mini-batch's mean over sequences a mean over its kept
        ones (all ranks counted; :func:`group_filter.loss_scale`), or None when it keeps none. 1.0 without
        the option."""
        if batch.kept is None:
            return 1.0
        num_kept = float(self.comm.sum(batch.kept[mb.to(batch.kept.device)].sum().float()))
        if num_kept == 0:
            return None
        return group_filter.loss_scale(num_kept, mb.numel() * self.world, self.cfg.loss_agg_mode)

    def _micro_batch_loss(
        self,
        batch: Experience,
        idx: torch.Tensor,
        num_tokens: torch.Tensor | None,
        stats: LossStats,
    ) -> torch.Tensor:
        """The loss of completions ``idx`` (a forward with gradients), its diagnostics appended to ``stats``."""
        cfg = self.cfg
        coef = self.entropy.applied()  # the same for every micro-batch of an optimizer step
        bonus = cfg.entropy_bonus
        logprobs, ent = self.logprobs.forward(
            self.policy, batch, idx, entropy=True, entropy_grad=bonus and coef > 0
        )  # (b, T)
        assert ent is not None  # entropy=True
        # On-policy the weights that sampled the rollout are the ones in this forward, so its own detached
        # log-probs are the exact "old" ones: ratio 1, no extra forward.
        old = logprobs.detach() if self._reuse_forward else batch.old_logprobs[idx]
        loss_mask = batch.loss_mask[idx]  # (b, T)
        advantages = batch.advantages[idx]  # (b,) or (b, T)
        is_weights = self._sampling_weights(batch, idx, old, stats)
        policy_mask = (
            self._top_entropy(ent.detach(), loss_mask, stats) if cfg.top_entropy_quantile < 1 else loss_mask
        )
        if cfg.off_policy_mask_threshold is not None:
            policy_mask = self._off_policy_mask(batch, idx, logprobs, old, advantages, policy_mask, stats)
        loss, st = algo.policy_loss(
            logprobs,
            old,
            advantages,
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
            loss_type=cfg.loss_type,
            cispo_max=cfg.cispo_max,
            sapo_temperature_pos=cfg.sapo_temperature_pos,
            sapo_temperature_neg=cfg.sapo_temperature_neg,
        )
        stats.policy_loss.append(loss.detach())
        if cfg.kl_in_loss:
            kl_term = algo.kl_loss(
                logprobs,
                batch.ref_logprobs[idx],
                loss_mask,
                cfg.kl_estimator,
                cfg.loss_agg_mode,
                cfg.response_length,
                num_tokens,
                importance_ratio=self._kl_ratio(logprobs, old, loss_mask)
                if cfg.use_bias_correction_kl
                else None,
            )
            stats.kl_loss.append(kl_term.detach())
            loss = loss + cfg.kl_coef * kl_term
        if batch.teacher_logprobs is not None:  # --teacher_kl_in_loss: on-policy distillation as a loss term
            teacher_term = algo.kl_loss(
                logprobs,
                batch.teacher_logprobs[idx],
                loss_mask,
                cfg.kl_estimator,
                cfg.loss_agg_mode,
                cfg.response_length,
                num_tokens,
            )
            stats.teacher_kl_loss.append(teacher_term.detach())
            loss = loss + cfg.teacher_kl_coef * teacher_term
        if bonus:
            ent_term = algo.agg_loss(ent, loss_mask, cfg.loss_agg_mode, cfg.response_length, num_tokens)
            stats.entropy_bonus.append(ent_term.detach())
            if coef > 0:
                loss = loss - coef * ent_term
            self.entropy.measure(ent.detach(), loss_mask)
        stats.entropy.append(algo.masked_mean(ent.detach(), batch.mask[idx]))
        stats.add_policy(st, trained=not self.masks_loss or bool(policy_mask.any()))
        return loss

    def _off_policy_mask(
        self,
        batch: Experience,
        idx: torch.Tensor,
        logprobs: torch.Tensor,
        old: torch.Tensor,
        advantages: torch.Tensor,
        policy_mask: torch.Tensor,
        stats: LossStats,
    ) -> torch.Tensor:
        """--off_policy_mask_threshold: ``policy_mask`` (b, T) without the negative-advantage completions that
        drifted off policy since they were sampled: measured against the generator's own log-probs when the
        batch has them (:func:`rloo.training.experience.sampler_logprobs_used`), else the old policy's."""
        sampler = old if batch.sampling_logprobs is None else batch.sampling_logprobs[idx]  # (b, T)
        loss_mask = batch.loss_mask[idx]  # (b, T)
        keep = algo.off_policy_sequence_mask(
            advantages, logprobs.detach(), sampler, loss_mask, float(self.cfg.off_policy_mask_threshold or 0)
        )  # (b,)
        has_tokens = loss_mask.any(dim=1)  # (b,)
        dropped = (has_tokens & ~keep).sum().float()
        n = has_tokens.sum().float()
        stats.off_policy_masked.append(torch.where(n > 0, dropped / n.clamp(min=1), math.nan))
        return policy_mask & keep.unsqueeze(1)  # (b, T)

    def _kl_ratio(self, logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """--use_bias_correction_kl: the importance ratio pi/pi_old with its gradient, per token (b, T), or
        GSPO's one per sequence (b,) with --importance_sampling_level sequence, as TRL weighs the KL."""
        logratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))  # (b, T)
        if self.cfg.importance_sampling_level == "sequence":
            return torch.exp(logratio.sum(1) / mask.sum(1).clamp(min=1))  # (b,)
        return torch.exp(logratio)  # (b, T)

    def _sampling_weights(
        self, batch: Experience, idx: torch.Tensor, old: torch.Tensor, stats: LossStats
    ) -> torch.Tensor | None:
        """--vllm_importance_sampling_correction: the weights pi_train / pi_vllm of the sampled tokens, per
        sequence for the classic sequence ratio (whose tokens have no surrogate of their own), per token
        otherwise, unless the mode says; truncated at the cap or masked above it. None without the flag."""
        cfg = self.cfg
        if batch.sampling_logprobs is None or not cfg.vllm_importance_sampling_correction:
            return None
        mode = cfg.vllm_importance_sampling_mode
        weights, mismatch = algo.truncated_importance_weights(
            old,
            batch.sampling_logprobs[idx],
            batch.mask[idx],
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
        self.guard.check(update, checks)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.entropy.step(self.comm)


class EntropyControl:
    """--use_adaptive_entropy: the entropy coefficient, moved once per optimizer step toward
    --entropy_target from the entropy of that step's trained tokens on every rank (TRL's control; the math
    is :func:`rloo.algo.next_entropy_coef`). Without it the coefficient is --entropy_coef throughout. Its
    state (:meth:`state_dict`) is checkpointed: a resumed run continues with the same coefficient."""

    def __init__(self, cfg: RLOOConfig) -> None:
        self.cfg = cfg
        self.coef = cfg.entropy_coef
        self.last_entropy = math.inf  # none measured yet: the bonus waits for the first step's entropy
        self._window: torch.Tensor | None = None  # (2,) this step's entropy sum and token count

    def applied(self) -> float:
        """The coefficient this optimizer step's loss uses."""
        if not self.cfg.use_adaptive_entropy:
            return self.cfg.entropy_coef
        return algo.applied_entropy_coef(self.coef, self.last_entropy, self.cfg.entropy_target)

    def measure(self, ent: torch.Tensor, mask: torch.Tensor) -> None:
        """Add a micro-batch's token entropies (b, T) where ``mask`` to this step's window."""
        if not self.cfg.use_adaptive_entropy:
            return
        part = torch.stack([torch.where(mask, ent, 0.0).sum(), mask.sum()]).float()  # (2,)
        self._window = part if self._window is None else self._window + part

    def step(self, comm: Collectives) -> None:
        """At an optimizer step: the window's entropy over every rank moves the coefficient."""
        if not self.cfg.use_adaptive_entropy or self._window is None:
            return
        total = comm.sum(self._window)  # (2,) one token-weighted mean over all ranks
        self._window = None
        entropy = float(total[0] / total[1]) if float(total[1]) > 0 else math.nan
        cfg = self.cfg
        self.coef = algo.next_entropy_coef(
            self.coef,
            entropy,
            target=cfg.entropy_target,
            delta=cfg.entropy_coef_delta,
            coef_min=cfg.entropy_coef_min,
            coef_max=cfg.entropy_coef_max,
        )
        if not math.isnan(entropy):
            self.last_entropy = entropy

    def state_dict(self) -> dict[str, float | None]:
        """What a checkpoint's trainer state holds of it (JSON: no entropy measured yet is None)."""
        last = None if math.isinf(self.last_entropy) else self.last_entropy
        return {"entropy_coef": self.coef, "last_entropy": last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint's trainer state; one taken before the control existed has none."""
        if "entropy_coef" in state:
            last = state.get("last_entropy")
            self.coef = float(state["entropy_coef"])
            self.last_entropy = math.inf if last is None else float(last)
