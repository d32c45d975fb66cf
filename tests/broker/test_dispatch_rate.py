"""Dispatch rate limits (Pulsar's ``dispatchRate`` and ``subscriptionDispatchRate``): the
buckets against their promise, and on a real in-process broker consumers that receive a
backlog no faster than the rate in force, per subscription and per topic, in messages and
in bytes, set in the broker's config, per namespace and per topic."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.admin.client import AdminHttpError
from anabranch.core.dispatch_rate import DispatchRate, DispatchThrottle
from tests.broker.policy_world import NS, PolicyWorld, worlds

# --- the buckets (pure) --------------------------------------------------------------------


@given(
    limit=st.integers(min_value=1, max_value=50),
    period=st.integers(min_value=1, max_value=4),
    steps=st.lists(st.floats(min_value=0, max_value=3, allow_nan=False), max_size=40),
)
def test_what_the_allowance_lets_go_never_passes_the_rate(
    limit: int, period: int, steps: list[float]
) -> None:
    throttle = DispatchThrottle(DispatchRate(messages=limit, period_s=period), now=0.0)
    now, sent = 0.0, 0
    for step in steps:
        now += step
        allowed, _, wait = throttle.allowance(now)
        assert allowed is not None
        if allowed == 0:
            assert wait > 0
            # The wait it names is enough: at its end at least one message may go.
            now += wait + 1e-9
            allowed = throttle.allowance(now).messages
            assert allowed is not None and allowed > 0
        throttle.take(messages=allowed, size=1, now=now)
        sent += allowed
        # One period's burst at most, then the rate.
        assert sent <= limit + limit * now / period + 1e-6


def test_no_limit_lets_anything_go_and_bytes_alone_stop_at_zero() -> None:
    unlimited = DispatchThrottle(DispatchRate(), now=0.0)
    assert unlimited.allowance(0.0) == (None, None, 0.0)
    by_bytes = DispatchThrottle(DispatchRate(bytes=100), now=0.0)
    assert by_bytes.allowance(0.0) == (None, 100, 0.0)
    by_bytes.take(messages=1, size=150, now=0.0)  # an entry's size is known afterwards
    over = by_bytes.allowance(0.0)
    assert (over.messages, over.bytes) == (0, 0)
    assert over.wait_s == pytest.approx(0.51)
    assert by_bytes.allowance(1.0) == (None, 50, 0.0)


# --- on a broker ---------------------------------------------------------------------------


class World(PolicyWorld):
    async def produce(self, topic: str, count: int, size: int = 10) -> None:
        producer = await self.client.create_producer(topic, batching=False)
        for i in range(count):
            await producer.send(str(i).encode().ljust(size, b"."))
        await producer.close()

    async def receive_all(
        self, topic: str, subscription: str, count: int, sub_type: str = "Exclusive"
    ) -> float:
        """Seconds a new consumer takes to receive ``count`` messages of the backlog."""
        consumer = await self.client.subscribe(
            topic, subscription, initial_position="earliest", subscription_type=sub_type
        )
        start = time.monotonic()
        for i in range(count):
            msg = await consumer.receive(timeout=10)
            assert msg is not None, f"message {i} of {count} never came"
            await consumer.acknowledge(msg)
        elapsed = time.monotonic() - start
        await consumer.close()
        return elapsed


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async for w in worlds(World, tmp_path):
        yield w


@pytest.mark.parametrize("sub_type", ["Exclusive", "Shared", "Key_Shared"])
async def test_a_namespace_subscription_rate_paces_each_subscription(
    world: World, sub_type: str
) -> None:
    topic = world.topic(f"dispatch-sub-{sub_type}")
    await world.produce(topic, 60)
    assert await world.receive_all(topic, "unlimited", 60) < 10  # the backlog is there
    await world.admin.set_dispatch_rate(NS, subscription=True, messages=30)
    got = await world.admin.get_dispatch_rate(NS, subscription=True)
    assert got is not None and got["dispatchThrottlingRateInMsg"] == 30
    # 30 at once (a period's quota), the other 30 over the next second.
    assert await world.receive_all(topic, "paced", 60, sub_type) >= 0.8
    await world.admin.remove_dispatch_rate(NS, subscription=True)
    assert await world.admin.get_dispatch_rate(NS, subscription=True) is None


async def test_a_topic_rate_is_shared_by_its_subscriptions(world: World) -> None:
    topic = world.topic("dispatch-topic")
    await world.produce(topic, 30)
    await world.admin.set_dispatch_rate(topic, messages=30)
    applied = await world.admin.get_dispatch_rate(topic, applied=True)
    assert applied is not None and applied["dispatchThrottlingRateInMsg"] == 30
    sub_applied = await world.admin.get_dispatch_rate(topic, subscription=True, applied=True)
    assert sub_applied is not None and sub_applied["dispatchThrottlingRateInMsg"] == -1
    # The first subscription takes the period's quota; the second waits for the next.
    assert await world.receive_all(topic, "a", 30) < 10
    assert await world.receive_all(topic, "b", 30) >= 0.8


async def test_a_byte_rate_with_a_period_paces_by_size(world: World) -> None:
    topic = world.topic("dispatch-bytes")
    await world.produce(topic, 20, size=100)
    # 1000 bytes per 2 s: the first 10 messages at once, the next 10 a period later.
    await world.admin.set_dispatch_rate(topic, subscription=True, size=1000, period_s=2)
    assert await world.receive_all(topic, "s", 20) >= 1.6


async def test_the_brokers_default_rate_applies_without_a_policy(tmp_path: Path) -> None:
    async for world in worlds(World, tmp_path, dispatch_throttling_rate_per_subscription_in_msg=25):
        topic = world.topic("dispatch-default")
        await world.produce(topic, 50)
        applied = await world.admin.get_dispatch_rate(topic, subscription=True, applied=True)
        assert applied is not None and applied["dispatchThrottlingRateInMsg"] == 25
        assert await world.receive_all(topic, "s", 50) >= 0.8
        await world.admin.set_dispatch_rate(topic, subscription=True, messages=-1)  # lifted
        assert await world.receive_all(topic, "t", 50) < 10


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("dispatchThrottlingRateInMsg", -2, 412),
        ("dispatchThrottlingRateInMsg", 2**31, 412),
        ("dispatchThrottlingRateInByte", 2**63, 400),  # no Java long: unreadable, as Jackson
        ("ratePeriodInSecond", 0, 412),
        ("relativeToPublishRate", True, 412),
    ],
)
async def test_a_rate_out_of_range_is_refused_and_changes_nothing(
    world: World, field: str, value: object, status: int
) -> None:
    await world.admin.set_dispatch_rate(NS, messages=7)
    body = {"dispatchThrottlingRateInMsg": 5, field: value}
    with pytest.raises(AdminHttpError) as refused:
        await world.admin.request("POST", f"/admin/v2/namespaces/{NS}/dispatchRate", body)
    assert refused.value.status == status
    got = await world.admin.get_dispatch_rate(NS)
    assert got is not None and got["dispatchThrottlingRateInMsg"] == 7
