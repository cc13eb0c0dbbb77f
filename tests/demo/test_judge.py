"""The toy judge: its verdict rule, and the real evaluation client talking to it over HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from rloo.demo.judge import MODEL, ToyJudge, verdict
from rloo.eval.config import DEFAULT_TEMPLATE
from rloo.eval.judge import JudgeSettings, PairwiseJudge, render_prompt


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
