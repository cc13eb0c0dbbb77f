"""What a cluster's platform adds to every pod the pipeline starts: its images, its pull secrets, its proxies
and other environment, its CA bundle.

A platform team installs the chart with its own registry, proxy and CA; the chart renders these settings as
``platform.json`` (the same file ``rloo pipeline compile|upload|submit --platform FILE`` reads) and the upload
applies them to the compiled pipeline before KFP sees it:

- every step's image is the platform's image of its kind (slim, train, eval), and so is the image of the
  multi-node training job (the ``train_image`` input of the launcher);
- every step gets the image pull secrets, the environment and the CA bundle (mounted from a ConfigMap at
  :data:`CA_DIR`, with :data:`CA_ENV` pointing at it), written exactly as ``kfp.kubernetes`` writes them, so
  KFP's driver reads them as it reads its own;
- every step also gets ``RLOO_PLATFORM``, the settings as JSON: the multi-node launcher gives its TrainJob or
  PyTorchJob pods the same pull secrets, environment and CA (:func:`from_env`).

A setting that is not there changes nothing: a default platform leaves the package byte for byte as it was.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rloo.errors import UserError
from rloo.pipeline.images import IMAGE_EXTRAS, is_reference

PLATFORM_ENV = "RLOO_PLATFORM"
# Where the CA bundle's ConfigMap is mounted, and the variables the tools read a bundle from (OpenSSL, httpx
# and the OpenAI client; requests and the Hugging Face Hub; boto3; curl). The chart mounts the same in its
# own pods (a test checks both agree).
CA_DIR = "/etc/rloo/ca"
CA_VOLUME = "rloo-ca-bundle"
CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "AWS_CA_BUNDLE", "CURL_CA_BUNDLE")
# The image each of the pipeline's executors runs (a test compiles the pipeline with a distinct image per kind
# and checks this table against it).
EXECUTOR_IMAGES = {
    "exec-validate-params": "slim",
    "exec-fetch-sft": "slim",
    "exec-train-rloo": "train",
    "exec-train-rloo-multinode": "slim",
    "exec-evaluate": "eval",
    "exec-push-model": "slim",
    "exec-finish-run": "slim",
}
TRAIN_IMAGE_INPUT = "train_image"  # the launcher's input naming the multi-node job's image
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_RESERVED_ENV = frozenset({PLATFORM_ENV, *CA_ENV})


@dataclass(frozen=True)
class CABundle:
    """A PEM bundle in key ``key`` of ConfigMap ``config_map`` (the pod's namespace)."""

    config_map: str
    key: str = "ca.crt"

    @property
    def path(self) -> str:
        return f"{CA_DIR}/{self.key}"


@dataclass(frozen=True)
class Platform:
    """The platform's settings (every field optional; see the module docstring)."""

    images: dict[str, str] = field(default_factory=dict)  # image kind (slim/train/eval) -> reference
    image_pull_secrets: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    ca_bundle: CABundle | None = None

    def all_env(self) -> dict[str, str]:
        """The environment a pod gets: ``env``, and the CA variables when there is a bundle."""
        out = dict(self.env)
        if self.ca_bundle is not None:
            out.update(dict.fromkeys(CA_ENV, self.ca_bundle.path))
        return out

    def pod_settings(self) -> dict[str, Any]:
        """What the multi-node job's pods need (``RLOO_PLATFORM``): the images are the launcher's business."""
        out: dict[str, Any] = {"imagePullSecrets": list(self.image_pull_secrets), "env": dict(self.env)}
        if self.ca_bundle is not None:
            out["caBundle"] = {"configMap": self.ca_bundle.config_map, "key": self.ca_bundle.key}
        return out

    def is_empty(self) -> bool:
        return not (self.images or self.image_pull_secrets or self.env or self.ca_bundle)


def parse(data: Any, where: str) -> Platform:
    """A :class:`Platform` from its JSON form (``platform.json``); ``where`` names it in one-line errors."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object with images, imagePullSecrets, env, caBundle.")
    unknown = sorted(data.keys() - {"images", "imagePullSecrets", "env", "caBundle"})
    if unknown:
        raise UserError(
            f"{where}: unknown key {unknown[0]!r}; the keys are images, imagePullSecrets, env, caBundle."
        )
    images = data.get("images") or {}
    if not isinstance(images, dict):
        raise UserError(f"{where}: images must map an image ({', '.join(IMAGE_EXTRAS)}) to a reference.")
    for name, ref in images.items():
        if name not in IMAGE_EXTRAS:
            raise UserError(
                f"{where}: images: unknown image {name!r}; the images are {', '.join(IMAGE_EXTRAS)}."
            )
        if not isinstance(ref, str) or not is_reference(ref):
            raise UserError(
                f"{where}: images.{name}: {ref!r} is not an image reference (registry/name:tag or "
                "registry/name@sha256:<digest>)."
            )
    secrets = data.get("imagePullSecrets") or []
    if not isinstance(secrets, list) or not all(isinstance(s, str) and _DNS1123.match(s) for s in secrets):
        raise UserError(f"{where}: imagePullSecrets must be a list of Secret names (got {secrets!r}).")
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise UserError(f"{where}: env must map variable names to string values.")
    for name, value in env.items():
        if not _ENV_NAME.match(name) or not isinstance(value, str):
            raise UserError(f"{where}: env: {name!r}={value!r} is not NAME=string.")
        if name in _RESERVED_ENV:
            raise UserError(f"{where}: env: {name} is set from the other settings; remove it from env.")
    ca = data.get("caBundle")
    bundle = None
    if ca:
        if not isinstance(ca, dict) or not isinstance(ca.get("configMap"), str) or not ca["configMap"]:
            raise UserError(f'{where}: caBundle must be {{"configMap": NAME, "key": KEY}} or null.')
        key = ca.get("key") or "ca.crt"
        if not _DNS1123.match(ca["configMap"]) or not isinstance(key, str) or not _KEY.match(key):
            raise UserError(f"{where}: caBundle {ca!r}: not a ConfigMap name and key.")
        bundle = CABundle(ca["configMap"], key)
    return Platform(dict(images), tuple(dict.fromkeys(secrets)), dict(env), bundle)


def read(path: str | os.PathLike[str]) -> Platform:
    """The platform file at ``path`` (what the chart renders as ``platform.json``)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--platform {path}: no such file.")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"--platform {path}: not JSON.") from None
    return parse(data, f"--platform {path}")


def from_env(env: Mapping[str, str]) -> Platform:
    """The settings a step runs under (``RLOO_PLATFORM``, set by :func:`apply`); empty when unset."""
    raw = env.get(PLATFORM_ENV, "").strip()
    if not raw:
        return Platform()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        raise UserError(f"{PLATFORM_ENV} is not JSON; upload the pipeline again with --platform.") from None
    return parse(data, PLATFORM_ENV)


def apply(package: str, platform: Platform) -> str:
    """The compiled pipeline ``package`` (YAML text) with ``platform`` applied (see the module docstring)."""
    if platform.is_empty():
        return package
    try:
        docs = list(yaml.safe_load_all(package))
    except yaml.YAMLError as e:
        raise UserError(f"the pipeline package is not YAML ({e.__class__.__name__}).") from None
    if not docs or not isinstance(docs[0], dict) or "deploymentSpec" not in docs[0]:
        raise UserError("the pipeline package is not a compiled pipeline (no deploymentSpec).")
    original = copy.deepcopy(docs)
    spec = docs[0]
    executors: dict[str, Any] = spec["deploymentSpec"].get("executors") or {}
    unknown = sorted(executors.keys() - EXECUTOR_IMAGES.keys())
    if unknown:
        raise UserError(
            f"the pipeline package has a step this rloo does not know ({unknown[0]}): compile it with the same "
            "rloo version that uploads it."
        )
    if len(docs) < 2 or not isinstance(docs[1], dict):
        docs[1:] = [{}]
    k8s = docs[1].setdefault("platforms", {}).setdefault("kubernetes", {})
    k8s_executors = k8s.setdefault("deploymentSpec", {}).setdefault("executors", {})
    env = platform.all_env()
    if platform.image_pull_secrets or platform.env or platform.ca_bundle:
        env[PLATFORM_ENV] = json.dumps(platform.pod_settings(), sort_keys=True)
    for name, executor in executors.items():
        container = executor["container"]
        image = platform.images.get(EXECUTOR_IMAGES[name])
        if image:
            container["image"] = image
        if env:
            kept = [e for e in container.get("env") or [] if e.get("name") not in env]
            container["env"] = kept + [{"name": k, "value": v} for k, v in sorted(env.items())]
        _apply_kubernetes(k8s_executors.setdefault(name, {}), platform)
    if platform.images.get("train"):
        for task_input in _task_inputs(spec, TRAIN_IMAGE_INPUT):
            task_input["runtimeValue"] = {"constant": platform.images["train"]}
    if not k8s_executors:
        docs = docs[:1]
    if docs == original:
        return package
    return yaml.safe_dump_all(docs, sort_keys=True, default_flow_style=False, width=10**6)


def _apply_kubernetes(config: dict[str, Any], platform: Platform) -> None:
    """Pull secrets and the CA volume of one executor, in kfp.kubernetes' form (constants as parameters)."""
    pulls = config.get("imagePullSecret") or []
    have = {p.get("secretName") for p in pulls}
    pulls += [
        {"secretName": s, "secretNameParameter": {"runtimeValue": {"constant": s}}}
        for s in platform.image_pull_secrets
        if s not in have
    ]
    if pulls:
        config["imagePullSecret"] = pulls
    if platform.ca_bundle is not None:
        name = platform.ca_bundle.config_map
        volumes = [v for v in config.get("configMapAsVolume") or [] if v.get("mountPath") != CA_DIR]
        volumes.append(
            {
                "configMapName": name,
                "configMapNameParameter": {"runtimeValue": {"constant": name}},
                "mountPath": CA_DIR,
                "optional": False,
            }
        )
        config["configMapAsVolume"] = volumes


def _task_inputs(spec: dict[str, Any], parameter: str) -> Iterator[dict[str, Any]]:
    """Every task's input ``parameter`` (root DAG and sub-DAGs such as the exit handler's)."""
    dags = [spec.get("root", {}).get("dag", {})]
    dags += [c.get("dag", {}) for c in (spec.get("components") or {}).values()]
    for dag in dags:
        for task in (dag.get("tasks") or {}).values():
            value = ((task.get("inputs") or {}).get("parameters") or {}).get(parameter)
            if isinstance(value, dict):
                yield value


def job_volumes(platform: Platform) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The multi-node job pods' share of the platform: (volumes, the training container's volumeMounts)."""
    if platform.ca_bundle is None:
        return [], []
    volume = {"name": CA_VOLUME, "configMap": {"name": platform.ca_bundle.config_map}}
    return [volume], [{"name": CA_VOLUME, "mountPath": CA_DIR, "readOnly": True}]
