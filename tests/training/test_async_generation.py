"""Generation that runs ahead of training (``--async_generation``, :mod:`rloo.training.async_rollout`): the
batch of update u + s is generated from update u's weights while update u trains, each row records the weights
that sampled it, the old log-probs come from today's weights, and the run stays reproducible.

The shape follows verl's one-step-off-policy trainer (``volcengine/verl
recipe/one_step_off_policy/ray_trainer.py``: the next batch is generated while the current one trains, on
weights one step old)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.training.experience import Experience
from rloo.training.trainer import RLOOTrainer
from tests.fixtures import recipes

pytestmark = pytest.mark.slow


def _cfg(tiny_setup: TinySetup, toy_dataset: Path, out: Path, **kw: Any) -> RLOOConfig:
    return recipes.config(tiny_setup, toy_dataset, out, recipes.LEARNING, **{"max_steps": 4, "seed": 3, **kw})


class Recorder:
    """Wraps the updater and the producer's generation: the batches trained on, each generation's thread, and
    the wall-clock interval of each update's optimization and of each batch's generation."""

    def __init__(self, trainer: RLOOTrainer) -> None:
        self.batches: list[Experience] = []
        self.threads: list[str] = []
        self.optimizing: dict[int, tuple[float, float]] = {}
        self.generating: dict[int, tuple[float, float]] = {}
        update, generate = trainer.updater.update, trainer.producer.generate

        def recording_update(batch: Experience) -> dict[str, float]:
            self.batches.append(batch)
            t0 = time.perf_counter()
            try:
                return update(batch)
            finally:
                self.optimizing[batch.update] = (t0, time.perf_counter())

        def recording_generate(u: int, *args: Any, **kw: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            t0 = time.perf_counter()
            try:
                return generate(u, *args, **kw)
            finally:
                self.generating[u] = (t0, time.perf_counter())

        trainer.updater.update = recording_update  # type: ignore[method-assign]
        trainer.producer.generate = recording_generate  # type: ignore[method-assign]


def test_the_next_batch_is_generated_on_a_worker_from_the_weights_one_update_old(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """num_ppo_epochs 1, num_mini_batches 1: one optimizer step per update. Batches 0 and 1 come from the
    starting weights (0 steps), batch u from the weights after u - 1 steps; the first is generated on the
    training thread (nothing to overlap yet), the rest on the worker while the previous update trains."""
    with caplog.at_level("INFO", logger="rloo"):
        trainer = RLOOTrainer(_cfg(tiny_setup, toy_dataset, tmp_path / "out", async_generation=True))
    # the run says so, in the unit async/staleness logs
    assert "async generation: the batch of update u+1 is generated from update u's weights" in caplog.text
    assert "(its rows 1 optimizer step old when trained: async/staleness)" in caplog.text
    seen = Recorder(trainer)
    history = trainer.train().history

    assert [b.update for b in seen.batches] == [0, 1, 2, 3]
    assert [set(b.policy_version.tolist()) for b in seen.batches] == [{0}, {0}, {1}, {2}]
    assert all(name.startswith("rloo-rollout") for name in seen.threads), seen.threads
    # batch u + 1 started before update u's optimization had ended (synchronously: after it), batch 0
    # before anything trained
    for u in range(3):
        assert seen.generating[u + 1][0] < seen.optimizing[u][1], u
    assert seen.generating[0][1] <= seen.optimizing[0][0]
    assert [h["async/staleness"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    assert [h["async/staleness_max"] for h in history] == [0.0, 1.0, 1.0, 1.0]
    assert all(h["time/generation_wait_s"] >= 0 and h["time/generation_s"] > 0 for h in history)
    # fresh batch: the update's own forward is the old policy (ratio exactly 1); stale: today's weights'
    # forward is, while the batch was sampled from the older ones
    assert history[0]["val/ratio"] == 1.0
    assert all(math.isfinite(h["loss/policy_avg"]) for h in history)


def test_the_first_update_is_the_synchronous_one_and_the_run_reproduces(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    """Batch 0 is sampled from the starting weights either way, with the same seeds: update 1's rollout is
    the synchronous run's. Later batches differ (older weights), and a second asynchronous run repeats the
    first exactly: each batch's seeds are its update's, whichever thread generates it and when."""
    sync = RLOOTrainer(_cfg(tiny_setup, toy_dataset, tmp_path / "sync")).train().history
    runs = [
        RLOOTrainer(_cfg(tiny_setup, toy_dataset, tmp_path / f"async{i}", async_generation=True))
        .train()
        .history
        for i in range(2)
    ]
    # the same completions (sampled from a copy of the same weights, on another thread)...
    for key in ("objective/scores", "completions/mean_length", "val/num_eos_tokens"):
        assert runs[0][0][key] == sync[0][key], key
    # ...whose log-probs the copy's forward gives up to float order
    for key in ("objective/kl", "objective/entropy"):
        assert runs[0][0][key] == pytest.approx(sync[0][key], rel=1e-4, abs=1e-6), key
    assert runs[0][2]["objective/scores"] != sync[2]["objective/scores"]
    timing = ("time/", "memory/", "throughput/", "eps", "timestamp")
    for a, b in zip(*runs, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith(timing)
        }


def test_two_updates_ahead_with_several_optimizer_steps_per_update(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    """--max_staleness 2 and 2 optimizer steps per update (two mini-batches): batch u comes from the
    weights of update u - 2, 4 optimizer steps old; the importance-sampling correction runs on the built-in
    generator's log-probs."""
    cfg = _cfg(
        tiny_setup,
        toy_dataset,
        tmp_path / "out",
        async_generation=True,
        max_staleness=2,
        num_mini_batches=2,
        max_steps=5,
        vllm_importance_sampling_correction=True,
    )
    trainer = RLOOTrainer(cfg)
    seen = Recorder(trainer)
    history = trainer.train().history
    assert [set(b.policy_version.tolist()) for b in seen.batches] == [{0}, {0}, {0}, {2}, {4}]
    assert [h["async/staleness"] for h in history] == [0.0, 2.0, 4.0, 4.0, 4.0]
    # the correction compares today's weights with the ones that sampled: equal for batch 0 (float order
    # aside), apart once the batch is 4 steps old
    diffs = [h["objective/vllm_logp_diff_abs_mean"] for h in history]
    assert diffs[0] < 1e-4 and all(d > 10 * diffs[0] for d in diffs[2:]), diffs


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"max_staleness": 2}, "--max_staleness bounds generation that runs ahead: add --async_generation."),
        (
            {"async_generation": True, "use_vllm": True, "vllm_enable_sleep_mode": True},
            "--vllm_enable_sleep_mode",
        ),
    ],
)
def test_settings_that_cannot_run_ahead_are_refused_in_one_line(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path, flags: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError, match=message.replace("-", r"\-").replace(".", r"\.")) as e:
        _cfg(tiny_setup, toy_dataset, tmp_path / "out", **flags).validate()
    assert "\n" not in str(e.value)


def test_a_copy_of_the_policy_is_sampled_from_while_it_trains(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    """The built-in generator samples from a rollout copy (the policy's own dtype here, fp32 on CPU) that the
    optimizer steps do not change under it; synchronous generation keeps sampling from the policy itself."""
    sync = RLOOTrainer(_cfg(tiny_setup, toy_dataset, tmp_path / "sync"))
    assert sync.generator.model is sync.policy  # type: ignore[attr-defined]
    sync.release_output()
    trainer = RLOOTrainer(_cfg(tiny_setup, toy_dataset, tmp_path / "out", async_generation=True))
    copy = trainer.generator.model  # type: ignore[attr-defined]
    assert copy is not trainer.policy
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in copy.parameters())
    # its own storage: in the same dtype, Tensor.to would have handed back the policy's
    pointers = {p.data_ptr() for p in trainer.policy.parameters()}
    assert not pointers & {p.data_ptr() for p in copy.parameters()}
    trainer.release_output()


def _ahead(world: int = 1, rank: int = 0, **producer: Any) -> Any:
    """RolloutsAhead over a stand-in producer (``producer``: its attributes) on rank ``rank`` of ``world``."""
    from types import SimpleNamespace

    from rloo.training.async_rollout import RolloutsAhead

    comm = SimpleNamespace(world=world, rank=rank, gather_objects=lambda obj: [obj])
    stand_in = SimpleNamespace(
        **{
            "generator": SimpleNamespace(),
            **producer,
            "comm": comm,
            "accelerator": None,
            "cfg": SimpleNamespace(rloo_k=2),
            "tokenizer": SimpleNamespace(pad_token_id=0),
        }
    )
    return RolloutsAhead(stand_in, staleness=1, num_updates=9)  # type: ignore[arg-type]


def test_a_checkpoint_from_two_processes_splits_over_one_or_four(tmp_path: Path) -> None:
    """The batches ahead are stored as every rank's part, in rank order; a resumed run on another number of
    processes takes its own prompts' rows (each row is its own seed's sample) padded to its widest one."""
    from rloo.training.async_rollout import AHEAD_FILE

    # two ranks x 2 prompts x k=2: rank 0 generated 3 tokens a row, rank 1 two; row r's tokens are r + 1
    parts = [
        {
            5: {
                "index": [10, 11],
                "tokens": torch.arange(1, 5)[:, None].repeat(1, 3),
                "logprobs": None,
                "version": 7,
                "seconds": 2.5,
            }
        },
        {
            5: {
                "index": [12, 13],
                "tokens": torch.arange(5, 9)[:, None].repeat(1, 2),
                "logprobs": None,
                "version": 7,
                "seconds": 1.5,
            }
        },
    ]
    torch.save({"parts": parts}, tmp_path / AHEAD_FILE)

    one = _ahead(world=1, rank=0)
    one.load(tmp_path)
    whole = one.take(5)
    assert whole.index == [10, 11, 12, 13] and whole.version == 7
    assert whole.seconds == 2.5  # the slower rank's generation time, logged as time/generation_s
    assert whole.generated.tokens.tolist() == [[r, r, r] for r in (1, 2, 3, 4)] + [
        [r, r, 0] for r in (5, 6, 7, 8)
    ]

    for rank, (index, rows) in enumerate([([10], [1, 2]), ([11], [3, 4]), ([12], [5, 6]), ([13], [7, 8])]):
        quarter = _ahead(world=4, rank=rank)
        quarter.load(tmp_path)
        got = quarter.take(5)
        width = 3 if rank < 2 else 2  # the widest of its own rows
        assert got.index == index and got.generated.tokens.tolist() == [[r] * width for r in rows]

    three = _ahead(world=3, rank=0)  # 4 prompts do not split over 3: generated again
    three.load(tmp_path)
    assert three.ready == {}


def test_a_generator_lost_on_the_worker_is_raised_after_the_wait_with_its_prompts_put_back() -> None:
    """The worker's failure surfaces on the training thread at the wait (where every process agrees on it);
    the prompts it had drawn go back to the sampler, so the checkpoint taken next draws them again."""
    from types import SimpleNamespace

    from rloo.training.sampler import PromptSampler
    from rloo.training.vllm_server import GeneratorLost

    sampler = PromptSampler(8, seed=0)
    calls: list[str] = []

    def lost(update: int, index: list[int]) -> Any:
        raise GeneratorLost("the vLLM server at http://rollout:8000 did not answer for 5 s")

    generator = SimpleNamespace(weights_version=3, sync_weights=lambda: calls.append("sync"), on_worker=False)
    ahead = _ahead(generator=generator, sampler=sampler, draw=lambda: sampler.next(2), generate=lost)
    before = sampler.state_dict()
    ahead.launch(1)
    assert calls == ["sync"] and sampler.state_dict() != before  # weights read, prompts drawn
    with pytest.raises(GeneratorLost, match="did not answer"):
        ahead.wait()
    assert sampler.state_dict() == before and ahead.ready == {}
    # the server's own push and agreement are back for the training thread
    assert generator.on_worker is False
    ahead.launch(9)  # past the run's end: nothing
    assert ahead.wait() == 0.0 and calls == ["sync"]
    ahead.close()


def test_lora_generates_ahead_from_a_copy_of_the_adapted_policy(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    """Under LoRA the built-in generator's copy holds the base and the adapters; each launch refreshes the
    copy from the policy, so batch 3 is sampled from the adapters after one step, neither the starting ones
    nor today's."""
    pytest.importorskip("peft")
    cfg = _cfg(
        tiny_setup,
        toy_dataset,
        tmp_path / "out",
        async_generation=True,
        use_peft=True,
        lora_r=4,
        lora_alpha=8.0,
        max_steps=3,
    )
    trainer = RLOOTrainer(cfg)
    copy = trainer.generator.model  # type: ignore[attr-defined]
    assert copy is not trainer.policy and hasattr(copy, "peft_config")
    seen = Recorder(trainer)
    history = trainer.train().history
    assert [set(b.policy_version.tolist()) for b in seen.batches] == [{0}, {0}, {1}]
    # the copy was refreshed at the last launch (before update 2 trained): its adapters are the policy's of then,
    # which update 2 and 3 have moved on from
    adapters = {n: p for n, p in trainer.policy.named_parameters() if "lora_" in n}
    copied = {n: p for n, p in copy.named_parameters() if "lora_" in n}
    assert adapters.keys() == copied.keys() and adapters
    assert any(not torch.equal(adapters[n], copied[n]) for n in adapters)
    # LoRA's B starts at zero: the copy's moved off it, so it was refreshed after a step, not only at the start
    assert any(bool(p.abs().sum() > 0) for n, p in copied.items() if "lora_B" in n)
    assert all(math.isfinite(h["loss/policy_avg"]) for h in history)
