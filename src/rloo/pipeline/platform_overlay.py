"""The cluster's platform applied to the compiled pipeline: its images, its pull secrets, its proxies and other
environment, its CA bundle, its Kueue queue, S3 credentials from a workload identity (the settings themselves,
and what they give a pod: :mod:`rloo.k8s.platform`).

A platform team installs the chart with its own registry, proxy and CA; the chart renders these settings as
``platform.json`` (the same file ``rloo pipeline compile|upload|submit --platform FILE`` reads: :func:`read`)
and the upload applies them to the compiled pipeline before KFP sees it (:func:`apply`):

- every step's image is the platform's image of its kind (slim, train, eval), and so is the image of the
  multi-node training job (the ``train_image`` input of the launcher);
- every step gets the image pull secrets, the environment and the CA bundle (mounted from a ConfigMap at
  :data:`~rloo.k8s.platform.CA_DIR`, with :data:`~rloo.k8s.platform.CA_ENV` pointing at it), written exactly
  as ``kfp.kubernetes`` writes them, so KFP's driver reads them as it reads its own;
- every step also gets ``RLOO_PLATFORM``, the settings as JSON: the multi-node launcher gives its TrainJob or
  PyTorchJob pods the same pull secrets, environment and CA (:func:`rloo.k8s.platform.from_env`), and the
  validate step reads the Kueue and S3 settings there;
- with a Kueue queue, the single-node GPU steps (:data:`QUEUED_EXECUTORS`) get Kueue's queue label, as
  ``kfp.kubernetes.add_pod_label`` writes it (KFP's Argo compiler puts ``podMetadata`` on the step's pod), so
  Kueue's ``pod`` integration admits them against the queue's quota like the multi-node job;
- with a workload identity for S3, every step's S3 key Secret becomes optional (``secretAsEnv`` ``optional:
  true``, which KFP's driver copies to the pod's ``secretKeyRef``): a pod without the Secret starts, and its
  S3 client takes the identity's credentials.

A setting that is not there changes nothing: a default platform leaves the package byte for byte as it was.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from typing import Any

import yaml

from rloo.errors import UserError
from rloo.k8s import platform as k8s_platform
from rloo.k8s.builders import QUEUE_LABEL
from rloo.k8s.platform import CA_DIR, PLATFORM_ENV, Platform
from rloo.pipeline.images import IMAGE_EXTRAS
from rloo.stages.constants import S3_SECRET_KEYS

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
# The steps that hold GPUs in pods of their own (the multi-node launcher's job is queued by its own label).
QUEUED_EXECUTORS = ("exec-train-rloo", "exec-evaluate")
# The variables of the S3 key Secret that a workload identity replaces (its S3_ENDPOINT_URL stays readable).
_S3_KEY_ENV = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}) & set(S3_SECRET_KEYS.values())


def parse(data: Any, where: str) -> Platform:
    """``platform.json``'s settings (:func:`rloo.k8s.platform.parse`), naming this pipeline's images."""
    return k8s_platform.parse(data, where, image_kinds=IMAGE_EXTRAS)


def read(path: str | os.PathLike[str]) -> Platform:
    """The platform file at ``path`` (:func:`rloo.k8s.platform.read`), naming this pipeline's images."""
    return k8s_platform.read(path, image_kinds=IMAGE_EXTRAS)


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
    if platform.pod_settings() != Platform().pod_settings():
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
        if platform.kueue.queue_name and name in QUEUED_EXECUTORS:
            labels = k8s_executors[name].setdefault("podMetadata", {}).setdefault("labels", {})
            labels[QUEUE_LABEL] = platform.kueue.queue_name
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
    if platform.s3_workload_identity:
        for secret in config.get("secretAsEnv") or []:
            if _S3_KEY_ENV & {k.get("envVar") for k in secret.get("keyToEnv") or []}:
                secret["optional"] = True


def _task_inputs(spec: dict[str, Any], parameter: str) -> Iterator[dict[str, Any]]:
    """Every task's input ``parameter`` (root DAG and sub-DAGs such as the exit handler's)."""
    dags = [spec.get("root", {}).get("dag", {})]
    dags += [c.get("dag", {}) for c in (spec.get("components") or {}).values()]
    for dag in dags:
        for task in (dag.get("tasks") or {}).values():
            value = ((task.get("inputs") or {}).get("parameters") or {}).get(parameter)
            if isinstance(value, dict):
                yield value
