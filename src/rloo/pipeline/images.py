"""The container images the pipeline's steps run in: the one place their names are defined.

Each image is built from ``images/<name>/Dockerfile`` in this repository (a test checks both directions).
Override the registry or tag at compile time with ``RLOO_IMAGE_REGISTRY`` / ``RLOO_IMAGE_TAG``, or one image
with ``RLOO_IMAGE_<NAME>`` (e.g. ``RLOO_IMAGE_TRAIN=my.registry/rloo-train:dev``), or name exactly the images
a build pushed with its record (``images/build.py`` writes it; ``rloo pipeline compile --images FILE``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rloo import __version__
from rloo.k8s.images import check_release_tag, is_reference

DEFAULT_REGISTRY = "ghcr.io/rloo-kfp"
# the package's version: a pipeline compiled from this code runs only in images built from it (the steps read
# the plan this version's validate step writes)
DEFAULT_TAG = __version__

# image name -> the package extras its Dockerfile must install (kfp: the executor of lightweight components,
# since they are built with install_kfp_package=False).
IMAGE_EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("train", "tracking", "kfp", "vllm"),
    "eval": ("eval", "tracking", "kfp", "vllm"),
    "slim": ("tracking", "kfp"),
}

# flavours of an image, built from a Dockerfile of their own: name -> the images whose steps they can run
# (train-cpu: CPU torch with the train and eval extras, for a CPU cluster and the container tests)
FLAVOURS: dict[str, tuple[str, ...]] = {"train-cpu": ("train", "eval")}


def image(name: str) -> str:
    """Full reference of image ``name`` (``train``, ``eval`` or ``slim``), environment overrides applied."""
    if name not in IMAGE_EXTRAS:
        raise KeyError(f"unknown image {name!r}; choose one of {', '.join(IMAGE_EXTRAS)}")
    override = os.environ.get(f"RLOO_IMAGE_{name.upper()}")
    if override:
        _check_reference(override, source=f"RLOO_IMAGE_{name.upper()}")
        check_release_tag(override, source=f"RLOO_IMAGE_{name.upper()}")
        return override
    registry = os.environ.get("RLOO_IMAGE_REGISTRY", DEFAULT_REGISTRY).rstrip("/")
    tag = os.environ.get("RLOO_IMAGE_TAG", DEFAULT_TAG)
    reference = f"{registry}/rloo-{name}:{tag}"
    _check_reference(reference, source="RLOO_IMAGE_REGISTRY / RLOO_IMAGE_TAG")
    check_release_tag(reference, source="RLOO_IMAGE_TAG")
    return reference


def _check_reference(reference: str, *, source: str) -> None:
    """One line at compile time, naming the variable, for what would otherwise compile into every step and
    fail on the cluster as an InvalidImageName / ImagePullBackOff."""
    if not is_reference(reference):
        from rloo.errors import UserError

        raise UserError(
            f"{source}: {reference!r} is not an image reference: use a lowercase registry/path and a tag of "
            "letters, digits, '.', '_' and '-' (registry/name:tag or registry/name@sha256:<digest>)."
        )


def read_record(path: str | os.PathLike[str]) -> dict[str, str]:
    """The references a build recorded (``images/build.py --record``, a JSON mapping of image or flavour name
    to reference), as the image of each step: a flavour serves its images where the record has none of
    their own. A missing, unreadable or wrong record is a one-line UserError."""
    from rloo.errors import UserError

    hint = "run 'make images' or 'make push-images' (images/build.py) to write it"
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--images {path}: no such file; {hint}.")
    try:
        record = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"--images {path}: not JSON; {hint}.") from None
    if not isinstance(record, dict) or not record:
        raise UserError(f"--images {path}: expected a JSON mapping of image name to reference; {hint}.")
    known = [*IMAGE_EXTRAS, *FLAVOURS]
    for name, ref in record.items():
        if name not in known:
            raise UserError(f"--images {path}: unknown image {name!r}; the names are {', '.join(known)}.")
        if not isinstance(ref, str) or not is_reference(ref):
            raise UserError(
                f"--images {path}: {name}: {ref!r} is not an image reference (registry/name:tag or "
                f"registry/name@sha256:<digest>)."
            )
    chosen = {name: record[name] for name in IMAGE_EXTRAS if name in record}
    for flavour in FLAVOURS.keys() & record.keys():
        for name in FLAVOURS[flavour]:
            chosen.setdefault(name, record[flavour])
    return chosen


def use_record(path: str | os.PathLike[str]) -> dict[str, str]:
    """Name the record's images (:func:`read_record`) for every step compiled or run from now on: images the
    record does not name keep their usual reference. Call it before the pipeline is loaded: the components
    take their image when they are imported. Returns image name -> reference, for every image."""
    chosen = read_record(path)
    loaded = [m for m in sys.modules if m == "components" or m.startswith("components.")]
    if loaded:
        raise RuntimeError(
            f"use_record after the components were imported ({loaded[0]}): their images are set"
        )
    for name, ref in chosen.items():
        os.environ[f"RLOO_IMAGE_{name.upper()}"] = ref
    global TRAIN_IMAGE, EVAL_IMAGE, SLIM_IMAGE
    TRAIN_IMAGE, EVAL_IMAGE, SLIM_IMAGE = image("train"), image("eval"), image("slim")
    return {name: image(name) for name in IMAGE_EXTRAS}


TRAIN_IMAGE = image("train")
EVAL_IMAGE = image("eval")
SLIM_IMAGE = image("slim")
