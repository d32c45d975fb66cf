"""Fixtures of the three-broker cluster tests (helpers in ``local_cluster.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from anabranch.testing.cluster import LocalCluster
from tests.cluster.local_cluster import SESSION_TTL_S


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three brokers on one etcd, started once per test module, with deduplication on in
    ``public/default``."""
    local = LocalCluster(tmp_path_factory.mktemp("cluster"), brokers=3, session_ttl_s=SESSION_TTL_S)
    asyncio.run(local.start())
    try:
        status, body = asyncio.run(
            local.http("POST", "/admin/v2/namespaces/public/default/deduplication", json=True)
        )
        assert status == 204, body
        yield local
    finally:
        asyncio.run(local.stop())


@pytest.fixture
async def three_brokers(cluster: LocalCluster) -> AsyncIterator[LocalCluster]:
    """The cluster, with every broker running again after the test."""
    yield cluster
    for broker in cluster.brokers:
        broker.resume()
        if not broker.running:
            await broker.start()
    await cluster.wait_registered(3)
