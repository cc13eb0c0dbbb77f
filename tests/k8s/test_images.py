"""What an image reference is: what registries and Kubernetes take, and pinned only by a sha256 digest."""

from __future__ import annotations

import pytest

from rloo.k8s.images import is_pinned, is_reference

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "ref",
    [
        "busybox",
        "ghcr.io/rloo-kfp/rloo-train:0.2.0",
        "registry.corp:5000/ml/rloo-slim:1.2",
        f"registry.corp:5000/ml/rloo-slim@{DIGEST}",
        f"reg/ml/rloo-slim:1@{DIGEST}",
        "reg/a__b/c-d.e:Tag_1.2-rc",
    ],
)
def test_references(ref: str) -> None:
    assert is_reference(ref)


@pytest.mark.parametrize(
    "ref",
    ["", "Reg/UPPER:1", "reg/x@sha256:123", "reg/x:", "reg/x y:1", "reg/x:-tag", "reg//x", "reg/x:1 "],
)
def test_not_references(ref: str) -> None:
    assert not is_reference(ref)


def test_pinned_means_a_sha256_digest() -> None:
    assert is_pinned(f"reg/ml/rloo-slim@{DIGEST}") and is_pinned(f"reg/ml/rloo-slim:1@{DIGEST}")
    assert not is_pinned("reg/ml/rloo-slim:1") and not is_pinned("reg/ml/rloo-slim@sha256:abc")
