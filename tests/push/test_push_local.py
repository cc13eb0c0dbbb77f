"""The push stage against local directories (no servers): staging, idempotency, the CLI contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rloo.cli.push_cmd import main
from rloo.push import PushConfig, run_push
from rloo.push.results import StoredCopy
from rloo.storage import MANIFEST_NAME, read_manifest
from rloo.storage.transfer import read_published_file
from tests.fixtures.weights import corrupt_copy
from tests.push.conftest import write_eval


@pytest.fixture(autouse=True)
def _no_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_URI", "KFP_RUN_ID", "KFP_RUN_NAME", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def test_champion_is_published_versioned_and_copied_to_production(trained_dir: Path, tmp_path: Path) -> None:
    ev = write_eval(tmp_path / "eval_results.json", lo=0.04)
    cfg = PushConfig(
        model_path=str(trained_dir),
        eval_results=str(ev),
        output_dir=str(tmp_path / "out"),
        storage_uri=str(tmp_path / "store"),
        production_uri=str(tmp_path / "prod"),
    )
    result = run_push(cfg).to_dict()
    assert result["decision"] == "champion" and result["promoted"]
    key = result["run_key"]
    assert key.startswith("sha256-")  # no KFP run: the content decides the version
    version = tmp_path / "store" / key
    files = sorted(f.path for f in read_manifest(version).files)
    assert "model.safetensors" in files and "README.md" in files and "eval_results.json" in files
    assert "rloo_config.json" in files and "metrics.jsonl" in files
    assert not any(f.startswith(("checkpoint-", "samples")) for f in files)  # training leftovers stay behind
    production = read_manifest(tmp_path / "prod").by_path
    assert production.keys() - read_manifest(version).by_path.keys() == {"promotion.json"}
    ledger = json.loads(read_published_file(tmp_path / "prod", "promotion.json") or b"")
    assert ledger == {"run_key": key, "storage_uri": version.as_uri(), "previous": []}
    card = (version / "README.md").read_text()
    assert "base_model: EleutherAI/pythia-14m-sft" in card and "5 RLOO updates" in card
    on_disk = json.loads((tmp_path / "out" / "push_result.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert result["storage"] == {"uri": version.as_uri(), "uploaded": True}

    # The same run again: same version prefix, nothing uploaded, no second version. Typed fields this time.
    typed = run_push(cfg)
    assert typed.decision.promoted and typed.run_key == key and typed.mlflow is None and typed.hub is None
    assert typed.storage == StoredCopy(version.as_uri(), uploaded=False)
    assert typed.production is not None and typed.production.uploaded is False
    again = typed.to_dict()
    assert again["run_key"] == key and again["storage"]["uploaded"] is False
    assert again["production"]["uploaded"] is False
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [key]


def test_candidate_is_not_copied_to_production(trained_dir: Path, tmp_path: Path) -> None:
    ev = write_eval(tmp_path / "eval_results.json", lo=-0.02)
    result = run_push(
        PushConfig(
            model_path=str(trained_dir),
            eval_results=str(ev),
            output_dir=str(tmp_path / "out"),
            storage_uri=str(tmp_path / "store"),
            production_uri=str(tmp_path / "prod"),
            run_id="run/42",
        )
    ).to_dict()
    assert result["decision"] == "candidate" and "not above the margin" in result["reason"]
    assert result["run_key"] == "run-42" and result["production"] is None
    assert not (tmp_path / "prod").exists()
    assert (tmp_path / "store" / "run-42" / MANIFEST_NAME).is_file()


def test_kfp_run_id_names_the_version(
    trained_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KFP_RUN_ID", "kfp-abc")
    result = run_push(
        PushConfig(model_path=str(trained_dir), output_dir=str(tmp_path), storage_uri=str(tmp_path / "s"))
    ).to_dict()
    assert result["run_key"] == "kfp-abc" and (tmp_path / "s" / "kfp-abc" / MANIFEST_NAME).is_file()
    assert result["decision"] == "candidate"  # no evaluation: never promoted


def test_cli_success_prints_the_decision(
    trained_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ev = write_eval(tmp_path / "ev.json")
    rc = main(
        ["--model_path", str(trained_dir), "--eval_results", str(ev), "--output_dir", str(tmp_path / "o")]
    )
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decision"] == "champion"
    assert json.loads((tmp_path / "o" / "push_result.json").read_text())["decision"] == "champion"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--output_dir", "x"], "--model_path is required"),
        (["--model_path", "/nonexistent/dir"], "no such directory"),
        (
            ["--model_path", "{model}", "--eval_results", "/nonexistent.json"],
            "--eval_results /nonexistent.json: no such file",
        ),
        (
            ["--model_path", "{model}", "--eval_results", "{bad_eval}"],
            "missing required key 'paired_difference'",
        ),
        (["--model_path", "{model}", "--promotion_margin", "x"], "--promotion_margin expects a number"),
        (["--model_path", "{model}", "--hub_repo_id", "o/m", "--eval_results", "{eval}"], "set HF_TOKEN"),
        (["--model_path", "{model}", "--bogus", "1"], "unknown flag"),
        (["--model_path", "{incomplete}"], "training_complete.json is missing"),
        # a finished run's directory whose weights were overwritten with 0x7f bytes (header intact)
        (["--model_path", "{non_finite}"], "tensor 'model.safetensors:"),
    ],
)
def test_cli_errors_are_one_line_exit_2(
    args: list[str], message: str, trained_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                k: v
                for k, v in json.loads(write_eval(tmp_path / "e.json").read_text()).items()
                if k != "paired_difference"
            }
        )
    )
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    if "{non_finite}" in args:
        corrupt_copy(trained_dir, tmp_path / "non_finite")
    subs = {
        "{non_finite}": str(tmp_path / "non_finite"),
        "{model}": str(trained_dir),
        "{bad_eval}": str(bad),
        "{eval}": str(tmp_path / "e.json"),
        "{incomplete}": str(incomplete),
    }
    argv = [subs.get(a, a) for a in args] + (
        ["--output_dir", str(tmp_path / "o")] if "--output_dir" not in args else []
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rloo push: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()  # bad input leaves no output_dir behind


def test_cli_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model_path",
        "--eval_results",
        "--storage_uri",
        "--production_uri",
        "--registered_model_name",
    ):
        assert flag in out
    assert "--hub_repo_id" in out and "--promotion_margin" in out


def test_pipeline_push_records_the_pinned_base_model_revision(trained_dir: Path, tmp_path: Path) -> None:
    from rloo.stages import push
    from rloo.stages.validate import build_plan
    from tests.stages.test_validate import good

    ev = write_eval(tmp_path / "eval_results.json", lo=0.04)
    commit = "c" * 40  # what the fetch step resolved and put in the SFT model's metadata
    plan = build_plan(good(output_uri=str(tmp_path / "runs")), check_paths=False)
    sft = {"source": "org/sft", "revision": commit, "uri": "s3://b/run-1/sft"}
    push.run(plan, "run-1", trained_uri=str(trained_dir), eval_results_uri=str(ev), sft=sft)
    card = (tmp_path / "runs" / "published" / "run-1" / "README.md").read_text()
    assert f"base_model_revision: {commit}" in card and f"- base model revision: `{commit}`" in card


def test_card_names_the_training_dataset_with_its_digest(
    trained_dir: Path, toy_dataset: Path, tmp_path: Path
) -> None:
    """The card's lineage says which data trained the model: name, split and the content digest (the same
    digest the training run's MLflow dataset input starts with); a Hub dataset by its id and split."""
    import shutil

    from rloo.data import dataset_record

    model = tmp_path / "model"
    shutil.copytree(trained_dir, model)
    config = json.loads((model / "rloo_config.json").read_text())
    cards = {}
    for name, dataset in (("local", str(toy_dataset)), ("hub", config["dataset_name"])):
        config.update(dataset_name=dataset, dataset_train_split="descriptiveness")
        (model / "rloo_config.json").write_text(json.dumps(config))
        cfg = PushConfig(
            model_path=str(model),
            output_dir=str(tmp_path / name),
            storage_uri=str(tmp_path / f"{name}-store"),
        )
        result = run_push(cfg)
        cards[name] = (tmp_path / f"{name}-store" / result.run_key / "README.md").read_text()
    digest = dataset_record(str(toy_dataset), "descriptiveness").digest
    assert digest is not None and digest.startswith("sha256:")
    line = f"- training dataset: `{toy_dataset} (split descriptiveness, digest {digest})`"
    assert line in cards["local"].splitlines()
    hub = "- training dataset: `trl-internal-testing/descriptiveness-sentiment-trl-style (split descriptiveness)`"
    assert hub in cards["hub"].splitlines()


def _push(trained_dir: Path, tmp_path: Path, run: str, ev: Path, **kw: object) -> dict:
    return run_push(
        PushConfig(
            model_path=str(trained_dir),
            eval_results=str(ev),
            output_dir=str(tmp_path / f"out-{run}"),
            storage_uri=str(tmp_path / "store"),
            production_uri=str(tmp_path / "prod"),
            run_id=run,
            **kw,  # type: ignore[arg-type]
        )
    ).to_dict()


def _production_run(tmp_path: Path) -> str | None:
    raw = read_published_file(tmp_path / "prod", "promotion.json")
    return None if raw is None else json.loads(raw)["run_key"]


def test_challenger_must_beat_the_champion_without_mlflow(trained_dir: Path, tmp_path: Path) -> None:
    """Without a registry the champion is the run production_uri's ledger names: a challenger that beats SFT
    but not the champion stays candidate; one that beats both takes production; the ledger keeps the chain."""
    a = write_eval(tmp_path / "a.json", lo=0.04, scores=[0.5] * 30)
    worse = write_eval(tmp_path / "b.json", lo=0.04, scores=[0.5] * 25 + [0.0] * 5)
    better = write_eval(tmp_path / "c.json", lo=0.04, scores=[1.0] * 30)

    first = _push(trained_dir, tmp_path, "a", a)
    assert first["decision"] == "champion" and _production_run(tmp_path) == "a"
    lost = _push(trained_dir, tmp_path, "b", worse)
    assert lost["decision"] == "candidate" and lost["production"] is None
    assert "against the champion (run a at " in lost["reason"] and "the champion stays" in lost["reason"]
    assert _production_run(tmp_path) == "a"
    won = _push(trained_dir, tmp_path, "c", better)
    assert won["decision"] == "champion" and "both lower bounds above the margin" in won["reason"]
    assert won["against_champion"]["estimate"] == 0.5 and won["against_champion"]["champion"].startswith(
        "run a"
    )
    assert first["against_champion"] is None  # the first champion is compared with SFT only
    ledger = json.loads(read_published_file(tmp_path / "prod", "promotion.json") or b"")
    assert ledger["run_key"] == "c" and [p["run_key"] for p in ledger["previous"]] == ["a"]

    # Opting out: the SFT comparison alone decides.
    alone = _push(trained_dir, tmp_path, "b", worse, compare_to_champion=False)
    assert alone["decision"] == "champion" and _production_run(tmp_path) == "b"


def test_challenger_on_other_examples_is_not_promoted(trained_dir: Path, tmp_path: Path) -> None:
    a = write_eval(tmp_path / "a.json", lo=0.04, scores=[0.5] * 30)
    other = write_eval(tmp_path / "b.json", lo=0.04, scores=[1.0] * 40)
    old_style = write_eval(tmp_path / "c.json", lo=0.04)  # no per-example scores
    assert _push(trained_dir, tmp_path, "a", a)["decision"] == "champion"
    b = _push(trained_dir, tmp_path, "b", other)
    assert b["decision"] == "candidate" and "evaluated on other examples" in b["reason"]
    assert "--compare_to_champion false" in b["reason"]
    c = _push(trained_dir, tmp_path, "c", old_style)
    assert c["decision"] == "candidate" and "no per-example scores" in c["reason"]
    assert _production_run(tmp_path) == "a"


def test_demotion_without_mlflow_restores_or_withdraws_production(trained_dir: Path, tmp_path: Path) -> None:
    """A re-run that decides candidate for the model production holds puts the previous champion back (from
    its versioned copy) or, with none, withdraws the production copy: push_result.json says which."""
    a = write_eval(tmp_path / "a.json", lo=0.04, scores=[0.5] * 30)
    c = write_eval(tmp_path / "c.json", lo=0.04, scores=[1.0] * 30)
    _push(trained_dir, tmp_path, "a", a)
    _push(trained_dir, tmp_path, "c", c)
    assert _production_run(tmp_path) == "c"

    demoted = _push(trained_dir, tmp_path, "c", c, promotion_margin=0.1)
    assert demoted["decision"] == "candidate"
    assert demoted["production"]["restored_from"] == (tmp_path / "store" / "a").as_uri()
    assert _production_run(tmp_path) == "a"

    last = _push(trained_dir, tmp_path, "a", a, promotion_margin=0.1)
    assert last["decision"] == "candidate" and last["production"]["withdrawn"] is True
    assert not (tmp_path / "prod" / MANIFEST_NAME).exists() and _production_run(tmp_path) is None


def test_failed_push_leaves_no_staged_files(trained_dir: Path, tmp_path: Path) -> None:
    """A push that fails while publishing leaves no publish/ (or other work) directory behind, and no output
    directory at all when it created it."""
    ev = write_eval(tmp_path / "ev.json", lo=0.04)
    (tmp_path / "store").write_text("a file where the storage directory should be")
    out = tmp_path / "out"
    cfg = PushConfig(
        model_path=str(trained_dir),
        eval_results=str(ev),
        output_dir=str(out),
        storage_uri=str(tmp_path / "store"),
    )
    with pytest.raises(Exception):  # noqa: B017 - whatever the storage error, what is left is the point
        run_push(cfg)
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("the user's")
    with pytest.raises(Exception):  # noqa: B017
        run_push(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_a_damaged_champion_copy_is_not_read_as_if_whole(trained_dir: Path, tmp_path: Path) -> None:
    """The champion's eval_results.json in production_uri is checked against the copy's manifest: a modified
    one leaves the challenger candidate, and the reason says to publish the champion again, not to
    re-evaluate."""
    _push(trained_dir, tmp_path, "a", write_eval(tmp_path / "a.json", lo=0.04, scores=[0.5] * 30))
    (copy,) = (tmp_path / "prod" / "versions").iterdir()
    (copy / "eval_results.json").write_text((copy / "eval_results.json").read_text().replace("0.5", "0.4"))
    b = _push(trained_dir, tmp_path, "b", write_eval(tmp_path / "b.json", lo=0.04, scores=[1.0] * 30))
    assert b["decision"] == "candidate" and "does not match its manifest" in b["reason"]
    assert "publish the champion's copy again" in b["reason"] and ".;" not in b["reason"]


def test_trained_model_check_follows_the_one_local_model_rule(
    trained_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rloo.models.local_model_dir decides what is a model directory (a LoRA output, adapter only, is one);
    push adds what only a finished training run has."""
    import shutil

    from rloo.errors import UserError
    from rloo.push.trained import check_trained_model

    adapter = tmp_path / "adapter"
    shutil.copytree(trained_dir, adapter)
    (adapter / "config.json").unlink()
    with pytest.raises(UserError, match=r"not a model directory \(no config\.json or adapter_config\.json\)"):
        check_trained_model(str(adapter))
    (adapter / "adapter_config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert check_trained_model("adapter") == adapter  # resolved: the card names the model by its directory
