"""``rloo eval`` end to end: tiny local models, the transformers engine, the scripted judge server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rloo.cli.eval_cmd import main
from rloo.demo.tiny import TinySetup
from rloo.errors import UserError
from rloo.eval.config import EvalConfig
from rloo.eval.data import load_eval_rows
from tests.eval.scripted_server import API_KEY, MODEL, ScriptedJudge
from tests.fixtures.servers import MlflowServer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    (path / "data").mkdir(parents=True)
    (path / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def tldr_like(tmp_path: Path) -> Path:
    rows = [
        {"prompt": "POST: my cat ate my homework. TL;DR:", "completion": " GOOD cat ate homework"},
        {"prompt": "POST: rain all week. TL;DR:", "completion": " rain"},
        {"prompt": "POST: new job, nervous. TL;DR:", "completion": " MALFORMED"},
    ]
    return write_jsonl(tmp_path / "tldr", rows)


def argv(setup: TinySetup, dataset: Path, server_url: str, out: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(setup.policy), "--baseline_model", str(setup.policy),
        "--dataset_name", str(dataset), "--dataset_split", "test", "--judge_base_url", server_url,
        "--judge_model", MODEL, "--num_examples", "3", "--output_dir", str(out), "--engine", "transformers",
        "--max_new_tokens", "8", "--judge_backoff", "0.01",
        "--report_to", "none", *extra,
    ]  # fmt: skip


def test_eval_end_to_end(
    tiny_setup: TinySetup, tldr_like: Path, scripted_judge: ScriptedJudge, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    out = tmp_path / "out"
    assert main(argv(tiny_setup, tldr_like, scripted_judge.base_url, out)) == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert results["num_examples"] == 3 and results["engine"] == "transformers"
    for label in ("trained", "baseline"):
        s = results["models"][label]
        # row 0: the reference is GOOD (loss); row 2: malformed answer (invalid, not a loss); row 1: the
        # judge always answers A, so the two orders disagree (tie)
        assert (s["num_losses"], s["num_ties"], s["num_invalid"], s["num_valid"]) == (1, 1, 1, 2)
        assert s["win_rate"] == pytest.approx(0.25)
        assert s["order_agreement"] == pytest.approx(0.5)
    # same checkpoint twice: greedy outputs and verdicts are identical, the paired difference is exactly 0
    assert results["paired_difference"]["estimate"] == 0.0 and results["paired_difference"]["n"] == 2
    assert results["settings"]["max_new_tokens"] == 8
    assert API_KEY not in (out / "eval_results.json").read_text()
    # the push stage's promotion gate reads this very file: the contract between the two stages
    from rloo.push.gate import parse_eval_results

    parsed = parse_eval_results(results)
    assert parsed.trained.estimate == pytest.approx(0.25) and parsed.paired_difference.estimate == 0.0
    assert parsed.judge_model == results["judge"]["model"] and parsed.num_examples == 3
    assert (parsed.invalid, parsed.ties) == (2, 2)  # one invalid and one tie per model
    # per-example scores keyed by the example, for the push gate's comparison with the champion
    scores = parsed.example_scores
    assert scores is not None and list(scores.values()) == [0.0, 0.5, None]
    # what the evaluation wrote is the typed value's JSON form, key for key
    assert parsed.to_dict() == results
    assert len(scores) == 3 and parsed.judge_template_sha256
    lines = [json.loads(x) for x in (out / "judgements.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    first = lines[0]
    assert first["reference"] == " GOOD cat ate homework" and first["prompt"].startswith("POST: my cat")
    assert set(first["outputs"]) == {"trained", "baseline"}
    assert [j["order"] for j in first["judgements"]["trained"]] == ["model_first", "reference_first"]
    assert first["scores"] == {"trained": 0.0, "baseline": 0.0}
    assert lines[2]["judgements"]["trained"][0]["status"] == "invalid"
    html = (out / "eval_report.html").read_text()
    assert "25.0%" in html and "POST: rain all week" in html
    kfp = json.loads((out / "kfp_metrics.json").read_text())
    assert kfp["trained_win_rate"] == pytest.approx(0.25) and kfp["baseline_num_invalid"] == 1
    assert "trained: win rate 25.0%" in capsys.readouterr().out


def test_messages_dataset_references(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "Summarize: x"}, {"role": "assistant", "content": "x."}]},
        {"messages": [{"role": "user", "content": "Summarize: y"}, {"role": "assistant", "content": "y."}]},
    ]
    data = load_eval_rows(str(write_jsonl(tmp_path / "m", rows)), "test", num_examples=1)
    assert data.prompts == [[{"role": "user", "content": "Summarize: x"}]]
    assert data.references == ["x."] and data.judge_prompts == ["Summarize: x"]


def test_missing_reference_column(toy_dataset: Path, tiny_setup: TinySetup, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"has no reference completions .*'completion'"):
        main(
            argv(tiny_setup, toy_dataset, "http://127.0.0.1:9/v1", tmp_path / "o", "--dataset_split", "train")
        )
    assert not (tmp_path / "o").exists()


def test_empty_dataset(tmp_path: Path, tiny_setup: TinySetup) -> None:
    ds = tmp_path / "empty"
    (ds / "data").mkdir(parents=True)
    (ds / "data" / "test.jsonl").write_text("")
    with pytest.raises(UserError, match="is empty"):
        main(argv(tiny_setup, ds, "http://127.0.0.1:9/v1", tmp_path / "o"))


def test_unreachable_judge_fails_before_generation(
    tiny_setup: TinySetup, tldr_like: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match="unreachable"):
        main(argv(tiny_setup, tldr_like, "http://127.0.0.1:9/v1", tmp_path / "o", "--judge_max_retries", "1"))
    assert not (tmp_path / "o").exists()


def test_wrong_key(
    tiny_setup: TinySetup, tldr_like: Path, scripted_judge: ScriptedJudge, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("MY_KEY", "sk-wrong")
    with pytest.raises(UserError, match="rejected the API key"):
        main(
            argv(
                tiny_setup,
                tldr_like,
                scripted_judge.base_url,
                tmp_path / "o",
                "--judge_api_key_env",
                "MY_KEY",
            )
        )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine", "tpu"], "--engine must be one of"),
        (["--num_examples", "0"], "--num_examples must be >= 1"),
        (["--judge_template", "/nope.txt"], "--judge_template /nope.txt: no such file"),
        (["--judge_concurrency", "0"], "--judge_concurrency must be >= 1"),
    ],
)
def test_bad_flags(
    extra: list[str], message: str, tiny_setup: TinySetup, tldr_like: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match=message):
        main(argv(tiny_setup, tldr_like, "http://127.0.0.1:9/v1", tmp_path / "o", *extra))


def test_template_without_placeholders(tmp_path: Path) -> None:
    bad = tmp_path / "t.txt"
    bad.write_text("Which is better, {response_a} or {response_b}?")
    with pytest.raises(UserError, match=r"missing placeholder\(s\) \{prompt\}"):
        EvalConfig(
            model_name_or_path="m",
            dataset_name="d",
            judge_base_url="u",
            judge_model="j",
            judge_template=str(bad),
        )


def test_required_flags() -> None:
    with pytest.raises(UserError, match="--judge_model is required"):
        main(["--model_name_or_path", "m", "--dataset_name", "d", "--judge_base_url", "http://x/v1"])


def test_results_reach_mlflow(
    tiny_setup: TinySetup, tldr_like: Path, scripted_judge: ScriptedJudge, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from mlflow.tracking import MlflowClient

    for name in (
        "MLFLOW_TRACKING_URI",
        "KFP_RUN_ID",
        "KFP_RUN_NAME",
        "RLOO_REPORT_TO",
        "MLFLOW_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    import time

    import rloo.eval.runner as runner

    spans: list[tuple[float, float]] = []  # (start, end) of each generation, to place the run against
    real_make_engine = runner.make_engine

    def timed_engine(cfg: EvalConfig) -> object:
        engine = real_make_engine(cfg)
        generate = engine.generate

        def timed(model_path: str, prompts: list, rows: object = None) -> list[str]:
            t0 = time.time()
            result = generate(model_path, prompts, rows)
            spans.append((t0, time.time()))
            return result

        engine.generate = timed
        return engine

    monkeypatch.setattr(runner, "make_engine", timed_engine)
    out = tmp_path / "out"
    args = argv(
        tiny_setup, tldr_like, scripted_judge.base_url, out, "--report_to", "mlflow", "--num_examples", "1"
    )
    assert main(args) == 0
    # no tracking URI: the embedded sqlite store under the output directory
    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlruns' / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.tags["rloo.stage"] == "eval"
    # the run spans the stage's work (it used to start when the results were logged, after it)
    assert len(spans) == 2 and run.info.start_time / 1000 <= spans[0][0]
    assert run.info.end_time / 1000 >= spans[-1][1]
    # 2 models x 1 example x 2 orders; the connectivity check is counted apart
    assert run.data.metrics["trained/win_rate"] == 0.0 and run.data.metrics["judge/requests"] == 4
    assert run.data.params["judge_model"] == MODEL
    names = {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
    assert names == {"eval/eval_results.json", "eval/judgements.jsonl", "eval/eval_report.html"}


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--judge_base_url",
        "--judge_request_budget",
        "--vllm_tensor_parallel_size",
        "--num_examples",
    ):
        assert flag in text


def test_one_model_without_baseline(
    tiny_setup: TinySetup, tldr_like: Path, scripted_judge: ScriptedJudge, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    args = argv(tiny_setup, tldr_like, scripted_judge.base_url, tmp_path / "o", "--num_examples", "2")
    i = args.index("--baseline_model")
    del args[i : i + 2]
    assert main(args) == 0
    results = json.loads((tmp_path / "o" / "eval_results.json").read_text())
    assert list(results["models"]) == ["trained"] and results["paired_difference"] is None
    assert results["num_examples"] == 2 and scripted_judge.requests == 1 + 4


def test_non_finite_model_is_refused_in_one_line(
    tiny_setup: TinySetup, tldr_like: Path, scripted_judge: ScriptedJudge, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from rloo.cli import main as rloo_main
    from tests.fixtures.weights import corrupt_copy

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    bad = corrupt_copy(tiny_setup.policy, tmp_path / "bad_model")  # parses, every weight 3.39e38
    args = argv(tiny_setup, tldr_like, scripted_judge.base_url, tmp_path / "o")
    args[args.index("--model_name_or_path") + 1] = str(bad)
    assert rloo_main(["eval", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"rloo eval: error: --model_name_or_path {bad}: tensor '"), err
    assert "magnitude 3.4e+38" in err
    assert not (tmp_path / "o").exists()  # nothing half-written, not even an empty output_dir


def test_corrupt_model_is_named_even_when_the_judge_is_down(
    tiny_setup: TinySetup, tldr_like: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The models' files are checked before the judge is contacted: a truncated weights file is reported as
    such, not as an unreachable judge."""
    from rloo.cli import main as rloo_main

    bad = tmp_path / "truncated"
    shutil.copytree(tiny_setup.policy, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    args = argv(tiny_setup, tldr_like, "http://127.0.0.1:9/v1", tmp_path / "o", "--judge_max_retries", "0")
    args[args.index("--baseline_model") + 1] = str(bad)
    assert rloo_main(["eval", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreachable" not in err, err
    assert f"--baseline_model {bad}: model.safetensors is not readable safetensors" in err
    assert not (tmp_path / "o").exists()


def test_failed_evaluation_leaves_no_output_dir(
    tiny_setup: TinySetup, tldr_like: Path, scripted_judge: ScriptedJudge, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A failure after the output directory was made (here: generation) removes it again when this run
    created it; one the user made is left, without our files."""
    import rloo.eval.runner as runner

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)

    class Broken:
        name = "broken"

        def generate(self, path: str, prompts: list, rows: object = None) -> list[str]:
            raise UserError("generation failed")

    for pre_existing in (False, True):
        out = tmp_path / f"o{pre_existing}"
        if pre_existing:
            out.mkdir()
        cfg = runner.EvalConfig(
            model_name_or_path=str(tiny_setup.policy), dataset_name=str(tldr_like), dataset_split="test",
            judge_base_url=scripted_judge.base_url, judge_model=MODEL, output_dir=str(out), report_to="none",
        )  # fmt: skip
        with pytest.raises(UserError, match="generation failed"):
            runner.run_eval(cfg, engine=Broken())
        assert out.exists() is pre_existing and (not pre_existing or not any(out.iterdir()))


def test_eval_run_records_its_dataset(
    tiny_setup: TinySetup, tldr_like: Path, scripted_judge: ScriptedJudge, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, mlflow_server: MlflowServer,
) -> None:  # fmt: skip
    """The eval run's Dataset column: the split it was judged on, context 'evaluation' (real MLflow server)."""
    import uuid

    from mlflow.tracking import MlflowClient

    from rloo.data import dataset_record

    experiment = f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    for name in ("KFP_RUN_ID", "KFP_RUN_NAME", "RLOO_REPORT_TO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    out = tmp_path / "out"
    args = argv(tiny_setup, tldr_like, scripted_judge.base_url, out, "--num_examples", "1")
    assert main([*args, "--report_to", "mlflow"]) == 0
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (dataset_input,) = run.inputs.dataset_inputs
    dataset, record = dataset_input.dataset, dataset_record(str(tldr_like), "test")
    assert record.digest is not None and record.num_rows == 3
    assert (dataset.name, dataset.source_type) == ("tldr:test", "local")
    assert dataset.digest == record.digest.removeprefix("sha256:")[:12]
    assert json.loads(dataset.source) == {"uri": tldr_like.resolve().as_uri()}
    assert [(t.key, t.value) for t in dataset_input.tags] == [("mlflow.data.context", "evaluation")]
    # the rows the stage read (its unset dataset_config reaches the sink as the text "None")
    assert json.loads(dataset.profile)["num_rows"] == 3


class _Fixed:
    """A generation engine that answers every prompt with ``text`` (the judge's side is what is tested)."""

    name = "fixed"

    def __init__(self, text: str) -> None:
        self.text = text

    def generate(self, path: str, prompts: list, rows: object = None) -> list[str]:
        return [self.text] * len(prompts)


def _cfg(setup: TinySetup, dataset: Path, url: str, out: Path) -> EvalConfig:
    return EvalConfig(
        model_name_or_path=str(setup.policy), dataset_name=str(dataset), dataset_split="test",
        judge_base_url=url, judge_model=MODEL, output_dir=str(out), report_to="none", judge_backoff=0.01,
    )  # fmt: skip


def test_a_judge_context_too_short_fails_before_generation(
    tiny_setup: TinySetup, tldr_like: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preflight sends a request as large as the evaluation's largest: a judge whose context cannot hold
    it refuses now, in the server's own words, and nothing is generated."""
    from rloo.eval.config import DEFAULT_TEMPLATE
    from rloo.eval.runner import run_eval

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    with ScriptedJudge(context_chars=len(DEFAULT_TEMPLATE) + 40) as short, pytest.raises(UserError) as e:
        run_eval(_cfg(tiny_setup, tldr_like, short.base_url, tmp_path / "o"), engine=_Fixed("GOOD"))
    assert e.value.exit_code == 2 and "HTTP 400: This model's maximum context length is" in str(e.value)
    assert not (tmp_path / "o").exists()


def test_mostly_unusable_verdicts_fail_the_evaluation(
    tiny_setup: TinySetup, tmp_path: Path, scripted_judge: ScriptedJudge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fewer than half of a model's pairs with two usable verdicts: no win rate is measured, the evaluation
    fails in one line saying what the judge did, and writes nothing."""
    from rloo.eval.runner import run_eval

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    rows = [{"prompt": f"p{i}", "completion": " MALFORMED" if i < 2 else " ok"} for i in range(3)]
    data = write_jsonl(tmp_path / "d", rows)
    with pytest.raises(UserError) as e:
        run_eval(_cfg(tiny_setup, data, scripted_judge.base_url, tmp_path / "o"), engine=_Fixed("x"))
    message = str(e.value)
    assert message.startswith("only 1 of 3 trained pairs got two usable verdicts, fewer than half"), message
    assert "4 answer(s) were not a single A or B (e.g. 'I like both of them')" in message
    assert e.value.exit_code == 2 and not (tmp_path / "o").exists()
    # two of three usable is enough: the evaluation goes through
    rows[1]["completion"] = " fine"
    run_eval(
        _cfg(tiny_setup, write_jsonl(tmp_path / "d2", rows), scripted_judge.base_url, tmp_path / "o2"),
        engine=_Fixed("x"),
    )
    assert (tmp_path / "o2" / "eval_results.json").is_file()


# One value that breaks each rule EvalConfig declares on a field (choices or a bound)
EVAL_BAD_VALUES = {
    "engine": "tpu",
    "max_new_tokens": 0,
    "max_tool_calling_iterations": -1,
    "tools": ["calculator"],
    "environment": "envs",
    "tool_timeout": 0.0,
    "temperature": -0.5,
    "generation_batch_size": 0,
    "vllm_tensor_parallel_size": 0,
    "vllm_gpu_memory_utilization": 0.0,
    "judge_max_tokens": 0,
    "judge_concurrency": 0,
    "judge_max_retries": -1,
    "judge_request_budget": 0,
    "judge_timeout": 0.0,
    "judge_backoff": -1.0,
    "report_to": "wandb",
}


def test_each_declared_eval_rule_is_in_help_and_is_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Every single-field rule of ``rloo eval`` is declared on its field (``option(choices=, check=)``):
    ``--help`` states it (as argparse prints help, cpython Lib/argparse.py), and a value that breaks it is
    refused with the declaration's one line, as ``rloo train``'s are."""
    import dataclasses

    from rloo.cli import main as cli_main
    from rloo.options import rule_of

    ruled = {f.name: rule for f in dataclasses.fields(EvalConfig) if (rule := rule_of(f)) is not None}
    assert set(ruled) == set(EVAL_BAD_VALUES)
    assert cli_main(["eval", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    good = dict(
        model_name_or_path="m", dataset_name="d", judge_base_url="http://127.0.0.1:9/v1", judge_model="j"
    )
    for name, rule in ruled.items():
        assert f"must be {rule.text}" in help_text, name
        expected = rule.problem(f"--{name}", EVAL_BAD_VALUES[name])
        assert expected is not None, name
        with pytest.raises(UserError) as caught:
            EvalConfig(**good, **{name: EVAL_BAD_VALUES[name]})
        assert str(caught.value) == expected
