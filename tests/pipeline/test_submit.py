"""Upload / submit decisions against a stand-in for ``kfp.Client`` (no KFP API server runs here): the
stand-in keeps pipelines and versions like the API does and records every call."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kfp.client.client import _FILTER_OPERATIONS

from rloo.errors import UserError
from rloo.pipeline import submit as S


class FakeKFP:
    """The subset of kfp.Client the module calls, with the API's bookkeeping (ids, versions, pages of 2)."""

    def __init__(self) -> None:
        self.pipelines: dict[str, dict[str, Any]] = {}  # id -> {name, description, versions: [...]}
        self.calls: list[str] = []
        self.runs: list[dict[str, Any]] = []

    def _version(self, pid: str, name: str) -> SimpleNamespace:
        versions = self.pipelines[pid]["versions"]
        v = SimpleNamespace(
            display_name=name,
            pipeline_version_id=f"{pid}-v{len(versions)}",
            created_at=f"t{len(versions):03d}",
        )
        versions.append(v)
        return v

    def list_pipelines(self, filter: str, namespace: str | None = None, page_size: int = 10) -> Any:
        # the v2beta1 API: a namespace lists that profile's pipelines, none the shared ones
        (predicate,) = json.loads(filter)["predicates"]
        assert predicate["operation"] == _FILTER_OPERATIONS["EQUALS"] and predicate["key"] == "display_name"
        found = [
            SimpleNamespace(pipeline_id=pid)
            for pid, p in self.pipelines.items()
            if p["name"] == predicate["stringValue"] and p["namespace"] == namespace
        ]
        return SimpleNamespace(pipelines=found[:page_size] or None)

    def upload_pipeline(self, path: str, pipeline_name: str, description: str, namespace: Any) -> Any:
        self.calls.append("upload_pipeline")
        assert Path(path).is_file()
        pid = f"p{len(self.pipelines)}"
        self.pipelines[pid] = {
            "name": pipeline_name,
            "description": description,
            "versions": [],
            "namespace": namespace,
        }
        self._version(pid, pipeline_name)  # KFP names the first version after the pipeline
        return SimpleNamespace(pipeline_id=pid)

    def upload_pipeline_version(
        self, path: str, pipeline_version_name: str, pipeline_id: str, description: str
    ) -> Any:
        self.calls.append("upload_pipeline_version")
        assert all(v.display_name != pipeline_version_name for v in self.pipelines[pipeline_id]["versions"])
        return self._version(pipeline_id, pipeline_version_name)

    def list_pipeline_versions(self, pipeline_id: str, page_token: str, page_size: int) -> Any:
        start = int(page_token or 0)
        versions = self.pipelines[pipeline_id]["versions"]
        nxt = str(start + 2) if start + 2 < len(versions) else ""
        return SimpleNamespace(pipeline_versions=versions[start : start + 2], next_page_token=nxt)

    def get_pipeline(self, pipeline_id: str) -> Any:
        return SimpleNamespace(description=self.pipelines[pipeline_id]["description"])

    def create_experiment(self, name: str, namespace: Any = None) -> Any:
        return SimpleNamespace(experiment_id=f"exp-{name}")

    def run_pipeline(self, **kwargs: Any) -> Any:
        self.runs.append(kwargs)
        return SimpleNamespace(run_id=f"run-{len(self.runs)}")


def _package(tmp_path: Path, text: str) -> Path:
    p = tmp_path / f"pkg-{abs(hash(text))}.yaml"
    p.write_text(text)
    return p


def test_upload_is_idempotent_and_versions_changes(tmp_path: Path) -> None:
    kfp = FakeKFP()
    a, b, c = (_package(tmp_path, t) for t in ("spec: 1\n", "spec: 2\n", "spec: 3\n"))
    first = S.ensure_uploaded(kfp, a, "rloo-rlhf")
    assert first.created == "pipeline" and first.version_id == "p0-v0"
    again = S.ensure_uploaded(kfp, a, "rloo-rlhf")  # e.g. a helm upgrade without changes
    assert again.created == "nothing" and again.version_id == "p0-v0"
    second = S.ensure_uploaded(kfp, b, "rloo-rlhf")
    assert second.created == "version" and second.version_name == S.version_name(S.package_digest(b))
    third = S.ensure_uploaded(kfp, c, "rloo-rlhf")  # a third version: found across pages of 2 below
    assert S.ensure_uploaded(kfp, c, "rloo-rlhf").created == "nothing"
    assert S.ensure_uploaded(kfp, b, "rloo-rlhf").version_id == second.version_id  # older version reused
    assert kfp.calls == ["upload_pipeline", "upload_pipeline_version", "upload_pipeline_version"]
    assert third.version_id == "p0-v2"


def test_upload_into_a_profile_namespace_finds_its_pipeline_again(tmp_path: Path) -> None:
    # multi-user KFP: a helm upgrade uploads into the same profile; the shared space is another pipeline
    kfp = FakeKFP()
    a, b = _package(tmp_path, "spec: 1\n"), _package(tmp_path, "spec: 2\n")
    first = S.ensure_uploaded(kfp, a, "rloo-rlhf", namespace="team-a")
    assert S.ensure_uploaded(kfp, a, "rloo-rlhf", namespace="team-a").created == "nothing"
    assert S.ensure_uploaded(kfp, b, "rloo-rlhf", namespace="team-a").pipeline_id == first.pipeline_id
    shared = S.ensure_uploaded(kfp, a, "rloo-rlhf")
    assert shared.created == "pipeline" and shared.pipeline_id != first.pipeline_id
    assert [p["namespace"] for p in kfp.pipelines.values()] == ["team-a", None]


def test_reverting_to_the_first_package_after_other_versions_adds_a_named_version(tmp_path: Path) -> None:
    # the digest in the pipeline description only identifies the first version while it is the only one
    kfp = FakeKFP()
    a, b = _package(tmp_path, "spec: 1\n"), _package(tmp_path, "spec: 2\n")
    S.ensure_uploaded(kfp, a, "rloo-rlhf")
    S.ensure_uploaded(kfp, b, "rloo-rlhf")
    back = S.ensure_uploaded(kfp, a, "rloo-rlhf")
    assert back.created == "version" and back.version_name == S.version_name(S.package_digest(a))


def test_start_run_uses_the_uploaded_version(tmp_path: Path) -> None:
    kfp = FakeKFP()
    up = S.ensure_uploaded(kfp, _package(tmp_path, "spec: 1\n"), "rloo-rlhf")
    run_id = S.start_run(kfp, up, {"rloo_k": 4}, experiment="rloo", run_name="r1", service_account="sa")
    (call,) = kfp.runs
    assert call == {
        "experiment_id": "exp-rloo",
        "job_name": "r1",
        "params": {"rloo_k": 4},
        "pipeline_id": up.pipeline_id,
        "version_id": up.version_id,
        "service_account": "sa",
    }
    assert S.run_url("http://kfp.example/", run_id) == "http://kfp.example/#/runs/details/run-1"


def test_missing_package_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        S.package_digest(tmp_path / "nope.yaml")


GOOD = {
    "model": "org/sft",
    "dataset_name": "org/prompts",
    "eval_dataset_name": "org/eval",
    "judge_base_url": "http://judge:8000/v1",
    "judge_model": "judge",
    "output_uri": "s3://bucket/rloo",
    "reward_model_path": "org/rm",
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rloo_k": 1}, "rloo_k must be >= 2"),
        ({"gpu_count": -1}, "gpu_count must be >= 0"),
        ({"judge_base_url": ""}, "judge_base_url is required"),
        ({"nope": 1}, "unknown pipeline parameter(s) nope"),
        ({"eval_max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_submit_validates_before_contacting_kfp(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        S.params_for_submit(GOOD | change)


def test_submit_accepts_good_parameters_unchanged() -> None:
    params = GOOD | {"gpu_node_selector": {"nvidia.com/gpu.product": "H100"}, "num_nodes": 2}
    assert S.params_for_submit(params) == params


def test_cli_submit_checks_parameters_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rloo.cli.pipeline_cmd import main

    # a closed port: had the parameters been accepted, the error would be about the connection
    argv = ["submit", "--host", "http://127.0.0.1:9"]
    argv += [x for k, v in (GOOD | {"rloo_k": 1}).items() for x in ("--param", f"{k}={v}")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "error: rloo_k must be >= 2" in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"learning_rate": "abc"}, "pipeline parameter learning_rate expects a number (got 'abc')."),
        ({"rloo_k": "four"}, "pipeline parameter rloo_k expects an integer (got 'four')."),
        ({"rloo_k": 2.5}, "pipeline parameter rloo_k expects an integer (got 2.5)."),
        ({"gpu_node_selector": "gpu"}, "pipeline parameter gpu_node_selector expects a mapping"),
        ({"hub_repo_id": True}, "pipeline parameter hub_repo_id expects a string (got True); quote it"),
        ({"seed": None}, "pipeline parameter seed expects an integer (got null)."),
        ({"rloo_kk": 4}, "unknown pipeline parameter(s) rloo_kk (did you mean rloo_k?)"),
    ],
)
def test_submit_checks_types_first(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError) as info:
        S.params_for_submit(GOOD | change)
    assert str(info.value).startswith(message), str(info.value)


def test_submit_converts_values_to_the_parameter_types() -> None:
    # YAML 1.1 reads 1e-5 (no dot) as a string, 2024 as a number: both are what the user meant
    got = S.params_for_submit(
        GOOD | {"learning_rate": "1e-5", "rloo_k": "4", "kl_coef": 1, "judge_model": 2024, "seed": 7.0}
    )
    assert got == GOOD | {
        "learning_rate": 1e-5,
        "rloo_k": 4,
        "kl_coef": 1.0,
        "judge_model": "2024",
        "seed": 7,
    }
    assert isinstance(got["kl_coef"], float) and isinstance(got["seed"], int)


def test_submit_names_pipeline_parameters_not_train_flags() -> None:
    no_reward = {k: v for k, v in GOOD.items() if k != "reward_model_path"}
    with pytest.raises(UserError) as info:
        S.params_for_submit(no_reward)
    assert str(info.value) == (
        "no reward source: set the pipeline parameter reward_model_path (a reward model) and/or put "
        "--reward_funcs pkg.module:fn in extra_train_args."
    )
    with pytest.raises(UserError, match=r"^rloo_k must be >= 2 \(got 1\)"):
        S.params_for_submit(GOOD | {"rloo_k": 1})
    # a flag of extra_train_args keeps its '--'
    with pytest.raises(UserError, match=r"^--temperature must be > 0"):
        S.params_for_submit(GOOD | {"extra_train_args": "--temperature 0"})
    S.params_for_submit(no_reward | {"extra_train_args": "--reward_funcs rloo.demo.toy:letter_reward"})


def test_cli_submit_reports_a_bad_type_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from rloo.cli.pipeline_cmd import main

    argv = ["submit", "--host", "http://127.0.0.1:9", "--param", "learning_rate=abc"]
    argv += [x for k, v in GOOD.items() for x in ("--param", f"{k}={v}")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "rloo pipeline: error: pipeline parameter learning_rate expects a number (got 'abc').\n"
    )


def test_cli_upload_to_an_unreachable_api_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from rloo.cli.pipeline_cmd import main
    from rloo.pipeline.compile import default_yaml

    # the real kfp.Client against a closed port (its own retries take about a second); 75: a script that retries
    # on it gets past an API server restarting, as it does past object storage or MLflow down
    assert main(["upload", "--host", "http://127.0.0.1:9", "--package", str(default_yaml())]) == 75
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rloo pipeline: error: Kubeflow Pipelines") and "http://127.0.0.1:9" in err


def test_api_errors_name_the_status() -> None:
    class Forbidden(Exception):
        status, reason = 403, "Forbidden"

    with pytest.raises(UserError, match="HTTP 403: not authorised"), S.api_errors("http://kfp"):
        raise Forbidden()
    with pytest.raises(UserError, match=r"failed \(ConnectionError\)"), S.api_errors("http://kfp"):
        raise ConnectionError("refused")


class _Healthz:
    """A loopback server answering KFP's healthz like an API server of release ``tag``; records the paths."""

    def __init__(self, tag: str) -> None:
        import http.server
        import json
        import threading

        self.paths: list[str] = []
        paths, body = self.paths, json.dumps({"commit_sha": "0" * 40, "tag_name": tag, "multi_user": False})

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                paths.append(self.path)
                code = 200 if self.path.startswith("/apis/v2beta1/healthz") else 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode() if code == 200 else b"{}")

            do_POST = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.host = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(("tag", "known"), [("2.17.0", True), ("v2.15.1", True), ("unknown", False)])
def test_the_kfp_release_is_read_from_the_real_client(tag: str, known: bool) -> None:
    """kfp.Client's own healthz model drops tag_name: the version is read from the raw response."""
    server = _Healthz(tag)
    try:
        client = S.connect(server.host)
        version = S.kfp_version(client)
    finally:
        server.close()
    assert version == tag
    note = S.check_kfp_version(version, server.host)
    expected = (
        f"KFP {tag}" if known else "KFP version not reported (unknown); this pipeline needs 2.15 or newer"
    )
    assert note == expected


def test_an_older_kfp_is_refused_before_anything_is_uploaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rloo.cli.pipeline_cmd import main as pipeline_main

    package = _package(tmp_path, "spec: 1\n")
    server = _Healthz("2.14.0")
    try:
        rc = pipeline_main(["upload", "--host", server.host, "--package", str(package)])
    finally:
        server.close()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"Kubeflow Pipelines at {server.host} is 2.14.0; this pipeline needs 2.15 or newer" in err
    assert all(p.startswith("/apis/v2beta1/healthz") for p in server.paths), server.paths  # nothing uploaded


def _multinode(**kw: Any) -> dict[str, Any]:
    return {"num_nodes": 2, "multinode_backend": "trainjob", "training_runtime": "torch-distributed", **kw}


def test_submit_checks_that_the_training_runtime_exists() -> None:
    from tests.fixtures.kube_api import FakeKubeAPI

    api = FakeKubeAPI()
    assert S.check_training_runtime(_multinode(), api, "team-a") == "training runtime torch-distributed found"
    with pytest.raises(
        UserError,
        match=r"no ClusterTrainingRuntime torch-h100 in the cluster \(kubectl get clustertrainingruntimes",
    ):
        S.check_training_runtime(_multinode(training_runtime="torch-h100"), api, "team-a")
    with pytest.raises(
        UserError,
        match=r"no TrainingRuntime mine in namespace team-b \(kubectl get trainingruntimes -n team-b",
    ):
        S.check_training_runtime(
            _multinode(training_runtime="TrainingRuntime/mine", namespace="team-b"), api, "team-a"
        )
    assert ("", "trainer.kubeflow.org", "clustertrainingruntimes", "get") in api.calls


def test_the_runtime_is_not_asked_for_when_it_does_not_matter() -> None:
    from kubernetes.client.rest import ApiException

    class Forbidden:
        def get_cluster_custom_object(self, *a: Any, **kw: Any) -> Any:
            raise ApiException(status=403, reason="Forbidden")

    assert S.check_training_runtime({"num_nodes": 1}, None, "ns") == ""  # one node: no job
    assert S.check_training_runtime(_multinode(multinode_backend="pytorchjob"), None, "ns") == ""
    assert "not checked (no Kubernetes credentials here)" in S.check_training_runtime(
        _multinode(), None, "ns"
    )
    assert "not checked (HTTP 403)" in S.check_training_runtime(_multinode(), Forbidden(), "ns")


def test_a_cluster_run_needs_an_s3_output_uri() -> None:
    """Each step of a cluster run is a pod of its own: a local output_uri is not shared between them."""
    from rloo.pipeline.compile import parse_params, repo_root
    from rloo.pipeline.submit import params_for_submit

    params = parse_params([], str(repo_root() / "pipelines" / "params.example.yaml"))
    with pytest.raises(UserError, match=r"^output_uri '/tmp/runs': a cluster run needs s3://bucket/prefix"):
        params_for_submit({**params, "output_uri": "/tmp/runs"})


def test_submit_refuses_a_queue_kueue_does_not_manage_before_contacting_kfp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The validate step's Kueue check, run by submit with the platform it uploads (``--platform``): a queued
    PyTorchJob is refused unless the platform says Kueue's kubeflow.org/pytorchjob integration is on
    (kubernetes-sigs/kueue config/components/manager/controller_manager_config.yaml ships it disabled)."""
    import json

    from rloo.cli.pipeline_cmd import main

    required = [f"{k}={v}" for k, v in GOOD.items()]
    queued = ["num_nodes=2", "gpu_count=8", "multinode_backend=pytorchjob", "queue_name=gpu-q"]
    argv = ["submit", "--host", "http://127.0.0.1:9"]
    for pair in [*required, *queued]:
        argv += ["--param", pair]
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"kueue": {"pytorchJobIntegration": False}}))
    assert main([*argv, "--platform", str(off)]) == 2
    assert "kubeflow.org/pytorchjob" in capsys.readouterr().err
    on = tmp_path / "on.json"
    on.write_text(json.dumps({"kueue": {"pytorchJobIntegration": True}}))
    assert main([*argv, "--platform", str(on)]) == 75  # past the check: KFP itself is out of reach
    assert "Kubeflow Pipelines at http://127.0.0.1:9 is unreachable" in capsys.readouterr().err
