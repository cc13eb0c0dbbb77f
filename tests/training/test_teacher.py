"""On-policy distillation (--teacher_model_path): the reward term on hand-computed numbers, the refusals (one
line each), a tiny policy pulled toward a different tiny teacher with no reward at all, and a run without a
teacher that carries nothing of one."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from rloo import algo
from rloo.config import RLOOConfig
from rloo.demo.tiny import TinySetup, build_causal_lm, build_tokenizer, build_vowel_teacher
from rloo.errors import UserError
from rloo.training import run_record, teacher
from rloo.training.experience import Experience, ExperienceProducer
from rloo.training.step_timer import StepTimer
from rloo.training.trainer import RLOOTrainer
from tests.fixtures import recipes


@pytest.fixture(scope="module")
def teacher_model(tiny_setup: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The policy's tokenizer, other weights, and a taste for the toy task's all-vowel tokens."""
    return build_vowel_teacher(tmp_path_factory.mktemp("teacher") / "teacher", tiny_setup.tokenizer)


@pytest.fixture(scope="module")
def other_vocab_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teacher whose tokenizer gives two of the policy's tokens each other's ids ("a" and "e"): the same
    strings, other ids, as another model family's tokenizer would."""
    import json

    root = tmp_path_factory.mktemp("other_vocab")
    build_tokenizer(root / "tokenizer")
    spec = json.loads((root / "tokenizer" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
    (root / "tokenizer" / "tokenizer.json").write_text(json.dumps(spec))
    return build_causal_lm(root / "teacher", root / "tokenizer", seed=7)


def test_tokens_only_the_teacher_has_are_no_obstacle(tmp_path: Path) -> None:
    """An appended pad token leaves every policy token's id as it was: the policy never samples it."""
    policy = build_tokenizer(tmp_path / "policy")
    padded = build_tokenizer(tmp_path / "padded", with_pad_token=True)
    assert len(padded.get_vocab()) == len(policy.get_vocab()) + 1
    teacher.check_shared_vocabulary(policy, padded, policy="p", teacher="t")


# -- the reward term, by hand ------------------------------------------------------------------------------
# One prompt, K = 2 completions of 3 tokens, the second one's last token padding.
MASK = torch.tensor([[True, True, True], [True, True, False]])
POLICY = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, -1.5, -9.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5], [-2.5, -0.5, -0.1]])  # k1: [0.5, -1, 0], [2, -1, -]: sums -0.5, 1
REFERENCE = torch.tensor(
    [[-1.0, -2.5, -0.5], [-1.0, -1.5, 0.0]]
)  # k1: [0, 0.5, 0], [0.5, 0, -]: sums 0.5, 0.5
SCORES = torch.tensor([1.0, 0.0])


def _advantages(**kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ExperienceProducer._advantages on the batch above, with kl_coef 0.25 and teacher_kl_coef 0.5."""
    cfg = RLOOConfig(
        model_name_or_path="/m",
        dataset_name="/d",
        teacher_model_path="/teacher",
        kl_coef=0.25,
        teacher_kl_coef=0.5,
        **kw,
    )
    kl = algo.per_token_kl(POLICY, REFERENCE, MASK, cfg.kl_estimator)
    teacher_kl = algo.per_token_kl(POLICY, TEACHER, MASK)
    producer = types.SimpleNamespace(cfg=cfg)  # what the method reads without normalisation or scaling
    return ExperienceProducer._advantages(
        producer, SCORES, torch.ones(2, dtype=torch.bool), kl, MASK, teacher_kl
    )  # type: ignore[arg-type]


def test_the_teacher_kl_is_subtracted_from_the_reward_like_the_reference_kl() -> None:
    # reward = score - 0.25 x (0.5) - 0.5 x (-0.5 | 1): 1 - 0.125 + 0.25 and 0 - 0.125 - 0.5
    advantages, rlhf_reward, non_score = _advantages()
    assert rlhf_reward.tolist() == [1.125, -0.625]
    assert non_score.tolist() == [0.125, -0.625]
    assert advantages.tolist() == [1.75, -1.75]  # leave-one-out over the group of two
    sequence = algo.sequence_kl(algo.per_token_kl(POLICY, TEACHER, MASK), MASK)
    assert teacher.teacher_metrics(sequence) == {"teacher/kl": 0.25}  # mean of -0.5 and 1


def test_with_token_level_kl_the_teacher_kl_is_a_per_token_reward() -> None:
    # per-token penalties 0.25 kl + 0.5 teacher_kl: [0.25, -0.375, 0] and [1.125, -0.5, -]; each token is
    # charged the penalties before it no more (returns to go)
    advantages, rlhf_reward, _ = _advantages(token_level_kl=True)
    assert rlhf_reward.tolist() == [1.125, -0.625]
    assert advantages.tolist() == [[1.75, 2.0, 1.625], [-1.75, -0.625, 0.0]]


def test_with_the_reference_kl_in_the_loss_the_reward_keeps_the_teacher_kl_alone() -> None:
    _, rlhf_reward, non_score = _advantages(kl_in_loss=True, kl_estimator="k3")
    assert rlhf_reward.tolist() == [1.25, -0.5]
    assert non_score.tolist() == [0.25, -0.5]


# -- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--teacher_kl_in_loss", "true"],
            "--teacher_kl_in_loss sets the distillation toward a teacher: add --teacher_model_path, or drop "
            "--teacher_kl_in_loss.",
        ),
        (
            ["--teacher_kl_coef", "0.3"],
            "--teacher_kl_coef sets the distillation toward a teacher: add --teacher_model_path, or drop "
            "--teacher_kl_coef.",
        ),
        (
            ["--teacher_model_path", "/teacher", "--teacher_kl_in_loss", "true"],
            "--teacher_kl_in_loss needs --kl_estimator k2 or k3: the gradient of k1 (logp - teacher_logp) is 0 "
            "in expectation, so it would not pull the policy towards the teacher.",
        ),
    ],
    ids=["in-loss-without-teacher", "coef-without-teacher", "in-loss-with-k1"],
)
def test_teacher_flags_are_refused_in_one_line_with_exit_code_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rloo.cli import main

    base = ["--model_name_or_path", "/m", "--dataset_name", "/d", "--reward_funcs", "m:f"]
    assert main(["train", *base, *flags]) == 2
    assert capsys.readouterr().err == f"rloo train: error: {message}\n"


def test_a_teacher_alone_is_a_reward_source_and_filter_groups_is_refused_with_it() -> None:
    cfg = RLOOConfig(model_name_or_path="/m", dataset_name="/d", teacher_model_path="/teacher")
    assert cfg.reward_funcs == [] and cfg.reward_model_path is None
    with pytest.raises(UserError, match=r"^--filter_groups leaves out") as refused:
        RLOOConfig(
            model_name_or_path="/m", dataset_name="/d", teacher_model_path="/teacher", filter_groups=True
        )
    assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match=r"^no reward source: .*--teacher_model_path"):
        RLOOConfig(model_name_or_path="/m", dataset_name="/d")


def test_a_teacher_with_another_vocabulary_is_refused_at_start(
    tiny_setup: TinySetup, toy_dataset: Path, other_vocab_teacher: Path, tmp_path: Path
) -> None:
    cfg = recipes.config(
        tiny_setup, toy_dataset, tmp_path / "out", teacher_model_path=str(other_vocab_teacher)
    )
    with pytest.raises(UserError) as refused:
        RLOOTrainer(cfg)
    text = str(refused.value)
    assert "\n" not in text
    assert text.startswith(
        f"--teacher_model_path {other_vocab_teacher}: its tokenizer maps 2 of the policy's"
    )
    assert f"--model_name_or_path {tiny_setup.policy}" in text and "same token ids" in text
    assert "(the first, 'a', is" in text or "(the first, 'e', is" in text


def test_the_teacher_is_a_setting_a_resume_must_repeat() -> None:
    fixed = run_record._fixed_settings()
    assert {"teacher_model_path", "teacher_kl_coef", "teacher_kl_in_loss"} <= set(fixed)


# -- training ------------------------------------------------------------------------------------------------
def _distillation(
    tiny_setup: TinySetup, toy_dataset: Path, teacher_model: Path, out: Path, **kw: Any
) -> RLOOConfig:
    """Pure distillation (no reward function) under the settings where the toy reward rises in 20 updates
    (tests/integration/test_train.py)."""
    return recipes.config(
        tiny_setup,
        toy_dataset,
        out,
        recipes.LEARNING,
        reward_funcs=[],
        teacher_model_path=str(teacher_model),
        per_device_train_batch_size=32,
        num_ppo_epochs=2,
        kl_coef=0.01,
        learning_rate=1e-2,
        max_steps=20,
        seed=3,
        **kw,
    )


def _falls(history: list[dict[str, Any]]) -> tuple[float, float]:
    """teacher/kl's mean over the first 4 updates and over the last 4."""
    kl = [h["teacher/kl"] for h in history]
    print(f"teacher/kl: {[round(v, 2) for v in kl]}")
    return sum(kl[:4]) / 4, sum(kl[-4:]) / 4


@pytest.mark.slow
def test_the_policy_moves_toward_the_teacher_with_no_reward_at_all(
    tiny_setup: TinySetup, toy_dataset: Path, teacher_model: Path, tmp_path: Path
) -> None:
    """Every score 0: the KL to the teacher is the whole reward. Seen: teacher/kl 13.0 over the first 4
    updates -> 5.8 over the last 4 (seed 3), 13.6 -> 5.9 (seed 0), 13.4 -> 6.2 (seed 1); the assertion asks
    for a fall of 30%, about four times the noise."""
    trainer = RLOOTrainer(_distillation(tiny_setup, toy_dataset, teacher_model, tmp_path / "out"))
    assert not trainer.teacher.training and not any(p.requires_grad for p in trainer.teacher.parameters())
    history = trainer.train().history
    assert all(h["objective/scores"] == 0.0 for h in history)
    first, last = _falls(history)
    assert last < 0.7 * first, (first, last)


@pytest.mark.slow
def test_with_the_kl_in_the_loss_the_policy_moves_toward_the_teacher(
    tiny_setup: TinySetup, toy_dataset: Path, teacher_model: Path, tmp_path: Path
) -> None:
    """With the term in the loss (k3) the policy moves toward the teacher too."""
    cfg = _distillation(
        tiny_setup, toy_dataset, teacher_model, tmp_path / "out", teacher_kl_in_loss=True, kl_estimator="k3"
    )
    history = RLOOTrainer(cfg).train().history
    first, last = _falls(history)
    assert last < 0.3 * first, (first, last)
    # the loss's term is logged too, and falls with the KL (k3 of the same log-probs, before the coefficient)
    terms = [h["loss/teacher_kl_avg"] for h in history]
    assert terms[-1] < terms[0]


@pytest.mark.slow
def test_with_the_kl_in_the_loss_the_batch_carries_the_teacher_log_probs(
    tiny_setup: TinySetup, toy_dataset: Path, teacher_model: Path, tmp_path: Path
) -> None:
    cfg = recipes.config(
        tiny_setup,
        toy_dataset,
        tmp_path / "out",
        teacher_model_path=str(teacher_model),
        teacher_kl_in_loss=True,
        kl_estimator="k3",
        max_steps=1,
    )
    trainer = RLOOTrainer(cfg)
    batches = _recorded(trainer)
    history = trainer.train().history
    (batch,) = batches
    assert batch.teacher_logprobs is not None and batch.teacher_logprobs.shape == batch.old_logprobs.shape
    # the teacher's KL is the loss's, not the reward's: at the first update the policy is the reference, so the
    # reward's penalty is (about) 0 while the KL to the teacher is not
    assert history[0]["teacher/kl"] > 1.0
    assert abs(history[0]["objective/non_score_reward"]) < 1e-6


@pytest.mark.slow
def test_lora_distils_from_a_separate_teacher(
    tiny_setup: TinySetup, toy_dataset: Path, teacher_model: Path, tmp_path: Path
) -> None:
    pytest.importorskip("peft")
    cfg = recipes.config(
        tiny_setup,
        toy_dataset,
        tmp_path / "out",
        teacher_model_path=str(teacher_model),
        use_peft=True,
        lora_r=4,
        max_steps=2,
    )
    trainer = RLOOTrainer(cfg)
    assert (
        trainer.ref_policy is None and trainer.teacher is not None
    )  # the reference is the base, not the teacher
    history = trainer.train().history
    assert len(history) == 2 and all(h["teacher/kl"] > 0 for h in history)


@pytest.mark.slow
def test_without_a_teacher_nothing_of_one_is_there(
    tiny_setup: TinySetup, toy_dataset: Path, tmp_path: Path
) -> None:
    trainer = RLOOTrainer(recipes.config(tiny_setup, toy_dataset, tmp_path / "out", max_steps=2))
    assert trainer.teacher is None and trainer.producer.teacher is None
    batches = _recorded(trainer)
    history = trainer.train().history
    assert len(batches) == 2 and all(b.teacher_logprobs is None for b in batches)
    assert not [key for h in history for key in h if key.startswith("teacher/")]


def _recorded(trainer: RLOOTrainer) -> list[Experience]:
    """The batches the trainer's producer hands to the update, as they are handed."""
    batches: list[Experience] = []
    produce = trainer.producer.produce

    def recording(update: int, timer: StepTimer, ahead: Any = None) -> Experience:
        batches.append(produce(update, timer, ahead))
        return batches[-1]

    trainer.producer.produce = recording  # type: ignore[method-assign]
    return batches
