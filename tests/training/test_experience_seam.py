"""The seam between producing experience and consuming it: the update reads one typed ``Experience`` and
nothing else, so a producer that runs one update ahead and a multi-turn episode with masked tool tokens both
fit it without a change to the update."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup
from rloo.training.experience import Experience, ExperienceProducer
from rloo.training.step_timer import StepTimer
from rloo.training.trainer import RLOOTrainer
from rloo.training.update import PolicyUpdater
from tests.fixtures import recipes

pytestmark = pytest.mark.slow


def _cfg(tiny_setup: TinySetup, toy_dataset: Path, out: Path, **kw: Any) -> RLOOConfig:
    return recipes.config(tiny_setup, toy_dataset, out, recipes.LEARNING, **{"max_steps": 3, "seed": 3, **kw})


class OneUpdateAhead:
    """A producer that samples the batch of update t+1 before update t trains, as asynchronous generation
    does (here in the same thread: the order of the work is what matters to the update)."""

    def __init__(self, inner: ExperienceProducer, num_updates: int) -> None:
        self.inner, self.num_updates = inner, num_updates
        self.ahead: Experience | None = None
        self.handed: list[Experience] = []

    def produce(self, update: int, timer: StepTimer, ahead: Any = None) -> Experience:
        if self.ahead is not None and self.ahead.update == update:
            batch = self.ahead
        else:
            batch = self.inner.produce(update, timer)
        self.ahead = self.inner.produce(update + 1, timer) if update + 1 < self.num_updates else None
        self.handed.append(batch)
        return batch

    def __getattr__(self, name: str) -> Any:  # the sample table and the rest: the inner producer's
        return getattr(self.inner, name)


def test_a_producer_running_one_update_ahead_plugs_in_without_touching_the_update(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    """One optimizer step per update (on-policy): the synchronous update reuses its own forward as the "old"
    log-probs (ratio exactly 1). A batch sampled one update ahead carries the version of the weights that
    sampled it (one step behind); the same, untouched updater sees that it is stale and takes its ratio
    against the sampler's log-probs instead, so the ratio moves off 1. The shape follows verl's one-step
    off-policy trainer (``volcengine/verl recipe/one_step_off_policy/ray_trainer.py``: the next batch is
    generated while the current one trains, on weights one step old)."""
    trainer = RLOOTrainer(_cfg(tiny_setup, toy_dataset, tmp_path / "out"))
    updater = trainer.updater
    ahead = OneUpdateAhead(trainer.producer, trainer.num_updates)
    trainer.producer = ahead  # type: ignore[assignment]
    history = trainer.train().history

    assert trainer.updater is updater and type(updater) is PolicyUpdater
    assert len(history) == 3 and [b.update for b in ahead.handed] == [0, 1, 2]
    # batch 0 and batch 1 were both sampled before the first optimizer step; batch 2 after one
    assert [set(b.policy_version.tolist()) for b in ahead.handed] == [{0}, {0}, {1}]
    assert updater.version == 3
    assert history[0]["val/ratio"] == 1.0  # fresh: the update's own forward is the old policy
    assert all(h["val/ratio"] != 1.0 for h in history[1:])  # stale: measured against the sampler
    assert all(math.isfinite(h["loss/policy_avg"]) for h in history)


def _episode(trainer: RLOOTrainer, tool: slice) -> Experience:
    """One prompt, K multi-turn episodes of T tokens: assistant tokens, then a tool's result at ``tool``
    (masked out of the loss), then assistant tokens again; per-token advantages."""
    gen = torch.Generator().manual_seed(0)
    k, t = trainer.cfg.rloo_k, 10
    prompt = torch.tensor([trainer.train_ids[0]])
    responses = torch.randint(3, trainer.policy.config.vocab_size, (k, t), generator=gen)
    loss_mask = torch.ones(k, t, dtype=torch.bool)
    loss_mask[:, tool] = False
    batch = Experience(
        update=0,
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt),
        rows=torch.zeros(k, dtype=torch.long),
        responses=responses,
        mask=torch.ones(k, t, dtype=torch.bool),
        loss_mask=loss_mask,
        old_logprobs=torch.zeros(k, t),
        ref_logprobs=torch.zeros(k, t),
        sampling_logprobs=None,
        scores=torch.zeros(k),
        advantages=torch.randn(k, t, generator=gen),
        policy_version=torch.zeros(k, dtype=torch.long),
        metrics={},
    )
    trainer.policy.train()
    return dataclasses.replace(batch, old_logprobs=trainer.logprobs.batched(trainer.policy, batch))


def _update_from(trainer: RLOOTrainer, start: tuple[dict, dict], batch: Experience) -> list[torch.Tensor]:
    trainer.policy.load_state_dict(start[0])
    trainer.optimizer.load_state_dict(start[1])
    trainer.updater.update(batch)
    return [p.detach().clone() for p in trainer.policy.parameters()]


def test_a_multi_turn_episode_fits_the_batch_and_its_tool_tokens_train_nothing(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    """A hand-built multi-turn batch goes through the same updater. Whatever its tool-result positions hold
    as old log-probs and advantages, the weights after the update are the same bit for bit: ``loss_mask``
    keeps them out of the loss and its gradient. The same change at one of the policy's own positions
    moves the weights (the check can fail). The episode layout follows SkyRL's generator, whose per-turn
    ``loss_mask`` is 0 on the environment's observation tokens (``NovaSky-AI/SkyRL
    skyrl-train/skyrl_train/generators/skyrl_gym_generator.py``)."""
    cfg = _cfg(
        tiny_setup,
        toy_dataset,
        tmp_path / "out",
        per_device_train_batch_size=4,
        num_ppo_epochs=2,  # off-policy: the loss reads the batch's old log-probs at every position
        max_steps=1,
    )
    trainer = RLOOTrainer(cfg)
    try:
        tool = slice(3, 6)
        batch = _episode(trainer, tool)
        start = (copy.deepcopy(trainer.policy.state_dict()), copy.deepcopy(trainer.optimizer.state_dict()))
        before = [p.detach().clone() for p in trainer.policy.parameters()]
        base = _update_from(trainer, start, batch)

        def perturbed(cols: slice) -> Experience:
            adv, old = batch.advantages.clone(), batch.old_logprobs.clone()
            adv[:, cols] = adv[:, cols] * -50.0 + 7.0
            old[:, cols] = old[:, cols] - 5.0
            return dataclasses.replace(batch, advantages=adv, old_logprobs=old)

        at_tool = _update_from(trainer, start, perturbed(tool))
        at_policy = _update_from(trainer, start, perturbed(slice(7, 8)))
    finally:
        trainer.release_output()
    assert any(not torch.equal(a, b) for a, b in zip(before, base, strict=True))  # it trained
    assert all(torch.equal(a, b) for a, b in zip(base, at_tool, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(base, at_policy, strict=True))
