"""Pure pieces of the steps: launch commands, training flags, manifest digest, parameter validation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rloo.errors import UserError
from rloo.pipeline.node import launch_command
from rloo.pipeline.steps import check_pipeline_params, fetch_model, manifest_digest, train_args
from tests.fixtures.servers import S3Server, use_s3


def test_launch_commands() -> None:
    kw = dict(model_dir="/w/sft", output_dir="/w/out", checkpoint_uri="s3://b/ck")
    one = launch_command(["--rloo_k", "4"], nproc=4, num_nodes=1, model_source="s3://b/sft", **kw)
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    assert one[:8] == [*launcher, "--num_machines", "1", "--num_processes", "4", "--multi_gpu"]
    assert one[one.index("--checkpoint_uri") + 1] == "s3://b/ck" and one[-2:] == ["--rloo_k", "4"]
    assert one[one.index("--model_source") + 1] == "s3://b/sft" and "--publish_uri" not in one
    assert "--multi_gpu" not in launch_command([], nproc=1, num_nodes=1, **kw)
    multi = launch_command([], nproc=8, num_nodes=2, **kw)
    assert multi[:7] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=8",
        "-m",
        "rloo.cli",
        "train",
    ]
    assert "--standalone" not in multi  # the rendezvous comes from the operator's PET_* variables


def test_the_validated_config_is_what_rloo_train_reads(tmp_path: Path) -> None:
    """validate emits the training config once (canonical names, typed, aliases resolved, defaults left out);
    the train step writes it as it is and 'rloo train --config' reads it: the same config as the flags give."""
    from rloo.config import RLOOConfig
    from rloo.parsing import parse_config

    params = good(
        rloo_k=4,
        learning_rate=1e-5,
        kl_coef=0.1,  # the same value under its alias in extra_train_args is accepted, once
        extra_train_args="--bf16 --beta 0.1 --reward_funcs rloo.demo.toy:letter_reward --reward_weights 1 -0.5",
    )
    with pytest.raises(UserError, match=r"kl_coef 0.05 and --beta 0.1 both set kl_coef, to different values"):
        check_pipeline_params({**params, "kl_coef": 0.05})
    config = check_pipeline_params(params)
    assert config["kl_coef"] == 0.1 and "beta" not in config  # the alias resolved, once
    assert (config["rloo_k"], config["bf16"], config["reward_weights"]) == (4, True, [1.0, -0.5])
    assert isinstance(config["learning_rate"], float) and isinstance(config["rloo_k"], int)
    assert "num_ppo_epochs" not in config  # a default stays the image's own
    # what the node does with it (rloo.pipeline.node): JSON to a file, then --config
    path = tmp_path / "train_config.yaml"
    path.write_text(json.dumps(json.loads(json.dumps(config, sort_keys=True)), indent=2))
    pod = ["--model_name_or_path", "m", "--output_dir", "o"]
    from_file = parse_config(RLOOConfig, [*pod, "--config", str(path)], prog="t")
    from_flags = parse_config(RLOOConfig, [*pod, *train_args(params)], prog="t")
    assert from_file == from_flags
    assert (from_file.kl_coef, from_file.learning_rate, from_file.reward_weights) == (0.1, 1e-5, [1.0, -0.5])


@pytest.mark.parametrize("flag", ["--output_dir x", "--model_name_or_path m", "--checkpoint_uri s3://bk/c"])
def test_pod_locations_are_not_the_users_to_give(flag: str) -> None:
    with pytest.raises(UserError, match=f"^{flag.split()[0]} is set by the pipeline itself"):
        check_pipeline_params(good(extra_train_args=flag))


GIVEN = dict(
    model="org/sft",
    dataset_name="org/data",
    reward_model_path="org/rm",
    eval_dataset_name="org/eval",
    judge_base_url="http://judge:8000/v1",
    judge_model="j",
    output_uri="/tmp/rloo-validate-out",  # s3:// ones are asked for access: tests/pipeline/test_storage_access.py
)


def good(**change: object) -> dict[str, object]:
    """Every pipeline parameter (the defaults filled in), with ``change``."""
    from rloo.pipeline.params import with_defaults

    return with_defaults({**GIVEN, **change})


def test_good_parameters_pass() -> None:
    check_pipeline_params(good())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "/no/such/model"}, "no such directory"),
        ({"rloo_k": 1}, "rloo_k"),
        ({"gpu_count": -1}, "gpu_count must be >= 0"),
        ({"judge_base_url": ""}, "judge_base_url is required"),
        ({"judge_model": ""}, "judge_model is required"),
        ({"reward_model_path": ""}, "no reward source"),
        ({"num_nodes": 0}, "num_nodes must be >= 1"),
        ({"num_nodes": 2, "output_uri": "/local"}, "s3:// output_uri"),
        ({"extra_train_args": "--nope 1"}, "unknown flag"),
        ({"promotion_margin": 2.0}, "promotion_margin"),
    ],
)
def test_bad_parameters_fail_in_one_line(change: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message) as err:
        check_pipeline_params(good(**change))
    assert "\n" not in str(err.value)


def test_fetch_local_model_publishes_verified_copy(tmp_path: Path) -> None:
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"w" * 100)
    meta = fetch_model(str(src), str(tmp_path / "store" / "sft"))
    assert (tmp_path / "store" / "sft" / "config.json").is_file()
    assert meta["num_files"] == 2 and meta["total_bytes"] == 102
    # the digest ignores the manifest timestamp: publishing the same files again gives the same digest
    again = fetch_model(str(src), str(tmp_path / "store2" / "sft"))
    assert again["manifest_digest"] == meta["manifest_digest"]
    assert meta["manifest_digest"].startswith("sha256:")
    (src / "model.safetensors").write_bytes(b"x" * 100)
    changed = fetch_model(str(src), str(tmp_path / "store3" / "sft"))
    assert changed["manifest_digest"] != meta["manifest_digest"]


def test_fetch_rejects_non_model_dir(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"config\.json"):
        fetch_model(str(tmp_path), str(tmp_path / "out"))


def test_manifest_digest_is_order_independent() -> None:
    from rloo.storage import FileEntry, Manifest

    a = Manifest(files=(FileEntry("a", 1, "x"), FileEntry("b", 2, "y")), created_at="t1")
    b = Manifest(files=(FileEntry("b", 2, "y"), FileEntry("a", 1, "x")), created_at="t2")
    assert manifest_digest(a) == manifest_digest(b)


def _job(*conds: tuple[str, str, str, str]) -> dict[str, object]:
    return {
        "status": {
            "conditions": [
                {"type": t, "status": st, "lastTransitionTime": ts, "reason": "R" + t, "message": msg}
                for t, st, ts, msg in conds
            ]
        }
    }


def test_job_outcome_follows_the_newest_terminal_condition() -> None:
    from rloo.pipeline.jobs import job_outcome, on_existing_job

    assert job_outcome({}) == ("running", "")
    created = ("Created", "True", "2026-01-01T00:00:00Z", "")
    running = ("Running", "True", "2026-01-01T00:01:00Z", "")
    assert job_outcome(_job(created, running)) == ("running", "")
    failed = ("Failed", "True", "2026-01-01T00:05:00Z", "master exited\n with code 137")
    assert job_outcome(_job(created, running, failed)) == ("failed", "RFailed: master exited with code 137")
    # listed out of order, a later success (after a restart) wins over an earlier failure
    succeeded = ("Succeeded", "True", "2026-01-01T00:09:00Z", "done")
    assert job_outcome(_job(succeeded, created, failed))[0] == "succeeded"
    # a condition that is no longer true does not count
    assert job_outcome(_job(("Failed", "False", "2026-01-01T00:05:00Z", "x"), running))[0] == "running"
    assert on_existing_job(_job(created, running, failed)) == "replace"
    assert on_existing_job(_job(created, running)) == "wait"
    assert on_existing_job(_job(created, succeeded)) == "wait"


class FakeHub:
    """Stands in for HfApi.model_info (the Hub cannot be reached from tests)."""

    def __init__(self, error: Exception | None) -> None:
        self.error, self.asked = error, []

    def model_info(self, repo_id: str, revision: str | None = None) -> object:
        self.asked.append(repo_id)
        if self.error:
            raise self.error
        return object()


class PinnedHub:
    """Stands in for HfApi's model_info and snapshot_download: a repo whose branches move between calls."""

    def __init__(self, refs: dict[str, str]) -> None:
        self.refs, self.downloads = refs, []  # branch/tag -> commit

    def model_info(self, repo_id: str, revision: str | None = None) -> object:
        from types import SimpleNamespace

        ref = revision or "main"
        if ref not in self.refs and ref not in self.refs.values():
            raise _hub_error("RevisionNotFoundError")
        return SimpleNamespace(id=repo_id, sha=self.refs.get(ref, ref))

    def snapshot_download(self, repo_id: str, *, revision: str | None = None, local_dir: Path) -> str:
        self.downloads.append((repo_id, revision))
        local_dir.mkdir(parents=True)
        (local_dir / "config.json").write_text(json.dumps({"commit": revision}))
        return str(local_dir)


def test_fetch_pins_a_hub_model_to_its_resolved_commit(tmp_path: Path) -> None:
    main, tag = "a" * 40, "b" * 40
    hub = PinnedHub({"main": main, "v1": tag})
    meta = fetch_model("org/sft", str(tmp_path / "s1"), hub_api=hub)
    # main is resolved once and exactly that commit is downloaded and recorded: if main moves during the
    # download, the record still says what was fetched
    assert hub.downloads == [("org/sft", main)] and meta["revision"] == main
    assert json.loads((tmp_path / "s1" / "config.json").read_text()) == {"commit": main}
    meta = fetch_model("org/sft", str(tmp_path / "s2"), revision="v1", hub_api=hub)
    assert hub.downloads[-1] == ("org/sft", tag) and meta["revision"] == tag
    with pytest.raises(UserError, match="no revision 'nope'"):
        fetch_model("org/sft", str(tmp_path / "s3"), revision="nope", hub_api=hub)
    assert not (tmp_path / "s3").exists()
    # non-Hub sources have no revision to record, and refuse one
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    assert fetch_model(str(src), str(tmp_path / "s4"))["revision"] is None
    with pytest.raises(UserError, match="only applies to a Hugging Face Hub id"):
        fetch_model(str(src), str(tmp_path / "s5"), revision="v1")
    from rloo.pipeline.reports import fetch_markdown

    assert tag in fetch_markdown({"source": "org/sft", "revision": tag})


def test_model_revision_parameter_is_checked(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="model_revision 'v1' only applies to a Hugging Face Hub id"):
        check_pipeline_params(good(model=str(tmp_path), model_revision="v1"))
    check_pipeline_params(good(model_revision="v1"))
    from rloo.pipeline.steps import check_model_source

    with pytest.raises(UserError, match="no revision 'nope'"):
        check_model_source("org/sft", hub=True, hub_api=PinnedHub({"main": "a" * 40}), revision="nope")


def _hub_error(kind: str) -> Exception:
    import httpx2 as httpx  # the HTTP client huggingface_hub builds its errors on
    from huggingface_hub import errors

    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
    return getattr(errors, kind)("nope", response=response)


def test_model_source_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rloo.pipeline.steps import check_model_source

    with pytest.raises(UserError, match="no such directory"):
        check_model_source(str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"has no config\.json"):
        check_model_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_model_source(str(tmp_path))
    check_model_source("org/model")  # Hub ids are left to the fetch step unless asked
    ok = FakeHub(None)
    check_model_source("org/model", hub=True, hub_api=ok)
    assert ok.asked == ["org/model"]
    with pytest.raises(UserError, match="not found on the Hugging Face Hub"):
        check_model_source("org/typo", hub=True, hub_api=FakeHub(_hub_error("RepositoryNotFoundError")))
    with pytest.raises(UserError, match="gated"):
        check_model_source("org/gated", hub=True, hub_api=FakeHub(_hub_error("GatedRepoError")))
    check_model_source("org/model", hub=True, hub_api=FakeHub(ConnectionError("no route")))  # logged only


def test_model_source_s3_needs_a_complete_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> None:
    from rloo.pipeline.steps import check_model_source

    server = use_s3(s3_server, monkeypatch)
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    target = f"s3://{server.bucket}/{tmp_path.name}/sft"
    with pytest.raises(UserError, match=r"has no _MANIFEST\.json"):
        check_model_source(target)
    fetch_model(str(src), target)
    check_model_source(target)
