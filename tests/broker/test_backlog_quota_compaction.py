"""Backlog quotas ignore the topic's ``__compaction`` cursor, as upstream does (its
``BrokerService.isSystemCursor``): a compactor that lags must neither block producers nor
have its cursor moved by an eviction. Before, the quota sweep took the compaction cursor
for the slowest subscription.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.broker.compaction import CURSOR_NAME
from anabranch.broker.topic import PersistentTopic
from anabranch.storage.api import Position
from anabranch.testing.broker import InProcessBroker

NS = "public/default"
PAYLOAD = b"x" * 1000
LONG_S = 3600.0
RECEIVE_S = 10.0


@dataclass
class World:
    broker: InProcessBroker
    admin: AdminClient
    client: Client


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with InProcessBroker(
        tmp_path,
        backlog_quota_check_interval_s=LONG_S,
        compaction_check_interval_s=LONG_S,
        cursor_persist_interval_ms=0,
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            yield World(broker, admin, client)


async def compacted_then_lagging(world: World, name: str) -> tuple[PersistentTopic, Position]:
    """A topic compacted once, then 10 x 1 KB more: the compaction cursor is behind them
    and subscription "s" has consumed everything."""
    topic_name = f"persistent://{NS}/{name}"
    consumer = await world.client.subscribe(topic_name, "s", initial_position="earliest")
    producer = await world.client.create_producer(topic_name, batching=False)
    await producer.send(b"first", key="k")
    topic = world.broker.service.loaded_topic(topic_name)
    assert topic is not None
    run = world.broker.service.compactions.of(topic)
    await run.trigger()
    await run.wait()
    assert run.status == "SUCCESS"
    for i in range(10):
        await producer.send(PAYLOAD, key=f"k{i}")
    for _ in range(11):
        msg = await consumer.receive(timeout=RECEIVE_S)
        assert msg is not None
        await consumer.acknowledge(msg)
    await consumer.close()
    await producer.close()
    compaction = next(c for c in topic.ledger.cursors() if c.name == CURSOR_NAME)
    assert compaction.backlog() >= 10  # the compactor lags (it sits before its horizon)
    sub = next(c for c in topic.ledger.cursors() if c.name == "s")
    for _ in range(1000):  # the acks reach the cursor asynchronously
        if sub.backlog() == 0:
            break
        await asyncio.sleep(0.01)
    assert sub.backlog() == 0
    return topic, compaction.mark_delete_position


@pytest.mark.parametrize("policy", ["producer_exception", "producer_request_hold"])
async def test_a_lagging_compactor_does_not_block_producers(world: World, policy: str) -> None:
    topic, _ = await compacted_then_lagging(world, f"lagging-{policy}")
    await world.admin.set_backlog_quota(NS, limit_size=5_000, policy=policy)
    await world.broker.service.sweeps.sweep_backlog_quotas()
    assert topic.quota.blocked is None
    producer = await world.client.create_producer(topic.name, batching=False)
    assert await producer.send(b"not blocked") is not None


async def test_eviction_never_moves_the_compaction_cursor(world: World) -> None:
    topic, before = await compacted_then_lagging(world, "lagging-evict")
    await world.admin.set_backlog_quota(NS, limit_size=5_000, policy="consumer_backlog_eviction")
    await world.broker.service.sweeps.sweep_backlog_quotas()
    compaction = next(c for c in topic.ledger.cursors() if c.name == CURSOR_NAME)
    assert compaction.mark_delete_position == before
    assert world.broker.service.counters.backlog_evictions == 0
