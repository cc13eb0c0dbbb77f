"""The judge against a real OpenAI-compatible server: ``transformers serve`` with a tiny local model.

The tiny model is random, so its answers are mostly not a letter: the point is the protocol (requests,
responses, model name, concurrency) and that unparseable answers land in ``invalid``, not in losses.
"""

from __future__ import annotations

from rloo.demo.tiny import TinySetup
from rloo.eval.config import DEFAULT_TEMPLATE
from rloo.eval.stats import summarize_scores
from rloo.judging.client import INVALID, OK, JudgeSettings
from rloo.judging.pairwise import PairwiseJudge, parse_answer


def test_judge_against_transformers_serve(transformers_server: str, tiny_setup: TinySetup) -> None:
    judge = PairwiseJudge(
        JudgeSettings(
            base_url=transformers_server,
            model=str(tiny_setup.policy),
            api_key="EMPTY",
            template=DEFAULT_TEMPLATE,
            concurrency=2,
            max_retries=2,
            timeout=60.0,
            backoff=0.1,
            max_tokens=3,
        )
    )
    judge.preflight()
    out = judge.judge(
        ["Write about the sea:", "Write about a fox:"], ["waves", "red fox"], ["blue sea", "fox"]
    )
    flat = [j for pair in out for j in pair]
    assert len(flat) == 4
    for j in flat:
        assert j.status in (OK, INVALID), j
        assert isinstance(j.answer, str)  # the server answered; what it said decides ok vs invalid
        assert (j.status == OK) == (parse_answer(j.answer) is not None)
    assert judge.stats.requests == 4 and judge.stats.preflight_requests == 1 and judge.stats.retries == 0
    summary = summarize_scores([(a.verdict, b.verdict) for a, b in out])
    invalid_pairs = sum(1 for a, b in out if INVALID in (a.status, b.status))
    assert summary["num_invalid"] == invalid_pairs
    assert summary["num_losses"] + summary["num_wins"] + summary["num_ties"] == 2 - invalid_pairs
