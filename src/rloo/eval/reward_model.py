"""The reward model's view of the judged pairs (``--reward_model_path``): both sides of every pair, each
model's output and the example's reference, scored by a sequence-classification reward model, the one
training optimised. :func:`rloo.eval.stats.rm_agreement` then asks how often it prefers the side the judge
picked: a policy that learned what the reward model rewards rather than what the judge prefers (reward
hacking) wins by the reward model while that agreement falls.

Loading and scoring are training's own (:func:`rloo.models.load_reward_model`,
:func:`rloo.models.reward_model_scores`): the same tokenizer settings, the same last-token read-out. The
text differs in one way: training scores the completion with the special tokens the policy emitted (its EOS
included), while here both sides are plain text (the references have none), so the two sides compare with
each other but ``rm_score_mean`` is not on the scale of training's ``objective/scores``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from rloo.errors import UserError
from rloo.eval.config import EvalConfig

log = logging.getLogger(__name__)

REFERENCE = "reference"  # the key of the references' scores beside the models' labels


def scoring_text(prompt_text: str, completion: str) -> str:
    """What the reward model reads for one side of a pair: the prompt as the policy saw it, then the
    completion. Model outputs and references alike are stripped and joined the same way (directly after a
    prompt that ends in whitespace, such as a chat template's assistant header; after one space otherwise),
    so neither side gets a systematic edge from its leading whitespace."""
    completion = completion.strip()
    if not prompt_text or prompt_text[-1].isspace():
        return prompt_text + completion
    return f"{prompt_text} {completion}"


def policy_prompt_texts(cfg: EvalConfig, prompts: list[Any]) -> list[str]:
    """The prompts as the trained policy saw them in training (:func:`rloo.data.format_prompts`): chat
    messages through the trained model's chat template, plain text as it is."""
    from rloo.data import format_prompts

    if not (prompts and isinstance(prompts[0], list)):
        return [str(p) for p in prompts]
    from rloo.eval.generation import full_model_dir
    from rloo.models import load_tokenizer

    assert cfg.model_name_or_path is not None  # validated
    flag = "model_name_or_path"
    tok = load_tokenizer(
        full_model_dir(cfg.model_name_or_path, flag), flag=flag, trust_remote_code=cfg.trust_remote_code
    )
    return format_prompts(prompts, tok)


def score_pairs(
    cfg: EvalConfig,
    prompts: list[Any],
    references: list[str],
    outputs: dict[str, list[str]],
    device: torch.device,
) -> dict[str, list[float]]:
    """The reward model's score of every reference and every model output, example by example:
    ``{"reference": [...], "trained": [...], "baseline": [...]}``. Batched (``generation_batch_size`` texts
    per forward), without gradients, on ``device``; the model is released after. A non-finite score is a
    one-line UserError, as in training."""
    from rloo.eval.generation import release_memory
    from rloo.models import load_reward_model, reward_model_scores

    assert cfg.reward_model_path
    texts = policy_prompt_texts(cfg, prompts)
    groups = {REFERENCE: references, **outputs}
    flat = [scoring_text(p, c) for side in groups.values() for p, c in zip(texts, side, strict=True)]
    log.info("scoring %d completions with the reward model %s", len(flat), cfg.reward_model_path)
    model, tok = load_reward_model(cfg.reward_model_path, trust_remote_code=cfg.trust_remote_code)
    try:
        model.to(device)
        scores = reward_model_scores(
            model, tok, flat, batch_size=cfg.generation_batch_size, device=device
        ).tolist()
    finally:
        del model
        release_memory()
    bad = next((i for i, s in enumerate(scores) if not math.isfinite(s)), None)
    if bad is not None:
        side = list(groups)[bad // len(texts)]
        raise UserError(
            f"--reward_model_path {cfg.reward_model_path} produced a non-finite score (for the {side} side of "
            f"example {bad % len(texts)}); check the reward model."
        )
    n = len(texts)
    return {side: scores[i * n : (i + 1) * n] for i, side in enumerate(groups)}
