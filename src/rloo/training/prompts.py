"""The training prompts against the model and the batch: cut to the positions the model has, and a warning when
one update takes more prompts than the split holds."""

from __future__ import annotations

import logging

from rloo.config import BatchPlan, RLOOConfig
from rloo.data import PromptDataset
from rloo.errors import UserError

log = logging.getLogger(__name__)


def fit_prompts(
    cfg: RLOOConfig, found: tuple[int, str] | None, train_ids: list[list[int]], eval_ids: list[list[int]]
) -> tuple[list[list[int]], list[list[int]], set[int]]:
    """Cut prompts to ``max_prompt_length`` tokens, keeping their end (where the task is asked): past the
    model's positions a learned-position model fails with IndexError and a rotary one trains on positions
    it never saw. Returns the train and eval ids, and the training prompts that were cut
    (``found``: the model's position limit and where it was read, or None)."""
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
        return train_ids, eval_ids, set()
    truncated = {i for i, ids in enumerate(train_ids) if len(ids) > keep}
    if truncated:
        longest = max(len(train_ids[i]) for i in truncated)
        log.warning(
            "%d of %d training prompts are longer than max_prompt_length (%d tokens, the longest %d): "
            "their beginning is cut off",
            len(truncated),
            len(train_ids),
            keep,
            longest,
        )
    train_ids = [ids[-keep:] for ids in train_ids]
    eval_ids = [ids[-keep:] for ids in eval_ids]
    return train_ids, eval_ids, truncated


def warn_if_batch_exceeds_prompts(plan: BatchPlan, rloo_k: int, train_ds: PromptDataset, main: bool) -> None:
    """One warning when an update takes more prompts than the split holds: the sampler then draws some
    prompts twice in one update, with the same seeds and so the same completions, which weighs them
    double and teaches nothing new (it trains; the batch is just larger than the data can fill)."""
    per_update = plan.batch_size // rloo_k
    have = len(train_ds)
    if per_update > have and main:
        log.warning(
            "each update takes %d prompts (batch %d / rloo_k %d) but the %r split holds %d: some prompts are "
            "drawn twice per update and sample the same completions twice; use a batch of at most %d "
            "completions (per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches x "
            "processes), or more prompts.",
            per_update,
            plan.batch_size,
            rloo_k,
            train_ds.split,
            have,
            have * rloo_k,
        )
