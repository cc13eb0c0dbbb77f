"""The judge client against a real HTTP server with scripted verdicts, malformed text, 429s, 500s, stalls."""

from __future__ import annotations

import socket

import pytest

from rloo.errors import ServiceUnavailable, UserError
from rloo.eval.config import DEFAULT_TEMPLATE
from rloo.eval.stats import MODEL, REFERENCE, pair_score, summarize_scores
from rloo.judging.client import BUDGET, ERROR, INVALID, OK, JudgeSettings, api_key_from_env
from rloo.judging.pairwise import PairwiseJudge, parse_answer
from tests.eval.scripted_server import API_KEY, ScriptedJudge
from tests.eval.scripted_server import MODEL as JUDGE_MODEL


def settings(server: ScriptedJudge, **kw: object) -> JudgeSettings:
    base = dict(
        base_url=server.base_url,
        model=JUDGE_MODEL,
        api_key=API_KEY,
        template=DEFAULT_TEMPLATE,
        concurrency=4,
        max_retries=3,
        # generous: a loaded CI machine can take a second to answer a plain request, and a timeout there
        # would add a retry the server never counted; the stalled case still stalls far longer
        timeout=3.0,
        backoff=0.01,
    )
    base.update(kw)
    return JudgeSettings(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "letter"),
    [("A", "A"), (" b\n", "B"), ("**A**", "A"), ('"B".', "B"), ("Response A", "A"), ("[B]", "B")],
)
def test_parse_answer_accepts_one_letter(text: str, letter: str) -> None:
    assert parse_answer(text) == letter


@pytest.mark.parametrize("text", ["", "AB", "A or B", "I prefer A", "0", "C", None, "Both are fine"])
def test_parse_answer_rejects_everything_else(text: str | None) -> None:
    assert parse_answer(text) is None


def test_scripted_verdicts_retries_and_invalid(scripted_judge: ScriptedJudge) -> None:
    cases = [  # (model output, reference, expected pair score, expected statuses)
        ("GOOD summary", "plain", 1.0, {OK}),
        ("plain", "GOOD reference", 0.0, {OK}),
        ("plain", "also plain", 0.5, {OK}),  # judge always says A: orders disagree
        ("MALFORMED", "plain", None, {INVALID}),
        ("GOOD E429x2", "plain", 1.0, {OK}),
        ("GOOD E500x1", "plain", 1.0, {OK}),
        ("GOOD STALLx1", "plain", 1.0, {OK}),
        ("E500x99", "plain", None, {ERROR}),
    ]
    judge = PairwiseJudge(settings(scripted_judge))
    out = judge.judge(["Summarize."] * len(cases), [c[0] for c in cases], [c[1] for c in cases])
    for (output, _, score, statuses), (ab, ba) in zip(cases, out, strict=True):
        assert (ab.order, ba.order) == ("model_first", "reference_first")
        assert pair_score(ab.verdict, ba.verdict) == score, output
        assert {ab.status, ba.status} == statuses, output
    by_output = {c[0]: pair for c, pair in zip(cases, out, strict=True)}
    assert [j.attempts for j in by_output["GOOD E429x2"]] == [3, 3]
    assert [j.attempts for j in by_output["GOOD E500x1"]] == [2, 2]
    assert [j.attempts for j in by_output["GOOD STALLx1"]] == [2, 2]
    assert all(j.attempts == 4 and j.error == "HTTP 500" for j in by_output["E500x99"])
    malformed = by_output["MALFORMED"][0]
    assert malformed.answer == "I like both of them" and malformed.verdict is None
    # every HTTP attempt is counted, and only those the server saw
    assert judge.stats.requests == scripted_judge.requests == 2 * (1 + 1 + 1 + 1 + 3 + 2 + 2 + 4)
    assert judge.stats.statuses == {OK: 12, INVALID: 2, ERROR: 2}
    summary = summarize_scores([(a.verdict, b.verdict) for a, b in out])
    assert (summary["num_invalid"], summary["num_losses"], summary["num_ties"]) == (2, 1, 1)


def test_request_budget_stops_sending_and_counts_unjudged(scripted_judge: ScriptedJudge) -> None:
    judge = PairwiseJudge(settings(scripted_judge, request_budget=3, concurrency=1))
    out = judge.judge(["p"] * 4, ["GOOD"] * 4, ["ref"] * 4)
    flat = [j for pair in out for j in pair]
    assert scripted_judge.requests == 3 == judge.stats.requests
    assert sum(j.status == OK for j in flat) == 3
    assert sum(j.status == BUDGET for j in flat) == 5
    summary = summarize_scores([(a.verdict, b.verdict) for a, b in out])
    # unjudged pairs are invalid, never losses
    assert summary["num_losses"] == 0 and summary["num_invalid"] == 3 and summary["num_wins"] == 1


def test_custom_template_reaches_the_server(scripted_judge: ScriptedJudge) -> None:
    template = (
        "Q: {prompt}\n\n## Response A\n\n{response_a}\n\n## Response B\n\n{response_b}\n\nWhich response? {x}"
    )
    judge = PairwiseJudge(settings(scripted_judge, template=template))
    ((ab, ba),) = judge.judge(["p {braces}"], ["plain"], ["GOOD"])
    assert (ab.verdict, ba.verdict) == (REFERENCE, REFERENCE)
    (body,) = {b for b in scripted_judge.seen if "Response B\\n\\nGOOD" in b}
    assert "Q: p {braces}" in body and "Which response? {x}" in body


def test_preflight_passes_on_a_healthy_judge(scripted_judge: ScriptedJudge) -> None:
    judge = PairwiseJudge(settings(scripted_judge))
    judge.preflight()
    assert judge.stats.preflight_requests == 1
    # the check is counted apart: the judgement requests add up with the judgements' statuses (the report
    # printed "Judge requests: 129" next to {'ok': 128})
    judge.judge(["p1", "p2"], ["o1", "o2"], ["r1", "r2"])
    assert judge.stats.requests == sum(judge.stats.statuses.values()) == 4


def test_wrong_key_is_a_user_error(scripted_judge: ScriptedJudge) -> None:
    judge = PairwiseJudge(settings(scripted_judge, api_key="sk-wrong"))
    with pytest.raises(UserError, match="rejected the API key"):
        judge.preflight()
    # fatal for a whole batch too, and not retried
    with pytest.raises(UserError, match="rejected the API key"):
        PairwiseJudge(settings(scripted_judge, api_key="sk-wrong")).judge(["p"] * 3, ["o"] * 3, ["r"] * 3)


def test_unknown_model_is_a_user_error(scripted_judge: ScriptedJudge) -> None:
    with pytest.raises(UserError, match="does not know model 'gpt-nope'"):
        PairwiseJudge(settings(scripted_judge, model="gpt-nope")).preflight()


def test_unreachable_judge_is_a_temporary_failure() -> None:
    """One line, exit 75 (not 2): a judge still starting or briefly down heals, so a retried step tries again."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = JudgeSettings(
        base_url=f"http://127.0.0.1:{port}/v1", model="m", api_key="k", template=DEFAULT_TEMPLATE,
        max_retries=1, backoff=0.01, timeout=2.0,
    )  # fmt: skip
    with pytest.raises(ServiceUnavailable, match="unreachable") as e:
        PairwiseJudge(cfg).preflight()
    assert e.value.exit_code == 75


def test_model_verdict_mapping_follows_the_order(scripted_judge: ScriptedJudge) -> None:
    ((ab, ba),) = PairwiseJudge(settings(scripted_judge)).judge(["p"], ["GOOD"], ["r"])
    assert (ab.answer, ba.answer) == ("A", "B")  # the model's output moved from A to B
    assert ab.verdict == ba.verdict == MODEL


def test_api_key_comes_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(UserError, match="--judge_api_key_env JUDGE_KEY: the variable is not set"):
        api_key_from_env("JUDGE_KEY", "https://api.openai.com/v1")
    # a self-hosted server (vLLM, transformers serve) usually needs no key
    assert api_key_from_env("JUDGE_KEY", "http://vllm-judge:8000/v1") == "EMPTY"
    monkeypatch.setenv("JUDGE_KEY", "sk-1")
    assert api_key_from_env("JUDGE_KEY", "https://api.openai.com/v1") == "sk-1"


class _OddJudge:
    """A stdlib HTTP server answering every POST with HTTP 200 and a fixed body (empty, HTML, bad JSON)."""

    def __init__(self, body: bytes, content_type: str) -> None:
        import http.server
        import threading

        answer = (body, content_type)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    self.send_response(200)
                    self.send_header("content-type", answer[1])
                    self.send_header("content-length", str(len(answer[0])))
                    self.end_headers()
                    self.wfile.write(answer[0])
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the judge gave up on its other requests after the first fatal answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    ("body", "content_type", "said"),
    [
        (b"", "application/json", "an empty body"),
        (b"<html>proxy login</html>", "text/html", "<html>proxy login</html>"),
        (b'{"choices": [', "application/json", '{"choices": ['),
    ],
)
def test_judge_answering_200_without_json_is_one_line(body: bytes, content_type: str, said: str) -> None:
    server = _OddJudge(body, content_type)
    try:
        cfg = JudgeSettings(
            base_url=server.base_url, model="m", api_key="k", template=DEFAULT_TEMPLATE,
            max_retries=1, backoff=0.01, timeout=5.0,
        )  # fmt: skip
        with pytest.raises(UserError) as info:
            PairwiseJudge(cfg).preflight()
        msg = str(info.value)
        assert "\n" not in msg and server.base_url in msg and said in msg and "HTTP 200" in msg
        # the same during judging: fatal at once, not a traceback from the gather
        with pytest.raises(UserError, match="HTTP 200"):
            PairwiseJudge(cfg).judge(["p"] * 3, ["o"] * 3, ["r"] * 3)
    finally:
        server.close()


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        ("APIConnectionError", True), ("APITimeoutError", True), ("HTTP 503", True), ("HTTP 429", True),
        ("HTTP 400", False), ("HTTP 422", False), (None, False),
    ],
)  # fmt: skip
def test_which_judge_failures_a_retry_may_heal(error: str | None, transient: bool) -> None:
    from rloo.judging.client import transient as may_heal

    assert may_heal(error) is transient


def test_a_judge_that_kept_failing_is_temporary_one_that_refused_is_not() -> None:
    from rloo.eval.runner import usable_verdicts_problem
    from rloo.judging.pairwise import Judgement

    def pair(status: str, error: str | None = None) -> tuple[Judgement, Judgement]:
        return (
            Judgement("model_first", status, error=error),
            Judgement("reference_first", status, error=error),
        )

    ok = pair(OK)
    assert usable_verdicts_problem("trained", [ok, ok, pair(ERROR, "HTTP 503")]) is None  # 2 of 3: measured
    down = usable_verdicts_problem("trained", [ok, pair(ERROR, "HTTP 503"), pair(ERROR, "HTTP 503")])
    assert isinstance(down, ServiceUnavailable) and "4 request(s) failed with 'HTTP 503'" in str(down)
    refused = usable_verdicts_problem(
        "trained", [ok, pair(ERROR, "HTTP 400: too long"), pair(ERROR, "HTTP 400: too long")]
    )
    assert type(refused) is UserError and "'HTTP 400: too long'" in str(refused)
