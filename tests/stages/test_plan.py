"""The run's plan: one declaration per pipeline parameter, on its config field; the plan survives its trip
through KFP as JSON."""

from __future__ import annotations

import dataclasses

import pytest

from rloo.errors import UserError
from rloo.options import PIPELINE, Exposed, option
from rloo.stages.plan import ClusterConfig, PipelinePlan, part_configs, pipeline_fields
from rloo.stages.validate import build_plan
from tests.stages.test_validate import good


def test_each_parameter_is_declared_once_on_one_field() -> None:
    fields = pipeline_fields()
    names = [p.name for p in fields]
    assert len(names) == len(set(names)), "two config fields declare the same pipeline parameter"
    declared = [
        f.metadata[PIPELINE].name
        for cls in part_configs().values()
        for f in dataclasses.fields(cls)
        if PIPELINE in f.metadata
    ]
    assert sorted(declared) == sorted(names)
    assert all(p.name.isidentifier() for p in fields)
    # required ones first (KFP lists them so, and a Python signature needs them before the defaults)
    assert [p.required for p in fields] == sorted((p.required for p in fields), reverse=True)
    assert all((p.default is None) == p.required for p in fields)


def test_an_optional_field_is_unset_by_its_parameters_empty_value() -> None:
    by_name = {p.name: p for p in pipeline_fields()}
    assert by_name["eval_num_examples"].default == 0 and by_name["eval_num_examples"].field_value(0) is None
    assert by_name["eval_num_examples"].field_value(5) == 5
    assert by_name["reward_model_path"].field_value("") is None
    # a pipeline default of its own is a value, not "unset": total_episodes 0 is refused, not dropped
    assert by_name["total_episodes"].default == 10000 and by_name["total_episodes"].field_value(0) == 0
    plan = build_plan(good(eval_num_examples=0, production_uri=""), check_paths=False)
    assert plan.eval["num_examples"] is None and plan.push["production_uri"] is None


def test_the_plan_round_trips_through_json() -> None:
    plan = build_plan(good(gpu_node_selector={"pool": "a100"}, extra_train_args="--bf16"), check_paths=False)
    again = PipelinePlan.from_json(plan.to_json())
    assert again == plan
    assert again.cluster.gpu_node_selector == {"pool": "a100"} and again.train["bf16"] is True


def test_a_plan_is_checked_again_when_read() -> None:
    """A step reading a plan that was edited by hand (or came from another version) gets the same one-line
    refusals as the validate step."""
    plan = build_plan(good(), check_paths=False)
    text = plan.to_json().replace('"gpu_count": 1', '"gpu_count": -1')
    with pytest.raises(UserError, match=r"^gpu_count must be >= 0"):
        PipelinePlan.from_json(text)


def test_option_records_the_exposure_without_reaching_argparse() -> None:
    from rloo.parsing import parse_values

    @dataclasses.dataclass
    class Config:
        steps: int = option(3, "Steps.", pipeline="train_steps")
        name: str | None = option(None, "Name.", pipeline=Exposed("run_name", required=True))

    exposed = {f.name: f.metadata[PIPELINE] for f in dataclasses.fields(Config)}
    assert exposed["steps"] == Exposed("train_steps") and exposed["name"].required
    assert parse_values(Config, ["--steps", "5"], prog="t") == {"steps": 5}


def test_cluster_defaults_pass_their_own_checks() -> None:
    assert ClusterConfig().num_nodes == 1 and not ClusterConfig().multinode
