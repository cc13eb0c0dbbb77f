"""Kubernetes' name rules, one definition for every check of rloo.k8s: the cases of
``kubernetes/kubernetes staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go`` (``IsDNS1123Label``:
``[a-z0-9]([-a-z0-9]*[a-z0-9])?``, at most 63 characters; ``IsDNS1123Subdomain``: such labels joined by '.', at
most 253, each label's length not checked) and its ``validation_test.go``."""

from __future__ import annotations

import pytest

from rloo.k8s.names import (
    DNS1123_LABEL_MAX_LENGTH,
    DNS1123_SUBDOMAIN_MAX_LENGTH,
    is_dns1123_label,
    is_dns1123_subdomain,
)

GOOD_LABELS = [
    "a",
    "ab",
    "abc",
    "a1",
    "a-1",
    "a--1--2--b",
    "0",
    "01",
    "012",
    "1a",
    "1-a",
    "1--a--b--2",
    "a" * 63,
]
BAD_NAMES = [
    "", "A", "ABC", "aBc", "A1", "A-1", "1-A", "-", "a-", "-a", "1-", "-1", "_", "a_", "_a", "a_b", "1_", "_1",
    "1_2", ".", "a.", ".a", "1.", ".1", " ", "a ", " a", "a b", "1 ", " 1", "1 2", "a\n", "a..b", "a.-b", "a-.b",
]  # fmt: skip
GOOD_SUBDOMAINS_ONLY = [
    "a.a",
    "a.b.c",
    "1.2.3",
    "a-1.b-2",
    "a" * 64,
    "a" * 253,
    ("a" * 63 + ".") * 3 + "a" * 61,
]


def test_limits_are_kubernetes() -> None:
    assert (DNS1123_LABEL_MAX_LENGTH, DNS1123_SUBDOMAIN_MAX_LENGTH) == (63, 253)


@pytest.mark.parametrize("name", GOOD_LABELS)
def test_a_label_is_a_subdomain_too(name: str) -> None:
    assert is_dns1123_label(name) and is_dns1123_subdomain(name)


@pytest.mark.parametrize("name", GOOD_SUBDOMAINS_ONLY)
def test_dots_and_length_make_a_subdomain_not_a_label(name: str) -> None:
    assert is_dns1123_subdomain(name) and not is_dns1123_label(name)


@pytest.mark.parametrize("name", [*BAD_NAMES, "a" * 254, "a." * 127])
def test_neither(name: str) -> None:
    assert not is_dns1123_label(name) and not is_dns1123_subdomain(name)
