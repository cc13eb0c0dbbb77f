"""Reward sources: a reward model scored with its own tokenizer, and user reward functions.

Each source returns one value per completion; ``None`` (a function saying "not applicable") becomes NaN
here and is handled by :func:`rloo.algo.combine_reward_sources`: a completion that no source scored is
left out of its group's leave-one-out baseline and gets a zero advantage.
"""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rloo.errors import UserError
from rloo.importing import load_callable
from rloo.models import reward_model_scores


@dataclass
class TrainerState:
    """What reward functions receive as ``trainer_state`` (the fields of transformers' TrainerState they use)."""

    global_step: int = 0
    max_steps: int = 0
    episode: int = 0
    epoch: float = 0.0


@dataclass
class RewardBatch:
    """Everything a reward source may look at, one entry per completion (prompt-major: p*K + k)."""

    prompts: list[Any]  # the dataset's prompt (text or chat messages)
    prompt_texts: list[str]  # the prompt as the policy saw it (chat template applied)
    completions: list[Any]  # text, or [{"role": "assistant", "content": text}] for chat prompts
    completion_texts: list[str]
    completion_ids: list[list[int]]  # the policy's ids, truncated after the stop token
    scoring_texts: list[str]  # prompt + completion, special tokens kept (what a reward model reads)
    extra: dict[str, list[Any]] = field(default_factory=dict)  # other dataset columns
    trainer_state: TrainerState = field(default_factory=TrainerState)
    # multi-turn episodes in an environment that scores them: its get_reward() at each episode's end
    environment_rewards: list[float | None] | None = None

    def __len__(self) -> int:
        return len(self.completion_texts)


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Resolve ``pkg.module:fn`` (or ``pkg.module.fn``) to a callable."""
    return load_callable(spec, flag="--reward_funcs", role="the function that scores the completions")


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


class RewardFunctionSource:
    """A user reward function, called TRL-style with keyword arguments, its output validated."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn = load_reward_function(spec)
        self.name = getattr(self.fn, "__name__", spec.rpartition(":")[2] or spec)

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        try:
            out = self.fn(
                prompts=batch.prompts,
                completions=batch.completions,
                completion_ids=batch.completion_ids,
                trainer_state=batch.trainer_state,
                **batch.extra,
            )
        except Exception as e:
            raise UserError(
                f"--reward_funcs {self.spec} raised {type(e).__name__}: {e}{_where(e)}."
            ) from None
        return self.validate(out, len(batch))

    def validate(self, out: Any, n: int) -> torch.Tensor:
        if isinstance(out, torch.Tensor):
            out = out.detach().cpu().tolist()
        elif hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
            out = out.tolist()  # numpy arrays
        if not isinstance(out, (list, tuple)):
            raise UserError(
                f"--reward_funcs {self.spec} returned a {type(out).__name__}; return a list with one float "
                "(or None) per completion."
            )
        if len(out) != n:
            raise UserError(
                f"--reward_funcs {self.spec} returned {len(out)} values for {n} completions; return exactly one "
                "float (or None) per completion."
            )
        values = []
        for i, v in enumerate(out):
            if v is None:
                values.append(math.nan)
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise UserError(
                    f"--reward_funcs {self.spec} returned a {type(v).__name__} for completion {i}; each value must be "
                    "a float or None."
                )
            if not math.isfinite(float(v)):
                raise UserError(
                    f"--reward_funcs {self.spec} returned a non-finite reward ({v}) for completion {i}; return a "
                    "finite float, or None when the completion cannot be scored."
                )
            values.append(float(v))
        return torch.tensor(values, dtype=torch.float32)


class EnvironmentRewardSource:
    """The reward an environment gives each episode (``get_reward()``, TRL's ``environment_factory``), read at
    the episode's end; None leaves the episode unscored by it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        got = batch.environment_rewards
        if got is None or len(got) != len(batch):
            raise RuntimeError("the batch carries no environment reward per episode")
        values = [math.nan if v is None else float(v) for v in got]
        if not all(math.isnan(v) or math.isfinite(v) for v in values):
            raise UserError(
                f"--environment {self.name}: get_reward() returned a non-finite value; return a finite float, or "
                "None when the episode cannot be scored."
            )
        return torch.tensor(values, dtype=torch.float32)


class RewardModelSource:
    """A sequence-classification reward model that reads decoded text through its own tokenizer.

    The policy's ids are never fed to it directly: the two tokenizers may differ, and a shared vocabulary
    is an assumption the reference made silently.
    """

    name = "reward_model"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int,
        device: torch.device,
        autocast: Callable[[], Any],
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # Keep the end of long inputs: the completion, which is what is being judged, sits there.
        self.tokenizer.truncation_side = "left"
        self.batch_size = batch_size
        self.device = device
        self.autocast = autocast

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """(B,) scalar reward of each text, read at its last token (:func:`rloo.models.reward_model_scores`)."""
        return reward_model_scores(
            self.model,
            self.tokenizer,
            texts,
            batch_size=self.batch_size,
            device=self.device,
            autocast=self.autocast,
        )

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        scores = self.score_texts(batch.scoring_texts)
        if not torch.isfinite(scores).all():
            i = int((~torch.isfinite(scores)).nonzero()[0])
            raise UserError(
                f"--reward_model_path produced a non-finite score for completion {i}; check the reward model "
                "(try float32 instead of --fp16/--bf16)."
            )
        return scores


def score_all(sources: list[Any], batch: RewardBatch) -> torch.Tensor:
    """(B, S): every source's reward for every completion, NaN where a function returned None; (B, 0) with no
    source (a distillation teacher alone)."""
    if not sources:
        return torch.zeros(len(batch.completion_ids), 0)
    return torch.stack([src(batch) for src in sources], dim=1)
