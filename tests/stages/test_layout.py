"""RunLayout names every artifact location of a pipeline run, and nothing else spells them."""

from __future__ import annotations

import re
from pathlib import Path

from rloo.stages.layout import EVAL_RESULTS_FILE, PUSH_RESULT_FILE, RunLayout

ROOT = Path(__file__).resolve().parents[2]


def test_locations_under_the_run() -> None:
    layout = RunLayout("s3://bucket/runs/", "run-1")  # a trailing slash is not doubled
    assert layout.root == "s3://bucket/runs/run-1"
    assert layout.sft == "s3://bucket/runs/run-1/sft"
    assert layout.model == "s3://bucket/runs/run-1/model"
    assert layout.checkpoints == "s3://bucket/runs/run-1/checkpoints"
    assert layout.eval_results == "s3://bucket/runs/run-1/eval/eval_results.json"
    assert layout.push_result == "s3://bucket/runs/run-1/push/push_result.json"
    assert layout.published == "s3://bucket/runs/published"


def test_file_names_agree_with_the_stages() -> None:
    from rloo.eval.runner import RESULTS_FILE
    from rloo.push.runner import RESULT_FILE

    assert (EVAL_RESULTS_FILE, PUSH_RESULT_FILE) == (RESULTS_FILE, RESULT_FILE)


def test_no_other_module_spells_the_layout() -> None:
    spelled = re.compile(r"\{kfp_run_id\}/|output_uri\.rstrip|f\"\{base\}/(published|model|checkpoints)")
    files = [*(ROOT / "components").rglob("*.py"), *(ROOT / "src" / "rloo").rglob("*.py")]
    offenders = [
        str(f.relative_to(ROOT)) for f in files if f.name != "layout.py" and spelled.search(f.read_text())
    ]
    assert offenders == []
