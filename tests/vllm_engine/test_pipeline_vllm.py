"""One local pipeline run (``rloo pipeline run --local``) with vLLM everywhere it runs in production: the
rollouts (``--use_vllm``), the evaluation's generation (``engine auto`` picks vLLM where it can run) and the
judge (vLLM's OpenAI server, started from the chart's judge container)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from rloo.demo.pipeline import embedded_params
from rloo.demo.tiny import TinySetup
from tests.vllm_engine.conftest import JudgeServer, metrics, needs_vllm, rloo

pytestmark = needs_vllm


def test_local_pipeline_with_vllm_for_rollouts_eval_and_judge(
    qwen: TinySetup, judge_server: JudgeServer, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    work = tmp_path / "work"
    params = embedded_params(work, updates=2)  # the demo's datasets and recipe, on the Qwen2-shaped policy
    params["model"] = str(qwen.policy)
    params["extra_train_args"] = shlex.join(
        [*shlex.split(params["extra_train_args"]), "--use_vllm", "--vllm_importance_sampling_correction"]
    )
    params.update(judge_base_url=judge_server.base_url, judge_model=judge_server.model)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    env = {**vllm_env, "OPENAI_API_KEY": judge_server.api_key}  # the judge_secret's key, locally
    proc = rloo(["pipeline", "run", "--local", "--workdir", str(work), "--params", str(params_file)], env)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])

    copies = sorted(work.rglob("metrics.jsonl"))  # the step's output and what it published
    assert copies
    for copy in copies:
        rows = metrics(copy.parent)
        assert len(rows) == 2 and all(r["objective/vllm_logp_diff_abs_mean"] < 1e-4 for r in rows), rows
    results_files = sorted(work.rglob("eval_results.json"))
    assert results_files
    for results_file in results_files:
        results = json.loads(results_file.read_text())
        assert results["engine"] == "vllm"
        assert results["invalid"] == 0 and results["trained"]["win_rate"] == 0.5  # every verdict usable
    assert "win rate" in proc.stdout.lower()
