"""``rloo eval --engine vllm`` end to end: real vLLM generation, the judge served by vLLM as the chart deploys it.

The judge model answers every question with "A" (``build_letter_judge``), so each pair gets two usable,
opposite verdicts (the model wins when it is A, loses when it is B): a tie, win rate 0.5 for both models.
Greedy completions of the two engines are compared token for token (float32 both): on these models every
one of them agrees (measured 8 of 8 for each model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rloo.demo.tiny import TinySetup, build_causal_lm
from rloo.demo.toy import write_toy_eval_dataset
from tests.vllm_engine.conftest import JudgeServer, needs_vllm, refusal, rloo

pytestmark = needs_vllm

N = 8


@pytest.fixture(scope="module")
def eval_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_eval_dataset(tmp_path_factory.mktemp("eval"), num_test=N)


@pytest.fixture(scope="module")
def baseline(qwen: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second Qwen2-shaped model (other weights): the 'SFT baseline' of the evaluation."""
    return build_causal_lm(
        tmp_path_factory.mktemp("baseline") / "m", qwen.tokenizer, arch="qwen2", hidden_size=256, seed=7
    )


def eval_args(
    qwen: TinySetup, baseline: Path, rows: Path, judge: JudgeServer, out: Path, engine: str, *extra: str
) -> list[str]:
    return [
        "eval",
        "--model_name_or_path", str(qwen.policy),
        "--baseline_model", str(baseline),
        "--dataset_name", str(rows),
        "--judge_base_url", judge.base_url,
        "--judge_model", judge.model,
        "--judge_api_key_env", "JUDGE_KEY",
        "--engine", engine,
        "--max_new_tokens", "16",
        "--output_dir", str(out),
        "--report_to", "none",
        *extra,
    ]  # fmt: skip


def _shape(x: Any) -> Any:
    """The keys of a JSON value, recursively (values left out): the results' schema."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_shape(x[0])] if x else []
    return type(x).__name__ if x is not None else "null"


def _outputs(out: Path) -> dict[str, list[str]]:
    rows = [json.loads(line) for line in (out / "judgements.jsonl").read_text().splitlines()]
    return {label: [r["outputs"][label] for r in rows] for label in ("trained", "baseline")}


@pytest.fixture(scope="module")
def both_engines(
    qwen: TinySetup,
    baseline: Path,
    eval_rows: Path,
    judge_server: JudgeServer,
    vllm_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    env = {**vllm_env, "JUDGE_KEY": judge_server.api_key}
    outs = {}
    for engine in ("vllm", "transformers"):
        out = tmp_path_factory.mktemp(engine) / "out"
        proc = rloo(eval_args(qwen, baseline, eval_rows, judge_server, out, engine), env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        outs[engine] = out
    return outs


def test_vllm_engine_results_have_the_transformers_engines_schema(both_engines: dict[str, Path]) -> None:
    results = {e: json.loads((out / "eval_results.json").read_text()) for e, out in both_engines.items()}
    assert results["vllm"]["engine"] == "vllm" and results["transformers"]["engine"] == "transformers"
    assert _shape(results["vllm"]) == _shape(results["transformers"])
    for r in results.values():
        # every pair judged in both orders by the vLLM-served judge, every answer usable: a tie each
        assert r["judge"]["requests"] == 2 * 2 * N
        assert r["invalid"] == 0 and r["ties"] == 2 * N
        assert r["trained"]["win_rate"] == r["baseline"]["win_rate"] == 0.5


def test_greedy_completions_agree_between_engines(both_engines: dict[str, Path]) -> None:
    vllm, hf = _outputs(both_engines["vllm"]), _outputs(both_engines["transformers"])
    for label in ("trained", "baseline"):
        assert len(vllm[label]) == N and any(vllm[label]), vllm[label]  # real text came out
        same = sum(a == b for a, b in zip(vllm[label], hf[label], strict=True))
        assert same == N, (label, same, list(zip(vllm[label], hf[label], strict=True)))
    assert vllm["trained"] != vllm["baseline"]  # two models, two sets of answers


def test_a_judge_request_without_the_key_is_refused_in_one_line(
    qwen: TinySetup,
    baseline: Path,
    eval_rows: Path,
    judge_server: JudgeServer,
    vllm_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """The chart's judge demands the key of the judge Secret (VLLM_API_KEY); a wrong one stops the eval
    before anything is generated, and leaves no output."""
    env = {**vllm_env, "JUDGE_KEY": "not-the-key"}
    out = tmp_path / "out"
    last = refusal(rloo(eval_args(qwen, baseline, eval_rows, judge_server, out, "vllm"), env), out)
    assert "rejected the API key" in last


def test_a_memory_fraction_too_small_for_the_cpu_engine_is_one_line(
    qwen: TinySetup,
    baseline: Path,
    eval_rows: Path,
    judge_server: JudgeServer,
    vllm_env: dict[str, str],
    tmp_path: Path,
) -> None:
    env = {**vllm_env, "JUDGE_KEY": judge_server.api_key}
    out = tmp_path / "out"
    args = eval_args(
        qwen, baseline, eval_rows, judge_server, out, "vllm", "--vllm_gpu_memory_utilization", "1e-7"
    )
    last = refusal(rloo(args, env), out)
    assert (
        "vLLM on CPU: --vllm_gpu_memory_utilization 1e-07" in last
        and "raise --vllm_gpu_memory_utilization" in last
    )
