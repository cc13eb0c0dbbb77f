"""What an OCI image reference is, as registries and Kubernetes take it: checked where a reference comes in
(a platform file, a build's record), so that a typo is one line here rather than an ``ImagePullBackOff`` later.
"""

from __future__ import annotations

import re

_DIGEST = r"@sha256:[0-9a-f]{64}"
# a reference as registries and Kubernetes take it: [host[:port]/]path[:tag][@sha256:digest], lowercase path
_REFERENCE = re.compile(
    r"(?:[a-zA-Z0-9.-]+(?::\d+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    rf"(?::[\w][\w.-]{{0,127}})?(?:{_DIGEST})?"
)


def is_reference(reference: str) -> bool:
    """Whether ``reference`` is an image reference as registries and Kubernetes take it."""
    return bool(_REFERENCE.fullmatch(reference))


def is_pinned(reference: str) -> bool:
    """Whether ``reference`` names one image by its registry digest (``...@sha256:<64 hex>``)."""
    return bool(re.search(f"{_DIGEST}$", reference))


# The tag the chart refuses (helm/templates/_helpers.tpl: images.tag, images.<name>.tag and every component's
# image.tag): it names a different image over time, so a retried step or a second node may run other code.
FLOATING_TAG = "latest"


def tag_of(reference: str) -> str | None:
    """The tag of ``reference`` (``reg:5000/a/b:1.2@sha256:...`` -> ``1.2``), None when it names none."""
    name = reference.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]  # a registry's port is before the last '/', a tag after it
    return last.rsplit(":", 1)[1] if ":" in last else None


def check_release_tag(reference: str, *, source: str) -> None:
    """Refuse an image reference the chart would refuse: tagged ``latest``, or (what a registry reads as
    ``latest``) with neither a tag nor a digest. One line naming ``source``, the setting it came from (such
    as ``RLOO_IMAGE_TAG``)."""
    from rloo.errors import UserError

    tag = tag_of(reference)
    if tag == FLOATING_TAG or (tag is None and not is_pinned(reference)):
        said = "is tagged latest" if tag else "has no tag, which registries read as latest"
        raise UserError(
            f"{source}: image {reference} {said}, which names a different image over time: set a release tag "
            "(unset RLOO_IMAGE_TAG for the package's version) or pin a digest (name@sha256:<digest>), as the "
            "Helm chart requires."
        )
