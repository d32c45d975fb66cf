"""A real SeaweedFS S3 server shared by a module's tiered-storage tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from anabranch.storage.object_store import S3Settings
from anabranch.testing.seaweedfs import SeaweedS3


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """``weed server -s3`` on free loopback ports with one bucket and one key pair."""
    server = SeaweedS3.start(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        server.stop()


def settings_of(server: SeaweedS3, *, secret: str | None = None) -> S3Settings:
    """Settings that reach ``server`` (with another ``secret`` to test a wrong one)."""
    return S3Settings(
        server.endpoint,
        server.bucket,
        server.region,
        server.access_key,
        server.secret_key if secret is None else secret,
        max_retries=1,
        request_timeout_s=5.0,
    )
