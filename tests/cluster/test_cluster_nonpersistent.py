"""Non-persistent topics on three brokers: one owner per topic, clients follow it.

A non-persistent topic exists only in its owner's memory, so ownership is what makes it
one topic: the official client reaches the owner from any broker, the admin routes of a
non-owner answer 307 to it, every broker lists the topic, and an unload moves it to
another broker where the clients carry on (what was in flight is lost, as upstream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import pulsar

from anabranch.testing.cluster import LocalCluster
from tests.cluster.local_cluster import fresh_name, others

R = TypeVar("R")
RECEIVE_MS = 10_000


async def run(fn: Callable[[], R]) -> R:
    return await asyncio.to_thread(fn)


def until_received(
    producer: Any, consumer: Any, prefix: bytes, attempts: int = 300
) -> tuple[bytes, int]:
    """Send until the consumer gets one (its FLOW, or its move, may lag the producer's):
    messages sent before it is attached are dropped, by design. Returns what it got and
    how many were sent."""
    for attempt in range(attempts):
        producer.send(b"%s%d" % (prefix, attempt))
        try:
            return bytes(consumer.receive(100).data()), attempt + 1
        except pulsar.Timeout:
            continue
    raise AssertionError(f"nothing received after {attempts} sends")


async def test_one_owner_redirects_listing_and_unload(cluster: LocalCluster) -> None:
    topic = f"non-persistent://public/default/{fresh_name('np')}"
    local = topic.removeprefix("non-persistent://")
    entry = cluster.live()[0]
    c = await run(lambda: pulsar.Client(entry.service_url, operation_timeout_seconds=30))
    try:
        consumer = await run(lambda: c.subscribe(topic, "s"))
        producer = await run(lambda: c.create_producer(topic, batching_enabled=False))
        first, _ = await run(lambda: until_received(producer, consumer, b"one"))
        assert first.startswith(b"one")
        owner = await cluster.owner_of(topic)
        status, stats = await cluster.http("GET", f"/admin/v2/non-persistent/{local}/stats",
                                           via=owner)  # fmt: skip
        assert status == 200 and stats["msgInCounter"] >= 1
        assert list(stats["subscriptions"]) == ["s"]
        for other in others(cluster, owner):
            status, location = await cluster.http(
                "GET", f"/admin/v2/non-persistent/{local}/stats", via=other
            )
            assert status == 307 and str(location).startswith(owner.http_url), location
            status, listed = await cluster.http(
                "GET", "/admin/v2/non-persistent/public/default", via=other
            )
            assert status == 200 and topic in listed
        # Move it: the new owner starts empty, the clients find it and carry on.
        target = others(cluster, owner)[0]
        status, body = await cluster.http(
            "PUT",
            f"/admin/v2/non-persistent/{local}/unload?destinationBroker={target.broker_id}",
            via=owner,
        )
        assert status == 204, body
        again, sent = await run(lambda: until_received(producer, consumer, b"two"))
        assert again.startswith(b"two")
        assert await cluster.owner_of(topic) is target
        status, moved = await cluster.http(
            "GET", f"/admin/v2/non-persistent/{local}/stats", via=target
        )
        assert status == 200 and 1 <= moved["msgInCounter"] <= sent  # nothing came along
        assert [p["msgInCounter"] >= 1 for p in moved["publishers"]] == [True]
    finally:
        await run(c.close)


async def test_an_unknown_topic_is_not_found_and_not_claimed(cluster: LocalCluster) -> None:
    local = f"public/default/{fresh_name('nowhere')}"
    for broker in cluster.live():
        status, _ = await cluster.http("GET", f"/admin/v2/non-persistent/{local}/stats", via=broker)
        assert status == 404
    listed = await cluster.http("GET", "/admin/v2/non-persistent/public/default")
    assert f"non-persistent://{local}" not in listed[1]
