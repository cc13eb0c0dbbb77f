"""What a cluster's platform adds to every pod: its images, its pull secrets, its proxies and other environment,
its CA bundle; and what the cluster runs that the steps must know: Kueue (its queue for the GPU steps, whether
its PyTorchJob integration is on), S3 credentials from a workload identity rather than a Secret.

A platform team installs the chart with its own registry, proxy and CA; the chart renders these settings as
``platform.json``, which :func:`read` and :func:`parse` read. Every pod then gets the image pull secrets, the
environment and the CA bundle (mounted from a ConfigMap at :data:`CA_DIR`, with :data:`CA_ENV` pointing at
it); a pod that starts pods of its own (the multi-node launcher) finds the settings in ``RLOO_PLATFORM``
(:func:`from_env`) and gives them to its job's pods (:meth:`Platform.all_env`, :func:`job_volumes`).

Which images there are is the caller's to say (``image_kinds``): this module only checks that each is an
image reference. A setting that is not there changes nothing.

Every value lands in plain text in the uploaded pipeline spec (the KFP UI shows it), every pod spec and the
training job: a URL with credentials in it (``user:password@``) is refused (:func:`parse`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rloo.errors import UserError
from rloo.k8s.images import is_reference
from rloo.k8s.names import is_dns1123_label, is_dns1123_subdomain

PLATFORM_ENV = "RLOO_PLATFORM"
# Where the CA bundle's ConfigMap is mounted, and the variables the tools read a bundle from (OpenSSL, httpx
# and the OpenAI client; requests and the Hugging Face Hub; boto3; curl). The chart mounts the same in its
# own pods (a test checks both agree).
CA_DIR = "/etc/rloo/ca"
CA_VOLUME = "rloo-ca-bundle"
CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "AWS_CA_BUNDLE", "CURL_CA_BUNDLE")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_RESERVED_ENV = frozenset({PLATFORM_ENV, *CA_ENV})
_POD_KEYS = ("imagePullSecrets", "env", "caBundle", "kueue", "s3WorkloadIdentity")
_KUEUE_KEYS = ("pytorchJobIntegration", "queueName")
# A URL's userinfo (RFC 3986: scheme "://" userinfo "@" host); a proxy variable may leave the scheme out
# (curl, Go and Python read "user:pass@proxy:3128" as http).
_URL_USERINFO = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s]*@")
_PROXY_USERINFO = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*://)?[^/?#@\s]*@")
_PROXY_ENV = re.compile(r"(?i)^(https?|all|ftp)_proxy$")
_CREDENTIALS_HELP = (
    "let the proxy admit the cluster by its source addresses, or run an in-cluster forwarding proxy that adds "
    'them from a Secret (helm/README.md, "Proxy credentials")'
)


@dataclass(frozen=True)
class CABundle:
    """A PEM bundle in key ``key`` of ConfigMap ``config_map`` (the pod's namespace)."""

    config_map: str
    key: str = "ca.crt"

    @property
    def path(self) -> str:
        return f"{CA_DIR}/{self.key}"


@dataclass(frozen=True)
class Kueue:
    """Kueue as the cluster runs it. ``queue_name``: the LocalQueue (in the pipeline's namespace) whose quota
    admits the single-node GPU steps' pods (Kueue's ``pod`` integration reads their ``kueue.x-k8s.io/queue-name``
    label); empty: they bypass Kueue. ``pytorchjob_integration``: Kueue's ``kubeflow.org/pytorchjob``
    integration is enabled (it ships disabled, and a PyTorchJob it does not manage never leaves the suspension
    a queue label asks for)."""

    pytorchjob_integration: bool = False
    queue_name: str = ""

    def settings(self) -> dict[str, Any]:
        return {"pytorchJobIntegration": self.pytorchjob_integration, "queueName": self.queue_name}


@dataclass(frozen=True)
class Platform:
    """The platform's settings (every field optional; see the module docstring). ``s3_workload_identity``: the
    pods' service account carries a cloud identity that the S3 client uses (IRSA, EKS Pod Identity), so the S3
    key Secret is optional."""

    images: dict[str, str] = field(default_factory=dict)  # image kind (the caller's) -> reference
    image_pull_secrets: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    ca_bundle: CABundle | None = None
    kueue: Kueue = Kueue()
    s3_workload_identity: bool = False

    def all_env(self) -> dict[str, str]:
        """The environment a pod gets: ``env``, and the CA variables when there is a bundle."""
        out = dict(self.env)
        if self.ca_bundle is not None:
            out.update(dict.fromkeys(CA_ENV, self.ca_bundle.path))
        return out

    def pod_settings(self) -> dict[str, Any]:
        """What the steps and the multi-node job's pods need (``RLOO_PLATFORM``): the images are the launcher's
        business. A setting at its default is left out."""
        out: dict[str, Any] = {"imagePullSecrets": list(self.image_pull_secrets), "env": dict(self.env)}
        if self.ca_bundle is not None:
            out["caBundle"] = {"configMap": self.ca_bundle.config_map, "key": self.ca_bundle.key}
        if self.kueue != Kueue():
            out["kueue"] = self.kueue.settings()
        if self.s3_workload_identity:
            out["s3WorkloadIdentity"] = True
        return out

    def is_empty(self) -> bool:
        return not self.images and self.pod_settings() == Platform().pod_settings()


def parse(data: Any, where: str, *, image_kinds: Collection[str]) -> Platform:
    """A :class:`Platform` from its JSON form (``platform.json``); ``where`` names it in one-line errors.
    ``image_kinds``: the images it may name (none: no ``images`` key, as in :meth:`Platform.pod_settings`)."""
    keys = ("images", *_POD_KEYS) if image_kinds else _POD_KEYS
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object with {', '.join(keys)}.")
    unknown = sorted(data.keys() - set(keys))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(keys)}.")
    images = data.get("images") or {}
    if not isinstance(images, dict):
        raise UserError(f"{where}: images must map an image ({', '.join(image_kinds)}) to a reference.")
    for name, ref in images.items():
        if name not in image_kinds:
            raise UserError(
                f"{where}: images: unknown image {name!r}; the images are {', '.join(image_kinds)}."
            )
        if not isinstance(ref, str) or not is_reference(ref):
            raise UserError(
                f"{where}: images.{name}: {ref!r} is not an image reference (registry/name:tag or "
                "registry/name@sha256:<digest>)."
            )
    secrets = data.get("imagePullSecrets") or []
    if not isinstance(secrets, list) or not all(
        isinstance(s, str) and is_dns1123_subdomain(s) for s in secrets
    ):
        raise UserError(f"{where}: imagePullSecrets must be a list of Secret names (got {secrets!r}).")
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise UserError(f"{where}: env must map variable names to string values.")
    for name, value in env.items():
        if not _ENV_NAME.match(name) or not isinstance(value, str):
            raise UserError(f"{where}: env: {name!r} is not NAME=string.")
        if name in _RESERVED_ENV:
            raise UserError(f"{where}: env: {name} is set from the other settings; remove it from env.")
        if has_credentials(name, value):  # the value is never echoed: it holds a password
            raise UserError(
                f"{where}: env: {name} has credentials in its URL (user:password@), which every pod spec and "
                f"the pipeline spec in KFP's UI would show in plain text: remove them, and {_CREDENTIALS_HELP}."
            )
    ca = data.get("caBundle")
    bundle = None
    if ca:
        if not isinstance(ca, dict) or not isinstance(ca.get("configMap"), str) or not ca["configMap"]:
            raise UserError(f'{where}: caBundle must be {{"configMap": NAME, "key": KEY}} or null.')
        key = ca.get("key") or "ca.crt"
        if not is_dns1123_subdomain(ca["configMap"]) or not isinstance(key, str) or not _KEY.match(key):
            raise UserError(f"{where}: caBundle {ca!r}: not a ConfigMap name and key.")
        bundle = CABundle(ca["configMap"], key)
    identity = data.get("s3WorkloadIdentity", False)
    if not isinstance(identity, bool):
        raise UserError(f"{where}: s3WorkloadIdentity must be true or false.")
    return Platform(
        dict(images),
        tuple(dict.fromkeys(secrets)),
        dict(env),
        bundle,
        _kueue(data.get("kueue"), where),
        identity,
    )


def has_credentials(name: str, value: str) -> bool:
    """Whether environment variable ``name``'s ``value`` is a URL with userinfo (``user[:password]@``); a proxy
    variable's value with or without its scheme."""
    pattern = _PROXY_USERINFO if _PROXY_ENV.match(name) else _URL_USERINFO
    return bool(pattern.match(value))


def _kueue(data: Any, where: str) -> Kueue:
    """The ``kueue`` setting: ``{"pytorchJobIntegration": bool, "queueName": LocalQueue name}``."""
    if data is None:
        return Kueue()
    if not isinstance(data, dict):
        raise UserError(f'{where}: kueue must be {{"pytorchJobIntegration": true|false, "queueName": NAME}}.')
    unknown = sorted(data.keys() - set(_KUEUE_KEYS))
    if unknown:
        raise UserError(f"{where}: kueue: unknown key {unknown[0]!r}; the keys are {', '.join(_KUEUE_KEYS)}.")
    integration = data.get("pytorchJobIntegration", False)
    if not isinstance(integration, bool):
        raise UserError(f"{where}: kueue.pytorchJobIntegration must be true or false.")
    queue = data.get("queueName") or ""
    if not isinstance(queue, str) or (queue and not is_dns1123_label(queue)):
        raise UserError(
            f"{where}: kueue.queueName {queue!r} is not a Kueue LocalQueue name (a-z, 0-9, '-', at most 63; "
            "empty: none)."
        )
    return Kueue(integration, queue)


def read(path: str | os.PathLike[str], *, image_kinds: Collection[str]) -> Platform:
    """The platform file at ``path`` (what the chart renders as ``platform.json``); ``image_kinds``: as for
    :func:`parse`."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--platform {path}: no such file.")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"--platform {path}: not JSON.") from None
    return parse(data, f"--platform {path}", image_kinds=image_kinds)


def from_env(env: Mapping[str, str]) -> Platform:
    """The settings a pod runs under (``RLOO_PLATFORM``: :meth:`Platform.pod_settings`, which names no
    images); empty when unset."""
    raw = env.get(PLATFORM_ENV, "").strip()
    if not raw:
        return Platform()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        raise UserError(f"{PLATFORM_ENV} is not JSON; upload the pipeline again with --platform.") from None
    return parse(data, PLATFORM_ENV, image_kinds=())


def job_volumes(platform: Platform) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The multi-node job pods' share of the platform: (volumes, the training container's volumeMounts)."""
    if platform.ca_bundle is None:
        return [], []
    volume = {"name": CA_VOLUME, "configMap": {"name": platform.ca_bundle.config_map}}
    return [volume], [{"name": CA_VOLUME, "mountPath": CA_DIR, "readOnly": True}]
