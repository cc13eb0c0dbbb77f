"""Pure parts: the eval_results.json contract, the promotion gate, the model card, the config checks."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rloo.errors import UserError
from rloo.push import (
    CANDIDATE,
    CHAMPION,
    CardInputs,
    PushConfig,
    decide,
    parse_eval_results,
    render_model_card,
    summarize_curves,
)
from rloo.push.gate import Champion, Decision, compare_to_champion
from tests.push.conftest import TRAIN_CONFIG, eval_results


def test_contract_parses_and_keeps_extra_keys() -> None:
    data = {**eval_results(), "per_prompt": [1, 2]}
    r = parse_eval_results(data)
    assert (r.paired_difference.low, r.paired_difference.estimate, r.paired_difference.high) == (
        0.04,
        0.11,
        0.18,
    )
    assert r.trained.estimate == 0.61 and r.baseline.high == 0.56
    assert (r.judge_model, r.num_examples, r.invalid, r.ties) == ("judge-model-x", 200, 3, 12)
    assert r.extra == {"per_prompt": [1, 2]}


@pytest.mark.parametrize(
    "path", ["trained", "baseline.ci95", "paired_difference.estimate", "judge.model", "num_examples", "ties"]
)
def test_missing_key_is_one_line_naming_it(path: str) -> None:
    data = copy.deepcopy(eval_results())
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    del node[last]
    with pytest.raises(UserError, match=f"missing required key '{path}") as e:
        parse_eval_results(data, "ev.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("ev.json:")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d["paired_difference"].update(ci95=[0.2, 0.3]), "outside its ci95"),
        (lambda d: d["trained"].update(win_rate=1.5), r"'trained.win_rate' must be in \[0, 1\]"),
        (lambda d: d["trained"].update(ci95=[0.1]), "must be a pair"),
        (lambda d: d["baseline"].update(win_rate="0.5"), "finite number"),
        (lambda d: d["paired_difference"].update(estimate=float("nan")), "finite number"),
        (lambda d: d.update(invalid=-1), "non-negative integer"),
        (lambda d: d.update(num_examples=True), "non-negative integer"),
    ],
)
def test_bad_values_are_rejected(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    data = copy.deepcopy(eval_results())
    mutate(data)
    with pytest.raises(UserError, match=match):
        parse_eval_results(data)


def test_top_level_must_be_an_object() -> None:
    with pytest.raises(UserError, match="JSON object"):
        parse_eval_results([1, 2])


def test_gate_uses_the_lower_bound_against_the_margin() -> None:
    assert decide(parse_eval_results(eval_results(lo=0.04)), 0.0).decision == CHAMPION
    # a large estimate does not help when the interval reaches below the margin
    assert decide(parse_eval_results(eval_results(lo=-0.01, estimate=0.3, hi=0.5)), 0.0).decision == CANDIDATE
    assert decide(parse_eval_results(eval_results(lo=0.04)), 0.05).decision == CANDIDATE
    at_margin = decide(parse_eval_results(eval_results(lo=0.05)), 0.05)  # strictly above, not equal
    assert at_margin.decision == CANDIDATE and "not above the margin +0.050" in at_margin.reason
    assert decide(parse_eval_results(eval_results(lo=-0.1, estimate=-0.05, hi=0.0)), -0.2).promoted
    none = decide(None, 0.0)
    assert none.decision == CANDIDATE and "no evaluation" in none.reason
    empty = {**eval_results(), "num_examples": 0}
    assert decide(parse_eval_results(empty), -1.0).decision == CANDIDATE


def _champ(scores: list[float | None], **judge: str) -> Champion:
    data = eval_results(scores=scores)
    data["judge"].update(judge)
    return Champion("version 1 (run old)", parse_eval_results(data))


def test_a_challenger_must_beat_the_champion_on_the_same_examples() -> None:
    """Paired per example: 6 of 20 examples better (1 vs 0.5), none worse -> +0.15; the interval decides."""
    mine = parse_eval_results(eval_results(scores=[1.0] * 6 + [0.5] * 14))
    vs = compare_to_champion(mine, _champ([0.5] * 20))
    assert not isinstance(vs, str)
    assert vs.estimate == pytest.approx(0.15) and vs.low < vs.estimate < vs.high
    better = decide(parse_eval_results(eval_results(scores=[1.0] * 20)), 0.0, _champ([0.5] * 20))
    assert better.promoted and "against the champion (version 1 (run old)) +0.500" in better.reason
    same = decide(parse_eval_results(eval_results(scores=[0.5] * 20)), 0.0, _champ([0.5] * 20))
    assert same.decision == CANDIDATE and "the champion stays" in same.reason
    # examples with no verdict on either side are left out of the pairing
    holes = compare_to_champion(
        parse_eval_results(eval_results(scores=[1.0, None, 1.0])), _champ([0.0, 1.0, None])
    )
    assert not isinstance(holes, str) and holes.estimate == 1.0
    # no champion yet: the SFT comparison alone makes the first one
    assert decide(parse_eval_results(eval_results(scores=[0.0] * 20)), 0.0, None).promoted
    # a model failing the SFT gate is not compared at all
    assert "champion" not in decide(parse_eval_results(eval_results(lo=-0.1)), 0.0, _champ([0.0])).reason


@pytest.mark.parametrize(
    ("mine", "champion", "why"),
    [
        (eval_results(scores=[1.0] * 3), _champ([0.5] * 4), "other examples"),
        (eval_results(scores=[1.0] * 3), _champ([0.5] * 3, model="other-judge"), "judged by 'other-judge'"),
        (eval_results(scores=[1.0] * 3), _champ([0.5] * 3, template_sha256="t2"), "another judge prompt"),
        (eval_results(), _champ([0.5] * 3), "this model's eval_results.json has no per-example"),
        (
            eval_results(scores=[1.0]),
            Champion("v", None, "it was registered without it"),
            "registered without",
        ),
        (eval_results(scores=[None]), _champ([0.5]), "no example has a usable verdict"),
    ],
)
def test_evaluations_that_cannot_be_compared_say_why(mine: dict, champion: Champion, why: str) -> None:
    decision = decide(parse_eval_results(mine), 0.0, champion)
    assert decision.decision == CANDIDATE and why in decision.reason


def test_per_example_scores_are_checked() -> None:
    bad = {**eval_results(), "per_example": {"keys": ["a"], "trained": [1.5]}}
    with pytest.raises(UserError, match=r"per_example.trained\[0\]"):
        parse_eval_results(bad)
    with pytest.raises(UserError, match="equal length"):
        parse_eval_results({**eval_results(), "per_example": {"keys": ["a"], "trained": []}})


def _card(**kw) -> str:  # type: ignore[no-untyped-def]
    rows = [
        {"objective/scores": 0.1, "objective/kl": 0.0},
        {"objective/scores": 0.5},
        {"objective/scores": 0.3},
    ]
    inputs = dict(
        model_name="tiny-rloo",
        base_model="org/sft-model",
        datasets=["org/prompts"],
        rloo_config=TRAIN_CONFIG,
        num_updates=3,
        curves=summarize_curves(rows),
        eval=parse_eval_results(eval_results()),
        decision=Decision(CHAMPION, "lower bound above"),
        lineage={"KFP run id": "run-123", "MLflow training run": "abc", "unset": None},
        digests={"model.safetensors": "f" * 64},
    )
    inputs.update(kw)
    return render_model_card(CardInputs(**inputs))


def test_model_card_front_matter_and_sections() -> None:
    card = _card()
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {
        "library_name": "transformers",
        "tags": ["rloo", "rlhf"],
        "base_model": "org/sft-model",
        "datasets": ["org/prompts"],
    }
    for text in (
        "# tiny-rloo",
        "**Promotion decision: champion**",
        "| trained (RLOO) | 61.0% | [55.0%, 67.0%] |",
        "| baseline (SFT) | 50.0% | [44.0%, 56.0%] |",
        "| +0.110 | [+0.040, +0.180] |",
        "Judge: `judge-model-x` at http://judge.local/v1; 200 examples, 12 ties, 3 invalid",
        "| `objective/scores` | 0.1 | 0.3 | 0.1 | 0.5 |",
        "| `objective/kl` | 0 | 0 | 0 | 0 |",
        "| `rloo_k` | 2 |",
        "| `learning_rate` | 3e-06 |",
        "- KFP run id: `run-123`",
        f"- `model.safetensors`: `{'f' * 64}`",
    ):
        assert text in card, text
    assert "unset" not in card
    assert card == _card()  # deterministic: re-pushing the same run leaves the manifest unchanged


def test_model_card_without_evaluation_or_base_model() -> None:
    card = _card(
        eval=None, base_model=None, datasets=[], decision=Decision(CANDIDATE, "no evaluation results")
    )
    front = yaml.safe_load(card.split("---\n")[1])
    assert "base_model" not in front and "datasets" not in front
    assert "No evaluation results were available" in card and "**Promotion decision: candidate**" in card


def test_summarize_curves_skips_missing_and_non_finite() -> None:
    rows = [{"a": 1.0}, {"a": float("nan")}, {"a": True}, {"b": 2}, {"a": -2}]
    (only,) = summarize_curves(rows, keys=("a", "missing"))
    assert (only.first, only.last, only.minimum, only.maximum) == (1.0, -2.0, -2.0, 1.0)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({}, "--model_path is required"),
        ({"model_path": "m", "promotion_margin": 1.5}, "--promotion_margin must be in"),
        ({"model_path": "m", "hub_repo_id": "no-owner"}, "--hub_repo_id must look like 'owner/name'"),
        ({"model_path": "m", "registered_model_name": "a/b"}, "--registered_model_name 'a/b' is not usable"),
        ({"model_path": "m", "run_id": "///"}, "--run_id"),
        ({"model_path": "m", "storage_uri": "s3://b-1/x", "production_uri": "s3://b-1/x/"}, "must differ"),
    ],
)
def test_config_errors_name_the_field(kw: dict, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UserError, match=match):
        PushConfig(**kw)


def test_registry_needs_a_tracking_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Checked when the push runs (before anything is written), not when the config is built: the pipeline's
    validate pod has no MLflow secret."""
    from rloo.push import run_push

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = PushConfig(model_path="m", registered_model_name="rloo-model", output_dir=str(tmp_path / "out"))
    with pytest.raises(UserError, match="set MLFLOW_TRACKING_URI"):
        run_push(cfg)
    assert not (tmp_path / "out").exists()


def test_model_card_names_the_base_model_revision() -> None:
    card = _card(base_model_revision="c" * 40)
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == "org/sft-model" and front["base_model_revision"] == "c" * 40
    assert f"from `org/sft-model` (revision `{'c' * 40}`) on `org/prompts`" in card


def test_promotion_margin_rule_is_declared_and_shown(capsys: pytest.CaptureFixture[str]) -> None:
    """--promotion_margin's bound is declared on the field (option(check=)): ``rloo push --help`` states it
    (argparse prints each action's help, cpython Lib/argparse.py) and NaN, which passes every comparison, is
    refused with the declaration's line."""
    import dataclasses

    from rloo.cli import main
    from rloo.options import rule_of

    (field,) = [f for f in dataclasses.fields(PushConfig) if f.name == "promotion_margin"]
    rule = rule_of(field)
    assert rule is not None and rule.text == "in [-1, 1)"
    assert main(["push", "--help"]) == 0
    assert "must be in [-1, 1)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(UserError, match=r"^--promotion_margin must be in \[-1, 1\) \(got nan\): it is a"):
        PushConfig(model_path="m", promotion_margin=float("nan"))
