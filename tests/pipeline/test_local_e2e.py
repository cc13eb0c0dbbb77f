"""The whole pipeline on this machine (``rloo pipeline run --local``): tiny model, toy data, scripted judge.

About 25 s of CPU training, generation and judging. A failing step is retried with the pipeline's real
backoff, so a regression here shows up as a slow failure rather than a quick one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning"),
]


def test_local_run_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_setup: object, toy_dataset: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rloo.cli.pipeline_cmd import main

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge

    evalds = tmp_path / "evalds" / "data"
    evalds.mkdir(parents=True)
    table = pa.table({"prompt": ["Say hi", "Count to 3"], "completion": ["hi GOOD", "1 2 3"]})
    pq.write_table(table, evalds / "test-00000-of-00001.parquet")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    with ScriptedJudge() as judge:
        params = {
            "model": tiny_setup.policy,  # type: ignore[attr-defined]
            "reward_model_path": tiny_setup.reward_model,  # type: ignore[attr-defined]
            "dataset_name": toy_dataset,
            "eval_dataset_name": tmp_path / "evalds",
            "judge_base_url": judge.base_url,
            "judge_model": MODEL,
            "output_uri": out,
            "total_episodes": 16,
            "per_device_train_batch_size": 4,
            "response_length": 8,
            "gpu_count": 0,
            "extra_train_args": "--num_ppo_epochs 1 --num_sample_generations 0 --save_steps 0",
        }
        argv = ["run", "--local", "--pipeline_root", str(tmp_path / "root")]
        for key, value in params.items():
            argv += ["--param", f"{key}={value}"]
        assert main(argv) == 0
    (run,) = (p for p in out.iterdir() if p.name != "published")
    assert (run / "model" / "_MANIFEST.json").is_file() and (run / "sft" / "_MANIFEST.json").is_file()
    results = json.loads((run / "eval" / "eval_results.json").read_text())
    assert results["num_examples"] == 2
    assert any((out / "published").rglob("_MANIFEST.json"))
    # the push stage ran its gate on the evaluation's own results file and published a model card
    cards = list((out / "published").rglob("README.md"))
    assert cards and "rloo" in cards[0].read_text()
