"""The embedded defaults of ``rloo pipeline run --local``: tiny models, toy datasets and the toy judge.

:func:`rloo.pipeline.local.run_pipeline_locally` takes these as arguments (the CLI passes them) rather than
importing them, so the pipeline layer does not depend on the demo fixtures.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rloo.demo.toy import TOY_UPDATES

ASSETS_DIR = "assets"


def embedded_params(workdir: Path, *, updates: int = TOY_UPDATES, seed: int = 0) -> dict[str, Any]:
    """The parameters of a self-contained run: build the tiny models and toy datasets under ``workdir`` and
    train with the toy recipe of ``rloo demo`` (:data:`rloo.demo.toy.TOY_TRAINING`): the settings the
    pipeline exposes as parameters, the others as ``extra_train_args``."""
    from rloo.demo.tiny import build_tiny_setup
    from rloo.demo.toy import TOY_TRAINING, write_toy_dataset, write_toy_eval_dataset
    from rloo.stages.plan import pipeline_fields

    assets = workdir / ASSETS_DIR
    setup = build_tiny_setup(assets / "models", arch="gpt_neox", seed=seed)
    exposed = {p.name for p in pipeline_fields() if p.part == "train"}
    extra: list[str] = []
    for flag, value in TOY_TRAINING.items():
        if flag not in exposed:
            extra += [f"--{flag}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return {
        "model": str(setup.policy),
        "reward_model_path": str(setup.reward_model),
        "dataset_name": str(write_toy_dataset(assets / "prompts", seed=seed)),
        "eval_dataset_name": str(write_toy_eval_dataset(assets / "eval", seed=seed + 1)),
        "eval_max_new_tokens": 16,
        "total_episodes": updates * TOY_TRAINING["per_device_train_batch_size"],
        **{k: v for k, v in TOY_TRAINING.items() if k in exposed},
        "seed": seed,
        "extra_train_args": shlex.join(extra),
        "gpu_count": 0,
    }


@contextmanager
def toy_judge() -> Iterator[dict[str, Any]]:
    """The toy judge, served while the run needs it: yields the judge parameters that point at it."""
    from rloo.demo.judge import MODEL, ToyJudge

    with ToyJudge() as judge:
        yield {"judge_base_url": judge.base_url, "judge_model": MODEL}
