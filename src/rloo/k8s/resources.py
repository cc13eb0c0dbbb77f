"""What a pod asks for and is given: CPU and memory quantities, service account, secret, resource, label and
namespace names, Kueue scheduling, and the GPUs a pod actually sees, each checked in one line before any pod is
created.

A bad value is otherwise refused only by the KFP driver or the API server when the pod is created, which for
a pipeline's late step (its evaluation's memory, say) is after hours of training. ``name`` in every check is
what the user set the value as (a pipeline parameter), so that the error names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rloo.errors import UserError
from rloo.k8s.names import is_dns1123_label, is_dns1123_subdomain

# Kubernetes quantities (resource.Quantity): a decimal number with an optional SI or binary suffix. CPU takes
# cores or millicores only; memory takes no millis ("64m" bytes is always a typo).
_CPU = re.compile(r"^(?P<n>[0-9]+(\.[0-9]+)?|\.[0-9]+)(?P<unit>m?)$")
_MEMORY = re.compile(r"^(?P<n>[0-9]+(\.[0-9]+)?)(?P<unit>Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_MEMORY_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


@dataclass(frozen=True)
class StepResources:
    """Requests and limits of one container (Kubernetes quantity strings)."""

    cpu_request: str
    cpu_limit: str
    memory_request: str
    memory_limit: str


def cpu_millis(name: str, value: str) -> int:
    """``value`` (e.g. ``"8"``, ``"500m"``) in millicores; a one-line UserError naming ``name`` otherwise."""
    m = _CPU.match(str(value).strip())
    millis = 0.0
    if m:
        millis = float(m["n"]) * (1 if m["unit"] else 1000)
    if not m or millis < 1:
        raise UserError(f"{name} must be a CPU quantity such as 8 or 500m (got {value!r}).")
    return int(millis)


def memory_bytes(name: str, value: str) -> int:
    """``value`` (e.g. ``"64Gi"``) in bytes; a one-line UserError naming ``name`` otherwise."""
    m = _MEMORY.match(str(value).strip())
    if not m or float(m["n"]) <= 0:
        raise UserError(f"{name} must be a memory quantity such as 64Gi or 512Mi (got {value!r}).")
    return int(float(m["n"]) * _MEMORY_UNITS[m["unit"] or ""])


def check_pod_memory(name: str, value: str, shm_size: str) -> None:
    """``value`` must leave room above the in-memory ``/dev/shm``: its pages count against the container's
    memory limit, so a limit at or below ``shm_size`` gets the pod OOM-killed before /dev/shm is full."""
    if memory_bytes(name, value) <= memory_bytes("shm size", shm_size):
        raise UserError(
            f"{name} must be more than the {shm_size} of /dev/shm (got {value!r}): the in-memory /dev/shm "
            "counts against the pod's memory limit."
        )


def check_service_account(name: str, value: str) -> None:
    if not is_dns1123_subdomain(value):
        raise UserError(
            f"{name} must be a Kubernetes service account name (lower-case a-z, 0-9, '-', '.'; got {value!r})."
        )


def check_secret_name(name: str, value: str) -> None:
    """A Kubernetes Secret name (DNS-1123 subdomain): a typo would leave a pod Pending, not failed."""
    if not is_dns1123_subdomain(value):
        raise UserError(
            f"{name} must be a Kubernetes secret name (lower-case a-z, 0-9, '-', '.'; got {value!r})."
        )


_LABEL = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _qualified_name(text: str) -> bool:
    """``[prefix/]name``: a label key or an extended resource name (``nvidia.com/gpu``)."""
    prefix, _, name = text.rpartition("/")
    if prefix and not is_dns1123_subdomain(prefix):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL.match(name))


def check_resource_name(name: str, value: str) -> None:
    if not _qualified_name(value) or "/" not in value:
        raise UserError(
            f"{name} must be an extended resource name such as nvidia.com/gpu or amd.com/gpu (got {value!r})."
        )


def check_node_selector(name: str, value: Any) -> None:
    """Label keys and values a node selector may hold: a bad one is refused only when the pod is created."""
    if not isinstance(value, dict):
        raise UserError(f'{name} must be a mapping of node labels to values, e.g. {{"gpu": "h100"}}.')
    for key, label in value.items():
        if not isinstance(key, str) or not _qualified_name(key):
            raise UserError(
                f"{name}: {key!r} is not a Kubernetes label key ([prefix/]name, e.g. nvidia.com/gpu.product)."
            )
        if not isinstance(label, str) or len(label) > 63 or (label and not _LABEL.match(label)):
            raise UserError(
                f"{name}: the value of {key!r} must be a label value (text of up to 63 a-z, A-Z, 0-9, '-', '_', "
                f"'.'; got {label!r})."
            )


def check_namespace(name: str, value: str) -> None:
    """Empty (the pipeline's own namespace) or a DNS-1123 label."""
    if value and not is_dns1123_label(value):
        raise UserError(
            f"{name} must be a Kubernetes namespace name (lower-case a-z, 0-9, '-'; got {value!r})."
        )


def gpus_granted(gpu_limit: str, gpu_resource: str, visible: int) -> int:
    """The GPU count the single-node train step trains on: ``gpu_limit`` (the validate step's text output that
    the pod's accelerator limit is set from), checked against the ``visible`` CUDA devices.

    A pod that got fewer GPUs than it asked for (a driver that dropped the accelerator limit, a device plugin
    that does not advertise ``gpu_resource``, a runtime without the NVIDIA hook) would otherwise train on what
    it has, for up to the step's 48-hour timeout, or crash far from the cause."""
    if not gpu_limit.isdigit():
        raise UserError(f"gpu_count {gpu_limit!r} is not a whole number of GPUs.")
    wanted = int(gpu_limit)
    if visible < wanted:
        raise UserError(
            f"this pod asked for {wanted} {gpu_resource} and sees {visible} CUDA device(s): the GPUs were not "
            "granted; check that the node's device plugin advertises gpu_resource and that the container "
            "runtime exposes the GPUs."
        )
    return wanted


def check_scheduling(queue_name: str, priority_class: str, backend: str | None = None) -> None:
    """``queue_name`` (a Kueue LocalQueue) and ``priority_class``: empty, or names the API server takes (both end
    up in label values: at most 63 characters). A TrainJob's priority (``backend="trainjob"``) is Kueue's
    WorkloadPriorityClass label, Trainer v2.3's pod patch having no ``priorityClassName``: it needs a queue."""
    if queue_name and not is_dns1123_label(queue_name):
        raise UserError(
            f"queue_name {queue_name!r} is not a Kueue LocalQueue name (a-z, 0-9, '-', at most 63)."
        )
    if priority_class and (len(priority_class) > 63 or not is_dns1123_subdomain(priority_class)):
        raise UserError(
            f"priority_class {priority_class!r} is not a priority class name (a-z, 0-9, '-', '.', at most 63)."
        )
    if priority_class and not queue_name and backend == "trainjob":
        raise UserError(
            "priority_class needs queue_name for a TrainJob: its pods cannot be given a priorityClassName "
            "(Trainer v2.3's pod patch has none), so the priority is Kueue's WorkloadPriorityClass label; set "
            "queue_name, or use multinode_backend=pytorchjob for a plain PriorityClass."
        )


_TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def check_tolerations(name: str, value: Any) -> None:
    """A list of pod tolerations as the API server validates them (Kubernetes ``ValidateTolerations``): a bad
    one is otherwise refused only when the GPU pod is created, after the steps before it ran."""
    if not isinstance(value, list):
        raise UserError(
            f'{name} must be a list of tolerations, e.g. [{{"key": "nvidia.com/gpu", "operator": "Exists", '
            '"effect": "NoSchedule"}] ([] for none).'
        )
    for i, t in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(t, dict):
            raise UserError(f"{where} must be a mapping with key, operator, value, effect (got {t!r}).")
        unknown = sorted(set(t) - _TOLERATION_KEYS)
        if unknown:
            raise UserError(
                f"{where}: unknown field {unknown[0]!r}; a toleration has {', '.join(sorted(_TOLERATION_KEYS))}."
            )
        key, operator = t.get("key", ""), t.get("operator", "Equal")
        if operator not in ("Equal", "Exists"):
            raise UserError(f"{where}: operator must be Equal or Exists (got {operator!r}).")
        if key and (not isinstance(key, str) or not _qualified_name(key)):
            raise UserError(f"{where}: key {key!r} is not a label key ([prefix/]name, e.g. nvidia.com/gpu).")
        if not key and operator != "Exists":
            raise UserError(f"{where}: an empty key tolerates every taint only with operator Exists.")
        val = t.get("value", "")
        if not isinstance(val, str) or (operator == "Exists" and val):
            raise UserError(f"{where}: value must be text, and empty with operator Exists (got {val!r}).")
        if val and (len(val) > 63 or not _LABEL.match(val)):
            raise UserError(
                f"{where}: value {val!r} is not a label value (up to 63 a-z, A-Z, 0-9, '-', '_', '.')."
            )
        effect = t.get("effect", "")
        if effect and effect not in _TOLERATION_EFFECTS:
            raise UserError(
                f"{where}: effect must be one of {', '.join(_TOLERATION_EFFECTS)} or empty (got {effect!r})."
            )
        seconds = t.get("tolerationSeconds")
        if seconds is not None and (
            effect != "NoExecute" or not isinstance(seconds, int) or isinstance(seconds, bool)
        ):
            raise UserError(f"{where}: tolerationSeconds (whole seconds) applies only to effect NoExecute.")
