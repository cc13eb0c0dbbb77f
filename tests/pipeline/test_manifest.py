"""`rloo pipeline manifest`: the multi-node job a run's train step would create, as YAML (the job's builders
themselves: tests/k8s/test_builders.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rloo.errors import UserError
from rloo.k8s.builders import check_multinode
from tests.k8s.test_builders import OWNER_REF, _trainjob_pod, _validate, _validate_trainjob
from tests.k8s.test_platform import SETTINGS, check_pod

REPO = Path(__file__).resolve().parents[2]


def test_manifest_command_names_the_placeholders_left(capsys: pytest.CaptureFixture[str]) -> None:
    """The job is YAML on stdout (for a pipe into kubectl); what it still holds as placeholders is said on
    stderr, and nothing once every value the job carries is given."""
    from rloo.cli.pipeline_cmd import main

    args = ["manifest", "--param", "num_nodes=2", "--param", "gpu_count=4"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["kind"] == "TrainJob" and "rloo pipeline: note" not in out
    assert err == (
        "rloo pipeline: note: output_uri, dataset_name, reward_model_path are placeholders in this job: pass "
        "--param NAME=VALUE for each before applying it.\n"
    )
    given = ["--param", "output_uri=s3://bkt/p", "--param", "dataset_name=org/d"]
    assert main([*args, *given, "--param", "extra_train_args=--reward_funcs pkg.mod:fn"]) == 0
    assert capsys.readouterr().err == ""


def test_manifest_command_prints_the_job_for_either_backend(capsys: pytest.CaptureFixture[str]) -> None:
    from rloo.cli.pipeline_cmd import main

    args = ["manifest", "--param", "num_nodes=2", "--param", "gpu_count=4", "--param", "learning_rate=3e-6"]
    assert main([*args, "--param", "namespace=team-a"]) == 0
    out = capsys.readouterr().out
    job = yaml.safe_load(out)
    _validate_trainjob(job)
    assert job["metadata"]["namespace"] == "team-a" and job["spec"]["trainer"]["numNodes"] == 2
    cmd = job["spec"]["trainer"]["command"]
    config = json.loads(cmd[cmd.index("--train_config") + 1])  # the validated config, as the pods read it
    assert config["learning_rate"] == 3e-6 and isinstance(config["learning_rate"], float)
    assert config["dataset_name"] == "<dataset_name>"  # placeholders for what is not given
    assert main([*args, "--backend", "pytorchjob", "--run_id", "r1"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    _validate(job)
    assert job["metadata"]["name"] == "rloo-train-r1" and "namespace" not in job["metadata"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], r"^rloo pipeline: error: the multi-node job is for num_nodes >= 2 \(got 1\)"),
        (["--param", "num_nodes=2", "--param", "multinode_backend=mpi"], "multinode_backend must be one of"),
        (["--param", "num_node=2"], r"unknown pipeline parameter\(s\) num_node \(did you mean num_nodes\?\)"),
        # a queued PyTorchJob Kueue does not manage (its integration ships disabled) would stay suspended
        (
            ["--param", "num_nodes=2", "--param", "multinode_backend=pytorchjob", "--param", "queue_name=q"],
            r"Kueue ships its kubeflow.org/pytorchjob integration disabled",
        ),
    ],
)
def test_manifest_command_refuses_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rloo.cli.pipeline_cmd import main

    assert main(["manifest", *args]) != 0
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err


@pytest.mark.parametrize("backend", ["trainjob", "pytorchjob"])
def test_manifest_command_shows_the_owner_as_placeholders(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rloo.cli.pipeline_cmd import main

    assert (
        main(["manifest", "--backend", backend, "--param", "num_nodes=2", "--param", "namespace=team-a"]) == 0
    )
    out = capsys.readouterr().out
    job = yaml.safe_load(out)
    (ref,) = job["metadata"]["ownerReferences"]
    assert ref == {**OWNER_REF, "name": "<launcher pod>", "uid": "<launcher pod uid>"}
    # said next to the job, in YAML comments: applying it as it is would get it garbage-collected at once
    assert out.startswith("# metadata.ownerReferences: the train step's pod")
    assert "remove ownerReferences before\n# applying this job by hand" in out


def test_manifest_shows_the_job_with_the_platform(tmp_path: Path) -> None:
    settings = tmp_path / "platform.json"
    settings.write_text(json.dumps(SETTINGS))
    args = [
        "manifest",
        "--platform",
        str(settings),
        "--param",
        "num_nodes=2",
        "--param",
        "output_uri=s3://b/o",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "rloo.cli", "pipeline", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    job = yaml.safe_load(done.stdout)
    assert job["spec"]["trainer"]["image"] == SETTINGS["images"]["train"]
    check_pod(_trainjob_pod(job))


@pytest.mark.parametrize(
    ("backend", "runtime"),
    [("jobset", "torch-distributed"), ("trainjob", "Runtime/x"), ("trainjob", "deepspeed-distributed")],
)
def test_the_parameters_check_refuses_what_the_job_would(backend: str, runtime: str) -> None:
    """The validate step's check of multinode_backend and training_runtime says what build_job would."""
    from rloo.stages.plan import ClusterConfig

    with pytest.raises(UserError) as job:
        check_multinode(backend, runtime)
    with pytest.raises(UserError, match=f"^{re.escape(str(job.value))}$"):
        ClusterConfig(multinode_backend=backend, training_runtime=runtime)


def test_the_manifest_has_no_yaml_anchors() -> None:
    """The PyTorchJob's Master and Worker share their pod spec in memory; the YAML a person reviews (and
    kubectl applies) spells both out instead of an ``&id001`` anchor and its ``*id001`` alias."""
    from rloo.pipeline.multinode_manifest import manifest_yaml

    text = manifest_yaml({"num_nodes": 2, "multinode_backend": "pytorchjob"})
    assert "&id" not in text and "*id" not in text
    assert text.count("restartPolicy") >= 2
