"""What ``rloo eval`` says when the judge cannot be used, and the numbers and JSON it accepts and writes: real
OpenAI-compatible servers on 127.0.0.1 (the scripted judge, ``transformers serve``)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from rloo.cli import main as rloo_main
from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.eval.config import DEFAULT_TEMPLATE
from rloo.judging.client import JudgeSettings
from rloo.judging.pairwise import PairwiseJudge
from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge
from tests.eval.test_eval_cli import argv, write_jsonl
from tests.fixtures.servers import free_port


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "d",
        [
            {"prompt": "POST: rain all week. TL;DR:", "completion": " GOOD rain"},
            {"prompt": "p", "completion": " r"},
        ],
    )


def _settings(url: str, **kw: object) -> JudgeSettings:
    base: dict[str, object] = dict(
        base_url=url, model=MODEL, api_key=API_KEY, template=DEFAULT_TEMPLATE, max_retries=2, timeout=2.0,
        backoff=0.01,
    )  # fmt: skip
    return JudgeSettings(**{**base, **kw})  # type: ignore[arg-type]


def test_a_malformed_judge_url_is_refused_at_once(
    tiny_setup: TinySetup, rows: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A base URL without http(s):// is no URL the client can call: openai-python (src/openai/_base_client.py)
    turns the transport's refusal into APIConnectionError, which it and the judge retry as if the server were
    down (32 s of retries, then exit 75). It is refused before anything loads: exit 2, one line."""
    started = time.monotonic()
    code = rloo_main(["eval", *argv(tiny_setup, rows, "judge:8000/v1", tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 20
    assert err == (
        "rloo eval: error: --judge_base_url 'judge:8000/v1' is not an http(s) URL (it does not start with "
        "http:// or https://): give the judge server's OpenAI-compatible base URL, e.g. http://judge:8000/v1.\n"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--judge_timeout", "nan"),
        ("--judge_backoff", "inf"),
    ],
)
def test_non_finite_numbers_are_refused(
    flag: str,
    value: str,
    tiny_setup: TinySetup,
    rows: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Python's float() reads 'nan' and 'inf', every comparison with nan is false (so '--temperature must be
    >= 0' let it through and the win rate came from garbage sampling), and json.dumps writes them as NaN and
    Infinity, which RFC 8259 JSON has not (cpython Lib/json/encoder.py: allow_nan). Refused in one line."""
    code = rloo_main(["eval", *argv(tiny_setup, rows, "http://127.0.0.1:9/v1", tmp_path / "o", flag, value)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"rloo eval: error: {flag} must be a finite number (got {float(value)}).\n"
    assert not (tmp_path / "o").exists()


def test_what_the_evaluation_writes_is_strict_json(
    tiny_setup: TinySetup, rows: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file the evaluation writes parses with a parser that refuses NaN/Infinity (as jq and the push
    gate's readers do), and a non-finite number that would reach one fails instead of being written."""
    from rloo.eval.runner import strict_json

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    out = tmp_path / "o"
    with ScriptedJudge() as judge:
        assert rloo_main(["eval", *argv(tiny_setup, rows, judge.base_url, out, "--num_examples", "2")]) == 0

    def refuse(constant: str) -> float:
        raise AssertionError(f"{constant} is not JSON")

    for name in ("eval_results.json", "kfp_metrics.json"):
        json.loads((out / name).read_text(), parse_constant=refuse)
    for line in (out / "judgements.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    with pytest.raises(ValueError, match="not JSON compliant"):
        strict_json({"win_rate": math.nan})


def test_a_context_length_refusal_says_what_to_change(rows: Path) -> None:
    """vLLM answers a request longer than its context HTTP 400 "This model's maximum context length is N
    tokens. However, you requested ..." (vllm/renderers/params.py), a status openai-python does not retry
    (src/openai/_base_client.py, _should_retry): the hint is the context, not "is the server up"."""
    with ScriptedJudge(context_chars=len(DEFAULT_TEMPLATE) + 10) as judge, pytest.raises(UserError) as info:
        PairwiseJudge(_settings(judge.base_url)).preflight("x" * (len(DEFAULT_TEMPLATE) + 100))
    message = str(info.value)
    assert info.value.exit_code == 2
    assert message.startswith(
        f"the judge at {judge.base_url} refused the request (HTTP 400: This model's maximum context length is"
    ), message
    assert message.endswith(
        "the judge's context is too short for the request: lower --max_new_tokens (the pipeline's "
        "eval_max_new_tokens) or --judge_max_tokens, or raise the judge server's --max-model-len (the chart's "
        "judge.maxModelLen)."
    )
    assert "server is up" not in message


@pytest.mark.parametrize(
    ("content", "hint"),
    [
        ("GOOD E500x99", "check that the judge server is up and --judge_base_url points at it"),
        ("GOOD E429x99", "check that the judge server is up and --judge_base_url points at it"),
    ],
)
def test_a_failing_judge_is_temporary_and_asked_to_be_up(content: str, hint: str) -> None:
    """5xx and 429 are what openai-python retries (src/openai/_base_client.py): exit 75, "is the server up"."""
    with ScriptedJudge() as judge, pytest.raises(UserError) as info:
        PairwiseJudge(_settings(judge.base_url)).preflight(
            DEFAULT_TEMPLATE.replace("{response_a}", content).replace("{response_b}", "r")
        )
    assert info.value.exit_code == 75 and str(info.value).endswith(f"after 3 attempt(s)): {hint}."), (
        info.value
    )
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(UserError) as info:
        PairwiseJudge(_settings(url, max_retries=0)).preflight()
    assert info.value.exit_code == 75 and str(info.value) == (
        f"the judge at {url} is unreachable or failing (APIConnectionError after 1 attempt(s)): {hint}."
    )


def test_the_validate_check_passes_a_model_served_on_first_use(
    transformers_server: str, tiny_setup: TinySetup
) -> None:
    """transformers/cli/serving/model_manager.py (get_gen_models) lists only the models in the Hugging Face
    cache at /v1/models and loads any other on its first request: a model it does not list is asked for one
    token before it is refused."""
    from rloo.judging.endpoint import check_judge_server

    check_judge_server(transformers_server, str(tiny_setup.policy), api_key="EMPTY", min_context_tokens=10**6)
    with pytest.raises(UserError) as info:
        check_judge_server(transformers_server, str(tiny_setup.policy / "nope"), api_key="EMPTY")
    # it serves the one model it was started with, and says so (HTTP 400, FastAPI's "detail")
    assert (
        info.value.exit_code == 2
        and "answered HTTP 400 to POST /chat/completions (Server is pinned to" in str(info.value)
    )
    assert str(info.value).endswith(
        "the judge refused the request as sent: check judge_model and the judge server's options."
    )
