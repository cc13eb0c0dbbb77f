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
