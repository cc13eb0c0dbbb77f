"""The validate step asks the judge before any GPU is requested: it used to be first contacted by the evaluate
step, after hours of training. Real OpenAI-compatible servers on 127.0.0.1: the demo's toy judge and the
scripted judge of tests/eval (which lists its model as vLLM does). The step runs as on a cluster: KFP's Argo
compiler sets KFP_POD_NAME on every step's pod (backend/src/v2/compiler/argocompiler/common.go), and the
Secrets the later steps need are mounted (rloo.stages.validate.check_secrets)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from rloo.demo.judge import MODEL as TOY_MODEL
from rloo.demo.judge import ToyJudge
from rloo.errors import UserError
from rloo.stages.validate import build_plan, run
from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge
from tests.fixtures.servers import free_port
from tests.stages.test_validate import good


def pod_env(key: str = "EMPTY") -> dict[str, str]:
    """A validate pod's environment: on a cluster, the S3 and judge Secrets mounted (the judge's key)."""
    return {
        "KFP_POD_NAME": "rloo-validate-params-abc",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "S3_ENDPOINT_URL": "http://127.0.0.1:9",
        "OPENAI_API_KEY": key,
    }


def _params(setup: Any, url: str, model: str, **change: object) -> dict[str, object]:
    # a local model directory: build_plan's Hub check would otherwise ask the Hub for org/sft
    return good(model=str(setup.policy), judge_base_url=url, judge_model=model, **change)


def test_a_judge_that_answers_and_serves_the_model_passes(tiny_setup: Any) -> None:
    """The demo's judge (GET /v1/models, POST /v1/chat/completions) passes; the check is one GET /models,
    no judgement is asked for."""
    with ToyJudge() as judge:
        run(_params(tiny_setup, judge.base_url, TOY_MODEL), env=pod_env())
        assert judge.requests == 0


def test_an_unreachable_judge_fails_the_validate_step(tiny_setup: Any) -> None:
    """Nothing listens: exit 75 (the judge may be starting; a vLLM judge loads its model for minutes), in
    one line that says the evaluation would fail after training and what to do."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    started = time.monotonic()
    with pytest.raises(UserError) as info:
        run(_params(tiny_setup, url, "j"), env=pod_env())
    message = str(info.value)
    assert info.value.exit_code == 75 and time.monotonic() - started < 30
    assert message.startswith(f"the judge at {url} is unreachable (GET /models: "), message
    assert "the evaluation would fail after training" in message and "submit the run again" in message
    assert "judge_check=false" in message
    # told not to: the step passes without asking (a judge started after the run is submitted); a local run
    # (no KFP_POD_NAME) serves its own judge while it runs
    run(_params(tiny_setup, url, "j"), env=pod_env(), check_judge=False)
    run(_params(tiny_setup, url, "j", judge_check=False), env=pod_env())
    run(_params(tiny_setup, url, "j"), env={})


def test_a_judge_that_does_not_serve_the_model_is_refused(tiny_setup: Any) -> None:
    """vllm/entrypoints/openai/models/serving.py: /v1/models lists the served names (``--served-model-name``)
    and a request for another model is answered 404 "The model `x` does not exist.": exit 2, naming what the
    server does list."""
    env = pod_env(API_KEY)
    with ScriptedJudge() as judge:
        run(_params(tiny_setup, judge.base_url, MODEL), env=env)
        with pytest.raises(UserError) as info:
            run(_params(tiny_setup, judge.base_url, "gpt-nope"), env=env)
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"the judge at {judge.base_url} does not serve judge_model 'gpt-nope' (it lists 'judge'): set "
        "judge_model to a name the server lists (vLLM: --served-model-name, the chart's "
        "judge.servedModelName), or check judge_base_url."
    )


def test_the_judges_key_and_path_are_checked(tiny_setup: Any) -> None:
    """openai-python src/openai/_base_client.py retries 408/409/429/5xx only: a 401 or a 404 is the same on
    every try, so exit 2 with the hint of the status: the key (judge_secret), or the base URL's path."""
    with ScriptedJudge() as judge:
        with pytest.raises(UserError) as info:
            run(_params(tiny_setup, judge.base_url, MODEL), env=pod_env("sk-wrong"))
        assert info.value.exit_code == 2 and "HTTP 401" in str(info.value)
        assert "check the API key" in str(info.value) and "judge_secret" in str(info.value)
        no_v1 = judge.base_url.removesuffix("/v1")
        with pytest.raises(UserError) as info:
            run(_params(tiny_setup, no_v1, MODEL), env=pod_env(API_KEY))
        assert info.value.exit_code == 2
        assert str(info.value) == (
            f"the judge at {no_v1} answers 404 to GET /models and to a chat request for 'judge': check the "
            "path of judge_base_url (usually ends in /v1) and judge_model."
        )


def test_a_judge_context_too_short_for_the_evaluation_is_refused(tiny_setup: Any) -> None:
    """vllm/entrypoints/serve/engine/protocol.py: vLLM's ModelCard carries ``max_model_len``, the context of
    every request (prompt and answer). One too short for the judge template, eval_max_new_tokens of model
    output and the verdict fails now, not after training."""
    env = pod_env(API_KEY)
    with ScriptedJudge(max_model_len=256) as judge:
        with pytest.raises(UserError) as info:
            run(_params(tiny_setup, judge.base_url, MODEL, eval_max_new_tokens=200), env=env)
        message = str(info.value)
        assert info.value.exit_code == 2
        assert "serves 'judge' with a context of 256 tokens (max_model_len)" in message
        assert "--max-model-len (the chart's judge.maxModelLen) or lower eval_max_new_tokens" in message
        run(_params(tiny_setup, judge.base_url, MODEL, eval_max_new_tokens=16), env=env)
    with ScriptedJudge(max_model_len=8192) as judge:
        run(_params(tiny_setup, judge.base_url, MODEL, eval_max_new_tokens=200), env=env)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("judge:8000/v1", "it does not start with http:// or https://"),
        ("http://", "it names no host"),
        ("http://judge:80a/v1", "its port is not a number"),
        ("http://judge /v1", "it contains whitespace"),
    ],
)
def test_a_malformed_judge_url_is_refused_where_the_plan_is_built(url: str, problem: str) -> None:
    """Every place that builds the plan (validate, submit, manifest, the local run's precheck) refuses it
    at once, exit 2, asking no server."""
    with pytest.raises(UserError) as info:
        build_plan(good(judge_base_url=url), check_paths=False)
    assert info.value.exit_code == 2
    assert str(info.value).startswith(f"judge_base_url {url!r} is not an http(s) URL ({problem}")
