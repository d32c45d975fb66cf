"""``/stats`` of a scalable topic asked at a broker that is not its controller leader.

The assignment state (and the autoscaler's view) lives on the leader. A non-leader answers
307 to the leader, as it does for mutations and as Pulsar redirects to a topic's owner, so
that any HTTP client (curl, ``anabranch admin scalable stats``) gets the real stats from any
broker. The redirect carries a hop count: past ``ADMIN_STATS_REDIRECTS_MAX`` (brokers that
disagree on who leads, for a moment) a broker answers what it knows itself instead of
sending the client round in circles.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from anabranch import limits
from anabranch.admin.client import AdminClient
from anabranch.testing.cluster import LocalCluster

TOPIC = "topic://public/default/stats-elsewhere"
STATS_PATH = "/admin/v2/scalable/public/default/stats-elsewhere/stats"


@pytest.fixture(scope="module")
def two_brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("cluster"), brokers=2, session_ttl_s=3.0)
    asyncio.run(local.start())
    try:
        yield local
    finally:
        asyncio.run(local.stop())


async def get(url: str, *, follow: bool) -> tuple[int, dict[str, str], Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url, allow_redirects=follow) as response,
    ):
        body = await response.json() if response.content_type == "application/json" else None
        return response.status, dict(response.headers), body


async def test_stats_at_a_non_leader_redirect_to_the_leader(two_brokers: LocalCluster) -> None:
    first, second = two_brokers.live()
    async with AdminClient(first.http_url) as admin:
        await admin.create_scalable_topic(TOPIC, 2)
        await admin.create_scalable_subscription(TOPIC, "billing")
        leader_url = (await admin.scalable_stats(TOPIC))["controllerBrokerUrl"]
    leader = two_brokers.by_url(leader_url)
    other = second if leader is first else first

    status, headers, _ = await get(other.http_url + STATS_PATH, follow=False)
    assert status == 307
    assert headers["Location"].startswith(leader_url.rstrip("/") + STATS_PATH)

    # A plain HTTP client that follows redirects gets the leader's real stats.
    status, _, stats = await get(other.http_url + STATS_PATH, follow=True)
    assert status == 200
    state = stats["subscriptionStates"]["billing"]
    assert state["leader"] is True and state["type"] == "STREAM"
    assert state["consumers"] == {} and state["unassignedSegments"] == [0, 1]
    async with AdminClient(other.http_url) as admin:
        assert (await admin.scalable_stats(TOPIC))["subscriptionStates"]["billing"] == state

    # The leader answers itself, never redirecting to itself.
    status, _, _ = await get(leader_url.rstrip("/") + STATS_PATH, follow=False)
    assert status == 200


async def test_the_redirect_hop_count_is_bounded(two_brokers: LocalCluster) -> None:
    async with AdminClient(two_brokers.live()[0].http_url) as admin:
        if TOPIC not in await admin.list_scalable_topics("public/default"):
            await admin.create_scalable_topic(TOPIC, 2)
            await admin.create_scalable_subscription(TOPIC, "billing")
        leader_url = (await admin.scalable_stats(TOPIC))["controllerBrokerUrl"]
    leader = two_brokers.by_url(leader_url)
    other = next(b for b in two_brokers.live() if b is not leader)
    hops = limits.ADMIN_STATS_REDIRECTS_MAX

    status, headers, _ = await get(
        other.http_url + STATS_PATH + f"?redirects={hops - 1}", follow=False
    )
    assert status == 307
    assert f"redirects={hops}" in headers["Location"]
    status, _, stats = await get(other.http_url + STATS_PATH + f"?redirects={hops}", follow=False)
    assert status == 200  # the last hop answers what this broker knows
    assert stats["subscriptionStates"] == {"billing": {"leader": False}}
    assert stats["controllerBrokerUrl"] == leader_url
