"""An LLM judge as a reward source (GenRM / RULER style), named ``judge``, weighted by --judge_reward_coef.

``pairwise``: each completion is judged against its row's reference answer (the dataset's ``completion``
column, as ``rloo eval`` reads it) in both orders, as the evaluation does, to cancel position bias: 1 when
both orders prefer the completion, 0 when both prefer the reference, 0.5 when they disagree
(:func:`rloo.judging.pairwise.pair_score`). ``pointwise``: the judge's score from 0 to 10, divided by 10.
An answer the judge's kind cannot read, or a request that failed, leaves the completion unscored by the judge
(None, as a reward function's None).

Every request of a batch is sent at once (at most --judge_concurrency in flight), and each verdict is kept
for the run: a completion judged before (the same prompt, text and reference, as a group's identical
completions are) costs no request.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from rloo.config import RLOOConfig
from rloo.data import PromptDataset
from rloo.errors import ServiceUnavailable, UserError
from rloo.judging.client import BUDGET, ERROR, INVALID, OK, settings_from, transient
from rloo.judging.endpoint import failure_hint
from rloo.judging.pairwise import PairwiseJudge, pair_score, render_prompt
from rloo.judging.pointwise import MAX_SCORE, PointwiseJudge, render_pointwise
from rloo.judging.templates import (
    PAIRWISE_FIELDS,
    PAIRWISE_TEMPLATE,
    POINTWISE_FIELDS,
    POINTWISE_TEMPLATE,
    completion_text,
    load_template,
    prompt_text,
)
from rloo.training.rewards import RewardBatch

log = logging.getLogger(__name__)

JUDGE = "judge"  # the source's name: rewards/judge/*, and monitor/judge_reward_corr finds it by it
REFERENCE_COLUMN = "completion"  # the reference answers, the column `rloo eval` judges against
# Verdicts kept at most: a long run's distinct completions would otherwise grow without bound; a group's
# duplicates, the saving that matters, are asked for within one batch.
CACHE_SIZE = 1 << 16
_ANSWERED = (OK, INVALID)  # the judge answered: asking again would get the same answer (temperature 0)

Key = tuple[str, ...]


class JudgeRewardSource:
    """The judge's reward of each completion of a batch, NaN where it gave none; see the module docstring."""

    name = JUDGE

    def __init__(self, judge: PairwiseJudge | PointwiseJudge) -> None:
        self.judge = judge
        self.pairwise = isinstance(judge, PairwiseJudge)
        self.cache: OrderedDict[Key, float | None] = OrderedDict()
        self._warned = False

    def _warn_if_mostly_unscored(self, records: Sequence[Any]) -> None:
        """One warning line, once per run, when the judge's answers to most of a batch's requests could not be
        read: the judge then scores few completions (rewards/judge/* count only the scored ones)."""
        unread = sum(r.status == INVALID for r in records)
        if self._warned or unread * 2 <= len(records):
            return
        self._warned = True
        log.warning(
            "the judge's answers to %d of %d requests could not be read as scores; those completions get no "
            "judge reward. Check --judge_max_tokens and --judge_template (said once).",
            unread,
            len(records),
        )

    def _keys(self, batch: RewardBatch) -> list[Key | None]:
        """What the judge sees of each completion; None where a pairwise judge has no reference for it."""
        prompts = [prompt_text(p) for p in batch.prompts]
        if not self.pairwise:
            return [(p, c) for p, c in zip(prompts, batch.completion_texts, strict=True)]
        refs = batch.extra.get(REFERENCE_COLUMN) or [None] * len(batch)
        return [
            None if (r := completion_text(ref)) is None else (p, c, r)
            for p, c, ref in zip(prompts, batch.completion_texts, refs, strict=True)
        ]

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        keys = self._keys(batch)
        todo = [k for k in dict.fromkeys(k for k in keys if k is not None) if k not in self.cache]
        fresh = self._ask(todo) if todo else {}
        values = []
        for k in keys:
            if k is None:
                value = None
            elif k in fresh:
                value = fresh[k]
            else:
                value = self.cache[k]
                self.cache.move_to_end(k)
            values.append(math.nan if value is None else value)
        return torch.tensor(values, dtype=torch.float32)

    def _ask(self, keys: Sequence[Key]) -> dict[Key, float | None]:
        """The reward of each key, asked of the judge, the answered ones cached; the batch's one-line error
        when the judge answered none of its requests."""
        prompts, outputs = [k[0] for k in keys], [k[1] for k in keys]
        rewards: list[float | None]
        if isinstance(self.judge, PairwiseJudge):
            pairs = self.judge.judge(prompts, outputs, [k[2] for k in keys])
            rewards = [pair_score(a.verdict, b.verdict) for a, b in pairs]
            answered = [a.status in _ANSWERED and b.status in _ANSWERED for a, b in pairs]
            records: list[Any] = [j for pair in pairs for j in pair]
        else:
            grades = self.judge.grade(prompts, outputs)
            rewards = [None if g.score is None else g.score / MAX_SCORE for g in grades]
            answered = [g.status in _ANSWERED for g in grades]
            records = grades
        problem = unanswered_problem(self.judge, records) or unreadable_problem(self.judge, records)
        if problem is not None:
            raise problem
        self._warn_if_mostly_unscored(records)
        for key, reward, ok in zip(keys, rewards, answered, strict=True):
            if ok:  # a failed request may succeed later; an answer would only be given again
                self.cache[key] = reward
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        return dict(zip(keys, rewards, strict=True))


def unreadable_problem(judge: PairwiseJudge | PointwiseJudge, records: Sequence[Any]) -> UserError | None:
    """Why a batch the judge answered taught nothing: none of its answers could be read (a chatty or
    reasoning judge, an answer cut at --judge_max_tokens, a template asking for something else), or None.
    Training on would silently give the judge's weight to no completion."""
    if not records or any(r.status == OK for r in records) or not any(r.status == INVALID for r in records):
        return None
    sample = next(r.answer for r in records if r.status == INVALID)
    wanted = "a verdict, A or B" if isinstance(judge, PairwiseJudge) else f"a score from 0 to {MAX_SCORE:g}"
    return UserError(
        f"the judge at {judge.s.base_url} answered {sum(r.status == INVALID for r in records)} of the "
        f"{len(records)} requests of a batch, none as {wanted} (e.g. {str(sample)[:80]!r}): raise "
        f"--judge_max_tokens ({judge.s.max_tokens}) or give a "
        "--judge_template that asks for the bare answer."
    )


def unanswered_problem(judge: PairwiseJudge | PointwiseJudge, records: Sequence[Any]) -> UserError | None:
    """Why the judge scored nothing of a batch, or None when it answered at least one request: its request
    budget is spent (exit 2), or every request failed: exit 75 when that failure may heal by itself (the
    server down or overloaded), 2 otherwise."""
    if not records or any(r.status in _ANSWERED for r in records):
        return None
    where = f"the judge at {judge.s.base_url}"
    if any(r.status == BUDGET for r in records):
        return UserError(
            f"--judge_request_budget {judge.s.request_budget} is spent: {where} scores no more completions; "
            "raise the budget, or drop it."
        )
    errors = [str(r.error) for r in records if r.status == ERROR]
    top = max(set(errors), key=errors.count)
    line = (
        f"{where} failed all {len(records)} requests of a batch ({top}, after --judge_max_retries "
        f"{judge.s.max_retries}): {failure_hint(top, length_flag=judge.s.length_flag)}."
    )
    return ServiceUnavailable(line) if transient(top) else UserError(line)


def judge_source(cfg: RLOOConfig, train: PromptDataset) -> JudgeRewardSource | None:
    """The judge's reward source of a run with --judge_reward_coef > 0 (None without), its server checked
    with one request (:meth:`rloo.judging.client.JudgeClient.preflight`: exit 75 when it is out of reach, 2
    when it refuses); a pairwise judge needs the training split's reference answers."""
    if cfg.judge_reward_coef == 0:
        return None
    pairwise = cfg.judge_reward_mode == "pairwise"
    references: list[str | None] = []
    if pairwise:
        if REFERENCE_COLUMN not in train.extra:
            raise UserError(
                f"--judge_reward_mode pairwise judges each completion against its row's reference, and "
                f"--dataset_name {cfg.dataset_name} split {train.split!r} has no {REFERENCE_COLUMN!r} column "
                f"(columns: {', '.join(sorted(['prompt', *train.extra]))}): add the reference answers as "
                f"{REFERENCE_COLUMN!r}, or use --judge_reward_mode pointwise."
            )
        references = [completion_text(v) for v in train.extra[REFERENCE_COLUMN]]
    if cfg.judge_template is not None:
        template = load_template(cfg.judge_template, PAIRWISE_FIELDS if pairwise else POINTWISE_FIELDS)
    else:
        template = PAIRWISE_TEMPLATE if pairwise else POINTWISE_TEMPLATE
    settings = settings_from(cfg, template, length_flag="--response_length")
    judge = (PairwiseJudge if pairwise else PointwiseJudge)(settings, progress=False)
    # the largest prompt (and its reference, standing in for a completion, as the evaluation's check does):
    # a judge whose context is too short for it says so now
    texts = [prompt_text(p) for p in train.prompts]
    refs = references or [""] * len(texts)
    i = max(range(len(texts)), key=lambda n: len(texts[n]) + 2 * len(refs[n] or ""))
    ref = refs[i] or ""
    judge.preflight(
        render_prompt(template, texts[i], ref, ref) if pairwise else render_pointwise(template, texts[i], ref)
    )
    log.info(
        "judge reward: %s judge %s at %s, weight %g",
        cfg.judge_reward_mode,
        cfg.judge_model,
        cfg.judge_base_url,
        cfg.judge_reward_coef,
    )
    return JudgeRewardSource(judge)


def with_judge(
    cfg: RLOOConfig, train: PromptDataset, sources: list[Any], weights: list[float]
) -> tuple[list[Any], torch.Tensor]:
    """``sources`` and their ``weights`` (one per source; extra ones are dropped), the judge's source and
    --judge_reward_coef last when the run has a judge (:func:`judge_source`)."""
    weights = weights[: len(sources)]
    judge = judge_source(cfg, train)
    if judge is not None:
        sources, weights = [*sources, judge], [*weights, cfg.judge_reward_coef]
    return sources, torch.tensor(weights, dtype=torch.float32)
