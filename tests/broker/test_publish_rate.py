"""Publish rate limits (Pulsar's ``publishRate``): the token buckets against a simple model,
then a real in-process broker slowing a producer down to its topic's rate by pausing its
connection, with the rate set in the broker's config, per namespace and per topic."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.admin.client import AdminHttpError
from anabranch.core.publish_rate import PublishRate, PublishThrottle, TokenBucket
from tests.broker.policy_world import NS, PolicyWorld, worlds

# --- the buckets (pure) ----------------------------------------------------------------------

takes = st.lists(
    st.tuples(st.floats(0, 3, allow_nan=False), st.integers(0, 500)), min_size=1, max_size=40
)


@given(st.integers(1, 1000), takes)
def test_a_bucket_matches_a_model_and_its_delay_is_exactly_enough(
    rate: int, steps: list[tuple[float, int]]
) -> None:
    bucket = TokenBucket(rate, now=0.0)
    tokens, now = float(rate), 0.0
    for dt, amount in steps:
        now += dt
        tokens = min(rate, tokens + dt * rate) - amount  # the model: refill, capped at 1 s
        delay = bucket.take(amount, now)
        assert delay == pytest.approx(max(0.0, -tokens / rate), abs=1e-6)
        if delay > 0:
            after = copy.copy(bucket)
            assert after.take(0, now + delay) == pytest.approx(0.0, abs=1e-6)
            assert copy.copy(bucket).take(0, now + delay * 0.5) > 0


def test_the_slower_of_the_two_rates_decides_and_unlimited_never_waits() -> None:
    throttle = PublishThrottle(PublishRate(messages=10, bytes=1000), now=0.0)
    assert throttle.take(messages=1, size=3000, now=0.0) == pytest.approx(2.0)
    assert PublishThrottle(PublishRate(), now=0.0).take(messages=10**9, size=10**12, now=0) == 0
    assert PublishRate().unlimited and not PublishRate(messages=1).unlimited


# --- on a broker -----------------------------------------------------------------------------


class World(PolicyWorld):
    @property
    def throttled(self) -> int:
        return self.broker.service.counters.publish_throttled

    async def produce_s(self, topic: str, count: int, size: int = 10) -> float:
        """Seconds to publish ``count`` messages unbatched (every one stored)."""
        producer = await self.client.create_producer(topic, batching=False)
        start = time.monotonic()
        futures = [await producer.send_async(b"x" * size) for _ in range(count)]
        await asyncio.gather(*futures)
        elapsed = time.monotonic() - start
        await producer.close()
        return elapsed


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async for w in worlds(World, tmp_path):
        yield w


async def test_a_namespace_rate_slows_a_producer_down_to_it(world: World) -> None:
    topic = world.topic("rate-ns")
    await world.admin.set_publish_rate(NS, messages=100)
    assert await world.admin.get_publish_rate(NS) == {
        "publishThrottlingRateInMsg": 100,
        "publishThrottlingRateInByte": -1,
    }
    # 250 messages at 100/s, with a burst of 100: 1.5 s at least.
    assert await world.produce_s(topic, 250) >= 1.2
    assert world.throttled > 0
    await world.admin.remove_publish_rate(NS)
    assert await world.admin.get_publish_rate(NS) is None
    before = world.throttled
    await world.produce_s(topic, 250)
    assert world.throttled == before  # no rate: never paused


async def test_a_topic_rate_of_bytes_wins_over_its_namespace(world: World) -> None:
    topic = world.topic("rate-bytes")
    await world.produce_s(topic, 1)  # the topic exists for its policy routes
    await world.admin.set_publish_rate(NS, messages=1_000_000)
    await world.admin.set_publish_rate(topic, size=10_000)
    assert await world.admin.get_publish_rate(topic, applied=True) == {
        "publishThrottlingRateInMsg": -1,
        "publishThrottlingRateInByte": 10_000,
    }
    # 25 kB at 10 kB/s with a burst of 10 kB: 1.5 s at least.
    assert await world.produce_s(topic, 25, size=1000) >= 1.2
    await world.admin.remove_publish_rate(topic)
    assert (await world.admin.get_publish_rate(topic, applied=True) or {})[
        "publishThrottlingRateInMsg"
    ] == 1_000_000


async def test_the_broker_default_applies_to_persistent_and_non_persistent_topics(
    tmp_path: Path,
) -> None:
    async for w in worlds(World, tmp_path, max_publish_rate_per_topic_in_messages=100):
        assert await w.produce_s(w.topic("rate-default"), 250) >= 1.2
        assert await w.produce_s(f"non-persistent://{NS}/rate-default", 250) >= 1.2


@pytest.mark.parametrize(
    "body",
    [
        {"publishThrottlingRateInMsg": -2},
        {"publishThrottlingRateInMsg": 2**31},
        {"publishThrottlingRateInByte": 2**63},
        {"publishThrottlingRateInMsg": "fast"},
    ],
)
async def test_a_bad_rate_is_refused_and_changes_nothing(
    world: World, body: dict[str, Any]
) -> None:
    with pytest.raises(AdminHttpError) as refused:
        await world.admin.request("POST", f"/admin/v2/namespaces/{NS}/publishRate", body)
    assert refused.value.status in (400, 412)
    assert await world.admin.get_publish_rate(NS) is None
