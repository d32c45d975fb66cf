"""Authorization in a two-broker cluster (token auth): controller-to-broker segment calls
carry the cluster role and pass, ordinary roles cannot make them, a granted role produces
through either broker, and an active segment's data cannot be deleted even by a superuser.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from anabranch.aio import Client
from anabranch.testing.cluster import LocalCluster
from anabranch.testing.security import TokenAuth

V2 = "/admin/v2"
TOPIC = "topic://public/default/scaled"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, TokenAuth]]:
    auth = TokenAuth(extra={"authorization_enabled": True})
    cluster = LocalCluster(Path(tmp_path_factory.mktemp("authz-cluster")), brokers=2, security=auth)
    asyncio.run(cluster.start())
    try:
        yield cluster, auth
    finally:
        asyncio.run(cluster.stop())


async def test_segment_operations_between_brokers_pass_and_ordinary_roles_cannot(
    cluster: tuple[LocalCluster, TokenAuth],
) -> None:
    c, auth = cluster
    # Four segments spread over both brokers: creating, splitting and deleting them are
    # controller-to-owner calls made with the brokers' own (superuser) role.
    status, body, _ = await c.http_follow("PUT", f"{V2}/scalable/public/default/scaled"
                                          "?numInitialSegments=4")  # fmt: skip
    assert status in (200, 204), body
    status, body, _ = await c.http_follow("POST", f"{V2}/scalable/public/default/scaled/split/0")
    assert status in (200, 204), body
    status, body = await c.http(
        "POST", f"{V2}/namespaces/public/default/permissions/shop", json=["produce"]
    )
    assert status == 204, body

    for broker in c.live():  # a granted role produces through either broker
        async with Client(broker.service_url, auth_token=auth.token("shop")) as client:
            producer = await client.create_producer(TOPIC)
            for i in range(8):
                await producer.send(b"x", key=f"k{i}")
            await producer.close()

    owned = f"{V2}/cluster/segments/public/default/scaled/8000-bfff-2"
    shop = {"Authorization": f"Bearer {auth.token('shop')}"}
    for broker in c.live():
        for method, path in (("GET", f"{owned}/subscriptions"), ("DELETE", owned)):
            status, body = await c.http(method, path, via=broker, headers=shop)
            assert status == 403, (method, path, status, body)
    # The superuser may call it, but the layout says ACTIVE: refused on every broker (the
    # check reads the shared layout before the broker would claim or redirect).
    for broker in c.live():
        status, body = await c.http("DELETE", owned, via=broker)
        assert status == 409, (status, body)

    status, body, _ = await c.http_follow("DELETE", f"{V2}/scalable/public/default/scaled")
    assert status in (200, 204), body
    status, body = await c.http("GET", f"{V2}/scalable/public/default/scaled")
    assert status == 404, body  # the layout and its segments are gone
