"""Training against an LLM judge: the scripted OpenAI-compatible judge of tests/eval, grading by the toy
task's criterion (the fraction of vowels), is the reward of a tiny policy on CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rloo.cli import main
from rloo.demo.toy import letter_reward
from rloo.training.trainer import train
from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge
from tests.fixtures import recipes
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.slow

KEY_ENV = "RLOO_TEST_JUDGE_KEY"


def vowels(text: str) -> float:
    return letter_reward([text])[0] or 0.0


def test_the_judge_s_reward_rises_when_it_is_the_only_reward(
    make_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pointwise judge scoring 0-10 by the vowel fraction is the only reward source: the policy learns what
    # the judge prefers. Seen: 0.37 over the first 3 updates -> 0.56 over the last 3 (seed 0), 0.34 -> 0.55
    # (seed 1); the assertion asks for a rise of 0.1.
    monkeypatch.setenv(KEY_ENV, API_KEY)
    with ScriptedJudge(grade=vowels) as judge:
        cfg = make_config(
            reward_funcs=[],
            judge_reward_coef=1.0,
            judge_reward_mode="pointwise",
            judge_base_url=judge.base_url,
            judge_model=MODEL,
            judge_api_key_env=KEY_ENV,
            per_device_train_batch_size=32,
            num_ppo_epochs=2,
            response_length=8,
            kl_coef=0.01,
            max_steps=15,
            seed=0,
            learning_rate=1e-2,
        )
        history = train(cfg).history
        requests = judge.requests
    rewards = [h["rewards/judge/mean"] for h in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, (
        f"the judge's reward did not rise: first 3 updates {first:.3f}, last 3 {last:.3f}"
    )
    assert "monitor/judge_reward_corr" not in history[-1]  # no other source to compare it with
    # one request per distinct completion at most, and the preflight: a group's duplicates are asked once
    assert requests <= 1 + 15 * 32


def test_pairwise_judge_beside_a_reward_function_logs_their_correlation(
    make_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    data = tmp_path / "with_references"
    data.mkdir()
    rows = [{"prompt": f"Write about thing {i}:", "completion": " a sea of words"} for i in range(16)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with ScriptedJudge(grade=vowels) as judge:
        cfg = make_config(
            dataset_name=str(data),
            judge_reward_coef=0.5,
            judge_base_url=judge.base_url,
            judge_model=MODEL,
            judge_api_key_env=KEY_ENV,
        )
        history = train(cfg).history
    record = json.loads((Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(history) == 2
    for name in ("rewards/judge/mean", "rewards/letter_reward/mean", "monitor/judge_reward_corr"):
        assert math.isfinite(record[name]), name
    assert 0.0 <= record["rewards/judge/mean"] <= 1.0
    # the judge grades by the reward function's own criterion: the two agree
    assert record["monitor/judge_reward_corr"] > 0.3


def test_an_unreachable_judge_ends_the_run_at_start_with_exit_75(
    tiny, toy_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    flags = recipes.argv(
        tiny, toy_data, tmp_path / "out", judge_reward_coef=1.0, judge_reward_mode="pointwise",
        judge_base_url=url, judge_model=MODEL, judge_max_retries=0, max_steps=1,
    )  # fmt: skip
    assert main(["train", *flags]) == 75
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"rloo train: error: the judge at {url} is unreachable or failing (APIConnectionError after 1 "
        "attempt(s)): check that the judge server is up and --judge_base_url points at it."
    ), err
