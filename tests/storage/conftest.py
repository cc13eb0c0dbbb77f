"""The AWS environment of the storage tests: the shared SeaweedFS server (tests/conftest.py) and nothing else."""

from __future__ import annotations

import pytest

from tests.fixtures.servers import S3Server, use_s3


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The AWS environment of a pod that reaches the test server (and nothing else)."""
    return use_s3(s3_server, monkeypatch)
