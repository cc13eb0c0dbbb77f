"""The platform's settings (images, pull secrets, environment, CA bundle, Kueue, an S3 workload identity) as read
from platform.json and from a pod's RLOO_PLATFORM, and given to the multi-node job's pods: one-line errors for
what a cluster would refuse (and for credentials in a URL), and no change at all to the job when there is nothing
to give."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rloo.errors import UserError
from rloo.k8s import platform
from rloo.k8s.builders import TrainJobSpec, build_pytorchjob, build_trainjob
from rloo.k8s.platform import CA_DIR, CA_ENV, PLATFORM_ENV, CABundle, Platform
from tests.k8s.test_builders import _spec, _trainjob_pod, _validate, _validate_trainjob

DIGEST = "@sha256:" + "ab" * 32
# The image kinds are the caller's (the pipeline's: rloo.pipeline.images.IMAGE_EXTRAS).
KINDS = ("train", "eval", "slim")
SETTINGS: dict[str, Any] = {
    "images": {
        "slim": "registry.corp:5000/ml/rloo-slim:1.2" + DIGEST,
        "train": "registry.corp:5000/ml/rloo-train@sha256:" + "cd" * 32,
        "eval": "registry.corp:5000/ml/rloo-eval:1.2",
    },
    "imagePullSecrets": ["corp-registry", "mirror"],
    "env": {
        "HTTPS_PROXY": "http://proxy.corp:3128",
        "NO_PROXY": ".svc,.cluster.local",
        "NCCL_IB_HCA": "mlx5",
    },
    "caBundle": {"configMap": "corp-ca", "key": "bundle.pem"},
}


def test_the_settings_and_what_a_pod_gets() -> None:
    p = platform.parse(SETTINGS, "t", image_kinds=KINDS)
    assert p.images == SETTINGS["images"] and p.image_pull_secrets == ("corp-registry", "mirror")
    assert p.ca_bundle == CABundle("corp-ca", "bundle.pem")
    env = p.all_env()
    assert {k: env[k] for k in SETTINGS["env"]} == SETTINGS["env"]
    assert {k: env[k] for k in CA_ENV} == dict.fromkeys(CA_ENV, f"{CA_DIR}/bundle.pem")
    volumes, mounts = platform.job_volumes(p)
    assert volumes == [{"name": platform.CA_VOLUME, "configMap": {"name": "corp-ca"}}]
    assert mounts == [{"name": platform.CA_VOLUME, "mountPath": CA_DIR, "readOnly": True}]
    assert platform.parse({}, "t", image_kinds=KINDS) == Platform() and Platform().is_empty()
    assert platform.job_volumes(Platform()) == ([], [])


def test_a_pod_reads_back_what_it_was_given() -> None:
    """RLOO_PLATFORM carries the pod settings, never the images (the launcher's business)."""
    p = platform.parse(SETTINGS, "t", image_kinds=KINDS)
    pod_settings = json.dumps(p.pod_settings())
    assert "images" not in p.pod_settings()
    assert platform.from_env({PLATFORM_ENV: pod_settings}) == replace(p, images={})
    assert platform.from_env({}) == Platform() == platform.from_env({PLATFORM_ENV: " "})
    with pytest.raises(UserError, match=f"^{PLATFORM_ENV} is not JSON"):
        platform.from_env({PLATFORM_ENV: "{"})
    with pytest.raises(
        UserError, match=f"^{PLATFORM_ENV}: unknown key 'images'; the keys are imagePullSecrets"
    ):
        platform.from_env({PLATFORM_ENV: json.dumps(SETTINGS)})


def test_the_file(tmp_path: Path) -> None:
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(SETTINGS))
    assert platform.read(path, image_kinds=KINDS) == platform.parse(SETTINGS, "t", image_kinds=KINDS)
    with pytest.raises(UserError, match=r"^--platform .*nope\.json: no such file\.$"):
        platform.read(tmp_path / "nope.json", image_kinds=KINDS)
    path.write_text("{not json")
    with pytest.raises(UserError, match=r"^--platform .*platform\.json: not JSON\.$"):
        platform.read(path, image_kinds=KINDS)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ([], "expected a JSON object"),
        ({"image": {}}, "unknown key 'image'"),
        ({"images": {"trainer": "a/b:1"}}, "unknown image 'trainer'; the images are train, eval, slim"),
        ({"images": {"train": "Not A Ref"}}, "is not an image reference"),
        ({"imagePullSecrets": "corp"}, "imagePullSecrets must be a list"),
        ({"imagePullSecrets": ["Corp_Registry"]}, "imagePullSecrets must be a list"),
        # a Secret's and a ConfigMap's names are DNS-1123 subdomains: labels joined by single dots
        ({"imagePullSecrets": ["corp..registry"]}, "imagePullSecrets must be a list"),
        ({"imagePullSecrets": ["corp.-registry"]}, "imagePullSecrets must be a list"),
        ({"imagePullSecrets": ["r" * 254]}, "imagePullSecrets must be a list"),
        ({"env": {"HTTPS PROXY": "x"}}, "is not NAME=string"),
        ({"env": {"NCCL_DEBUG": 1}}, "is not NAME=string"),
        ({"env": {"SSL_CERT_FILE": "/x"}}, "SSL_CERT_FILE is set from the other settings"),
        ({"caBundle": {"key": "ca.crt"}}, "caBundle must be"),
        ({"caBundle": {"configMap": "ca", "key": "a/b"}}, "not a ConfigMap name and key"),
        ({"caBundle": {"configMap": "corp..ca"}}, "not a ConfigMap name and key"),
    ],
)
def test_bad_settings_are_one_line(data: Any, says: str) -> None:
    """What a cluster would refuse, refused in one line; a Secret's and a ConfigMap's name as Kubernetes checks
    it (kubernetes/kubernetes staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go,
    IsDNS1123Subdomain)."""
    with pytest.raises(UserError, match=says) as e:
        platform.parse(data, "--platform p.json", image_kinds=KINDS)
    assert "\n" not in str(e.value) and str(e.value).startswith("--platform p.json")


def job_spec(pod_platform: Platform) -> TrainJobSpec:
    """A job given ``pod_platform`` the way a launcher gives it (env, pull secrets, the CA's volume)."""
    volumes, mounts = platform.job_volumes(pod_platform)
    return _spec(
        image=SETTINGS["images"]["train"],
        num_nodes=2,
        env={**pod_platform.all_env(), "KFP_RUN_ID": "abc"},
        image_pull_secrets=pod_platform.image_pull_secrets,
        extra_volumes=volumes,
        extra_mounts=mounts,
    )


def check_pod(pod: dict[str, Any]) -> None:
    """``pod`` (a pod template of the job) has SETTINGS' pull secrets, environment and CA bundle."""
    spec = pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "corp-registry"}, {"name": "mirror"}]
    (ca,) = [v for v in spec["volumes"] if v["name"] == platform.CA_VOLUME]
    assert ca["configMap"]["name"] == "corp-ca"
    (container,) = [c for c in spec["containers"] if c["image"] == SETTINGS["images"]["train"]]
    assert {"name": platform.CA_VOLUME, "mountPath": CA_DIR, "readOnly": True} in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {k: env[k] for k in SETTINGS["env"]} == SETTINGS["env"]
    assert env["AWS_CA_BUNDLE"] == f"{CA_DIR}/bundle.pem" and env["KFP_RUN_ID"]


def test_the_training_jobs_pods_get_the_platform() -> None:
    spec = job_spec(platform.parse(SETTINGS, "t", image_kinds=KINDS))
    trainjob = build_trainjob(spec)
    _validate_trainjob(trainjob)  # Trainer's CRD, strict, and the pod it gives against the Pod schema
    check_pod(_trainjob_pod(trainjob))
    pytorchjob = build_pytorchjob(spec)
    _validate(pytorchjob)
    for replica in pytorchjob["spec"]["pytorchReplicaSpecs"].values():
        check_pod(replica["template"])


def test_without_a_platform_the_job_is_as_before() -> None:
    pod = build_pytorchjob(job_spec(Platform()))["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "imagePullSecrets" not in pod and [v["name"] for v in pod["volumes"]] == ["dshm", "scratch"]
    assert build_trainjob(job_spec(Platform())) == build_trainjob(
        _spec(image=SETTINGS["images"]["train"], num_nodes=2, env={"KFP_RUN_ID": "abc"})
    )


# Kueue and S3 workload identity: the settings the steps read from RLOO_PLATFORM ----------------------------


def test_kueue_and_workload_identity_travel_in_rloo_platform() -> None:
    """The validate step reads ``from_env(os.environ).kueue.pytorchjob_integration`` (to accept ``queue_name``
    with a PyTorchJob: Kueue ships its ``kubeflow.org/pytorchjob`` integration commented out in
    kubernetes-sigs/kueue ``config/components/manager/controller_manager_config.yaml``) and
    ``s3_workload_identity``: both must survive platform.json -> RLOO_PLATFORM -> the pod."""
    data = {
        **SETTINGS,
        "kueue": {"pytorchJobIntegration": True, "queueName": "gpu-queue"},
        "s3WorkloadIdentity": True,
    }
    p = platform.parse(data, "t", image_kinds=KINDS)
    assert p.kueue == platform.Kueue(pytorchjob_integration=True, queue_name="gpu-queue")
    assert p.s3_workload_identity and not p.is_empty()
    pod = platform.from_env({PLATFORM_ENV: json.dumps(p.pod_settings())})
    assert pod.kueue.pytorchjob_integration and pod.kueue.queue_name == "gpu-queue"
    assert pod.s3_workload_identity and pod == replace(p, images={})
    # at their defaults they change nothing: not written, and a platform of defaults is empty
    defaults = {"kueue": {"pytorchJobIntegration": False, "queueName": ""}, "s3WorkloadIdentity": False}
    assert platform.parse(defaults, "t", image_kinds=KINDS) == Platform()
    assert Platform().pod_settings() == {"imagePullSecrets": [], "env": {}}
    assert platform.from_env({}).kueue == platform.Kueue() and not platform.from_env({}).s3_workload_identity
    only_kueue = Platform(kueue=platform.Kueue(pytorchjob_integration=True))
    assert not only_kueue.is_empty() and only_kueue.pod_settings()["kueue"]["pytorchJobIntegration"] is True


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"kueue": "gpu"}, 'kueue must be {"pytorchJobIntegration"'),
        (
            {"kueue": {"queue": "gpu"}},
            "kueue: unknown key 'queue'; the keys are pytorchJobIntegration, queueName",
        ),
        ({"kueue": {"pytorchJobIntegration": "yes"}}, "kueue.pytorchJobIntegration must be true or false"),
        ({"kueue": {"queueName": "GPU_Queue"}}, "kueue.queueName 'GPU_Queue' is not a Kueue LocalQueue name"),
        ({"kueue": {"queueName": "q" * 64}}, "is not a Kueue LocalQueue name"),
        ({"kueue": {"queueName": "gpu\n"}}, "is not a Kueue LocalQueue name"),  # Go's $ ends the text
        ({"s3WorkloadIdentity": "true"}, "s3WorkloadIdentity must be true or false"),
    ],
)
def test_bad_kueue_and_identity_settings_are_one_line(data: Any, says: str) -> None:
    """The queue's name goes into a label value, so it is a DNS-1123 label
    (kubernetes/kubernetes staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go, IsDNS1123Label)."""
    for kinds in (KINDS, ()):  # platform.json, and RLOO_PLATFORM
        with pytest.raises(UserError, match=re.escape(says)) as e:
            platform.parse(data, "--platform p.json", image_kinds=kinds)
        assert "\n" not in str(e.value)


# No credentials in a URL -----------------------------------------------------------------------------------

PASSWORD = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HTTPS_PROXY", f"http://alice:{PASSWORD}@proxy.corp:3128"),
        ("https_proxy", f"https://alice:{PASSWORD}@proxy.corp:3128/"),
        ("HTTP_PROXY", f"alice:{PASSWORD}@proxy.corp:3128"),  # no scheme: curl, Go and Python take it as http
        ("ALL_PROXY", f"socks5://alice:{PASSWORD}@proxy.corp:1080"),
        ("HTTP_PROXY", f"http://{PASSWORD}@proxy.corp:3128"),  # a token as the user name
        ("HF_ENDPOINT", f"https://bot:{PASSWORD}@hf-mirror.corp"),
    ],
)
def test_a_url_with_credentials_is_refused_without_echoing_it(name: str, value: str) -> None:
    """Every env value lands in plain text in the pipeline spec (KFP's UI shows it), each pod spec and the
    TrainJob: kubeflow/pipelines ``backend/src/v2/driver/driver.go`` copies the container's env into the pod
    spec patch as literal values. One line naming the variable, never its value."""
    for kinds in (KINDS, ()):
        with pytest.raises(UserError) as e:
            platform.parse({"env": {name: value}}, "--platform p.json", image_kinds=kinds)
        message = str(e.value)
        assert message.startswith(f"--platform p.json: env: {name} has credentials in its URL")
        assert "\n" not in message and PASSWORD not in message and "alice" not in message
        assert "Proxy credentials" in message  # where to read how to pass them instead
    with pytest.raises(UserError) as e:
        platform.from_env({PLATFORM_ENV: json.dumps({"env": {name: value}})})
    assert PASSWORD not in str(e.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HTTPS_PROXY", "http://proxy.corp:3128"),
        ("HTTP_PROXY", "proxy.corp:3128"),
        ("NO_PROXY", ".svc,.cluster.local,10.0.0.0/8"),
        ("HF_ENDPOINT", "https://hf-mirror.corp/path@v2"),  # an @ in the path is not userinfo
        ("GIT_REMOTE", "git@github.com:org/repo.git"),  # not a URL with a scheme
        ("NCCL_SOCKET_IFNAME", "eth0"),
    ],
)
def test_values_without_credentials_pass(name: str, value: str) -> None:
    assert platform.parse({"env": {name: value}}, "t", image_kinds=KINDS).env == {name: value}
