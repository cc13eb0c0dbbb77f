"""The validate step: every pipeline parameter checked once, the plan built from them."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from rloo.errors import UserError
from rloo.stages.fetch import fetch_model
from rloo.stages.validate import build_plan, check_pipeline_model
from tests.fixtures.servers import S3Server, use_s3
from tests.fixtures.weights import safetensors_bytes


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
    with pytest.raises(
        UserError,
        match=r"^kl_coef 0.2 and extra_train_args \(0.1, given as one of --kl_coef, --beta\) both set kl_coef",
    ):
        build_plan({**params, "kl_coef": 0.2})
    assert build_plan({**params, "kl_coef": 0.05}).train["kl_coef"] == 0.1  # the default gives way
    config = build_plan(params).train
    assert config["kl_coef"] == 0.1 and "beta" not in config  # the alias resolved, once
    assert (config["rloo_k"], config["bf16"], config["reward_weights"]) == (4, True, [1.0, -0.5])
    assert isinstance(config["learning_rate"], float) and isinstance(config["rloo_k"], int)
    assert "num_ppo_epochs" not in config  # a default stays the image's own
    # what the node does with it (rloo.stages.node): JSON to a file, then --config
    path = tmp_path / "train_config.yaml"
    path.write_text(json.dumps(json.loads(json.dumps(config, sort_keys=True)), indent=2))
    pod = ["--model_name_or_path", "m", "--output_dir", "o"]
    from_file = parse_config(RLOOConfig, [*pod, "--config", str(path)], prog="t")
    # the same run as 'rloo train' flags: each training parameter under its field's name, then the extras
    from rloo.stages.plan import pipeline_fields

    flags = []
    for p in pipeline_fields():
        if p.part == "train" and p.field_value(params[p.name]) is not None:
            flags += [f"--{p.field}", str(params[p.name])]
    flags += shlex.split(str(params["extra_train_args"]))
    from_flags = parse_config(RLOOConfig, [*pod, *flags], prog="t")
    assert from_file == from_flags
    assert (from_file.kl_coef, from_file.learning_rate, from_file.reward_weights) == (0.1, 1e-5, [1.0, -0.5])


def test_the_rollout_server_topology_reaches_the_train_step_through_extra_train_args() -> None:
    """The chart's rolloutServer Service, generation one update ahead: the config the train step gets."""
    url = "http://rloo-rloo-kfp-rollout.ml.svc.cluster.local:8000"
    flags = f"--use_vllm --vllm_mode server --vllm_server_base_url {url} --async_generation --max_staleness 2"
    config = build_plan(good(extra_train_args=flags)).train
    assert (config["use_vllm"], config["vllm_mode"], config["vllm_server_base_url"]) == (True, "server", url)
    assert (config["async_generation"], config["max_staleness"]) == (True, 2)


@pytest.mark.parametrize("flag", ["--output_dir x", "--model_name_or_path m", "--checkpoint_uri s3://bk/c"])
def test_pod_locations_are_not_the_users_to_give(flag: str) -> None:
    with pytest.raises(UserError, match=f"^{flag.split()[0]} is set by the pipeline itself"):
        build_plan(good(extra_train_args=flag))


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
    build_plan(good())


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
        ({"extra_train_args": "--max_staleness 2"}, "--max_staleness bounds generation that runs ahead"),
        ({"extra_train_args": "--use_vllm --vllm_mode server --vllm_server_base_url rollout:8000"}, "http"),
        ({"promotion_margin": 2.0}, "promotion_margin"),
    ],
)
def test_bad_parameters_fail_in_one_line(change: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message) as err:
        build_plan(good(**change))
    assert "\n" not in str(err.value)


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


def test_model_revision_parameter_is_checked(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="model_revision 'v1' only applies to a Hugging Face Hub id"):
        build_plan(good(model=str(tmp_path), model_revision="v1"))
    build_plan(good(model_revision="v1"))
    with pytest.raises(UserError, match="no revision 'nope'"):
        check_pipeline_model("org/sft", hub=True, hub_api=PinnedHub({"main": "a" * 40}), revision="nope")


def _hub_error(kind: str) -> Exception:
    import httpx2 as httpx  # the HTTP client huggingface_hub builds its errors on
    from huggingface_hub import errors

    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
    return getattr(errors, kind)("nope", response=response)


def test_model_source_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match="no such directory"):
        check_pipeline_model(str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"^model .*: not a model directory \(no config\.json"):
        check_pipeline_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_pipeline_model(str(tmp_path))
    check_pipeline_model("org/model")  # Hub ids are left to the fetch step unless asked
    ok = FakeHub(None)
    check_pipeline_model("org/model", hub=True, hub_api=ok)
    assert ok.asked == ["org/model"]
    with pytest.raises(UserError, match="not found on the Hugging Face Hub"):
        check_pipeline_model("org/typo", hub=True, hub_api=FakeHub(_hub_error("RepositoryNotFoundError")))
    with pytest.raises(UserError, match="gated"):
        check_pipeline_model("org/gated", hub=True, hub_api=FakeHub(_hub_error("GatedRepoError")))
    check_pipeline_model("org/model", hub=True, hub_api=FakeHub(ConnectionError("no route")))  # logged only


def test_model_source_s3_holds_a_model_whoever_wrote_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> None:
    """An s3:// SFT model copied up with plain boto3 (`aws s3 cp --recursive` of a save_pretrained
    directory: no _MANIFEST.json) passes when config.json is at its top, as transformers'
    PreTrainedModel.from_pretrained reads it (huggingface/transformers src/transformers/modeling_utils.py:
    CONFIG_NAME in the directory given); an rloo upload must still match its manifest (a file lost after
    publishing is caught); an empty prefix or one without config.json is one line, exit 2."""
    server = use_s3(s3_server, monkeypatch)
    client, base = server.client(), f"{tmp_path.name}-{id(tmp_path):x}"
    copied = f"s3://{server.bucket}/{base}/copied"
    with pytest.raises(UserError, match=r"^model s3://\S+/copied: no objects under this prefix") as err:
        check_pipeline_model(copied)
    assert err.value.exit_code == 2
    client.put_object(Bucket=server.bucket, Key=f"{base}/copied/model.safetensors", Body=b"w")
    client.put_object(Bucket=server.bucket, Key=f"{base}/copied/nested/config.json", Body=b"{}")
    with pytest.raises(UserError, match=r"^model s3://\S+/copied: no config\.json at the top of this prefix"):
        check_pipeline_model(copied)
    client.put_object(Bucket=server.bucket, Key=f"{base}/copied/config.json", Body=b"{}")
    check_pipeline_model(copied)
    # an rloo upload: verified against its manifest
    src = tmp_path / "sft"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(safetensors_bytes(b"w" * 10))  # fetch reads its header
    published = f"s3://{server.bucket}/{base}/published"
    fetch_model(str(src), published)
    check_pipeline_model(published)
    client.delete_object(Bucket=server.bucket, Key=f"{base}/published/model.safetensors")
    with pytest.raises(
        UserError,
        match=r"^model s3://\S+/published: .* does not match its manifest \(missing: model\.safetensors\)",
    ):
        check_pipeline_model(published)


def test_an_s3_reward_model_is_trained_with_and_monitored() -> None:
    """An air-gapped cluster keeps its reward model in object storage: training takes the s3:// prefix (each
    pod fetches it into its scratch) and the evaluation scores the judged pairs with it too. The plan is built
    without asking the store (rloo pipeline submit builds it where the cluster's store is out of reach)."""
    plan = build_plan(good(reward_model_path="s3://models/rm"), check_paths=False)
    assert plan.train["reward_model_path"] == "s3://models/rm" == plan.eval["reward_model_path"]
    with pytest.raises(UserError, match=r"^reward_model_path: invalid S3 bucket name"):
        build_plan(good(reward_model_path="s3://Bad_Bucket/rm"), check_paths=False)


def test_an_s3_reward_model_without_a_model_fails_the_validate_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server: S3Server
) -> None:
    """The validate step looks into an s3:// reward model prefix before any GPU is requested (the training
    pod would otherwise find it empty after the fetch): transformers loads a directory with config.json at its
    top (huggingface/transformers src/transformers/modeling_utils.py, CONFIG_NAME)."""
    server = use_s3(s3_server, monkeypatch)
    rm = f"s3://{server.bucket}/{tmp_path.name}-{id(tmp_path):x}/rm"
    with pytest.raises(
        UserError, match=r"^reward_model_path s3://\S+/rm: no objects under this prefix"
    ) as err:
        build_plan(good(reward_model_path=rm))
    assert err.value.exit_code == 2
    key = rm.removeprefix(f"s3://{server.bucket}/")
    server.client().put_object(Bucket=server.bucket, Key=f"{key}/config.json", Body=b"{}")
    assert build_plan(good(reward_model_path=rm)).train["reward_model_path"] == rm


def test_evaluation_scores_with_the_training_reward_model() -> None:
    """The judge/reward-model agreement uses the reward model training optimised: the parameter, or
    --reward_model_path in extra_train_args; no reward model in training, none in evaluation."""
    from rloo.eval.config import EvalConfig
    from rloo.stages.plan import PipelinePlan, pipeline_fields

    assert build_plan(good()).eval["reward_model_path"] == "org/rm"
    plan = build_plan(good(reward_model_path="", extra_train_args="--reward_model_path org/other-rm"))
    assert plan.eval["reward_model_path"] == "org/other-rm" == plan.train["reward_model_path"]
    funcs = build_plan(
        good(reward_model_path="", extra_train_args="--reward_funcs rloo.demo.toy:letter_reward")
    )
    assert "reward_model_path" not in funcs.eval
    # what the evaluate step builds from the plan it reads back
    again = PipelinePlan.from_json(plan.to_json())
    cfg = EvalConfig(**again.eval, model_name_or_path="m", baseline_model="b", output_dir="o")
    assert cfg.reward_model_path == "org/other-rm"
    # derived, not a second pipeline parameter
    assert not [p for p in pipeline_fields() if p.part == "eval" and p.field == "reward_model_path"]


def test_a_reward_model_directory_this_step_cannot_see_is_left_out_of_the_evaluation(tmp_path: Path) -> None:
    """A directory only the training image holds would fail the evaluation after training: the monitor is
    left out instead; a directory every step sees (the local run's) is kept."""
    gone = build_plan(good(reward_model_path="/models/only-in-the-train-image"))
    assert gone.train["reward_model_path"] == "/models/only-in-the-train-image"
    assert "reward_model_path" not in gone.eval
    here = tmp_path / "rm"
    here.mkdir()
    assert build_plan(good(reward_model_path=str(here))).eval["reward_model_path"] == str(here)


def test_a_reward_model_training_weighs_0_is_not_the_evaluation_monitor() -> None:
    """At weight 0 the policy never chased the reward model (the demo's): its agreement with the judge would
    say nothing of reward hacking."""
    zero = build_plan(
        good(extra_train_args="--reward_weights 0 1 --reward_funcs rloo.demo.toy:letter_reward")
    )
    assert zero.train["reward_weights"] == [0.0, 1.0] and "reward_model_path" not in zero.eval
    half = build_plan(
        good(extra_train_args="--reward_weights 0.5 1 --reward_funcs rloo.demo.toy:letter_reward")
    )
    assert half.eval["reward_model_path"] == "org/rm"


def test_a_single_node_runs_queue_name_is_noted(caplog: pytest.LogCaptureFixture, tiny_setup: Any) -> None:
    """queue_name labels the multi-node job for Kueue (kubernetes-sigs/kueue pkg/controller/jobframework
    reconciler.go reads the job's queue-name label); a single-node run creates no job, so the value would
    do nothing without a word."""
    import logging

    from rloo.stages.validate import run

    with caplog.at_level(logging.WARNING, logger="rloo.stages.validate"):
        run(good(model=str(tiny_setup.policy), queue_name="gpu-q"), env={})
    assert "queue_name 'gpu-q' queues the multi-node job only" in caplog.text


def test_evaluation_runs_the_episodes_training_ran() -> None:
    """--tools / --environment and their settings in extra_train_args reach the evaluation's config."""
    plan = build_plan(
        good(
            extra_train_args="--tools rloo.demo.agent_toy:add --max_tool_calling_iterations 2 --tool_timeout 5"
        )
    )
    assert plan.eval["tools"] == ["rloo.demo.agent_toy:add"] == plan.train["tools"]
    assert (plan.eval["max_tool_calling_iterations"], plan.eval["tool_timeout"]) == (2, 5.0)
    assert "environment" not in plan.eval  # not set in training: the evaluation's default
    assert "tools" not in build_plan(good()).eval
