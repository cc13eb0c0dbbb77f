"""A real SeaweedFS S3 server for the storage tests (shared with tests/tracking, started once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.servers import S3Server, release, shared_s3, use_s3


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = shared_s3(tmp_path_factory.mktemp("servers"))
    yield server
    release("s3")


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The AWS environment of a pod that reaches the test server (and nothing else)."""
    return use_s3(s3_server, monkeypatch)
