"""The judge/reward-model agreement (``--reward_model_path``): the tiny local policy evaluated by the real
``rloo eval`` path, judged by the toy judge (:mod:`rloo.demo.judge`), both sides of every pair scored by the
tiny random-init reward model; the agreement checked against a computation of its own from judgements.jsonl."""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from rloo.cli.eval_cmd import main
from rloo.demo.judge import MODEL, ToyJudge
from rloo.demo.tiny import TinySetup
from rloo.demo.toy import write_toy_eval_dataset
from rloo.errors import UserError
from rloo.eval.config import EvalConfig
from rloo.eval.report import flat_metrics
from rloo.eval.reward_model import scoring_text
from rloo.eval.runner import run_eval
from rloo.eval.stats import rm_agreement, rm_agreement_record, summarize_reward_model
from rloo.pipeline.reports import eval_markdown
from tests.fixtures.servers import S3Server, use_s3

NUM_EXAMPLES = 12
NEW_KEYS = {"judge_rm_agreement"}  # top level of eval_results.json
NEW_SUMMARY_KEYS = {
    "judge_rm_agreement",
    "judge_rm_agreement_ci_low",
    "judge_rm_agreement_ci_high",
    "judge_rm_agreement_n",
    "rm_win_rate",
    "rm_score_mean",
}


@pytest.fixture(scope="module")
def toy_eval(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_eval_dataset(tmp_path_factory.mktemp("toy_eval"), num_test=NUM_EXAMPLES, seed=3)


@pytest.fixture(scope="module")
def judge() -> Any:
    with ToyJudge() as server:
        yield server


def argv(setup: TinySetup, dataset: Path, url: str, out: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(setup.policy), "--baseline_model", str(setup.policy),
        "--dataset_name", str(dataset), "--judge_base_url", url, "--judge_model", MODEL,
        "--output_dir", str(out), "--engine", "transformers", "--max_new_tokens", "8",
        "--temperature", "1.0", "--generation_batch_size", "5", "--report_to", "none", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_setup: TinySetup, toy_eval: Path, judge: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same evaluation twice, with and without the reward model: {"with": dir, "without": dir}."""
    root = tmp_path_factory.mktemp("runs")
    out = {"with": root / "with", "without": root / "without"}
    # sampled (temperature 1, seeded): varied outputs, so that the judge decides pairs both ways
    rm = ["--reward_model_path", str(tiny_setup.reward_model)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv(tiny_setup, toy_eval, judge.base_url, out["with"], *rm)) == 0
    assert main(argv(tiny_setup, toy_eval, judge.base_url, out["without"])) == 0
    return {**out, "printed": printed.getvalue()}


def test_the_console_says_the_agreement(runs: dict) -> None:
    results, _ = read(runs["with"])
    a = results["judge_rm_agreement"]
    line = next(x for x in runs["printed"].splitlines() if x.startswith("judge/reward-model agreement"))
    assert line.startswith(
        f"judge/reward-model agreement {100 * a['estimate']:.1f}% [{100 * a['low']:.1f}, {100 * a['high']:.1f}] "
        f"over {a['n']} decided pairs"
    ), line


def read(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    results = json.loads((out / "eval_results.json").read_text())
    lines = [json.loads(x) for x in (out / "judgements.jsonl").read_text().splitlines()]
    return results, lines


def _wilson(k: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def test_agreement_is_what_the_judgements_and_the_scores_say(runs: dict, tiny_setup: TinySetup) -> None:
    results, lines = read(runs["with"])
    assert len(lines) == NUM_EXAMPLES
    # computed here from the raw verdicts of both orders and the recorded scores, per pair
    agree: dict[str, list[float]] = {"trained": [], "baseline": []}
    skipped = 0
    for ex in lines:
        rm = ex["rm_scores"]
        assert set(rm) == {"reference", "trained", "baseline"} and all(math.isfinite(v) for v in rm.values())
        for label in ("trained", "baseline"):
            first, second = (j["verdict"] for j in ex["judgements"][label])
            if first is None or first != second:  # invalid, or the two orders disagree: not decided
                skipped += 1
                continue
            rm_pick = "model" if rm[label] > rm["reference"] else "reference"
            agree[label].append(0.5 if rm[label] == rm["reference"] else float(rm_pick == first))
    pooled = agree["trained"] + agree["baseline"]
    assert pooled and 0 < skipped + len(pooled) == 2 * NUM_EXAMPLES
    a = results["judge_rm_agreement"]
    assert a["estimate"] == pytest.approx(sum(pooled) / len(pooled))
    assert (a["n"], a["num_skipped"]) == (len(pooled), skipped)
    assert [a["low"], a["high"]] == pytest.approx(_wilson(sum(pooled), len(pooled)))
    assert a["ci95"] == [a["low"], a["high"]] and a["reward_model"] == str(tiny_setup.reward_model)
    refs = [ex["rm_scores"]["reference"] for ex in lines]
    assert a["reference_rm_score_mean"] == pytest.approx(sum(refs) / len(refs))
    for label in ("trained", "baseline"):
        s = results["models"][label]
        assert s["judge_rm_agreement_n"] == len(agree[label])
        assert s["judge_rm_agreement"] == pytest.approx(sum(agree[label]) / len(agree[label]))
        assert s["judge_rm_agreement_ci_low"] <= s["judge_rm_agreement"] <= s["judge_rm_agreement_ci_high"]
        outs = [ex["rm_scores"][label] for ex in lines]
        assert s["rm_score_mean"] == pytest.approx(sum(outs) / len(outs))
        wins = [1.0 if o > r else 0.5 if o == r else 0.0 for o, r in zip(outs, refs, strict=True)]
        assert s["rm_win_rate"] == pytest.approx(sum(wins) / len(wins))
    # MLflow and KFP get them as the win rates are logged (flat_metrics; kfp_metrics.json with '_')
    metrics = flat_metrics(results)
    assert metrics["judge_rm_agreement/estimate"] == pytest.approx(a["estimate"])
    assert metrics["judge_rm_agreement/n"] == len(pooled)
    assert metrics["trained/judge_rm_agreement"] == pytest.approx(
        results["models"]["trained"]["judge_rm_agreement"]
    )
    assert "baseline/rm_score_mean" in metrics
    kfp = json.loads((runs["with"] / "kfp_metrics.json").read_text())
    assert kfp["judge_rm_agreement_estimate"] == pytest.approx(a["estimate"])
    # the reports say it, and what a low value means
    html = (runs["with"] / "eval_report.html").read_text()
    assert "Judge/reward-model agreement" in html and "reward-hacking signal" in html
    summary = eval_markdown(kfp, "s3://b/run/eval", "link")
    assert "Judge/reward-model agreement" in summary and "reward-hacking signal" in summary


def test_the_scores_are_the_reward_models(runs: dict, tiny_setup: TinySetup) -> None:
    """The recorded scores are the reward model's, read from prompt + completion with its own tokenizer:
    recomputed here with a plain transformers forward, one unpadded text at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, lines = read(runs["with"])
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_setup.reward_model)).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_setup.reward_model))
    for ex in lines[:3]:
        for side, text in (("reference", ex["reference"]), ("trained", ex["outputs"]["trained"])):
            ids = tok(scoring_text(ex["prompt"], text), add_special_tokens=False, return_tensors="pt")
            with torch.no_grad():
                want = float(model(**ids).logits[0, 0])
            assert ex["rm_scores"][side] == pytest.approx(want, abs=1e-4)


def test_without_the_option_nothing_changes(runs: dict) -> None:
    with_rm, with_lines = read(runs["with"])
    without, lines = read(runs["without"])
    assert not NEW_KEYS & set(without) and all("rm_scores" not in ex for ex in lines)
    for label, s in without["models"].items():
        assert not NEW_SUMMARY_KEYS & set(s)
        assert set(with_rm["models"][label]) - set(s) == NEW_SUMMARY_KEYS
    assert not [k for k in flat_metrics(without) if "rm_" in k]
    assert "reward-model" not in (runs["without"] / "eval_report.html").read_text()
    assert without["settings"]["reward_model_path"] is None
    # the same evaluation otherwise: the judge saw the same pairs and said the same
    strip = {k: v for k, v in with_rm.items() if k not in NEW_KEYS | {"settings"}}
    strip["models"] = {
        label: {k: v for k, v in s.items() if k not in NEW_SUMMARY_KEYS}
        for label, s in with_rm["models"].items()
    }
    assert strip == {k: v for k, v in without.items() if k != "settings"}
    assert [{k: v for k, v in ex.items() if k != "rm_scores"} for ex in with_lines] == lines


class NoGeneration:
    name = "spy"

    def generate(self, model_path: str, prompts: list[Any], rows: Any = None) -> list[str]:
        raise AssertionError("generated before the reward model was checked")


def test_a_missing_reward_model_fails_in_one_line_before_generation(
    tiny_setup: TinySetup, toy_eval: Path, judge: Any, tmp_path: Path
) -> None:
    cfg = EvalConfig(
        model_name_or_path=str(tiny_setup.policy),
        dataset_name=str(toy_eval),
        judge_base_url=judge.base_url,
        judge_model=MODEL,
        output_dir=str(tmp_path / "out"),
        report_to="none",
        reward_model_path=str(tmp_path / "no_such_rm"),
    )
    asked = judge.requests
    with pytest.raises(UserError, match=r"^--reward_model_path .*no_such_rm: no such directory") as err:
        run_eval(cfg, engine=NoGeneration())
    assert "\n" not in str(err.value) and judge.requests == asked  # not even the judge's preflight
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=r"^--reward_model_path 'gs://b/rm': only s3:// URIs and local paths"):
        EvalConfig(**{**cfg.to_dict(), "reward_model_path": "gs://b/rm"})


def test_an_s3_reward_model_scores_as_the_local_one(
    runs: dict,
    tiny_setup: TinySetup,
    toy_eval: Path,
    judge: Any,
    s3_server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """An air-gapped cluster's reward model lives in object storage, copied there with any tool: the evaluation
    fetches it into the machine's scratch before it loads it (the top-level files that transformers'
    from_pretrained reads, huggingface/transformers src/transformers/modeling_utils.py) and scores every pair
    exactly as the local directory does."""
    server = use_s3(s3_server, monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    uri = server.copy_up(tiny_setup.reward_model, f"rm-{uuid.uuid4().hex[:8]}")
    out = tmp_path / "out"
    assert main(argv(tiny_setup, toy_eval, judge.base_url, out, "--reward_model_path", uri)) == 0
    results, lines = read(out)
    want_results, want_lines = read(runs["with"])
    assert [ex["rm_scores"] for ex in lines] == [ex["rm_scores"] for ex in want_lines]
    got, want = results["judge_rm_agreement"], want_results["judge_rm_agreement"]
    assert got.pop("reward_model") == uri  # the store's name, not the scratch copy's
    assert want.pop("reward_model") == str(tiny_setup.reward_model) and got == want
    assert results["settings"]["reward_model_path"] == uri
    (copy,) = [p for p in (tmp_path / "scratch" / "rloo-models").iterdir() if p.is_dir()]
    assert {p.name for p in copy.iterdir()} >= {"config.json", "model.safetensors"}


def test_an_s3_reward_model_that_is_none_fails_before_generation(
    tiny_setup: TinySetup,
    toy_eval: Path,
    judge: Any,
    s3_server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A prefix without config.json at its top (weights copied without their config): one line, exit 2,
    before the judge or the generation is asked anything."""
    server = use_s3(s3_server, monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    prefix = f"rm-{uuid.uuid4().hex[:8]}"
    server.client().put_object(Bucket=server.bucket, Key=f"{prefix}/model.safetensors", Body=b"w")
    uri = f"s3://{server.bucket}/{prefix}"
    cfg = EvalConfig(
        model_name_or_path=str(tiny_setup.policy),
        dataset_name=str(toy_eval),
        judge_base_url=judge.base_url,
        judge_model=MODEL,
        output_dir=str(tmp_path / "out"),
        report_to="none",
        reward_model_path=uri,
    )
    asked = judge.requests
    with pytest.raises(
        UserError, match=rf"^--reward_model_path {uri}: no config\.json or adapter_config\.json at the top"
    ) as err:
        run_eval(cfg, engine=NoGeneration())
    assert err.value.exit_code == 2 and judge.requests == asked


def test_agreement_counts_decided_pairs_only() -> None:
    # judge pick: 1.0 the model's output, 0.0 the reference; 0.5 a tie and None an invalid pair are skipped
    assert rm_agreement(1.0, 2.0, 1.0) == 1.0 and rm_agreement(0.0, 2.0, 1.0) == 0.0
    assert rm_agreement(0.0, 0.5, 1.0) == 1.0 and rm_agreement(1.0, 0.5, 1.0) == 0.0
    assert rm_agreement(1.0, 1.0, 1.0) == 0.5  # equal scores: no side higher, half
    assert rm_agreement(0.5, 2.0, 1.0) is None and rm_agreement(None, 2.0, 1.0) is None
    s = summarize_reward_model([1.0, 0.0, 0.5, None], [2.0, 2.0, 0.0, 3.0], [1.0, 1.0, 1.0, 1.0])
    assert (s["judge_rm_agreement"], s["judge_rm_agreement_n"]) == (0.5, 2)
    assert s["rm_win_rate"] == 0.75 and s["rm_score_mean"] == 1.75
    none = summarize_reward_model([0.5, None], [1.0, 2.0], [0.0, 0.0])
    assert none["judge_rm_agreement"] is None and none["judge_rm_agreement_n"] == 0
    record = rm_agreement_record(
        {"trained": ([1.0, 0.5], [2.0, 0.0]), "baseline": ([1.0, 0.0], [0.0, 0.0])}, [1.0, 1.0]
    )
    # trained: agree, skip; baseline: disagree (the reference scored higher, the judge picked the model), agree
    assert (record["estimate"], record["n"], record["num_skipped"]) == (pytest.approx(2 / 3), 3, 1)
    assert record["reference_rm_score_mean"] == 1.0


def test_ties_and_invalid_pairs_are_left_out(
    tiny_setup: TinySetup, scripted_judge: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scripted judge: row 0 a decided pair (the reference, marked GOOD, wins), row 1 a tie (the two
    orders disagree), row 2 an invalid answer (MALFORMED): only row 0 of each model counts."""
    from tests.eval.scripted_server import API_KEY
    from tests.eval.scripted_server import MODEL as SCRIPTED

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    rows = [
        {"prompt": "POST: my cat ate my homework. TL;DR:", "completion": " GOOD cat ate homework"},
        {"prompt": "POST: rain all week. TL;DR:", "completion": " rain"},
        {"prompt": "POST: new job, nervous. TL;DR:", "completion": " MALFORMED"},
    ]
    (tmp_path / "data" / "data").mkdir(parents=True)
    (tmp_path / "data" / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = argv(tiny_setup, tmp_path / "data", scripted_judge.base_url, out)
    args[args.index(MODEL)] = SCRIPTED
    assert main([*args, "--judge_backoff", "0.01", "--reward_model_path", str(tiny_setup.reward_model)]) == 0
    results, lines = read(out)
    a = results["judge_rm_agreement"]
    assert (a["n"], a["num_skipped"]) == (2, 4)
    rm = lines[0]["rm_scores"]
    want = 0.5 if rm["trained"] == rm["reference"] else float(rm["trained"] < rm["reference"])
    assert a["estimate"] == want  # the same pair twice (one checkpoint as both models)
    assert results["models"]["trained"]["judge_rm_agreement_n"] == 1
