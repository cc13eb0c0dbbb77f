"""The LLM judge as a reward source, against a real OpenAI-compatible server (the scripted judge of
tests/eval): the reward of each verdict, the run's cache of verdicts, and the one-line refusals at start and
when the judge scores nothing of a batch."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rloo.config import JUDGE_SETTINGS, RLOOConfig
from rloo.data import PromptDataset
from rloo.errors import ServiceUnavailable, UserError
from rloo.judging.client import JudgeSettings
from rloo.judging.pairwise import PairwiseJudge
from rloo.judging.pointwise import PointwiseJudge
from rloo.judging.templates import PAIRWISE_TEMPLATE, POINTWISE_TEMPLATE
from rloo.training.judge_reward import JUDGE, JudgeRewardSource, judge_source, with_judge
from rloo.training.rewards import RewardBatch
from rloo.training.rollout import judge_reward_corr
from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge
from tests.fixtures.servers import free_port

KEY_ENV = "RLOO_TEST_JUDGE_KEY"


@pytest.fixture
def server() -> Iterator[ScriptedJudge]:
    with ScriptedJudge(stall_seconds=5.0) as s:
        yield s


def settings(server: ScriptedJudge, template: str, **kw: Any) -> JudgeSettings:
    base: dict[str, Any] = dict(
        base_url=server.base_url, model=MODEL, api_key=API_KEY, template=template, max_retries=0, timeout=3.0,
        backoff=0.01,
    )  # fmt: skip
    return JudgeSettings(**{**base, **kw})


def pointwise(server: ScriptedJudge, **kw: Any) -> JudgeRewardSource:
    return JudgeRewardSource(PointwiseJudge(settings(server, POINTWISE_TEMPLATE, **kw), progress=False))


def pairwise(server: ScriptedJudge, **kw: Any) -> JudgeRewardSource:
    return JudgeRewardSource(PairwiseJudge(settings(server, PAIRWISE_TEMPLATE, **kw), progress=False))


def batch(completions: list[str], references: list[Any] | None = None, prompt: str = "p") -> RewardBatch:
    n = len(completions)
    return RewardBatch(
        prompts=[prompt] * n,
        prompt_texts=[prompt] * n,
        completions=completions,
        completion_texts=completions,
        completion_ids=[[1]] * n,
        scoring_texts=[prompt + c for c in completions],
        extra={} if references is None else {"completion": references},
    )


def values(t: torch.Tensor) -> list[float | None]:
    return [None if math.isnan(v) else v for v in t.tolist()]


def test_pointwise_reward_is_the_score_over_10_and_an_unreadable_answer_scores_nothing(
    server: ScriptedJudge,
) -> None:
    got = pointwise(server)(batch(["SCORE7", "SCORE**10**", "SCORE0", "MALFORMED", "SCORE11", "SCORE3/10"]))
    assert values(got) == pytest.approx([0.7, 1.0, 0.0, None, None, 0.3], nan_ok=True)


def test_pairwise_reward_is_win_tie_loss_averaged_over_both_orders(server: ScriptedJudge) -> None:
    # the scripted judge prefers the response holding GOOD, and answers A when it cannot tell (position bias)
    got = pairwise(server)(
        batch(
            ["GOOD answer", "plain", "plain", "MALFORMED", "GOOD too"],
            ["plain reference", "GOOD reference", "also plain", "plain", None],
        )
    )
    # both orders prefer the completion: 1; both the reference: 0; the orders disagree: 0.5 (a tie); an
    # unreadable verdict, or a row without a reference: no score
    assert values(got) == [1.0, 0.0, 0.5, None, None]
    assert server.requests == 2 * 4  # both orders of each row with a reference, none for the other


def test_identical_completions_cost_one_request_and_a_verdict_is_kept_for_the_run(
    server: ScriptedJudge,
) -> None:
    source = pointwise(server)
    assert values(source(batch(["SCORE8"] * 6))) == pytest.approx([0.8] * 6)
    assert server.requests == 1
    assert values(source(batch(["SCORE8", "SCORE2"]))) == pytest.approx([0.8, 0.2])
    assert server.requests == 2  # only the new completion was asked
    assert values(source(batch(["SCORE8"], prompt="another prompt"))) == pytest.approx([0.8])
    assert server.requests == 3  # the same text for another prompt is another question

    both_orders = pairwise(server)
    both_orders(batch(["GOOD x"] * 6, ["plain"] * 6))
    assert server.requests == 3 + 2


def test_a_failed_request_is_asked_again_later_and_an_answer_is_not(server: ScriptedJudge) -> None:
    source = pointwise(server)
    # the server fails the first request holding E500x1: with no retries its completion is unscored now
    assert values(source(batch(["SCORE6", "SCORE4 E500x1"]))) == pytest.approx([0.6, None], nan_ok=True)
    assert values(source(batch(["SCORE6", "SCORE4 E500x1"]))) == pytest.approx([0.6, 0.4])
    assert server.requests == 3


def test_a_batch_the_judge_scored_nothing_of_ends_the_run_in_one_line(server: ScriptedJudge) -> None:
    with pytest.raises(ServiceUnavailable) as down:
        pointwise(server)(batch(["SCORE4 E500x9", "SCORE5 E500x9"]))
    assert str(down.value) == (
        f"the judge at {server.base_url} failed all 2 requests of a batch (HTTP 500, after --judge_max_retries "
        "0): check that the judge server is up and --judge_base_url points at it."
    )
    assert down.value.exit_code == 75

    source = pointwise(server, request_budget=1)
    assert values(source(batch(["SCORE1", "SCORE2"]))) == pytest.approx([0.1, None], nan_ok=True)
    with pytest.raises(UserError) as spent:
        source(batch(["SCORE3"]))
    assert str(spent.value) == (
        f"--judge_request_budget 1 is spent: the judge at {server.base_url} scores no more completions; raise "
        "the budget, or drop it."
    )
    assert spent.value.exit_code == 2


def test_a_batch_none_of_whose_answers_can_be_read_ends_the_run_in_one_line(
    server: ScriptedJudge, caplog: pytest.LogCaptureFixture
) -> None:
    """A judge that answers but never with a score (a chatty one, an answer cut short) would give its weight to
    no completion and train on nothing: the run stops (exit 2), naming an answer; a batch mostly unreadable
    warns once."""
    with pytest.raises(UserError) as unread:
        pointwise(server)(batch(["MALFORMED one", "MALFORMED two"]))
    assert str(unread.value) == (
        f"the judge at {server.base_url} answered 2 of the 2 requests of a batch, none as a score from 0 to 10 "
        "(e.g. 'I like both of them'): raise --judge_max_tokens (16) or give a --judge_template that asks for "
        "the bare answer."
    )
    assert unread.value.exit_code == 2
    source = pointwise(server)
    with caplog.at_level("WARNING", logger="rloo"):
        got = source(batch(["SCORE6", "MALFORMED a", "MALFORMED b"]))
        source(batch(["MALFORMED c", "MALFORMED d", "SCORE1"]))
    assert values(got) == pytest.approx([0.6, None, None], nan_ok=True)
    warned = [r.getMessage() for r in caplog.records if "could not be read as scores" in r.getMessage()]
    assert warned == [
        "the judge's answers to 2 of 3 requests could not be read as scores; those completions get no judge "
        "reward. Check --judge_max_tokens and --judge_template (said once)."
    ]


# --- the source of a run: its config, its dataset, its server --------------------------------------------
def config(url: str, **kw: Any) -> RLOOConfig:
    base: dict[str, Any] = dict(
        model_name_or_path="m", dataset_name="d", judge_reward_coef=0.5, judge_base_url=url, judge_model=MODEL,
        judge_api_key_env=KEY_ENV, judge_max_retries=0,
    )  # fmt: skip
    return RLOOConfig(**{**base, **kw})


def dataset(**extra: list[Any]) -> PromptDataset:
    return PromptDataset(prompts=["p1", "a longer prompt"], extra=dict(extra), split="train")


def test_the_judge_is_the_last_source_with_its_own_weight(
    server: ScriptedJudge, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    cfg = config(server.base_url, judge_reward_mode="pointwise", reward_funcs=["rloo.demo.toy:letter_reward"])
    other = object()
    sources, weights = with_judge(cfg, dataset(), [other], [2.0, 1.0])  # the environment's default weight
    assert sources[0] is other and isinstance(sources[1], JudgeRewardSource) and sources[1].name == JUDGE
    assert weights.tolist() == [2.0, 0.5]
    assert server.requests == 1  # the preflight

    off = RLOOConfig(model_name_or_path="m", dataset_name="d", reward_funcs=["rloo.demo.toy:letter_reward"])
    sources, weights = with_judge(off, dataset(), [other], [1.0, 1.0])
    assert sources == [other] and weights.tolist() == [1.0]
    assert server.requests == 1


def test_pairwise_needs_the_training_split_s_references(
    server: ScriptedJudge, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    with pytest.raises(UserError) as e:
        judge_source(config(server.base_url), dataset(target=["a", "e"]))
    assert str(e.value) == (
        "--judge_reward_mode pairwise judges each completion against its row's reference, and --dataset_name d "
        "split 'train' has no 'completion' column (columns: prompt, target): add the reference answers as "
        "'completion', or use --judge_reward_mode pointwise."
    )
    assert e.value.exit_code == 2 and server.requests == 0
    assert judge_source(config(server.base_url), dataset(completion=["r1", "r2"])) is not None


def test_an_unreachable_judge_is_a_temporary_failure_at_start() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServiceUnavailable) as e:
        judge_source(config(url, judge_reward_mode="pointwise"), dataset())
    assert str(e.value) == (
        f"the judge at {url} is unreachable or failing (APIConnectionError after 1 attempt(s)): check that the "
        "judge server is up and --judge_base_url points at it."
    )
    assert e.value.exit_code == 75


def test_an_unknown_judge_model_is_refused_at_start(
    server: ScriptedJudge, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    with pytest.raises(UserError) as e:
        judge_source(config(server.base_url, judge_model="other", judge_reward_mode="pointwise"), dataset())
    assert e.value.exit_code == 2 and "does not know model 'other'" in str(e.value)
    assert "\n" not in str(e.value)


# --- the settings ---------------------------------------------------------------------------------------
def test_training_declares_the_evaluation_s_judge_settings_alike() -> None:
    """``rloo train``'s judge settings that ``rloo eval`` has too carry its names, types and defaults."""
    from rloo.eval.config import EvalConfig

    train = {f.name: f for f in dataclasses.fields(RLOOConfig)}
    evaluate = {f.name: f for f in dataclasses.fields(EvalConfig)}
    train_types, eval_types = typing.get_type_hints(RLOOConfig), typing.get_type_hints(EvalConfig)
    shared = [n for n in JUDGE_SETTINGS if n in evaluate]
    assert set(JUDGE_SETTINGS) - set(shared) == {"judge_reward_coef", "judge_reward_mode"}
    assert {n for n in evaluate if n.startswith("judge_")} == set(shared)
    for name in shared:
        assert train_types[name] == eval_types[name], name
        assert train[name].default == evaluate[name].default, name


@pytest.mark.parametrize(
    ("settings_", "message"),
    [
        (
            {"judge_model": "j"},
            "--judge_model sets the LLM judge's reward: add --judge_reward_coef > 0 (its weight), or drop "
            "--judge_model.",
        ),
        (
            {"judge_reward_mode": "pointwise", "judge_concurrency": 2},
            "--judge_reward_mode sets the LLM judge's reward: add --judge_reward_coef > 0 (its weight), or drop "
            "--judge_reward_mode.",
        ),
        (
            {"judge_reward_coef": 1.0, "judge_model": "j"},
            "--judge_reward_coef 1 asks an LLM judge: add --judge_base_url (an OpenAI-compatible server and the "
            "model it serves), or drop --judge_reward_coef.",
        ),
        (
            {"judge_reward_coef": 0.5},
            "--judge_reward_coef 0.5 asks an LLM judge: add --judge_base_url and --judge_model (an "
            "OpenAI-compatible server and the model it serves), or drop --judge_reward_coef.",
        ),
    ],
)
def test_judge_settings_without_a_weight_or_a_weight_without_a_judge_are_refused(
    settings_: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError) as e:
        RLOOConfig(model_name_or_path="m", dataset_name="d", reward_funcs=["a:b"], **settings_)
    assert str(e.value) == message and e.value.exit_code == 2


def test_the_judge_alone_is_a_reward_source_and_a_template_is_checked_for_its_mode(tmp_path: Any) -> None:
    RLOOConfig(model_name_or_path="m", dataset_name="d", judge_reward_coef=1.0, judge_base_url="http://j/v1",
               judge_model="j")  # fmt: skip
    template = tmp_path / "t.txt"
    template.write_text("Rate {response} to {prompt}: 0 to 10.")
    RLOOConfig(model_name_or_path="m", dataset_name="d", judge_reward_coef=1.0, judge_base_url="http://j/v1",
               judge_model="j", judge_reward_mode="pointwise", judge_template=str(template))  # fmt: skip
    with pytest.raises(
        UserError, match=r"missing placeholder\(s\) \{response_a\}, \{response_b\}; add them\.$"
    ):
        RLOOConfig(model_name_or_path="m", dataset_name="d", judge_reward_coef=1.0, judge_base_url="http://j/v1",
                   judge_model="j", judge_template=str(template))  # fmt: skip


# --- the reward-hacking monitor -------------------------------------------------------------------------
def test_judge_reward_corr_compares_the_judge_with_the_weighted_other_sources() -> None:
    nan = math.nan
    judge = [0.0, 0.5, 1.0, 1.0, nan]
    rm = [1.0, 2.0, 2.0, 4.0, 9.0]
    fn = [0.0, 1.0, 0.0, nan, 9.0]
    per_source = torch.tensor([rm, judge, fn]).T  # (B, S): the judge in the middle
    weights = torch.tensor([1.0, 0.3, 2.0])
    rest = torch.tensor([1.0, 4.0, 2.0, 4.0])  # rm + 2 fn, a missing fn counted 0; the last row unjudged
    expected = torch.corrcoef(torch.stack([torch.tensor(judge[:4]), rest]))[0, 1]
    assert judge_reward_corr(per_source, 1, weights) == pytest.approx(float(expected))


def test_the_monitor_is_logged_only_beside_other_sources() -> None:
    from rloo.training.rollout import RolloutStats, rollout_metrics

    n = 4
    stats = RolloutStats(*(torch.ones(n) for _ in dataclasses.fields(RolloutStats)))
    per_source = torch.tensor([[0.1, 0.2], [0.4, 0.3], [0.2, 0.9], [0.8, 0.5]])
    both = rollout_metrics(stats, per_source, ["f", JUDGE], 2, weights=torch.ones(2))
    assert both["monitor/judge_reward_corr"] == pytest.approx(
        float(torch.corrcoef(per_source.T)[0, 1]), abs=1e-6
    )
    alone = rollout_metrics(stats, per_source[:, 1:], [JUDGE], 2, weights=torch.ones(1))
    assert "monitor/judge_reward_corr" not in alone
    assert "monitor/judge_reward_corr" not in rollout_metrics(
        stats, per_source, ["f", "g"], 2, weights=torch.ones(2)
    )
