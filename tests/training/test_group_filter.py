"""--filter_groups: replacing groups without spread by fresh ones, and the loss scale that follows."""

from __future__ import annotations

import pytest
import torch

from rloo.training.group_filter import Scored, loss_scale, replace_groups
from rloo.training.rollout import Sampled

PAD = 0


def _scored(
    index: list[int], scores: list[float], width: int, prompts: list[list[int]], k: int = 2
) -> Scored:
    """Groups of k completions; completion tokens encode (prompt, sample) so a test can follow them."""
    from rloo.generation import left_pad

    ids, mask = left_pad([prompts[i] for i in index], PAD)
    b = len(index) * k
    responses = torch.tensor([[100 * index[r // k] + r % k + 1] * width for r in range(b)])  # (B, T)
    return Scored(
        index=index,
        sampled=Sampled(
            prompt_ids=ids,
            prompt_mask=mask,
            rows=torch.arange(b) // k,
            responses=responses,
            mask=torch.ones(b, width, dtype=torch.bool),
            loss_mask=torch.ones(b, width, dtype=torch.bool),
            sampling_logprobs=None,
        ),
        gen_logprobs=torch.full((b, width), -float(index[0])),
        per_source=torch.tensor(scores)[:, None],
        scores=torch.tensor(scores),
        valid=torch.ones(b, dtype=torch.bool),
        contains_eos=torch.zeros(b, dtype=torch.bool),
        version=torch.full((b,), index[0]),
    )


PROMPTS = [[7], [8, 8], [9, 9, 9], [5], [6, 6, 6, 6], [4, 4]]


def test_groups_without_spread_are_replaced_by_informative_fresh_ones_at_their_position() -> None:
    # base: prompt 0 has spread, 1 and 2 do not; fresh: prompt 3 none, 4 and 5 spread
    base = _scored([0, 1, 2], [0.0, 1.0, 0.5, 0.5, 2.0, 2.0], width=3, prompts=PROMPTS)
    fresh = _scored([3, 4, 5], [1.0, 1.0, 0.0, 3.0, 1.0, 2.0], width=2, prompts=PROMPTS)
    merged, n = replace_groups(base, fresh, 2, PROMPTS, PAD)
    assert n == 2
    assert merged.index == [0, 4, 5]
    assert merged.scores.tolist() == [0.0, 1.0, 0.0, 3.0, 1.0, 2.0]
    assert merged.informative(2).tolist() == [True, True, True]
    # each completion's tokens travel with its score; the narrower fresh batch is right-padded, unmasked
    assert merged.sampled.responses[:, 0].tolist() == [1, 2, 401, 402, 501, 502]
    assert merged.sampled.responses.shape == (6, 3)
    assert merged.sampled.responses[2:, 2].tolist() == [PAD] * 4
    assert merged.sampled.mask[2:, 2].tolist() == [False] * 4 and merged.sampled.mask[:2].all()
    assert merged.gen_logprobs is not None and merged.gen_logprobs[:, 0].tolist() == [
        0.0,
        0.0,
        -3.0,
        -3.0,
        -3.0,
        -3.0,
    ]
    # so does the version of the weights that sampled it (each fixture batch: its first prompt's index)
    assert merged.version.tolist() == [0, 0, 3, 3, 3, 3]
    # the prompts are the merged batch's, left-padded to its longest (prompt 4: four tokens)
    assert merged.sampled.prompt_ids.tolist() == [[PAD, PAD, PAD, 7], [6, 6, 6, 6], [PAD, PAD, 4, 4]]
    assert merged.sampled.prompt_mask.sum(1).tolist() == [1, 4, 2]


def test_nothing_to_replace_or_nothing_to_replace_with_keeps_the_batch() -> None:
    base = _scored([0, 1], [0.0, 1.0, 2.0, 3.0], width=2, prompts=PROMPTS)
    fresh = _scored([2, 3], [1.0, 1.0, 0.0, 3.0], width=2, prompts=PROMPTS)
    same, n = replace_groups(base, fresh, 2, PROMPTS, PAD)
    assert same is base and n == 0
    flat = _scored([0, 1], [1.0, 1.0, 2.0, 2.0], width=2, prompts=PROMPTS)
    also_flat = _scored([2, 3], [1.0, 1.0, 5.0, 5.0], width=2, prompts=PROMPTS)
    same, n = replace_groups(flat, also_flat, 2, PROMPTS, PAD)
    assert same is flat and n == 0
    # position for position (the same on any number of processes): flat group 0 meets fresh group 0, flat
    # too, so it stays, although fresh group 1 has spread
    merged, n = replace_groups(_scored([0, 1], [1.0, 1.0, 2.0, 3.0], 2, PROMPTS), fresh, 2, PROMPTS, PAD)
    assert (n, merged.index) == (0, [0, 1])
    merged, n = replace_groups(_scored([0, 1], [2.0, 3.0, 1.0, 1.0], 2, PROMPTS), fresh, 2, PROMPTS, PAD)
    assert (n, merged.index) == (1, [0, 3])


@pytest.mark.parametrize(
    ("num_kept", "num_sequences", "mode", "scale"),
    [
        (4, 8, "seq-mean-token-sum", 2.0),  # 8 sequences, 4 kept: the mean over 4
        (6, 8, "seq-mean-token-mean", 8 / 6),
        (3, 12, "seq-mean-token-sum-norm", 4.0),
        (2, 8, "token-mean", 1.0),  # its denominator counts trained tokens already
    ],
)
def test_loss_scale_makes_the_mean_over_kept_sequences(
    num_kept: int, num_sequences: int, mode: str, scale: float
) -> None:
    assert loss_scale(num_kept, num_sequences, mode) == pytest.approx(scale)
