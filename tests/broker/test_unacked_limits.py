"""Caps on unacknowledged messages (Pulsar's ``maxUnackedMessagesPerConsumer`` and
``maxUnackedMessagesPerSubscription``): the gate's rule against a model, and on a real
in-process broker a Shared consumer and a Shared subscription that stop being sent
messages at their cap and start again once acknowledgements bring them down to half."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch import limits
from anabranch.admin.client import AdminHttpError
from anabranch.broker.topic_limits import TopicLimits
from anabranch.client.consumer import Consumer, PartitionedConsumer
from anabranch.client.message import Message
from anabranch.core.unacked_gate import UnackedGate
from tests.broker.policy_world import NS, PolicyWorld, worlds

QUIET_S = 0.4
"""How long a consumer at its cap must get nothing (the broker would have sent at once)."""


# --- the gate (pure) -----------------------------------------------------------------------


@given(
    cap=st.integers(min_value=0, max_value=12),
    at_half=st.booleans(),
    counts=st.lists(st.integers(min_value=0, max_value=15), max_size=40),
)
def test_the_gate_closes_at_the_cap_and_opens_at_half(
    cap: int, at_half: bool, counts: list[int]
) -> None:
    gate = UnackedGate(cap=cap, reopen_at_half=at_half)
    closed = False  # the model: upstream's hysteresis
    for count in counts:
        if cap == 0:
            closed = False
        elif closed:
            closed = count > cap // 2 if at_half else count >= cap // 2
        else:
            closed = count >= cap
        assert gate.closed(count) is closed
        assert gate.is_closed is closed


# --- on a broker ---------------------------------------------------------------------------


class World(PolicyWorld):
    async def produce(self, topic: str, count: int) -> None:
        producer = await self.client.create_producer(topic, batching=False)
        for i in range(count):
            await producer.send(f"m{i}".encode())
        await producer.close()

    async def stats(self, topic: str, subscription: str) -> dict[str, Any]:
        stats: dict[str, Any] = (await self.admin.stats(topic))["subscriptions"][subscription]
        return stats


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async for w in worlds(World, tmp_path):
        yield w


async def drain(consumer: Consumer | PartitionedConsumer) -> list[Message]:
    """Everything the consumer is sent until it gets nothing for ``QUIET_S``."""
    got = []
    while (msg := await consumer.receive(timeout=QUIET_S)) is not None:
        got.append(msg)
    return got


@pytest.mark.parametrize("sub_type", ["Shared", "Key_Shared"])
async def test_a_shared_consumer_at_its_cap_is_sent_more_once_down_to_half(
    world: World, sub_type: str
) -> None:
    topic = world.topic(f"unacked-consumer-{sub_type}")
    await world.admin.set_cap(NS, "maxUnackedMessagesPerConsumer", 10)
    consumer = await world.client.subscribe(topic, "s", subscription_type=sub_type)
    await world.produce(topic, 30)
    held = await drain(consumer)
    assert len(held) == 10
    stats = await world.stats(topic, "s")
    assert stats["unackedMessages"] == 10
    assert stats["consumers"][0]["blockedConsumerOnUnackedMsgs"] is True
    for msg in held[:4]:  # 6 left: more than half
        await consumer.acknowledge(msg)
    assert await drain(consumer) == []
    await consumer.acknowledge(held[4])  # 5 left: half, so it opens (up to the cap again)
    more = await drain(consumer)
    assert len(more) == 5
    assert [m.value for m in held + more] == [f"m{i}".encode() for i in range(15)]


async def test_a_shared_subscription_at_its_cap_stops_all_its_consumers(world: World) -> None:
    topic = world.topic("unacked-subscription")
    await world.produce(topic, 0)  # the topic exists for its policy routes
    await world.admin.set_cap(topic, "maxUnackedMessagesOnSubscription", 8)
    assert await world.admin.get_cap(topic, "maxUnackedMessagesOnSubscription") == 8
    assert await world.admin.get_cap(topic, "maxUnackedMessagesOnConsumer", applied=True) == (
        world.broker.service.config.max_unacked_messages_per_consumer
    )
    a = await world.client.subscribe(topic, "s", subscription_type="Shared")
    b = await world.client.subscribe(topic, "s", subscription_type="Shared")
    await world.produce(topic, 30)
    held_a, held_b = await drain(a), await drain(b)
    assert len(held_a) + len(held_b) == 8
    assert (await world.stats(topic, "s"))["blockedSubscriptionOnUnackedMsgs"] is True
    # Down to 4 of 8 is not yet below half; 3 is.
    acks = [(a, m) for m in held_a] + [(b, m) for m in held_b]
    for consumer, msg in acks[:4]:
        await consumer.acknowledge(msg)
    assert await drain(a) == [] and await drain(b) == []
    consumer, msg = acks[4]
    await consumer.acknowledge(msg)
    assert len(await drain(a)) + len(await drain(b)) == 5  # up to the cap again
    assert (await world.stats(topic, "s"))["blockedSubscriptionOnUnackedMsgs"] is True


async def test_a_changed_subscription_cap_applies_to_a_subscription_already_there(
    world: World,
) -> None:
    topic = world.topic("unacked-refresh")
    await world.admin.set_cap(NS, "maxUnackedMessagesPerSubscription", 4)
    consumer = await world.client.subscribe(topic, "s", subscription_type="Shared")
    await world.produce(topic, 20)
    assert len(await drain(consumer)) == 4
    await world.admin.set_cap(NS, "maxUnackedMessagesPerSubscription", 0)  # 0: no cap
    assert await drain(consumer) == []  # not before the refresh
    await world.broker.service.sweeps.sweep_rates()
    assert len(await drain(consumer)) == 16
    stats = await world.stats(topic, "s")
    assert stats["blockedSubscriptionOnUnackedMsgs"] is False
    assert stats["unackedMessages"] == 20


async def test_exclusive_and_failover_consumers_have_no_unacked_cap(world: World) -> None:
    topic = world.topic("unacked-exclusive")
    await world.admin.set_cap(NS, "maxUnackedMessagesPerConsumer", 3)
    await world.admin.set_cap(NS, "maxUnackedMessagesPerSubscription", 3)
    exclusive = await world.client.subscribe(topic, "e")
    failover = await world.client.subscribe(topic, "f", subscription_type="Failover")
    await world.produce(topic, 12)
    assert len(await drain(exclusive)) == 12
    assert len(await drain(failover)) == 12
    assert (await world.stats(topic, "e"))["blockedSubscriptionOnUnackedMsgs"] is False


def test_no_cap_is_still_the_brokers_ceiling() -> None:
    assert TopicLimits(max_unacked_per_consumer=0).consumer_unacked_cap == (
        limits.CONSUMER_UNACKED_MESSAGES_MAX
    )
    assert TopicLimits(max_unacked_per_consumer=10**9).consumer_unacked_cap == (
        limits.CONSUMER_UNACKED_MESSAGES_MAX
    )


@pytest.mark.parametrize("body", [-1, 2**31])
async def test_an_unacked_cap_out_of_range_is_refused(world: World, body: int) -> None:
    path = f"/admin/v2/namespaces/{NS}/maxUnackedMessagesPerSubscription"
    with pytest.raises(AdminHttpError) as refused:
        await world.admin.request("POST", path, body)
    assert refused.value.status == 412
    assert await world.admin.get_cap(NS, "maxUnackedMessagesPerSubscription") is None
