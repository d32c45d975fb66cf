"""Subscribe rate limits (Pulsar's ``subscribeRate``): the per-consumer buckets against
their promise, and on a real in-process broker a consumer that subscribes in a loop
refused with upstream's NotAllowed while other consumers are not, set per namespace, per
topic and in the broker's config."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.admin.client import AdminHttpError
from anabranch.core.subscribe_rate import SubscribeLimiter, SubscribeRate
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from tests.broker.policy_world import NS, PolicyWorld, worlds
from tests.scalable.wire import RawClient

T = pb.BaseCommand


# --- the buckets (pure) --------------------------------------------------------------------


@given(
    limit=st.integers(min_value=1, max_value=5),
    period=st.integers(min_value=1, max_value=60),
    steps=st.lists(st.floats(min_value=0, max_value=20, allow_nan=False), max_size=60),
)
def test_one_consumer_never_subscribes_more_than_its_rate(
    limit: int, period: int, steps: list[float]
) -> None:
    limiter = SubscribeLimiter(SubscribeRate(limit, period), max_tracked=10)
    now, accepted = 0.0, 0
    for step in steps:
        now += step
        accepted += limiter.try_acquire(("h", "c", 1), now)
        # One period's subscribes at once, then the rate; a refusal takes nothing.
        assert accepted <= limit + limit * now / period + 1e-9
    # After a whole idle period the consumer may subscribe again, whatever came before.
    assert limiter.try_acquire(("h", "c", 1), now + period + 1e-6)


def test_the_consumers_tracked_are_bounded_least_recent_first() -> None:
    limiter = SubscribeLimiter(SubscribeRate(1, 30), max_tracked=2)
    assert limiter.try_acquire(("h", "a", 1), 0.0)
    assert limiter.try_acquire(("h", "b", 2), 0.0)
    assert not limiter.try_acquire(("h", "a", 1), 0.0)  # a: seen again, now the newest
    assert limiter.try_acquire(("h", "c", 3), 0.0)  # b, the least recent, is forgotten
    assert limiter.tracked == 2
    assert limiter.try_acquire(("h", "b", 2), 0.0)  # forgotten: subscribes at once again
    assert not limiter.try_acquire(("h", "c", 3), 0.0)


# --- on a broker ---------------------------------------------------------------------------


class World(PolicyWorld):
    async def subscribes(self, topic: str, consumer_id: int, times: int) -> list[int]:
        """Subscribe and close again ``times`` times with one consumer id and name, as a
        consumer reconnecting in a loop does: the answers (SUCCESS, or ERROR's code)."""
        raw = await RawClient.connect(self.broker.port)
        answers = []
        try:
            for n in range(times):
                cmd = commands.subscribe(topic, "s", pb.CommandSubscribe.Shared, consumer_id, n)
                cmd.subscribe.consumer_name = "looping"
                await raw.send(cmd)
                frame = await raw.next(lambda f: f.type in (T.SUCCESS, T.ERROR))
                if frame.type == T.ERROR:
                    assert "subscribe rate" in frame.body.message
                    answers.append(int(frame.body.error))
                    continue
                answers.append(0)
                await raw.send(commands.close_consumer(consumer_id, 1000 + n))
                await raw.next(lambda f: f.type == T.SUCCESS)
        finally:
            await raw.close()
        return answers


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async for w in worlds(World, tmp_path):
        yield w


async def test_a_consumer_subscribing_in_a_loop_is_refused_past_its_rate(world: World) -> None:
    topic = world.topic("subscribe-rate")
    await world.admin.set_subscribe_rate(NS, per_consumer=2, period_s=60)
    got = await world.admin.get_subscribe_rate(NS)
    assert got == {"subscribeThrottlingRatePerConsumer": 2, "ratePeriodInSecond": 60}
    assert await world.subscribes(topic, 1, 4) == [0, 0, pb.NotAllowedError, pb.NotAllowedError]
    assert await world.subscribes(topic, 2, 1) == [0]  # another consumer is not held back
    assert world.broker.service.counters.subscribes_throttled == 2
    await world.admin.set_subscribe_rate(topic, per_consumer=-1, period_s=60)  # lifted
    applied = await world.admin.get_subscribe_rate(topic, applied=True)
    assert applied == {"subscribeThrottlingRatePerConsumer": -1, "ratePeriodInSecond": 60}
    assert await world.subscribes(topic, 1, 3) == [0, 0, 0]


async def test_the_brokers_default_rate_applies_without_a_policy(tmp_path: Path) -> None:
    async for world in worlds(World, tmp_path, subscribe_throttling_rate_per_consumer=1):
        topic = world.topic("subscribe-default")
        assert await world.subscribes(topic, 7, 2) == [0, pb.NotAllowedError]
        assert await world.admin.get_subscribe_rate(topic) is None
        applied = await world.admin.get_subscribe_rate(topic, applied=True)
        assert applied == {"subscribeThrottlingRatePerConsumer": 1, "ratePeriodInSecond": 30}


@pytest.mark.parametrize(
    "body",
    [
        {"subscribeThrottlingRatePerConsumer": -2, "ratePeriodInSecond": 30},
        {"subscribeThrottlingRatePerConsumer": 2**31, "ratePeriodInSecond": 30},
        {"subscribeThrottlingRatePerConsumer": 5, "ratePeriodInSecond": 0},
    ],
)
async def test_a_subscribe_rate_out_of_range_is_refused(world: World, body: object) -> None:
    with pytest.raises(AdminHttpError) as refused:
        await world.admin.request("POST", f"/admin/v2/namespaces/{NS}/subscribeRate", body)
    assert refused.value.status == 412
    assert await world.admin.get_subscribe_rate(NS) is None
