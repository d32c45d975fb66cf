"""Unused topics deleted and unused subscriptions expired (Pulsar's inactive topic policies
and subscription expiration time) on a real in-process broker. The test calls the sweeps
itself and moves the broker's clock, so "a minute later" needs no waiting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.core.inactive_topics import DeleteMode, InactivePolicy, TopicUsage, due, in_use
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_retention import SkewedClock

NS = "public/default"
LONG_S = 3600.0


@dataclass
class World:
    broker: InProcessBroker
    admin: AdminClient
    client: Client
    clock: SkewedClock

    @staticmethod
    def topic(name: str) -> str:
        return f"persistent://{NS}/{name}"

    async def later(self, seconds: float) -> None:
        """Move the clock on, then sweep."""
        self.clock.monotonic_offset_s += seconds
        await self.broker.service.sweeps.sweep_inactive_topics()

    async def exists(self, topic: str) -> bool:
        return topic in await self.admin.list_topics(NS)

    async def produce(self, topic: str, *values: bytes) -> None:
        producer = await self.client.create_producer(topic)
        for value in values:
            await producer.send(value)
        await producer.close()

    async def read_all(self, topic: str) -> list[bytes]:
        reader = await self.client.create_reader(topic, "earliest")
        out = []
        while (msg := await reader.read_next(timeout=0.5)) is not None:
            out.append(msg.value)
        await reader.close()
        return out


async def world_of(tmp_path: Path, **config: Any) -> AsyncIterator[World]:
    clock = SkewedClock()
    async with InProcessBroker(
        tmp_path / "data", clock=clock, delete_inactive_topics_frequency_s=LONG_S, **config
    ) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            yield World(broker, admin, client, clock)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    """Deletion on, after 60 s unused, in the default mode (no subscriptions)."""
    async for w in world_of(
        tmp_path,
        delete_inactive_topics_enabled=True,
        delete_inactive_topics_max_inactive_duration_s=60,
    ):
        yield w


# --- the decisions (pure) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("usage", "no_subscriptions", "caught_up"),
    [
        (TopicUsage(0, 0, 0, 0), False, False),
        (TopicUsage(1, 0, 0, 0), True, True),
        (TopicUsage(0, 1, 1, 0), True, True),
        (TopicUsage(0, 0, 1, 0), True, False),
        (TopicUsage(0, 0, 1, 5), True, True),
        (TopicUsage(0, 0, 0, 0, open_transactions=1), True, True),
    ],
)
def test_what_counts_as_in_use_by_mode(
    usage: TopicUsage, no_subscriptions: bool, caught_up: bool
) -> None:
    assert in_use(usage, DeleteMode.NO_SUBSCRIPTIONS) is no_subscriptions
    assert in_use(usage, DeleteMode.SUBSCRIPTIONS_CAUGHT_UP) is caught_up


def test_due_only_when_enabled_and_the_period_has_passed() -> None:
    on = InactivePolicy(True, DeleteMode.NO_SUBSCRIPTIONS, 60)
    assert not due(on, last_in_use_s=0, now_s=59.9)
    assert due(on, last_in_use_s=0, now_s=60)
    off = InactivePolicy(False, DeleteMode.NO_SUBSCRIPTIONS, 60)
    assert not due(off, last_in_use_s=0, now_s=1e9)


# --- the sweep -------------------------------------------------------------------------------


async def test_an_unused_topic_goes_after_its_period_and_its_name_starts_afresh(
    world: World,
) -> None:
    topic = world.topic("idle")
    await world.produce(topic, b"old-1", b"old-2")
    await world.later(30)
    assert await world.exists(topic)  # unused for 30 s only
    await world.later(31)
    assert not await world.exists(topic)
    assert world.broker.service.counters.inactive_topics_deleted == 1
    await world.produce(topic, b"new")  # auto-created again, empty
    assert await world.read_all(topic) == [b"new"]


async def test_a_producer_a_consumer_or_a_subscription_keeps_a_topic(world: World) -> None:
    with_producer, with_consumer, with_cursor = (
        world.topic(n) for n in ("keep-p", "keep-c", "keep-s")
    )
    producer = await world.client.create_producer(with_producer)
    await world.client.subscribe(with_consumer, "live")
    await (await world.client.subscribe(with_cursor, "parked")).close()
    await world.later(3600)
    for topic in (with_producer, with_consumer, with_cursor):
        assert await world.exists(topic), topic
    # The period runs from when the producer left, even with no sweep seeing it in use.
    world.clock.monotonic_offset_s += 3600
    await producer.close()
    await world.later(30)
    assert await world.exists(with_producer)
    await world.later(31)
    assert not await world.exists(with_producer)


async def test_caught_up_mode_deletes_a_topic_whose_subscriptions_acked_everything(
    world: World,
) -> None:
    topic = world.topic("caught-up")
    await world.admin.set_inactive_topic_policies(
        NS,
        delete_while_inactive=True,
        max_inactive_duration_s=10,
        mode="delete_when_subscriptions_caught_up",
    )
    consumer = await world.client.subscribe(topic, "s")
    await world.produce(topic, b"a", b"b")
    first = await consumer.receive(timeout=5)
    assert first is not None
    await consumer.acknowledge(first)
    await consumer.close()
    await world.later(60)
    assert await world.exists(topic)  # one message left to acknowledge
    consumer = await world.client.subscribe(topic, "s")
    second = await consumer.receive(timeout=5)
    assert second is not None and second.value == b"b"
    await consumer.acknowledge(second)
    await consumer.close()
    await world.later(60)
    assert not await world.exists(topic)


async def test_partitions_are_left_alone(world: World) -> None:
    await world.admin.create_partitioned_topic(world.topic("parted"), 2)
    await world.produce(world.topic("parted"), b"x")
    await world.later(3600)
    names = await world.admin.list_topics(NS)
    assert {world.topic("parted-partition-0"), world.topic("parted-partition-1")} <= set(names)
    assert world.broker.service.counters.inactive_topics_deleted == 0


# --- policies: broker default off, namespace and topic levels --------------------------------


async def test_off_by_default_and_the_levels_of_the_policy(tmp_path: Path) -> None:
    async for w in world_of(tmp_path):
        kept, gone, pinned = (w.topic(n) for n in ("kept", "gone", "pinned"))
        for topic in (kept, gone, pinned):
            await w.produce(topic, b"x")
        await w.later(3600)
        assert all([await w.exists(t) for t in (kept, gone, pinned)])  # the broker's: off
        assert await w.admin.get_inactive_topic_policies(gone, applied=True) == {
            "inactiveTopicDeleteMode": "delete_when_no_subscriptions",
            "maxInactiveDurationSeconds": int(LONG_S),
            "deleteWhileInactive": False,
        }
        await w.admin.set_inactive_topic_policies(
            NS, delete_while_inactive=True, max_inactive_duration_s=5
        )
        await w.admin.set_inactive_topic_policies(
            pinned, delete_while_inactive=False, max_inactive_duration_s=5
        )
        assert (await w.admin.get_inactive_topic_policies(NS) or {})["deleteWhileInactive"]
        await w.later(10)
        assert not await w.exists(gone)
        assert not await w.exists(kept)
        assert await w.exists(pinned)  # its own policy wins
        await w.admin.remove_inactive_topic_policies(NS)
        assert await w.admin.get_inactive_topic_policies(NS) is None


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"inactiveTopicDeleteMode": "delete_sometimes", "maxInactiveDurationSeconds": 5}, 412),
        ({"maxInactiveDurationSeconds": -1, "deleteWhileInactive": True}, 412),
        ({"maxInactiveDurationSeconds": 2**31, "deleteWhileInactive": True}, 412),
        # No Java long holds it: unreadable (400), as Jackson answers.
        ({"maxInactiveDurationSeconds": 10**30, "deleteWhileInactive": True}, 400),
    ],
)
async def test_a_bad_policy_is_refused_and_changes_nothing(
    world: World, body: dict[str, Any], status: int
) -> None:
    path = f"/admin/v2/namespaces/{NS}/inactiveTopicPolicies"
    with pytest.raises(AdminHttpError) as refused:
        await world.admin.request("POST", path, body)
    assert refused.value.status == status
    assert await world.admin.get_inactive_topic_policies(NS) is None


async def test_a_topic_used_while_it_is_deleted_comes_back_new_and_keeps_what_it_gets(
    world: World,
) -> None:
    topic = world.topic("reborn")
    await world.produce(topic, b"old")
    deleting = asyncio.ensure_future(world.broker.service.delete_topic(topic))
    await asyncio.sleep(0)  # the deletion has begun: the topic is out of the loaded map
    await world.produce(topic, b"new")  # its load waits for the deletion to end
    await deleting
    assert await world.read_all(topic) == [b"new"]


# --- subscription expiration -----------------------------------------------------------------


async def expire_later(world: World, seconds: float) -> None:
    world.clock.monotonic_offset_s += seconds
    await world.broker.service.sweeps.sweep_expired_subscriptions()


async def test_a_subscription_without_a_consumer_expires_after_its_time(world: World) -> None:
    topic, parted = world.topic("expiry"), world.topic("expiry-parted")
    await world.admin.create_partitioned_topic(parted, 2)
    await (await world.client.subscribe(topic, "idle")).close()
    await (await world.client.subscribe(parted, "idle")).close()  # on each partition
    live = await world.client.subscribe(topic, "live")
    await expire_later(world, 10**6)
    assert sorted(await world.admin.subscriptions(topic)) == ["idle", "live"]  # broker: never
    await world.admin.set_subscription_expiration_time(NS, 1)
    await expire_later(world, 0)  # "idle" has been without a consumer for long enough
    assert await world.admin.subscriptions(topic) == ["live"]
    for i in range(2):
        assert await world.admin.subscriptions(f"{parted}-partition-{i}") == []
    assert world.broker.service.counters.subscriptions_expired == 3
    # A consumer leaving starts the time again; the topic itself stays.
    await live.close()
    await expire_later(world, 30)
    assert await world.admin.subscriptions(topic) == ["live"]
    await expire_later(world, 31)
    assert await world.admin.subscriptions(topic) == []
    assert await world.exists(topic)


async def test_a_subscription_holding_transactional_acks_waits_for_them(world: World) -> None:
    topic = world.topic("expiry-txn")
    await world.admin.set_subscription_expiration_time(NS, 1)
    consumer = await world.client.subscribe(topic, "s")
    await world.produce(topic, b"m")
    msg = await consumer.receive(timeout=5)
    assert msg is not None
    txn = await world.client.new_transaction(timeout=3600)
    await consumer.acknowledge(msg, txn=txn)
    await consumer.close()
    await expire_later(world, 120)
    assert await world.admin.subscriptions(topic) == ["s"]  # the transaction holds an ack
    await txn.commit()
    await expire_later(world, 0)
    assert await world.admin.subscriptions(topic) == []


@pytest.mark.parametrize("body", [-1, 2**31])
async def test_an_expiration_time_out_of_range_is_refused(world: World, body: int) -> None:
    path = f"/admin/v2/namespaces/{NS}/subscriptionExpirationTime"
    with pytest.raises(AdminHttpError) as refused:
        await world.admin.request("POST", path, body)
    assert refused.value.status == 412
    assert await world.admin.get_subscription_expiration_time(NS) is None
