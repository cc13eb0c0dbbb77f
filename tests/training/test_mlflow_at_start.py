"""What happens to ``rloo train`` when MLflow is down, as docs/storage-and-mlflow.md says it: a tracking server that cannot be
reached when the stage starts is a one-line error before any model loads (a mistyped URI should fail in
seconds, not after hours of GPU time); an outage once the stage runs never stops it (buffered and retried:
tests/tracking/test_mlflow.py). The start is tested end to end in tests/tracking/test_compare.py."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "docs" / "storage-and-mlflow.md"


def test_readme_says_what_the_code_does() -> None:
    text = " ".join(README.read_text().split())
    assert re.search(
        r"A tracking server that cannot be reached \(or does not answer like MLflow\) when a stage starts is a "
        r"one-line error before any model loads",
        text,
    )
    assert "Once the stage is running, an MLflow outage never stops it" in text
    assert "An MLflow outage never stops training" not in text  # the old, unconditional promise
