"""Training on multi-turn episodes with the built-in generator: the toy calculator task of
:mod:`rloo.demo.agent_toy` (a tiny model warm-started to call ``add`` in about half its answers) learns to call
its tool; an episode's sampled log-probs are those of one forward over the whole episode; the tools' tokens
carry no gradient; an environment holds state across turns and scores the episode; a run with an environment
resumes where it stopped; TRL-style user code (examples/agents) runs through ``rloo train`` by import path.

TRL's loop these follow: trl/trainer/grpo_trainer.py (1.16), ``_tool_call_loop`` (the tool messages' tokens
appended to the exact ids sampled so far, ``tool_mask`` 0 on them in the loss)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rloo import algo
from rloo.config import RLOOConfig
from rloo.demo import agent_toy
from rloo.training.step_timer import StepTimer
from rloo.training.trainer import RLOOTrainer
from tests.fixtures import recipes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "agents"


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return agent_toy.build_agent_sft_model(tmp_path_factory.mktemp("agent_sft"))


@pytest.fixture(scope="module")
def agent_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return agent_toy.write_agent_toy_dataset(tmp_path_factory.mktemp("agent_data"))


def settings(model: Path, data: Path, out: Path, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_name_or_path": str(model),
        "dataset_name": str(data),
        "output_dir": str(out),
        "tools": ["rloo.demo.agent_toy:add"],
        "reward_funcs": ["rloo.demo.agent_toy:tool_use_reward"],
        "per_device_train_batch_size": 32,
        "rloo_k": 4,
        "num_ppo_epochs": 1,
        "response_length": 128,
        "learning_rate": 1e-3,
        "temperature": 1.0,
        "save_steps": 0,
        "num_sample_generations": 0,
        "disable_tqdm": True,
        "seed": 1,
        "max_steps": 2,
    }
    return {**base, **kw}


def test_the_toy_agent_learns_to_call_its_tool(agent_model: Path, agent_data: Path, tmp_path: Path) -> None:
    """24 updates (~15 s): the share of episodes calling ``add`` and the reward (1 for the right sum through the
    tool, 0.5 for another sum, 0 without a call) rise from the warm start's."""
    history = (
        RLOOTrainer(RLOOConfig(**settings(agent_model, agent_data, tmp_path / "out", max_steps=24)))
        .train()
        .history
    )
    calls = [m["tools/call_frequency"] for m in history]
    scores = [m["objective/scores"] for m in history]
    first, last = slice(0, 6), slice(-6, None)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # measured: calls 0.47 -> 0.88, reward 0.29 -> 0.60 (the first six updates' mean -> the last six's)
    assert mean(calls[last]) > mean(calls[first]) + 0.2, calls
    assert mean(scores[last]) > mean(scores[first]) + 0.15, scores
    assert all(m["tools/turns"] >= 1 for m in history)
    assert max(m["tools/tool_token_frac"] for m in history) > 0  # tool messages were appended


def test_episode_logprobs_are_one_forward_over_the_episode_and_tools_carry_no_gradient(
    agent_model: Path, agent_data: Path, tmp_path: Path
) -> None:
    trainer = RLOOTrainer(RLOOConfig(**settings(agent_model, agent_data, tmp_path / "out")))
    producer = trainer.producer
    index = producer.draw()
    gen = producer.generate(0, index)
    sampled, sampler_logprobs = producer._sampled(index, gen)
    episodes = sampled.episodes
    assert episodes is not None and int(episodes.tool_calls.sum()) > 0 and int(episodes.turns.max()) >= 2
    tool_tokens = (~sampled.mask) & (torch.arange(sampled.mask.size(1)) < _lengths(sampled.mask)[:, None])
    assert tool_tokens.any()  # the episodes hold tool messages between the model's turns
    # the sampler's log-probs, turn by turn on its KV cache, are those of one forward over prompt + episode
    trainer.policy.eval()
    forward = trainer.logprobs.batched(trainer.policy, sampled)  # (B, T)
    assert sampler_logprobs is not None
    torch.testing.assert_close(sampler_logprobs[sampled.mask], forward[sampled.mask], atol=2e-4, rtol=0)
    # the loss over an episode: zero gradient at the tools' tokens, some at the model's
    experience = producer.produce(0, StepTimer(trainer.device))
    assert not (experience.loss_mask & ~experience.mask).any()
    idx = torch.arange(experience.responses.size(0))
    logprobs, _ = trainer.logprobs.forward(trainer.policy, experience, idx)
    logprobs.retain_grad()
    loss, _ = algo.policy_loss(
        logprobs,
        experience.old_logprobs,
        experience.advantages,
        experience.loss_mask,
        0.2,
        loss_agg_mode="token-mean",
    )
    kl = algo.kl_loss(logprobs, experience.ref_logprobs, experience.loss_mask, "k3", "token-mean", 128, None)
    (loss + kl).backward()
    assert logprobs.grad is not None
    tools_now = (~experience.mask) & (
        torch.arange(experience.mask.size(1)) < _lengths(experience.mask)[:, None]
    )
    assert tools_now.any() and (logprobs.grad[tools_now] == 0).all()
    assert (logprobs.grad[experience.loss_mask] != 0).any()


def _lengths(mask: torch.Tensor) -> torch.Tensor:
    """(B,) one past each row's last True position."""
    return (mask.cumsum(1) == mask.sum(1, keepdim=True)).int().argmax(1) + 1


def test_an_environment_holds_state_and_scores_episodes(
    agent_model: Path, agent_data: Path, tmp_path: Path
) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        cfg = RLOOConfig(
            **settings(
                agent_model,
                agent_data,
                tmp_path / "out",
                tools=[],
                reward_funcs=[],
                environment="calculator:CalculatorEnv",
                max_steps=3,
            )
        )
        history = RLOOTrainer(cfg).train().history
    finally:
        sys.path.remove(str(EXAMPLES))
    assert all("rewards/CalculatorEnv/mean" in m for m in history)
    assert max(m["rewards/CalculatorEnv/mean"] for m in history) > 0  # some episodes got a result through it
    assert max(m["tools/call_frequency"] for m in history) > 0


def test_a_run_with_an_environment_resumes_where_it_stopped(
    agent_model: Path, agent_data: Path, tmp_path: Path
) -> None:
    """A run stopped by a crash in update 3 resumes from its checkpoint of update 2 and ends as a straight run
    (the episodes' seeds are their update's; the environments are made afresh and reset per episode)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        kw = dict(
            tools=[], reward_funcs=[], environment="calculator:CalculatorEnv", save_steps=2, max_steps=4
        )
        want = (
            RLOOTrainer(RLOOConfig(**settings(agent_model, agent_data, tmp_path / "a", **kw))).train().history
        )
        crashing = RLOOTrainer(RLOOConfig(**settings(agent_model, agent_data, tmp_path / "b", **kw)))
        update = crashing.updater.update

        def crash_in_update_3(batch: Any) -> dict[str, float]:
            if batch.update == 2:
                raise RuntimeError("the node went away")
            return update(batch)

        crashing.updater.update = crash_in_update_3  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="went away"):
            crashing.train()
        del crashing
        got = (
            RLOOTrainer(RLOOConfig(**settings(agent_model, agent_data, tmp_path / "b", **kw))).train().history
        )
    finally:
        sys.path.remove(str(EXAMPLES))
    keys = ["objective/scores", "tools/call_frequency", "tools/episode_length", "objective/kl"]
    assert [[m[k] for k in keys] for m in got[-2:]] == [[m[k] for k in keys] for m in want[-2:]]


@pytest.mark.parametrize(
    "flags",
    [
        ["--tools", "calculator:add", "--reward_funcs", "calculator:correct_sum"],
        ["--environment_factory", "calculator:CalculatorEnv"],
    ],
    ids=["tools", "environment"],
)
def test_trl_style_code_runs_through_rloo_train_by_import_path(
    agent_model: Path, agent_data: Path, tmp_path: Path, flags: list[str]
) -> None:
    """examples/agents/calculator.py is written for TRL's GRPOTrainer (``tools=[add]``,
    ``environment_factory=CalculatorEnv``, ``reward_funcs=[correct_sum]``); ``rloo train`` takes the same
    objects by import path, with TRL's flag names (``num_generations``, ``max_completion_length``)."""
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "rloo.cli",
        "train",
        "--model_name_or_path",
        str(agent_model),
        "--dataset_name",
        str(agent_data),
        "--output_dir",
        str(out),
        "--num_generations",
        "4",
        "--max_completion_length",
        "128",
        "--per_device_train_batch_size",
        "8",
        "--max_tool_calling_iterations",
        "2",
        "--max_steps",
        "2",
        "--save_steps",
        "0",
        "--num_sample_generations",
        "0",
        "--disable_tqdm",
        "true",
        *flags,
    ]
    env = recipes.subprocess_env(PYTHONPATH=str(EXAMPLES))
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("tools/call_frequency" in r for r in rows)


@pytest.mark.parametrize(
    "flags",
    [["--tools", "rloo.demo.agent_toy:add"], ["--environment_factory", "calculator:CalculatorEnv"]],
    ids=["tools", "environment"],
)
def test_rloo_eval_judges_whole_episodes(
    agent_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    """``rloo eval`` runs the episodes training ran, for the trained and the baseline model, and the judge reads
    each whole: the model's turns and the tools' results (an environment reset with the eval row's columns)."""
    from rloo.cli.eval_cmd import main
    from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge

    data = tmp_path / "eval"
    (data / "data").mkdir(parents=True)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"add {a} and {b}"}],
            "completion": str(a + b),
            "answer": str(a + b),
        }
        for a, b in [(3, 4), (1, 2), (5, 0)]
    ]
    (data / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    out = tmp_path / "out"
    with ScriptedJudge() as judge:
        argv = [
            "--model_name_or_path", str(agent_model), "--baseline_model", str(agent_model),
            "--dataset_name", str(data), "--dataset_split", "test", "--judge_base_url", judge.base_url,
            "--judge_model", MODEL, "--output_dir", str(out), "--max_new_tokens", "128",
            "--judge_backoff", "0.01", "--report_to", "none", *flags,
        ]  # fmt: skip
        assert main(argv) == 0
        asked = list(judge.seen)
    judged = [json.loads(x) for x in (out / "judgements.jsonl").read_text().splitlines()]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["engine"] == "transformers"  # auto picks it for episodes
    answers = [ex["outputs"]["trained"] for ex in judged]
    # greedy, the warm-started model calls add on every prompt (its greedy turn always does), then answers
    assert all(f"[add returned] {r['answer']}" in a for a, r in zip(answers, rows, strict=True)), answers
    assert any("[add returned]" in body for body in asked)  # what the judge was sent
