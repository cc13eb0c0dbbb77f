"""The pointwise judge against a real HTTP server (the scripted judge): the scores it reads, the answers it
cannot read, and the requests it sends."""

from __future__ import annotations

import pytest

from rloo.judging.client import INVALID, OK, JudgeSettings
from rloo.judging.pointwise import PointwiseJudge, parse_score, render_pointwise
from rloo.judging.templates import POINTWISE_TEMPLATE
from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("7", 7.0),
        (" 10\n", 10.0),
        ("**0**", 0.0),
        ("8/10", 8.0),
        ("Score: 6.", 6.0),
        ("7.5", 7.5),
        ("[9]", 9.0),
    ],
)
def test_parse_score_reads_one_number_from_0_to_10(text: str, score: float) -> None:
    assert parse_score(text) == score


@pytest.mark.parametrize("text", ["", None, "11", "-1", "7 or 8", "I'd say 7", "seven", "A", "100"])
def test_parse_score_rejects_everything_else(text: str | None) -> None:
    assert parse_score(text) is None


def test_the_template_takes_braces_in_prompts_and_responses_as_they_are() -> None:
    content = render_pointwise(POINTWISE_TEMPLATE, "use {response} here", "{prompt}")
    assert "## Prompt\n\nuse {response} here\n\n## Response\n\n{prompt}\n\nHow good" in content


def test_grades_statuses_and_requests() -> None:
    with ScriptedJudge() as server:
        judge = PointwiseJudge(
            JudgeSettings(
                base_url=server.base_url,
                model=MODEL,
                api_key=API_KEY,
                template=POINTWISE_TEMPLATE,
                backoff=0.01,
            ),
            progress=False,
        )
        grades = judge.grade(["p"] * 4, ["SCORE7", "SCORE**10**", "MALFORMED", "SCORE11"])
        assert [g.score for g in grades] == [7.0, 10.0, None, None]
        assert [g.status for g in grades] == [OK, OK, INVALID, INVALID]
        assert [g.answer for g in grades] == ["7", "**10**", "I like both of them", "11"]
        assert server.requests == judge.stats.requests == 4
