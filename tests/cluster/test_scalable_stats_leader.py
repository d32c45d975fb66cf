"""``/stats`` of a scalable topic asked at a broker that is not its controller leader: the
assignment state lives on the leader, the admin client fetches it from there."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from anabranch.admin.client import AdminClient
from anabranch.testing.cluster import LocalCluster

TOPIC = "topic://public/default/stats-elsewhere"


@pytest.fixture(scope="module")
def two_brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("cluster"), brokers=2, session_ttl_s=3.0)
    asyncio.run(local.start())
    try:
        yield local
    finally:
        asyncio.run(local.stop())


async def test_stats_at_a_non_leader_show_the_leaders_assignments(
    two_brokers: LocalCluster,
) -> None:
    first, second = two_brokers.live()
    async with AdminClient(first.http_url) as admin:
        await admin.create_scalable_topic(TOPIC, 2)
        await admin.create_scalable_subscription(TOPIC, "billing")
        leader_url = (await admin.scalable_stats(TOPIC))["controllerBrokerUrl"]
    leader = two_brokers.by_url(leader_url)
    other = second if leader is first else first
    raw = await other_stats(other.http_url)
    assert raw["subscriptionStates"] == {"billing": {"leader": False}}  # what it knows itself
    async with AdminClient(other.http_url) as admin:
        stats = await admin.scalable_stats(TOPIC)
    state = stats["subscriptionStates"]["billing"]
    assert state["leader"] is True and state["type"] == "STREAM"
    assert state["consumers"] == {} and state["unassignedSegments"] == [0, 1]


async def other_stats(url: str) -> dict[str, object]:
    async with AdminClient(url) as admin:
        return dict(
            await admin.request("GET", "/admin/v2/scalable/public/default/stats-elsewhere/stats")
        )
