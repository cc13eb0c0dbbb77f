"""On-policy distillation (``--teacher_model_path``): a frozen teacher scores the policy's own samples token by
token, and the reverse KL to it, KL(policy || teacher) estimated on those samples, is a penalty: subtracted
from the reward like the reference's KL (``objective/non_score_reward``), or with ``--teacher_kl_in_loss`` a
term of the loss. The two models' log-probs are compared token id by token id, so the teacher must share the
policy's vocabulary. The teacher never changes: a checkpoint holds nothing of it, and its path is one of the
run's recorded settings (``rloo_config.json``), which a resume must repeat."""

from __future__ import annotations

from typing import Any

import torch

from rloo.config import RLOOConfig
from rloo.errors import UserError
from rloo.models import load_causal_lm, load_tokenizer
from rloo.training import frozen
from rloo.training.completion_logprobs import LogProbs, NonFiniteGuard
from rloo.training.rollout import Sampled

FLAG = "teacher_model_path"


def load_teacher(cfg: RLOOConfig, tokenizer: Any, accelerator: Any) -> Any | None:
    """The teacher, frozen and placed like the reference (:func:`rloo.training.frozen.place`; an ``s3://``
    one fetched into this machine's scratch first, as the reward model), after its tokenizer is checked
    against the policy's ``tokenizer``; None without ``--teacher_model_path``."""
    path = cfg.teacher_model_path
    if not path:
        return None
    teacher_tokenizer = load_tokenizer(path, flag=FLAG, trust_remote_code=cfg.trust_remote_code)
    check_shared_vocabulary(
        tokenizer, teacher_tokenizer, policy=cfg.model_source or str(cfg.model_name_or_path), teacher=path
    )
    model = load_causal_lm(path, flag=FLAG, trust_remote_code=cfg.trust_remote_code)
    model.eval().requires_grad_(False)
    # --cast_lm_head_to_fp32: its log-probs are compared with the policy's, so computed in the same precision
    return frozen.place(model, accelerator, "teacher model", fp32_head=cfg.cast_lm_head_to_fp32)


def check_shared_vocabulary(
    policy_tokenizer: Any, teacher_tokenizer: Any, *, policy: str, teacher: str
) -> None:
    """One line when a token of the policy's tokenizer has another id (or none) in the teacher's: the KL reads
    the teacher's log-prob of each id the policy samples. Tokens only the teacher has (an added pad token)
    are no obstacle: the policy never samples them."""
    ours, theirs = policy_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    differ = sorted((i, token) for token, i in ours.items() if theirs.get(token) != i)
    if not differ:
        return
    i, token = differ[0]
    there = theirs.get(token)
    raise UserError(
        f"--{FLAG} {teacher}: its tokenizer maps {len(differ)} of the policy's {len(ours)} tokens (--model_name_or_path "
        f"{policy}) to other ids (the first, {token!r}, is {i} in the policy's and "
        f"{'missing' if there is None else there} in the teacher's); the KL to the teacher compares both models' "
        "log-probs of the same token ids, so take a teacher of the same model family (same tokenizer)."
    )


def completion_logprobs(
    teacher: Any, logprobs: LogProbs, sampled: Sampled, guard: NonFiniteGuard, update: int
) -> torch.Tensor:
    """The teacher's log-probs (B, T) of the sampled completions, at the sampling temperature as the
    reference's; training stops here (one line) on a non-finite one."""
    out = logprobs.batched(teacher, sampled)  # (B, T)
    bad = ~torch.isfinite(out.masked_fill(~sampled.mask, 0.0)).all()
    guard.check(update, {"rollout/teacher_logprobs": bad})
    return out


def reward_penalty(cfg: RLOOConfig, kl: torch.Tensor, teacher_kl: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The per-token KL penalty (B, T) of the reward with the teacher's in it, and the coefficient to apply to
    it (1: the coefficients are inside): kl_coef x the reference's ``kl`` (none when --kl_in_loss puts that in
    the loss) plus teacher_kl_coef x the teacher's k1 ``teacher_kl``, each (B, T) and 0 off the mask."""
    reference_coef = 0.0 if cfg.kl_in_loss else cfg.kl_coef
    return reference_coef * kl + cfg.teacher_kl_coef * teacher_kl, 1.0


def teacher_metrics(sequence_kl: torch.Tensor) -> dict[str, float]:
    """``teacher/kl``: the mean over completions (the global batch's ``sequence_kl``, (B,)) of the summed k1
    KL to the teacher, whichever route it takes."""
    return {"teacher/kl": float(sequence_kl.mean())}
