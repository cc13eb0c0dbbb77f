"""DAPO's dynamic sampling (``--filter_groups``): prompt groups whose task scores are all equal carry no
learning signal (every leave-one-out advantage is 0), yet they count in the loss's mean over sequences.

With ``--max_num_gen_batches`` above 1 the trainer samples a fresh batch of prompts, and
:func:`replace_groups` puts each of its informative groups in the place of the flat group at the same
position, before any log-prob forward: the forwards, the KL and the advantages then see one batch of the
usual shape. Position for position, so the result is the same on one process or many (a rank holds the same
positions of both batches); a donor elsewhere is not used, and each flat position gets one more chance per
round. Whatever is still without spread after the last round is left out of the loss (the trainer masks it,
rescales each mini-batch's mean with :func:`loss_scale`, and takes no step for a mini-batch it leaves
empty).

Every rank samples the same number of rounds (the trainer agrees on it with one all-reduce), so the
collectives inside generation (ZeRO-3, vLLM) stay in step; a rank with nothing to replace samples too and
keeps its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rloo import algo
from rloo.generation import left_pad
from rloo.training.rollout import Sampled


@dataclass
class Scored:
    """One round's samples of this rank's prompts, scored: everything the rest of the rollout needs."""

    index: list[int]  # (P,) global prompt indices
    sampled: Sampled
    gen_logprobs: torch.Tensor | None  # (B, T) the sampler's own log-probs, when it returned them
    per_source: torch.Tensor  # (B, S) each reward source's score
    scores: torch.Tensor  # (B,) the combined score
    valid: torch.Tensor  # (B,) bool: every source scored it
    contains_eos: torch.Tensor  # (B,) bool
    version: torch.Tensor  # (B,) long on CPU: optimizer steps of the weights that sampled each completion

    def informative(self, k: int) -> torch.Tensor:
        """(P,) bool: the groups whose scores have spread."""
        return algo.informative_groups(self.scores.view(-1, k), self.valid.view(-1, k))


def _pad_columns(t: torch.Tensor, width: int, value: float | int | bool) -> torch.Tensor:
    """(B, T) -> (B, width), new columns on the right (completions are right-padded)."""
    if t.size(1) == width:
        return t
    pad = torch.full((t.size(0), width - t.size(1)), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def replace_groups(
    base: Scored, fresh: Scored, k: int, prompt_ids: list[list[int]], pad_id: int
) -> tuple[Scored, int]:
    """``base`` with each group without spread replaced by ``fresh``'s group at the same position when that
    one has spread; the number replaced. ``prompt_ids`` holds every training prompt's tokens (the prompts of
    the merged batch are left-padded again)."""
    slots = ((~base.informative(k)) & fresh.informative(k)).nonzero().flatten().tolist()  # (n,)
    n = len(slots)
    if n == 0:
        return base, 0
    groups = list(range(len(base.index)))  # position in cat([base, fresh]) of each group of the result
    for slot in slots:
        groups[slot] = len(base.index) + slot
    index = [(base.index + fresh.index)[g] for g in groups]
    dev = base.scores.device
    rows = (torch.tensor(groups, device=dev)[:, None] * k + torch.arange(k, device=dev)).flatten()  # (B,)

    def pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b])[rows.to(a.device)]

    width = max(base.sampled.responses.size(1), fresh.sampled.responses.size(1))
    per_row: dict[str, torch.Tensor | None] = {}
    for f in fields(Sampled):
        a, b = getattr(base.sampled, f.name), getattr(fresh.sampled, f.name)
        if f.name in (
            "prompt_ids",
            "prompt_mask",
            "rows",
            "episodes",
        ):  # episodes: the config refuses them here
            continue
        if a is None or b is None:
            per_row[f.name] = None
            continue
        fill = pad_id if f.name == "responses" else (False if a.dtype == torch.bool else 0)
        per_row[f.name] = pick(_pad_columns(a, width, fill), _pad_columns(b, width, fill))
    ids, mask = left_pad([prompt_ids[i] for i in index], pad_id, dev)  # (P, L)
    sampled = Sampled(prompt_ids=ids, prompt_mask=mask, rows=base.sampled.rows, **per_row)  # type: ignore[arg-type]
    gen = None
    if base.gen_logprobs is not None and fresh.gen_logprobs is not None:
        gen = pick(_pad_columns(base.gen_logprobs, width, 0.0), _pad_columns(fresh.gen_logprobs, width, 0.0))
    merged = Scored(
        index=index,
        sampled=sampled,
        gen_logprobs=gen,
        per_source=pick(base.per_source, fresh.per_source),
        scores=pick(base.scores, fresh.scores),
        valid=pick(base.valid, fresh.valid),
        contains_eos=pick(base.contains_eos, fresh.contains_eos),
        version=pick(base.version, fresh.version),
    )
    return merged, n


def loss_scale(num_kept: float, num_sequences: int, loss_agg_mode: str) -> float:
    """The factor that makes a mini-batch's mean over its ``num_sequences`` sequences a mean over its
    ``num_kept`` kept ones (both counted on every rank; ``num_kept`` > 0). ``token-mean`` needs none: its
    denominator counts the trained tokens already. The surrogate is positively homogeneous in the advantage,
    so scaling the loss is exact for each sequence."""
    if loss_agg_mode == "token-mean":
        return 1.0
    return num_sequences / num_kept
