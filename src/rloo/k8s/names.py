"""Kubernetes' rules for the names of objects, as ``k8s.io/apimachinery/pkg/util/validation/validation.go``
states them (``IsDNS1123Label``, ``IsDNS1123Subdomain``): a DNS-1123 label (a Pod's or Service's name, a
training job's, whose pods and services are named after it) is at most 63 lower-case alphanumerics and '-',
starting and ending alphanumeric; a DNS-1123 subdomain (most objects' names: a Secret's, a ConfigMap's) is such
labels joined by '.', at most 253 characters. Go's ``^...$`` anchors the whole string, hence ``fullmatch``."""

from __future__ import annotations

import re

DNS1123_LABEL_MAX_LENGTH = 63
DNS1123_SUBDOMAIN_MAX_LENGTH = 253
_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = re.compile(_LABEL)
DNS1123_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def is_dns1123_label(value: str) -> bool:
    """Whether ``value`` is a valid DNS-1123 label."""
    return len(value) <= DNS1123_LABEL_MAX_LENGTH and DNS1123_LABEL.fullmatch(value) is not None


def is_dns1123_subdomain(value: str) -> bool:
    """Whether ``value`` is a valid DNS-1123 subdomain."""
    return len(value) <= DNS1123_SUBDOMAIN_MAX_LENGTH and DNS1123_SUBDOMAIN.fullmatch(value) is not None
