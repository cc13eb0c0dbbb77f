"""Multi-turn episodes on vLLM's CPU build: the toy calculator task (rloo.demo.agent_toy, its model with heads
of 64 for vLLM's CPU attention) trained with a colocated engine and against a real ``rloo vllm-serve``.

The proof that vLLM continues each episode on the exact tokens the trainer trains on (the sampled turns and the
tool messages' tokens between them, TRL's way: trl/trainer/grpo_trainer.py ``_tool_call_loop``): with
``--vllm_importance_sampling_correction`` every update logs the mean |log pi_trainer - log pi_vLLM| over the
model's tokens of the episodes, the trainer's taken by one forward over prompt + whole episode. A turn sampled
on another context would differ by far more than rounding (measured: 3.3e-7 to 3.9e-7 at every update).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rloo.demo.agent_toy import build_agent_sft_model, write_agent_toy_dataset
from tests.fixtures.servers import stop_process
from tests.vllm_engine.conftest import metrics, needs_vllm, rloo
from tests.vllm_engine.test_server_mode import PolicyServer, start_server
from tests.vllm_engine.test_train_vllm import GAP, TOLERANCE

pytestmark = needs_vllm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("agent")
    model = build_agent_sft_model(root / "model", hidden_size=128, num_heads=2)
    return model, write_agent_toy_dataset(root / "data")


def agent_args(agent: tuple[Path, Path], out: Path, *extra: str, steps: int) -> list[str]:
    model, data = agent
    return [
        "train", "--disable_tqdm",
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
        "--tools", "calculator:add", "--reward_funcs", "calculator:correct_sum",
        "--num_generations", "4", "--per_device_train_batch_size", "32", "--max_completion_length", "128",
        "--learning_rate", "5e-4", "--temperature", "1.0", "--max_tool_calling_iterations", "2",
        "--max_steps", str(steps), "--num_sample_generations", "0", "--seed", "1",
        "--use_vllm", "--vllm_importance_sampling_correction",
        *extra,
    ]  # fmt: skip


def test_the_toy_agent_learns_on_a_colocated_engine(
    agent: tuple[Path, Path], vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """12 updates (~30 s). Measured: calls per episode 0.64 -> 0.99, reward 0.33 -> 0.52 (the first three
    updates' mean -> the last four's; this model copies the question's digits less often than the smaller
    one the built-in tests train: 0.5 is a call with a wrong sum)."""
    out = tmp_path / "out"
    proc = rloo(agent_args(agent, out, steps=12), {**vllm_env, "PYTHONPATH": str(EXAMPLES)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(out)
    assert all(r[GAP] < TOLERANCE for r in rows), [r[GAP] for r in rows]
    calls = [r["tools/call_frequency"] for r in rows]
    scores = [r["objective/scores"] for r in rows]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # it learns within a few updates: the first three against the last four
    assert mean(calls[-4:]) > mean(calls[:3]) + 0.2, calls
    assert mean(scores[-4:]) > mean(scores[:3]) + 0.1, scores
    assert all(r["tools/tool_token_frac"] > 0 for r in rows)  # tool messages between the turns


def test_vllm_runs_the_same_episodes_as_the_built_in_generator(
    agent: tuple[Path, Path], vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """The sample table's greedy episodes (the model's turns, the tool calls, the tools' results, the answers)
    are the same text from a colocated engine as from the built-in generator, both in float32. The table is
    drawn after update 1, so that update's rollout samples at temperature 0.01: the same episodes on both, the
    same weights after it."""
    tables = []
    for name, extra in (("builtin", []), ("vllm", ["--use_vllm"])):
        out = tmp_path / name
        args = agent_args(agent, out, "--num_sample_generations", "1", "--temperature", "0.01", steps=1)
        args = [a for a in args if a != "--vllm_importance_sampling_correction"]
        args = [a for a in args if a != "--use_vllm"] + extra
        proc = rloo(args, {**vllm_env, "PYTHONPATH": str(EXAMPLES)})
        assert proc.returncode == 0, proc.stderr[-4000:]
        tables.append([json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()])
    builtin, vllm = tables
    assert len(builtin) == 8 and any("tool_call" in row["response"] for row in builtin)
    assert [r["response"] for r in vllm] == [r["response"] for r in builtin]


@pytest.fixture(scope="module")
def agent_server(
    agent: tuple[Path, Path], vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PolicyServer]:
    s = start_server(agent[0], vllm_env, tmp_path_factory.mktemp("agent-server"))
    yield s
    stop_process(s.proc)  # type: ignore[arg-type]


def test_episodes_run_against_a_vllm_server(
    agent: tuple[Path, Path], agent_server: PolicyServer, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    """Each later turn is one more request whose prompt is the episode so far; the pushed weights sample it."""
    out = tmp_path / "out"
    args = agent_args(
        agent, out, "--vllm_mode", "server", "--vllm_server_base_url", agent_server.url, steps=3
    )
    proc = rloo(args, {**vllm_env, "PYTHONPATH": str(EXAMPLES)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(out)
    assert len(rows) == 3 and all(r[GAP] < TOLERANCE for r in rows), [r[GAP] for r in rows]
    assert all(r["tools/turns"] > 1 and r["tools/call_frequency"] > 0 for r in rows)
