"""The container images the pipeline's steps run in: the one place their names are defined.

Each image is built from ``images/<name>/Dockerfile`` in this repository (a test checks both directions).
Override the registry or tag at compile time with ``RLOO_IMAGE_REGISTRY`` / ``RLOO_IMAGE_TAG``, or one image
with ``RLOO_IMAGE_<NAME>`` (e.g. ``RLOO_IMAGE_TRAIN=my.registry/rloo-train:dev``).
"""

from __future__ import annotations

import os

DEFAULT_REGISTRY = "ghcr.io/rloo-kfp"
DEFAULT_TAG = "0.1.0"

# image name -> the package extras its Dockerfile must install (kfp: the executor of lightweight components,
# since they are built with install_kfp_package=False).
IMAGE_EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("train", "tracking", "kfp", "vllm"),
    "eval": ("eval", "tracking", "kfp", "vllm"),
    "slim": ("tracking", "kfp"),
}


def image(name: str) -> str:
    """Full reference of image ``name`` (``train``, ``eval`` or ``slim``), environment overrides applied."""
    if name not in IMAGE_EXTRAS:
        raise KeyError(f"unknown image {name!r}; choose one of {', '.join(IMAGE_EXTRAS)}")
    override = os.environ.get(f"RLOO_IMAGE_{name.upper()}")
    if override:
        return override
    registry = os.environ.get("RLOO_IMAGE_REGISTRY", DEFAULT_REGISTRY).rstrip("/")
    tag = os.environ.get("RLOO_IMAGE_TAG", DEFAULT_TAG)
    return f"{registry}/rloo-{name}:{tag}"


TRAIN_IMAGE = image("train")
EVAL_IMAGE = image("eval")
SLIM_IMAGE = image("slim")
