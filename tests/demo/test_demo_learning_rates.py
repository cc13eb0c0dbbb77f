"""The demo's evaluation tells runs apart: the local pipeline's training and evaluation (``make demo``) at two
learning rates give two different trained win rates, ordered like the two runs' final rewards.

Against references of one level (ordinary words, about 0.3 vowels) any model that had learnt a little won
every pair: 5e-3 and 5e-4 both came out at 1.00. The references are graded now (their vowel fractions spread
from 0 to 1), so the win rate follows how far each run got. The steps' own code runs in this process: the
validate step's checks give the training config, the trainer trains on it, the evaluate step's function
judges the model against the toy judge over HTTP. About 30 s on two cores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

FAST, SLOW = 5e-3, 5e-4


def _demo_run(work: Path, params: dict[str, Any], learning_rate: float) -> dict[str, Any]:
    from rloo.config import RLOOConfig
    from rloo.pipeline.local import check_names
    from rloo.pipeline.params import with_defaults
    from rloo.stages.evaluate import evaluate
    from rloo.stages.validate import build_plan
    from rloo.storage import upload_dir
    from rloo.training.trainer import train

    p = with_defaults(check_names({**params, "learning_rate": learning_rate}, required=True))
    plan = build_plan(p)  # the validate step: the config the train step runs `rloo train` on
    values = plan.train
    model = work / f"model-{learning_rate:g}"
    cfg = RLOOConfig(
        model_name_or_path=p["model"], output_dir=str(model), report_to="none", disable_tqdm=True, **values
    )
    history = train(cfg).history
    # the evaluate step reads both models from the store, as the fetch and train steps published them
    store = Path(p["output_uri"])
    sft = store / "sft"
    if not sft.exists():
        upload_dir(p["model"], sft, progress=False)
    upload_dir(model, store / model.name, progress=False)
    results = work / f"eval-{learning_rate:g}"
    evaluate(
        plan,
        trained_uri=str(store / model.name),
        sft_uri=str(sft),
        results_uri=str(results),
        work=str(work / f"eval-work-{learning_rate:g}"),
    )
    scores = [h["objective/scores"] for h in history]
    return {
        "updates": len(history),
        "final_reward": sum(scores[-3:]) / 3,
        "eval": json.loads((results / "eval_results.json").read_text()),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[float, dict[str, Any]]:
    from rloo.demo.pipeline import embedded_params, toy_judge
    from rloo.demo.toy import TOY_UPDATES

    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # no MLflow run: the numbers are in eval_results.json
    work = tmp_path_factory.mktemp("demo-learning-rates")
    try:
        with toy_judge() as judge:
            params = {**embedded_params(work, updates=TOY_UPDATES), **judge}  # what `make demo` runs
            params["output_uri"] = str(work / "store")
            return {lr: _demo_run(work, params, lr) for lr in (FAST, SLOW)}
    finally:
        mp.undo()


def test_two_learning_rates_give_two_win_rates_ordered_like_their_rewards(
    runs: dict[float, dict[str, Any]],
) -> None:
    from rloo.demo.toy import TOY_UPDATES

    fast, slow = runs[FAST], runs[SLOW]
    assert fast["updates"] == slow["updates"] == TOY_UPDATES
    summary = {lr: (round(r["final_reward"], 3), r["eval"]["trained"]) for lr, r in runs.items()}
    # the larger step learns more in the demo's updates: the training curves end apart...
    assert fast["final_reward"] > slow["final_reward"] + 0.1, summary
    # ...and the evaluation sees it, in the same order, by more than its own resolution (1/32 a pair)
    win_fast, win_slow = fast["eval"]["trained"]["win_rate"], slow["eval"]["trained"]["win_rate"]
    assert win_fast > win_slow + 0.1, summary
    # graded, not saturated: the slower run is short of the ceiling, and both runs beat their SFT start
    assert win_slow < 0.9, summary
    sft = fast["eval"]["baseline"]["win_rate"]
    assert sft == slow["eval"]["baseline"]["win_rate"] and 0.2 < sft < 0.6, summary
    assert win_slow > sft + 0.1, summary
    for r in runs.values():
        low, high = r["eval"]["trained"]["ci95"]
        assert low <= r["eval"]["trained"]["win_rate"] <= high and high - low > 0.05
        assert r["eval"]["paired_difference"]["estimate"] > 0
