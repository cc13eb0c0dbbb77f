"""The image tag a pipeline is compiled with obeys the chart's rule: ``latest`` is refused.

The rule is the chart's own (this repository's ``helm/templates/_helpers.tpl``, rendered here with real Helm:
``images.tag`` ``latest`` fails the render), and the reason is Kubernetes': a tag names whatever was pushed
last, and a ``:latest`` image (or one with no tag, which the registry reads as ``latest``) gets
``imagePullPolicy: Always`` (kubernetes/kubernetes ``pkg/apis/core/v1/defaults.go``, ``SetDefaults_Container``),
so a retried step or a second node may run different code than the first.
"""

from __future__ import annotations

import pytest

from rloo.errors import UserError
from rloo.k8s.images import check_release_tag, tag_of
from tests.helm.helpers import render

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize("tag", ["latest", "0.2.0", "Latest", "latest-cuda", "dev"])
def test_the_tag_rule_is_the_charts(tag: str) -> None:
    try:
        render({"images": {"tag": tag}})
        chart_refuses = False
    except Exception as e:  # helm's fail(): the render error names the value
        assert "images.tag is latest" in str(e)
        chart_refuses = True
    try:
        check_release_tag(f"registry.example.com/ml/rloo-train:{tag}", source="RLOO_IMAGE_TAG")
        refused = False
    except UserError as e:
        assert str(e).startswith("RLOO_IMAGE_TAG: image registry.example.com/ml/rloo-train:latest is tagged")
        refused = True
    assert refused == chart_refuses == (tag == "latest")


def test_no_tag_is_latest_unless_a_digest_pins_it() -> None:
    with pytest.raises(UserError, match="has no tag, which registries read as latest"):
        check_release_tag("registry.example.com:5000/ml/rloo-train", source="RLOO_IMAGE_TRAIN")
    check_release_tag(f"registry.example.com:5000/ml/rloo-train@{DIGEST}", source="RLOO_IMAGE_TRAIN")
    assert tag_of("registry.example.com:5000/ml/rloo-train") is None
    assert tag_of(f"registry.example.com:5000/ml/rloo-train:1.2@{DIGEST}") == "1.2"
