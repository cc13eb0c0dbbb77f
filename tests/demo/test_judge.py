"""The toy judge: its verdict rule, and the real evaluation client talking to it over HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rloo.demo.judge import MODEL, ToyJudge, verdict
from rloo.eval.config import DEFAULT_TEMPLATE
from rloo.judging.client import JudgeSettings
from rloo.judging.pairwise import PairwiseJudge, render_prompt


def test_verdict_prefers_more_vowels_and_breaks_ties_to_a() -> None:
    # "aeiou": 5/5 vowels = 1.0; "xyz": 0/3 = 0.0
    assert verdict(render_prompt(DEFAULT_TEMPLATE, "p", "xyz", "aeiou")) == "B"
    assert verdict(render_prompt(DEFAULT_TEMPLATE, "p", "aeiou", "xyz")) == "A"
    # "ab" and "ba" both 1/2: a tie goes to A, which the two-order evaluation turns into a tie
    assert verdict(render_prompt(DEFAULT_TEMPLATE, "p", "ab", "ba")) == "A"
    assert verdict("a prompt in some other layout") == "I cannot find two responses to compare."


def test_real_client_judges_both_orders() -> None:
    with ToyJudge() as judge:
        settings = JudgeSettings(
            base_url=judge.base_url, model=MODEL, api_key="EMPTY", template=DEFAULT_TEMPLATE
        )
        pairs = PairwiseJudge(settings).judge(["p1", "p2"], ["aaaa", "xyz"], ["the sea", "the sea"])
        assert judge.requests == 4
    # "aaaa" (1.0) beats "the sea" (3/6 = 0.5) in both orders; "xyz" (0.0) loses in both
    assert [(a.verdict, b.verdict) for a, b in pairs] == [("model", "model"), ("reference", "reference")]
    assert all(j.status == "ok" for pair in pairs for j in pair)


def test_models_endpoint_and_errors() -> None:
    with ToyJudge() as judge:
        with urllib.request.urlopen(f"{judge.base_url}/models", timeout=5) as resp:
            assert [m["id"] for m in json.load(resp)["data"]] == [MODEL]
        body = json.dumps({"model": "other", "messages": [{"role": "user", "content": "x"}]}).encode()
        req = urllib.request.Request(f"{judge.base_url}/chat/completions", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 404


def test_win_rates_against_the_demo_references_follow_the_vowel_fraction(tmp_path: Path) -> None:
    """Through the real client: answers of vowel fraction 1/4, 1/2, 3/4 and 1 win about that fraction of the
    demo's graded references, not all of them: the evaluation tells degrees apart."""
    from rloo.demo.toy import write_toy_eval_dataset
    from rloo.eval.data import load_eval_rows
    from rloo.eval.stats import summarize_scores

    rows = load_eval_rows(
        str(write_toy_eval_dataset(tmp_path / "eval", seed=1)), "test", config=None, num_examples=None
    )
    answers = {0.25: "eau hmm shh brr", 0.5: "eau oui psst hm", 0.75: "eau oui aie hmm", 1.0: "eau oui aie"}
    rates = {}
    with ToyJudge() as judge:
        settings = JudgeSettings(
            base_url=judge.base_url, model=MODEL, api_key="EMPTY", template=DEFAULT_TEMPLATE
        )
        for fraction, answer in answers.items():
            n = len(rows.prompts)
            pairs = PairwiseJudge(settings).judge(
                list(rows.judge_prompts), [answer] * n, list(rows.references)
            )
            summary = summarize_scores([(a.verdict, b.verdict) for a, b in pairs])
            assert summary["num_valid"] == n
            rates[fraction] = summary["win_rate"]
    for fraction, rate in rates.items():
        assert rate == pytest.approx(fraction, abs=1 / 31), rates
    # the all-vowel answer ties the all-vowel reference (both orders answer A: a tie) and beats the rest
    assert rates[1.0] == (31 + 0.5) / 32
