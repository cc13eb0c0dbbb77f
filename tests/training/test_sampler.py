from __future__ import annotations

import pytest

from rloo.training.sampler import PromptSampler


def test_each_epoch_is_a_permutation_and_draws_run_across_epochs() -> None:
    s = PromptSampler(5, seed=3)
    drawn = s.next(7)  # all of epoch 0, then 2 of epoch 1
    assert sorted(drawn[:5]) == [0, 1, 2, 3, 4]
    assert drawn[5:] == s.epoch_order(1)[:2]
    assert s.state_dict() == {"data_epoch": 1, "data_cursor": 2}


def test_the_order_does_not_depend_on_how_it_is_drawn() -> None:
    # one rollout of 12 or three of 4 (or 4 ranks slicing one draw): the same global order
    a, b = PromptSampler(7, seed=1), PromptSampler(7, seed=1)
    assert a.next(12) == b.next(4) + b.next(4) + b.next(4)
    assert PromptSampler(7, seed=2).next(7) != PromptSampler(7, seed=1).next(7)


def test_state_dict_resumes_exactly() -> None:
    s = PromptSampler(6, seed=9)
    s.next(4)
    state = s.state_dict()
    expected = s.next(10)
    fresh = PromptSampler(6, seed=9)
    fresh.load_state_dict(state)
    assert fresh.next(10) == expected
    unstarted = PromptSampler(6, seed=9)
    unstarted.load_state_dict({"data_epoch": -1, "data_cursor": 0})  # a checkpoint before any draw
    assert unstarted.next(3) == PromptSampler(6, seed=9).next(3)


def test_no_prompts_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptSampler(0, seed=0)
