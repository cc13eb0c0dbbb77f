"""The pipeline's parameters: the README table and the example file match the pipeline, and values of the
wrong type are refused in one line before KFP (or kfp.local) sees them."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from rloo.errors import UserError
from rloo.pipeline.compile import parse_params, readme_path, repo_root
from rloo.pipeline.params import TABLE_BEGIN, TABLE_END, pipeline_params, readme_with_table

EXAMPLE = repo_root() / "pipelines" / "params.example.yaml"


def test_readme_table_is_the_pipelines_parameters() -> None:
    """pipelines/README.md carries the table generated from rloo_pipeline.py ('rloo pipeline compile'
    refreshes it): it cannot drift from the pipeline."""
    text = readme_path().read_text()
    assert text.count(TABLE_BEGIN) == 1 and text.count(TABLE_END) == 1
    assert readme_with_table(text) == text, "stale parameter table: run 'rloo pipeline compile'"
    table = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    params = pipeline_params()
    assert [row.split("`")[1] for row in rows] == [p.name for p in params]
    for row, p in zip(rows, params, strict=True):
        assert p.help and p.type in row, row
        assert ("*required*" in row) == p.required


def test_example_params_file_validates() -> None:
    from rloo.pipeline.params import check_params
    from rloo.pipeline.submit import params_for_submit

    params = parse_params([], str(EXAMPLE))
    assert set(params) >= {p.name for p in pipeline_params() if p.required}
    assert check_params(params, required=True) == params  # every value already has its parameter's type
    assert params_for_submit(params) == params  # the validate step's checks too


def test_example_params_file_is_accepted_by_submit(capsys: pytest.CaptureFixture[str]) -> None:
    from rloo.cli.pipeline_cmd import main

    # a closed port: the parameters were accepted when the error is about the connection
    assert main(["submit", "--host", "http://127.0.0.1:9", "--params", str(EXAMPLE)]) == 75
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rloo pipeline: error: Kubeflow Pipelines") and "127.0.0.1:9" in err


@pytest.fixture
def own_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system temp dir of this test alone (kfp.local makes its kfp-workspace-* directories there)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.mark.parametrize(
    ("param", "message"),
    [
        ("learning_rate=abc", "pipeline parameter learning_rate expects a number (got 'abc')."),
        ("rloo_k=four", "pipeline parameter rloo_k expects an integer (got 'four')."),
    ],
)
def test_local_run_refuses_a_bad_type_in_one_line(
    own_tempdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], param: str, message: str
) -> None:
    from rloo.cli.pipeline_cmd import main

    work = tmp_path / "work"
    assert main(["run", "--local", "--workdir", str(work), "--param", param]) == 2
    out, err = capsys.readouterr()
    assert err == f"rloo pipeline: error: {message}\n" and "Traceback" not in out
    assert not work.exists()  # refused before anything was built
    assert list(own_tempdir.iterdir()) == []


def test_run_local_checks_types_before_kfp_local_starts(own_tempdir: Path, tmp_path: Path) -> None:
    from rloo.pipeline.local import run_local

    params: dict[str, Any] = {p.name: "x" for p in pipeline_params() if p.required}
    with pytest.raises(UserError, match=r"^pipeline parameter rloo_k expects an integer \(got 'four'\)\.$"):
        run_local(params | {"rloo_k": "four"}, tmp_path / "kfp")
    assert list(own_tempdir.iterdir()) == []  # no kfp-workspace-* left behind


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        ("train_cpu", "8 cores", "train_cpu must be a CPU quantity such as 8 or 500m (got '8 cores')."),
        ("eval_cpu", "0", "eval_cpu must be a CPU quantity"),
        (
            "train_memory",
            "128GB",
            "train_memory must be a memory quantity such as 64Gi or 512Mi (got '128GB').",
        ),
        ("eval_memory", "8Gi", "eval_memory must be more than the 16Gi of /dev/shm (got '8Gi')"),
        (
            "train_service_account",
            "Pipeline_Runner",
            "train_service_account must be a Kubernetes service account",
        ),
        (
            "multinode_backend",
            "mpijob",
            "multinode_backend must be one of trainjob, pytorchjob (got 'mpijob').",
        ),
        (
            "training_runtime",
            "Torch Distributed",
            "training_runtime 'Torch Distributed' is not a runtime name",
        ),
    ],
)
def test_submit_refuses_bad_pod_settings(param: str, value: str, message: str) -> None:
    """Checked before KFP sees them: the driver would refuse a bad quantity only when that step's pod is
    created, possibly after hours of training."""
    from rloo.pipeline.submit import params_for_submit

    params = parse_params([], str(EXAMPLE))
    assert params_for_submit(params)  # the defaults pass
    with pytest.raises(UserError) as err:
        params_for_submit(params | {param: value})
    assert str(err.value).startswith(message), str(err.value)


def test_multinode_parameters_default_to_a_trainjob_on_torch_distributed() -> None:
    from rloo.k8s.builders import DEFAULT_BACKEND, DEFAULT_RUNTIME

    defaults = {p.name: p.default for p in pipeline_params()}
    assert defaults["multinode_backend"] == DEFAULT_BACKEND == "trainjob"
    assert defaults["training_runtime"] == DEFAULT_RUNTIME == "torch-distributed"


# Where the pipeline deliberately differs from the stage's default, and why.
PIPELINE_OWN_DEFAULTS = {
    # the CLI's None means "one pass over the prompts"; a pipeline run gets a concrete, visible budget
    "total_episodes": 10000,
}
_UNSET = {str: "", int: 0}  # what a KFP parameter holds for "not set": KFP has no None


def _stage_fields() -> list[Any]:
    """The pipeline parameters that set a field of a stage's own config (train, eval, push)."""
    from rloo.stages.plan import pipeline_fields

    return [p for p in pipeline_fields() if p.part in ("train", "eval", "push")]


def _field(p: Any) -> Any:
    from dataclasses import fields

    from rloo.stages.plan import part_configs

    return next(f for f in fields(part_configs()[p.part]) if f.name == p.field)


def test_pipeline_defaults_are_the_stage_configs_defaults() -> None:
    """Each pipeline parameter that sets a config field defaults to that field's default (a config None is
    the KFP type's empty value), so the KFP UI shows what `rloo train/eval/push` would do."""
    checked, wrong = [], []
    for p in _stage_fields():
        if p.required:
            continue
        default = _field(p).default
        checked.append(p.name)
        if p.name in PIPELINE_OWN_DEFAULTS:
            assert p.default == PIPELINE_OWN_DEFAULTS[p.name], p.name
            continue
        expected = _UNSET.get(p.type) if default is None else default
        if p.default != expected:
            wrong.append(f"{p.name}: pipeline {p.default!r}, {p.part}.{p.field} {default!r}")
    assert not wrong, wrong
    # the parameters this covers, so that a renamed field cannot silently drop out of the check
    assert {"learning_rate", "kl_coef", "rloo_k", "response_length", "eval_max_new_tokens"} <= set(checked)


# Where the pipeline's help deliberately differs from the stage config's, and why. Every other parameter that
# sets a config field takes the field's help.
PIPELINE_OWN_HELP = {
    "dataset_name": "names the 'rloo train' layout a directory must have, not the CLI's file pattern",
    "eval_dataset_name": "says what the rows must hold for judging, in pipeline terms",
    "judge_base_url": "points at judge_secret, where the pipeline keeps the key",
    "eval_num_examples": "0 means all rows: a KFP integer has no None",
    "reward_model_path": "points at extra_train_args for --reward_funcs",
    "total_episodes": "the pipeline has a concrete default; the CLI's help explains its None",
    "production_uri": "states the pipeline's empty value",
    "registered_model_name": "states the pipeline's empty value",
    "register_model": "points at mlflow_secret, where the pipeline keeps the tracking URI",
    "hub_repo_id": "states the pipeline's empty value; the token comes from hf_secret",
}


def test_pipeline_help_is_the_stage_configs_help() -> None:
    """A parameter that sets a config field is documented once, in the config; the pipeline's own wording is
    the exception, listed with its reason."""
    from rloo.options import PIPELINE

    mapped = {p.name: p for p in _stage_fields()}
    assert set(PIPELINE_OWN_HELP) <= set(mapped), "an exception for a parameter that sets no config field"
    for name, p in mapped.items():
        own = _field(p).metadata[PIPELINE].help
        assert (own is not None) == (name in PIPELINE_OWN_HELP), f"{name}: list its own help with a reason"
        assert p.help == (own or _field(p).metadata["help"])


def test_the_compiled_pipeline_has_the_declared_parameters() -> None:
    """The pipeline's signature is made of the declarations on the config fields: the compiled pipeline (what
    KFP's UI shows) has exactly those parameters, types, defaults and help."""
    from rloo.pipeline.compile import default_yaml, load_yaml

    spec = load_yaml(default_yaml())[0]["root"]["inputDefinitions"]["parameters"]
    kfp_types = {"String": "STRING", "Integer": "NUMBER_INTEGER", "Float": "NUMBER_DOUBLE"}
    kfp_types |= {"Boolean": "BOOLEAN", "Dict": "STRUCT", "List": "LIST"}
    params = pipeline_params()
    assert set(spec) == {p.name for p in params}
    for p in params:
        compiled = spec[p.name]
        assert compiled["parameterType"] == kfp_types[p.type], p.name
        assert compiled.get("isOptional", False) == (not p.required), p.name
        assert compiled.get("defaultValue") == p.default, p.name
        assert " ".join(compiled["description"].split()) == p.help, p.name


def test_a_params_file_that_is_not_yaml_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("model: x\nthis is: not: yaml\n")
    with pytest.raises(
        UserError, match=r"^--params .*params.yaml: not valid YAML \(line 2\); fix the syntax\.$"
    ):
        parse_params([], str(bad))
    with pytest.raises(
        UserError, match=r"^--param 'gpu_node_selector=\{a: \[1,': the value is not valid YAML"
    ):
        parse_params(["gpu_node_selector={a: [1,"])


def test_the_validate_step_takes_every_pipeline_parameter() -> None:
    """The pipeline hands every parameter to its first step, under the same name and type: none reaches a
    later step (or a pod spec) unchecked."""
    from rloo.pipeline.compile import load_pipeline

    load_pipeline()  # puts the repository root on sys.path for components/
    from components.validate.component import validate_params

    step = {name: str(spec.type) for name, spec in (validate_params.component_spec.inputs or {}).items()}
    assert step == {p.name: p.type for p in pipeline_params()}


# A value each pipeline parameter refuses. A new parameter needs one here, or a reason in ANY_VALUE.
REFUSED: dict[str, Any] = {
    "model": "",
    "dataset_name": "",
    "eval_dataset_name": "",
    "judge_base_url": "",
    "judge_model": "",
    "output_uri": "",
    "dataset_train_split": " ",
    "model_revision": "my branch",
    "eval_dataset_split": "",
    "eval_num_examples": -1,
    "eval_max_new_tokens": 0,
    "reward_model_path": "",  # with no --reward_funcs either: no reward source
    "learning_rate": float("nan"),
    "total_episodes": 0,
    "rloo_k": 1,
    "kl_coef": -0.1,
    "per_device_train_batch_size": 0,
    "gradient_accumulation_steps": 0,
    "response_length": 0,
    "seed": -1,
    "extra_train_args": "--no_such_flag 1",
    "gpu_resource": "gpu",
    "gpu_count": -1,
    "num_nodes": 0,
    "multinode_backend": "mpijob",
    "training_runtime": "Torch Distributed",
    "queue_name": "Team Queue",
    "priority_class": "High!",
    "gpu_node_selector": {"gpu type": "h100"},
    "gpu_tolerations": [{"key": "sku", "operator": "Exists", "value": "gpu"}],
    "admission_timeout_s": 0,
    "train_cpu": "8 cores",
    "train_memory": "8Gi",  # not above the 16Gi in-memory /dev/shm
    "eval_cpu": "",
    "eval_memory": "lots",
    "train_service_account": "Default",
    "namespace": "Team_A",
    "mlflow_experiment": "",
    "production_uri": " ",
    "registered_model_name": "my model!",
    "hub_repo_id": "no-owner",
    "promotion_margin": 1.5,
    "s3_secret": "S3 creds",
    "mlflow_secret": "",
    "hf_secret": "hf_token",
    "judge_secret": "-judge",
}
ANY_VALUE = {
    "register_model": "a boolean: both values are valid, and the type is checked with every parameter's",
    "istio_sidecar": "a boolean: both values are valid, and the type is checked with every parameter's",
    "compare_to_champion": "a boolean: both values are valid, and the type is checked with every parameter's",
    "judge_check": "a boolean: both values are valid, and the type is checked with every parameter's",
}


def test_every_pipeline_parameter_is_validated() -> None:
    assert set(REFUSED) | set(ANY_VALUE) == {p.name for p in pipeline_params()}
    assert not set(REFUSED) & set(ANY_VALUE)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_bad_value_of_each_parameter_is_refused_by_name(name: str) -> None:
    from rloo.stages.validate import build_plan
    from tests.stages.test_validate import good

    build_plan(good(), check_paths=False)
    with pytest.raises(UserError) as err:
        build_plan(good(**{name: REFUSED[name]}), check_paths=False)
    message = str(err.value)
    # the message names the parameter as the user gave it (extra_train_args: the offending flag)
    assert (name in message) if name != "extra_train_args" else ("--no_such_flag" in message), message


@pytest.mark.parametrize("model", ["gpt2", "org/sft"])
def test_the_validate_step_takes_a_hub_id_without_organisation(model: str) -> None:
    """``gpt2`` is a Hub id to the validate step as to 'rloo train' (rloo.storage.location.source_kind), not a
    missing directory; ``./gpt2`` and ``a/b/c`` are directories."""
    from rloo.stages.validate import build_plan
    from tests.stages.test_validate import good

    build_plan(good(model=model), check_paths=True)
    build_plan(good(model=model, model_revision="v1"), check_paths=True)
    for local in ("./gpt2", "a/b/c"):
        with pytest.raises(UserError, match=f"^model {local}: no such directory"):
            build_plan(good(model=local), check_paths=True)


def test_the_validate_step_takes_s3_datasets() -> None:
    """An air-gapped cluster keeps its datasets in object storage: dataset_name and eval_dataset_name take
    s3://bucket/prefix (a malformed one is refused naming the parameter)."""
    from rloo.stages.validate import build_plan
    from tests.stages.test_validate import good

    build_plan(
        good(dataset_name="s3://datasets/tldr", eval_dataset_name="s3://datasets/tldr-eval"),
        check_paths=False,
    )
    for name in ("dataset_name", "eval_dataset_name"):
        with pytest.raises(UserError, match=rf"^{name}: invalid S3 bucket name 'Data_Sets'"):
            build_plan(good(**{name: "s3://Data_Sets/tldr"}), check_paths=False)
        with pytest.raises(
            UserError, match=rf"^{name} 'gs://b/tldr': only s3:// URIs and local paths are supported"
        ):
            build_plan(good(**{name: "gs://b/tldr"}), check_paths=False)


def test_a_priority_without_a_queue_matters_only_for_a_multinode_trainjob() -> None:
    """One node creates no job: its priority_class has nothing to need a queue for (names are still checked)."""
    from rloo.stages.validate import build_plan
    from tests.stages.test_validate import good

    build_plan(good(priority_class="high"), check_paths=False)
    multi = {"num_nodes": 2, "output_uri": "s3://runs/o", "priority_class": "high"}
    with pytest.raises(UserError, match=r"^priority_class needs queue_name for a TrainJob"):
        build_plan(good(**multi), check_paths=False)
    build_plan(good(**multi, multinode_backend="pytorchjob"), check_paths=False)
    with pytest.raises(UserError, match=r"^priority_class 'High!' is not a priority class name"):
        build_plan(good(priority_class="High!"), check_paths=False)
