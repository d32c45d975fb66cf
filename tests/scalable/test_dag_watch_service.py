"""DagWatcher sees every layout change in order; ScalableTopicService reads anywhere and
redirects mutations to the leader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from anabranch.clock import SystemClock
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import NotFound, NotLeader
from anabranch.metadata.api import MetadataStore
from anabranch.scalable.dag_watch import DagWatcher
from anabranch.scalable.segment_ops import StorageSegmentOps
from anabranch.scalable.service import ScalableTopicService
from tests.scalable.conftest import eventually

TOPIC = "topic://public/default/orders"


@pytest.fixture
async def services(
    store: MetadataStore, ops: StorageSegmentOps
) -> AsyncIterator[list[ScalableTopicService]]:
    made = [
        ScalableTopicService(store, ops, SystemClock(), f"http://broker-{i}:8080") for i in (1, 2)
    ]
    try:
        for service in made:
            await service.start()
        yield made
    finally:
        for service in made:
            await service.close()


async def test_dag_watcher_sees_every_change_in_order(
    store: MetadataStore, services: list[ScalableTopicService]
) -> None:
    leader = services[0]
    watcher = DagWatcher(store)
    seen: list[SegmentLayout | None] = []
    late: list[SegmentLayout | None] = []
    try:
        handle = await watcher.add_listener(TopicName.parse(TOPIC), seen.append)
        assert seen == [None]  # the topic does not exist yet
        await leader.create(TOPIC, 2)
        await leader.split(TOPIC, 0)
        await leader.split(TOPIC, 1)
        await leader.merge(TOPIC, 3, 4)
        await eventually(lambda: len(seen) == 5, "four layouts delivered")
        assert [layout.epoch if layout else None for layout in seen] == [None, 0, 1, 2, 3]
        final = await leader.get_metadata(TOPIC)
        assert seen[-1] is not None and seen[-1].to_dict() == final.to_dict()
        # A second listener starts from the current layout, sharing the watch.
        late_handle = await watcher.add_listener(TopicName.parse(TOPIC), late.append)
        assert [layout.epoch if layout else None for layout in late] == [3]
        await leader.delete(TOPIC)
        await eventually(lambda: seen[-1] is None and late[-1] is None, "deletion delivered")
        await late_handle.remove()
        await handle.remove()
    finally:
        await watcher.close()


async def test_service_reads_anywhere_and_redirects_mutations(
    services: list[ScalableTopicService],
) -> None:
    first, second = services
    await first.create(TOPIC, 2)
    await first.create("topic://public/default/payments", 1)
    with pytest.raises(NotLeader) as redirect:
        await second.split(TOPIC, 0)
    assert redirect.value.leader_url == "http://broker-1:8080"
    assert redirect.value.http_status == 307
    with pytest.raises(NotLeader):
        await second.create_subscription(TOPIC, "billing")
    assert (await second.get_metadata(TOPIC)).epoch == 0
    assert await second.list_topics("public/default") == [
        "topic://public/default/orders",
        "topic://public/default/payments",
    ]
    with pytest.raises(NotFound):
        await second.get_metadata("topic://public/default/missing")
    await first.create_subscription(TOPIC, "billing")
    assert await second.list_subscriptions(TOPIC) == ["billing"]
    stats = await second.stats(TOPIC)
    assert stats["epoch"] == 0 and stats["activeSegments"] == 2
    assert stats["controllerBrokerUrl"] == "http://broker-1:8080"


async def test_concurrent_first_listeners_both_get_the_stored_layout(
    store: MetadataStore, services: list[ScalableTopicService]
) -> None:
    """Listeners that join while the first one's initial read is in flight must not be
    told "no topic" (None) for a topic that exists."""
    await services[0].create(TOPIC, 2)
    watcher = DagWatcher(store)
    seen: list[list[SegmentLayout | None]] = [[] for _ in range(4)]
    try:
        await asyncio.gather(
            *(watcher.add_listener(TopicName.parse(TOPIC), got.append) for got in seen)
        )
        assert [[layout.epoch if layout else None for layout in got] for got in seen] == [[0]] * 4
    finally:
        await watcher.close()
