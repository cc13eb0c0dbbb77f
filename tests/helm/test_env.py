"""The environment the chart gives its containers and (platform.json) the pipeline's steps: proxies that work for
KFP (NO_PROXY completed, both cases), no name twice in a container (the chart's own names in one list), and the
values rloo.pipeline.platform_overlay would refuse refused at render already."""

from __future__ import annotations

import functools
import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from rloo.errors import UserError
from rloo.k8s.platform import CA_ENV, PLATFORM_ENV
from rloo.pipeline import platform_overlay
from tests.helm.helpers import (
    CHART,
    NOT_SECRET_ENV,
    SECRET_ENV,
    VARIANTS,
    containers,
    documents,
    env_of,
    find,
    pod_spec,
    render,
    variant_values,
    with_test_values,
)

PROXY = "http://proxy.corp:3128"
# What the chart adds to NO_PROXY, in this order, after the user's entries (release namespace "rloo").
IN_CLUSTER = [".svc", ".cluster.local", ".kubeflow", ".rloo"]
LOCAL = ["localhost", "127.0.0.1"]
# The names KFP's launcher (Go) calls in every step, and the chart's own in-cluster URLs.
KFP_HOSTS = [
    "ml-pipeline.kubeflow",
    "metadata-grpc-service.kubeflow",
    "minio-service.kubeflow",
    "ml-pipeline.kubeflow.svc.cluster.local",
    "rel-rloo-kfp-mlflow.rloo.svc",
    "localhost",
    "127.0.0.1",
]

# The chart's containers that some env value reaches, as (kind, name suffix, container) -> the container's key in
# rloo-kfp.ownEnv; every other container of the chart is reached by none.
REACHED = {
    ("Job", "-upload", "upload"): "upload",
    ("Job", "-bucket", "create-bucket"): "bucket",
    ("Job", "-db-upgrade", "db-upgrade"): "db-upgrade",
    ("Deployment", "-mlflow", "mlflow"): "mlflow",
    ("Deployment", "-judge", "vllm"): "judge",
    ("Deployment", "-rollout", "vllm"): "rollout",
    ("Pod", "-test-mlflow", "mlflow"): "test-mlflow",
    ("Pod", "-test-judge", "judge"): "test-judge",
}
UNREACHED = {
    ("StatefulSet", "-postgresql", "postgresql"),
    ("StatefulSet", "-seaweedfs", "s3-identity"),
    ("StatefulSet", "-seaweedfs", "seaweedfs"),
}
# Which containers each value reaches (steps: platform.json, applied by the upload).
VALUE_REACHES = {
    "extraEnv": [
        "upload",
        "bucket",
        "db-upgrade",
        "mlflow",
        "judge",
        "rollout",
        "test-mlflow",
        "test-judge",
        "steps",
    ],
    "pipeline.extraEnv": ["steps"],
    "mlflow.extraEnv": ["mlflow", "db-upgrade"],
    "judge.extraEnv": ["judge"],
}


def _everything(**more: Any) -> dict[str, Any]:
    """Values that render every pod and every variable the chart can set itself."""
    values: dict[str, Any] = {
        "seaweedfs": {"enabled": True},
        "judge": {"enabled": True, "hfTokenSecret": "hf", "offline": True},
        "rolloutServer": {"enabled": True, "model": "m", "hfTokenSecret": "hf", "offline": True},
        "mlflow": {"auth": {"enabled": True}},
        "caBundle": {"configMap": "corp-ca", "key": "bundle.pem"},
    }
    for key, value in more.items():
        values[key] = {**values.get(key, {}), **value} if isinstance(value, dict) else value
    return values


def _platform_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])["env"]


def _client_env(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    out = []
    for (kind, suffix, name), _ in REACHED.items():
        doc = next((d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)), None)
        if doc is None:
            continue
        (c,) = [c for c in containers(pod_spec(doc)) if c["name"] == name]
        out.append((suffix, env_of(c)))
    return out


def _bypassed(no_proxy: str, host: str) -> bool:
    """Whether a client that reads no_proxy (Python's urllib, the same suffix rule as Go's and curl's) calls
    ``host`` directly."""
    return bool(urllib.request.proxy_bypass_environment(host, proxies={"no": no_proxy}))


# Proxies ------------------------------------------------------------------------------------------------


def test_no_proxy_is_completed_in_the_chart_containers_and_platform_json() -> None:
    values = _everything(
        extraEnv={
            "HTTPS_PROXY": PROXY,
            "HTTP_PROXY": PROXY,
            "NO_PROXY": " 10.96.0.0/12, .svc,,10.244.0.0/16 ",
        },
        pipeline={"namespace": "team-a"},
    )
    docs = documents(render(values))
    # the user's entries first, as given (trimmed, no repeats), then whichever of the chart's they lack
    expected = "10.96.0.0/12,.svc,10.244.0.0/16,.cluster.local,.kubeflow,.rloo,.team-a,localhost,127.0.0.1"
    twins = {"HTTPS_PROXY": PROXY, "https_proxy": PROXY, "HTTP_PROXY": PROXY, "http_proxy": PROXY}
    complete = {**twins, "NO_PROXY": expected, "no_proxy": expected}
    env = _platform_env(docs)
    assert env == complete
    clients = _client_env(docs)
    assert len(clients) == len(REACHED)
    for suffix, cenv in clients:
        assert {k: cenv[k]["value"] for k in complete} == complete, suffix
    for host in [*KFP_HOSTS, "rel-rloo-kfp-judge.team-a"]:
        assert _bypassed(expected, host), host
    assert not _bypassed(expected, "huggingface.co")


@pytest.mark.parametrize(
    ("extra_env", "pipeline_env", "steps_only"),
    [
        ({"https_proxy": PROXY}, {}, False),  # lowercase only
        ({"HTTP_PROXY": PROXY}, {}, False),  # HTTP only
        ({"NO_PROXY": "10.0.0.0/8"}, {"HTTPS_PROXY": PROXY}, True),  # the proxy for the steps only
        ({"HTTPS_PROXY": PROXY, "https_proxy": PROXY}, {"no_proxy": ".corp.example.com"}, False),
    ],
)
def test_no_proxy_is_completed_however_the_proxy_is_named(
    extra_env: dict[str, str], pipeline_env: dict[str, str], steps_only: bool
) -> None:
    docs = documents(render({"extraEnv": extra_env, "pipeline": {"extraEnv": pipeline_env}}))
    env = _platform_env(docs)
    for variable in ("HTTPS_PROXY", "HTTP_PROXY"):
        given = {**extra_env, **pipeline_env}
        value = given.get(variable) or given.get(variable.lower())
        if value:
            assert env[variable] == env[variable.lower()] == value
        else:
            assert variable not in env and variable.lower() not in env
    assert env["NO_PROXY"] == env["no_proxy"]
    entries = env["NO_PROXY"].split(",")
    assert entries[-len(IN_CLUSTER) - len(LOCAL) :] == IN_CLUSTER + LOCAL
    assert len(entries) == len(set(entries))
    for own in ("10.0.0.0/8", ".corp.example.com"):
        if own in str(extra_env) + str(pipeline_env):
            assert entries[0] == own
    for host in KFP_HOSTS:
        assert _bypassed(env["no_proxy"], host), host
    upload = env_of(pod_spec(find(docs, "Job", "-upload"))["containers"][0])
    if steps_only:  # pipeline.extraEnv reaches the steps only: the chart's containers keep extraEnv as given
        assert upload["NO_PROXY"]["value"] == "10.0.0.0/8" and "no_proxy" not in upload
        assert "HTTPS_PROXY" not in upload
    else:
        assert upload["no_proxy"]["value"] == upload["NO_PROXY"]["value"]


def test_without_a_proxy_the_environment_is_as_given() -> None:
    values = {"extraEnv": {"NO_PROXY": "10.0.0.0/8", "HF_ENDPOINT": "https://hf.corp"}}
    docs = documents(render(values))
    assert _platform_env(docs) == values["extraEnv"]
    upload = env_of(pod_spec(find(docs, "Job", "-upload"))["containers"][0])
    assert upload["NO_PROXY"]["value"] == "10.0.0.0/8" and "no_proxy" not in upload


def test_the_proxy_in_two_cases_with_two_values_is_refused() -> None:
    for values, message in (
        (
            {"extraEnv": {"HTTPS_PROXY": PROXY, "https_proxy": "http://other:3128"}},
            "extraEnv set HTTPS_PROXY and https_proxy to different values",
        ),
        (
            {
                "extraEnv": {"HTTP_PROXY": PROXY},
                "pipeline": {"extraEnv": {"http_proxy": "http://other:3128"}},
            },
            "extraEnv and pipeline.extraEnv set HTTP_PROXY and http_proxy to different values",
        ),
    ):
        with pytest.raises(helm.HelmRenderError) as err:
            render(values)
        assert message in str(err.value)


# No name twice in a container ---------------------------------------------------------------------------


@functools.cache
def _own_env() -> dict[str, list[str]]:
    """rloo-kfp.ownEnv, as the chart computes it (rendered from a copy of the chart with one more template)."""
    with tempfile.TemporaryDirectory() as tmp:
        with helm.Chart.load(CHART) as c:
            c.save_dir(tmp)
        (Path(tmp) / "rloo-kfp" / "templates" / "own-env.json").write_text(
            '{{ include "rloo-kfp.ownEnv" . }}'
        )
        with helm.Chart.load(Path(tmp) / "rloo-kfp") as copy:
            rendered = copy.render(with_test_values({}), name="rel", namespace="rloo")
    return json.loads(rendered["rloo-kfp/templates/own-env.json"])


def _every_pod_values() -> list[tuple[str, dict[str, Any]]]:
    proxies = {
        "HTTPS_PROXY": PROXY,
        "HTTP_PROXY": PROXY,
        "NO_PROXY": "10.0.0.0/8",
        "HF_ENDPOINT": "https://hf",
    }
    return [
        *((v, variant_values(v)) for v in VARIANTS),
        ("everything", _everything()),
        (
            "everything with every env value",
            _everything(
                extraEnv=proxies,
                pipeline={"extraEnv": {"NCCL_DEBUG": "INFO"}},
                mlflow={"extraEnv": [{"name": "PGSSLROOTCERT", "value": "/ca.crt"}]},
                judge={"extraEnv": [{"name": "VLLM_LOGGING_LEVEL", "value": "WARNING"}]},
            ),
        ),
    ]


@pytest.mark.parametrize(("case", "values"), _every_pod_values(), ids=[c for c, _ in _every_pod_values()])
def test_no_container_has_a_name_twice(case: str, values: dict[str, Any]) -> None:
    """Kubernetes (server-side apply, as Helm 4 installs) refuses a container whose env names a variable twice."""
    docs = documents(render(values))
    for doc in docs:
        spec = pod_spec(doc)
        if spec is None:
            continue
        for c in containers(spec):
            names = [e["name"] for e in c.get("env") or []]
            repeated = sorted({n for n in names if names.count(n) > 1})
            assert not repeated, (case, doc["metadata"]["name"], c["name"], repeated)


def test_the_own_names_list_is_what_the_chart_sets() -> None:
    """rloo-kfp.ownEnv names exactly the variables the chart sets itself in each container a value reaches (with
    every switch on that adds one), and in the steps exactly what the upload adds to platform.json's env: the list
    the refusals use cannot drift from the templates."""
    own = _own_env()
    assert set(own) == {*REACHED.values(), "steps"}
    docs = documents(render(_everything()))
    seen = set()
    for doc in docs:
        spec = pod_spec(doc)
        if spec is None:
            continue
        kind, name = doc["kind"], doc["metadata"]["name"]
        for c in containers(spec):
            key = next(
                (
                    k
                    for (kk, suffix, cn), k in REACHED.items()
                    if kk == kind and name.endswith(suffix) and cn == c["name"]
                ),
                None,
            )
            names = {e["name"] for e in c.get("env") or []}
            if key is None:
                assert any(kind == k and name.endswith(s) and c["name"] == cn for k, s, cn in UNREACHED), (
                    f"{kind}/{name} container {c['name']}: a container rloo-kfp.ownEnv does not know"
                )
                continue
            seen.add(key)
            assert names == set(own[key]), (key, sorted(names ^ set(own[key])))
    assert seen == set(REACHED.values())
    # the steps: what the upload adds beyond platform.json's env
    settings = platform_overlay.parse(
        {"env": {}, "caBundle": {"configMap": "corp-ca"}, "imagePullSecrets": ["x"]}, "t"
    )
    applied = platform_overlay.apply((CHART / "files" / "rloo_pipeline.yaml").read_text(), settings)
    spec = next(yaml.safe_load_all(applied))
    added = {
        e["name"]
        for ex in spec["deploymentSpec"]["executors"].values()
        for e in ex["container"].get("env") or []
    }
    assert added == set(own["steps"])
    assert set(CA_ENV) | {PLATFORM_ENV} == set(own["steps"])


def _own_cases() -> list[tuple[str, str, str]]:
    """Every (value, variable, container key) where the variable is the chart's own in a container the value
    reaches."""
    own = _own_env()
    cases = []
    for value, keys in VALUE_REACHES.items():
        names = {n for k in keys for n in own[k]}
        for name in sorted(names):
            first = next(k for k in keys if name in own[k])
            cases.append((value, name, first))
    return cases


def _set_env(value: str, name: str, text: str = "x") -> dict[str, Any]:
    if value == "extraEnv":
        return {"extraEnv": {name: text}}
    if value == "pipeline.extraEnv":
        return {"pipeline": {"extraEnv": {name: text}}}
    entry = {
        "name": name,
        "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}},
    }  # not a literal credential
    return {value.split(".")[0]: {"extraEnv": [entry]}}


def _credential(name: str) -> bool:
    return bool(SECRET_ENV.search(name) and not NOT_SECRET_ENV.search(name))


WHERE = {
    "upload": "the upload container",
    "bucket": "the bucket Job's container",
    "db-upgrade": "the db-upgrade container",
    "mlflow": "the mlflow container",
    "judge": "the judge's vllm container",
    "rollout": "the rollout server's vllm container",
    "test-mlflow": "the helm test mlflow container",
    "test-judge": "the helm test judge container",
    "steps": "the pipeline's steps and training jobs (platform.json)",
}


def test_every_name_the_chart_sets_is_refused_where_the_value_reaches() -> None:
    """Whatever the switches (the CA variables even without caBundle): one line naming the value, the variable and
    the container, or for a credential-like name in extraEnv the credential message."""
    cases = _own_cases()
    assert ("extraEnv", "HOME", "upload") in cases and (
        "mlflow.extraEnv",
        "MLFLOW_TMP_DIR",
        "mlflow",
    ) in cases
    assert ("pipeline.extraEnv", "RLOO_PLATFORM", "steps") in cases
    for value, name, key in cases:
        with pytest.raises(helm.HelmRenderError) as err:
            render(_set_env(value, name))
        text = str(err.value)
        if value in ("extraEnv", "pipeline.extraEnv") and _credential(name):
            expected = f"{value}.{name} looks like a credential"
        elif name in CA_ENV:
            expected = (
                f"{value}.{name} is set by the chart itself: caBundle.configMap points it at the CA bundle"
            )
        else:
            expected = f"{value}.{name} is set by the chart itself in {WHERE[key]}; remove it"
        assert expected in text and text.count("\n") == 0, (value, name, text)


def test_example_messages_of_repeated_names() -> None:
    for values, message in (
        (
            {"extraEnv": {"HOME": "/x"}},
            "extraEnv.HOME is set by the chart itself in the upload container; remove it",
        ),
        (
            {"mlflow": {"extraEnv": [{"name": "MLFLOW_TMP_DIR", "value": "/scratch"}]}},
            "mlflow.extraEnv.MLFLOW_TMP_DIR is set by the chart itself in the mlflow container; remove it",
        ),
        (
            {"extraEnv": {"SSL_CERT_FILE": "/x.pem"}},  # without caBundle too
            "extraEnv.SSL_CERT_FILE is set by the chart itself: caBundle.configMap points it at the CA bundle",
        ),
        (
            {"mlflow": {"extraEnv": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
            "mlflow.extraEnv names A twice: keep one entry",
        ),
        (
            {
                "extraEnv": {"HF_ENDPOINT": "https://hf"},
                "judge": {"extraEnv": [{"name": "HF_ENDPOINT", "value": "x"}]},
            },
            "judge.extraEnv.HF_ENDPOINT is also set by extraEnv",
        ),
        (  # the lowercase twin the chart adds from extraEnv's proxy
            {
                "extraEnv": {"HTTPS_PROXY": PROXY},
                "mlflow": {"extraEnv": [{"name": "no_proxy", "value": "x"}]},
            },
            "mlflow.extraEnv.no_proxy is also set by extraEnv",
        ),
    ):
        with pytest.raises(helm.HelmRenderError) as err:
            render(values)
        assert message in str(err.value), str(err.value)


# The chart refuses what platform.json's reader refuses ---------------------------------------------------

AGREE: list[tuple[str, dict[str, Any]]] = [
    ("pull secret not a DNS name", {"imagePullSecrets": ["Corp_Registry"]}),
    ("pull secret ending in a dash", {"imagePullSecrets": ["corp-"]}),
    ("env name", {"extraEnv": {"1_PROXY": "x"}}),
    ("pipeline env name", {"pipeline": {"extraEnv": {"NCCL-X": "1"}}}),
    ("RLOO_PLATFORM in extraEnv", {"extraEnv": {"RLOO_PLATFORM": "{}"}}),
    ("RLOO_PLATFORM in pipeline.extraEnv", {"pipeline": {"extraEnv": {"RLOO_PLATFORM": "{}"}}}),
    ("CA variable", {"pipeline": {"extraEnv": {"SSL_CERT_FILE": "/x.pem"}}}),
    (
        "CA variable with caBundle",
        {"caBundle": {"configMap": "corp-ca"}, "extraEnv": {"AWS_CA_BUNDLE": "/x"}},
    ),
    ("CA ConfigMap name", {"caBundle": {"configMap": "Corp_CA"}}),
    ("CA key", {"caBundle": {"configMap": "corp-ca", "key": "certs/ca.crt"}}),
    ("registry with a scheme", {"images": {"registry": "https://registry.corp"}}),
]


@pytest.fixture(scope="module")
def unchecked_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart without its schema and without rloo-kfp.validate: what it would render unchecked."""
    tmp = tmp_path_factory.mktemp("unchecked")
    with helm.Chart.load(CHART) as c:
        c.save_dir(tmp)
    (tmp / "rloo-kfp" / "values.schema.json").unlink()
    (tmp / "rloo-kfp" / "templates" / "validate.yaml").unlink()
    return tmp / "rloo-kfp"


@pytest.mark.parametrize(("case", "values"), AGREE, ids=[c for c, _ in AGREE])
def test_the_chart_refuses_what_platform_json_would_be_refused_for(
    case: str, values: dict[str, Any], unchecked_chart: Path
) -> None:
    """At render (`helm install` stops before it applies anything), not in the post-install upload Job after
    everything else was applied: the chart refuses the value, and rloo.pipeline.platform_overlay.parse would have refused
    the platform.json the chart renders from it without its checks."""
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)):
        render(values)
    with helm.Chart.load(unchecked_chart) as unchecked:
        docs = documents(unchecked.render(with_test_values(values), name="rel", namespace="rloo"))
    data = json.loads(find(docs, "ConfigMap", "-pipeline")["data"]["platform.json"])
    with pytest.raises(UserError):
        platform_overlay.parse(data, "platform.json")
    # and what the chart takes, the reader takes
    platform_overlay.parse(
        json.loads(find(documents(render()), "ConfigMap", "-pipeline")["data"]["platform.json"]), "p"
    )
