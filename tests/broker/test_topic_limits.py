"""Per-topic caps on producers, consumers and subscriptions (Pulsar's
``maxProducersPerTopic`` and friends) on a real in-process broker: set over the admin API at
namespace and topic level or in the broker's config, enforced on the wire, our client and
the official one refused with upstream's errors."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pulsar
import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.broker.topic_limits import CAP_FIELDS, TopicLimits
from anabranch.client.errors import ConsumerBusy
from anabranch.errors import NotAllowed, ProducerBusy
from anabranch.testing.broker import InProcessBroker
from tests.broker.policy_world import NS, PolicyWorld, worlds

World = PolicyWorld


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async for w in worlds(World, tmp_path):
        yield w


# --- the resolution (pure) -------------------------------------------------------------------

cap_value = st.one_of(st.none(), st.integers(min_value=0, max_value=5))
level = st.tuples(*[cap_value] * len(CAP_FIELDS))


@given(st.lists(level, max_size=4))
def test_each_cap_is_the_first_level_that_sets_it(levels: list[Any]) -> None:
    # Each level as the policies and the config hold it: the caps by their field names.
    caps = TopicLimits.resolve(
        *(SimpleNamespace(**dict(zip(CAP_FIELDS, lv, strict=True))) for lv in levels)
    )
    for i, value in enumerate(dataclasses.astuple(caps)):
        set_here = [lv[i] for lv in levels if lv[i] is not None]
        assert value == (set_here[0] if set_here else 0)


def test_internal_subscriptions_neither_count_nor_are_refused() -> None:
    caps = TopicLimits(max_subscriptions=1, max_consumers=1)
    caps.check_new_subscription("t", "__compaction", existing=["a"])
    caps.check_new_subscription("t", "b", existing=["__compaction"])
    caps.check_consumer("__compaction", on_topic=5, on_subscription=5)
    with pytest.raises(NotAllowed):
        caps.check_new_subscription("t", "b", existing=["a", "__compaction"])


# --- producers -------------------------------------------------------------------------------


async def test_a_namespace_cap_refuses_the_next_producer_until_one_leaves(world: World) -> None:
    topic = world.topic("cap-producers")
    await world.admin.set_cap(NS, "maxProducersPerTopic", 2)
    assert await world.admin.get_cap(NS, "maxProducersPerTopic") == 2
    first = await world.client.create_producer(topic)
    await world.client.create_producer(topic)
    with pytest.raises(ProducerBusy, match="reached max producers limit"):
        await world.client.create_producer(topic)
    # Another topic has its own count.
    await world.client.create_producer(world.topic("cap-producers-other"))
    await first.close()
    await world.client.create_producer(topic)  # the place it left
    await world.admin.remove_cap(NS, "maxProducersPerTopic")
    assert await world.admin.get_cap(NS, "maxProducersPerTopic") is None
    for _ in range(3):
        await world.client.create_producer(topic)


async def test_a_topic_cap_wins_over_its_namespace_and_applied_reports_it(world: World) -> None:
    topic = world.topic("cap-override")
    await world.client.create_producer(topic)  # the topic exists for its policy routes
    await world.admin.set_cap(NS, "maxProducersPerTopic", 1)
    await world.admin.set_cap(topic, "maxProducers", 3)
    assert await world.admin.get_cap(topic, "maxProducers") == 3
    assert await world.admin.get_cap(topic, "maxProducers", applied=True) == 3
    await world.client.create_producer(topic)
    await world.client.create_producer(topic)
    with pytest.raises(ProducerBusy):
        await world.client.create_producer(topic)
    await world.admin.remove_cap(topic, "maxProducers")
    assert await world.admin.get_cap(topic, "maxProducers") is None
    assert await world.admin.get_cap(topic, "maxProducers", applied=True) == 1


# --- consumers and subscriptions -------------------------------------------------------------


async def test_consumer_caps_count_the_topic_and_each_subscription(world: World) -> None:
    topic = world.topic("cap-consumers")
    await world.admin.set_cap(NS, "maxConsumersPerSubscription", 2)
    await world.admin.set_cap(NS, "maxConsumersPerTopic", 3)
    await world.client.subscribe(topic, "a", subscription_type="Shared")
    await world.client.subscribe(topic, "a", subscription_type="Shared")
    with pytest.raises(ConsumerBusy, match="Subscription reached max consumers limit"):
        await world.client.subscribe(topic, "a", subscription_type="Shared")
    await world.client.subscribe(topic, "b", subscription_type="Shared")
    with pytest.raises(ConsumerBusy, match="Topic reached max consumers limit"):
        await world.client.subscribe(topic, "c", subscription_type="Shared")


async def test_a_subscription_cap_refuses_new_names_not_existing_ones(world: World) -> None:
    topic = world.topic("cap-subs")
    await world.admin.set_cap(NS, "maxSubscriptionsPerTopic", 2)
    for name in ("a", "b"):
        await (await world.client.subscribe(topic, name)).close()
    with pytest.raises(NotAllowed, match="maximum number of subscriptions"):
        await world.client.subscribe(topic, "c")
    with pytest.raises(AdminHttpError) as refused:
        await world.admin.create_subscription(topic, "d")
    assert refused.value.status == 405
    await (await world.client.subscribe(topic, "a")).close()  # an existing one is no new one
    await world.admin.delete_subscription(topic, "b")
    await world.client.subscribe(topic, "c")
    assert sorted(await world.admin.subscriptions(topic)) == ["a", "c"]


async def test_concurrent_new_subscriptions_cannot_all_take_the_last_places(
    tmp_path: Path,
) -> None:
    # SQLite metadata: creating a cursor awaits a real write, so the subscribes interleave.
    async with InProcessBroker(tmp_path, metadata="sqlite", max_subscriptions_per_topic=5) as b:
        assert b.http_url is not None
        async with AdminClient(b.http_url) as admin, Client(b.service_url) as client:
            topic = World.topic("cap-race")
            await client.create_producer(topic)
            results = await asyncio.gather(
                *(client.subscribe(topic, f"s{i}") for i in range(20)), return_exceptions=True
            )
            refused = [r for r in results if isinstance(r, BaseException)]
            assert len(refused) == 15
            assert all(isinstance(r, NotAllowed) for r in refused), refused
            assert len(await admin.subscriptions(topic)) == 5


# --- the broker's default, and bad values ----------------------------------------------------


async def test_the_broker_default_applies_and_a_namespace_zero_lifts_it(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, max_producers_per_topic=1) as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            topic = "persistent://public/default/cap-default"
            await client.create_producer(topic)
            with pytest.raises(ProducerBusy):
                await client.create_producer(topic)
            assert await admin.get_cap(topic, "maxProducers", applied=True) == 1
            await admin.set_cap(NS, "maxProducersPerTopic", 0)  # 0 at a level: no cap
            await client.create_producer(topic)
            await client.create_producer(topic)


@pytest.mark.parametrize("body", [-1, 2**31, 10**30, "two", 1.5])
async def test_a_cap_that_is_not_a_count_is_refused_and_changes_nothing(
    world: World, body: object
) -> None:
    await world.admin.set_cap(NS, "maxConsumersPerTopic", 4)
    with pytest.raises(AdminHttpError) as refused:
        await world.admin.request("POST", f"/admin/v2/namespaces/{NS}/maxConsumersPerTopic", body)
    # A number no Java long holds is unreadable (400), as Jackson answers; an int past
    # the field's range is an invalid value (412).
    readable = isinstance(body, int) and -(2**63) <= body < 2**63
    assert refused.value.status == (412 if readable else 400)
    assert await world.admin.get_cap(NS, "maxConsumersPerTopic") == 4


# --- the official client ---------------------------------------------------------------------


def official_refusals(url: str, topic: str) -> list[str]:
    """Create producers and consumers until refused; the refusals' error types."""
    client = pulsar.Client(url, operation_timeout_seconds=10)
    out = []
    try:
        client.create_producer(topic)
        try:
            client.create_producer(topic)
        except Exception as err:
            out.append(type(err).__name__)
        client.subscribe(topic, "s", consumer_type=pulsar.ConsumerType.Shared)
        try:
            client.subscribe(topic, "s", consumer_type=pulsar.ConsumerType.Shared)
        except Exception as err:
            out.append(type(err).__name__)
        try:
            client.subscribe(topic, "other")
        except Exception as err:
            out.append(type(err).__name__)
    finally:
        client.close()
    return out


async def test_the_official_client_gets_upstreams_errors(world: World) -> None:
    for cap in ("maxProducersPerTopic", "maxConsumersPerSubscription", "maxSubscriptionsPerTopic"):
        await world.admin.set_cap(NS, cap, 1)
    refusals = await asyncio.to_thread(
        official_refusals, world.broker.service_url, world.topic("cap-official")
    )
    assert refusals == ["ProducerBusy", "ConsumerBusy", "NotAllowedError"]


async def test_a_refused_reader_leaves_no_subscription_behind(world: World) -> None:
    topic = world.topic("cap-readers")
    await world.admin.set_cap(NS, "maxConsumersPerTopic", 1)
    await world.client.subscribe(topic, "only")
    for _ in range(5):
        with pytest.raises(ConsumerBusy):
            await world.client.create_reader(topic, "earliest")
    loaded = world.broker.service.loaded_topic(topic)
    assert loaded is not None
    assert list(loaded.subscriptions) == ["only"]
