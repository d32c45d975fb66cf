"""The consumer controller over the wire (commands 73-75) against an in-process broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anabranch.aio import Client
from anabranch.broker.policies import AutoTopicCreationOverride
from anabranch.core.names import TopicName
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.scalable.paths import TopicPaths
from anabranch.scalable.segment_ops import StorageSegmentOps
from anabranch.scalable.service import ScalableTopicService
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker
from tests.scalable.wire import RawClient, is_assignment_update, segment_ids

TOPIC = "topic://public/default/orders"
GRACE_S = 0.4


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, metadata="memory", consumer_grace_period_s=GRACE_S) as b:
        b.service.scalable.drain_poll_interval_s = 0.05
        yield b


@pytest.fixture
async def client(broker: InProcessBroker) -> AsyncIterator[RawClient]:
    c = await RawClient.connect(broker.port)
    try:
        yield c
    finally:
        await c.close()


async def set_auto_creation(broker: InProcessBroker, *, allow: bool) -> None:
    override = AutoTopicCreationOverride(allow_auto_topic_creation=allow)
    await broker.service.policies.update_namespace_policies(
        "public/default",
        lambda p: msgspec.structs.replace(p, auto_topic_creation_override=override),
    )


def covered(assignment: pb.ScalableConsumerAssignment) -> list[tuple[int, int]]:
    return sorted((s.hash_start, s.hash_end) for s in assignment.segments)


async def test_subscribe_returns_an_assignment_covering_the_keyspace(
    broker: InProcessBroker, client: RawClient
) -> None:
    await broker.service.scalable.create(TOPIC, 4)
    response = await client.subscribe(1, TOPIC, "billing", "w1", 10)
    assert not response.HasField("error"), response.message
    assignment = response.assignment
    assert assignment.layout_epoch == 0
    assert segment_ids(assignment) == [0, 1, 2, 3]
    assert covered(assignment) == [
        (0, 0x3FFF),
        (0x4000, 0x7FFF),
        (0x8000, 0xBFFF),
        (0xC000, 0xFFFF),
    ]
    assert assignment.segments[1].segment_topic == "segment://public/default/orders/4000-7fff-1"
    # The subscription exists now, with a cursor on every segment and a durable session.
    paths = TopicPaths(TopicName.parse(TOPIC))
    assert await broker.service.store.get(paths.consumer("billing", "w1")) is not None
    segment = broker.service.loaded_topic("segment://public/default/orders/0000-3fff-0")
    assert segment is not None and "billing" in segment.subscriptions


async def test_two_consumers_split_the_segments_deterministically(
    broker: InProcessBroker, client: RawClient
) -> None:
    await broker.service.scalable.create(TOPIC, 4)
    other = await RawClient.connect(broker.port)
    try:
        first = await client.subscribe(1, TOPIC, "billing", "w-b", 1)
        assert segment_ids(first.assignment) == [0, 1, 2, 3]
        second = await other.subscribe(1, TOPIC, "billing", "w-a", 1)
        # Consumers sorted by name, segments by range, dealt round-robin.
        assert segment_ids(second.assignment) == [0, 2]
        assert segment_ids(await client.assignment_update(1)) == [1, 3]
    finally:
        await other.close()


async def test_reconnect_within_grace_keeps_segments_without_rebalance(
    broker: InProcessBroker, client: RawClient
) -> None:
    await broker.service.scalable.create(TOPIC, 2)
    assert segment_ids((await client.subscribe(1, TOPIC, "s", "w1", 1)).assignment) == [0, 1]
    leaving = await RawClient.connect(broker.port)
    assert segment_ids((await leaving.subscribe(1, TOPIC, "s", "w2", 5)).assignment) == [1]
    assert segment_ids(await client.assignment_update(1)) == [0]
    await leaving.close()
    back = await RawClient.connect(broker.port)
    try:
        again = await back.subscribe(9, TOPIC, "s", "w2", 6)
        assert segment_ids(again.assignment) == [1]
        # w1 hears nothing: no rebalance happened, and none after the old grace deadline.
        await client.none(is_assignment_update(1), within=GRACE_S * 2)
    finally:
        await back.close()


async def test_grace_expiry_rebalances_to_the_survivor(
    broker: InProcessBroker, client: RawClient
) -> None:
    await broker.service.scalable.create(TOPIC, 2)
    await client.subscribe(1, TOPIC, "s", "w1", 1)
    leaving = await RawClient.connect(broker.port)
    await leaving.subscribe(1, TOPIC, "s", "w2", 1)
    assert segment_ids(await client.assignment_update(1)) == [0]
    await leaving.close()
    # Within the grace period nothing moves; after it, w1 owns everything again.
    update = await client.assignment_update(1, wait_s=GRACE_S * 10)
    assert segment_ids(update) == [0, 1]
    paths = TopicPaths(TopicName.parse(TOPIC))
    assert await broker.service.store.get(paths.consumer("s", "w2")) is None


async def test_children_are_carried_with_the_parent_until_it_drains(
    broker: InProcessBroker, client: RawClient
) -> None:
    await broker.service.scalable.create(TOPIC, 1)
    assert segment_ids((await client.subscribe(1, TOPIC, "s", "w1", 1)).assignment) == [0]
    parent = "segment://public/default/orders/0000-ffff-0"
    async with Client(broker.service_url) as pulsar:
        producer = await pulsar.create_producer(parent)
        await producer.send(b"before the split", key="k")
        await producer.close()
    await broker.service.scalable.split(TOPIC, 0)
    # The parent still has a backlog for "s": its children are carried to its consumer,
    # which orders them itself (it joins them once the parent ended), and which must not
    # wait for a drain that only its own acks after the parent's last message could bring.
    news = await client.assignment_update(1)
    assert (news.layout_epoch, segment_ids(news)) == (1, [0, 1, 2])
    await client.none(is_assignment_update(1), within=0.3)
    async with Client(broker.service_url) as pulsar:
        consumer = await pulsar.subscribe(parent, "s")
        message = await consumer.receive()
        assert message is not None and message.value == b"before the split"
        await consumer.acknowledge(message)
        await consumer.close()
    update = await client.assignment_update(1)
    assert update.layout_epoch == 1
    assert segment_ids(update) == [1, 2]  # the drained parent retired


async def test_refusals_are_per_request(broker: InProcessBroker, client: RawClient) -> None:
    bad_sub = await client.subscribe(1, TOPIC, "bad sub", "w1", 1)
    assert bad_sub.error == pb.InvalidTopicName and not bad_sub.HasField("assignment")
    bad_topic = await client.subscribe(2, "topic://public/default/a b", "s", "w1", 1)
    assert bad_topic.error == pb.InvalidTopicName
    nameless = await client.subscribe(2, TOPIC, "s", "", 1)
    assert (nameless.error, nameless.message) == (pb.InvalidTopicName, "consumer name is empty")
    await set_auto_creation(broker, allow=False)
    missing = await client.subscribe(3, TOPIC, "s", "w1", 1)
    assert missing.error == pb.TopicNotFound
    assert await broker.service.store.get(TopicPaths(TopicName.parse(TOPIC)).layout) is None
    await set_auto_creation(broker, allow=True)
    created = await client.subscribe(4, TOPIC, "s", "w1", 1)  # auto-created, 1 segment
    assert segment_ids(created.assignment) == [0]
    busy = await client.subscribe(5, TOPIC, "s", "w2", 1)
    assert busy.error == pb.ConsumerBusy


async def test_non_leader_answers_with_the_leader_url(
    broker: InProcessBroker, client: RawClient
) -> None:
    """Another broker (its own metadata session and address) leads the topic: this one
    answers ServiceNotReady naming the leader's pulsar URL, and writes nothing."""
    leader = ScalableTopicService(
        broker.service.store,
        StorageSegmentOps(MemoryManagedLedgerFactory()),
        broker.service.clock,
        "http://leader:8080",
        pulsar_url="pulsar://leader:6650",
    )
    await leader.start()
    try:
        await leader.create(TOPIC, 1)
        response = await client.subscribe(1, TOPIC, "s", "w1", 1)
        assert response.error == pb.ServiceNotReady
        assert response.message.endswith("the leader is pulsar://leader:6650"), response.message
        paths = TopicPaths(TopicName.parse(TOPIC))
        assert await broker.service.store.get(paths.subscription("s")) is None
        # The DAG names the leader as the controller too.
        update = await client.lookup(1, TOPIC)
        assert update.dag.controller_broker_url == "pulsar://leader:6650"
    finally:
        await leader.close()


async def test_scalable_metrics(broker: InProcessBroker, client: RawClient) -> None:
    await broker.service.scalable.create(TOPIC, 2)
    await broker.service.scalable.split(TOPIC, 0)
    await client.lookup(1, TOPIC)
    await client.subscribe(1, TOPIC, "s", "w1", 1)
    async with Client(broker.service_url) as pulsar:
        producer = await pulsar.create_producer("segment://public/default/orders/8000-ffff-1")
        await producer.send(b"x")
    async with aiohttp.ClientSession() as http, http.get(f"{broker.http_url}/metrics") as resp:
        text = await resp.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = {"cluster": "standalone", "namespace": "public/default", "topic": TOPIC}

    def value(name: str, **extra: str) -> float:
        return samples[(name, tuple(sorted({**labels, **extra}.items())))]

    assert value("anabranch_scalable_segments", state="active") == 3
    assert value("anabranch_scalable_segments", state="sealed") == 1
    assert value("anabranch_scalable_layout_epoch") == 1
    broker_labels = (("cluster", "standalone"),)
    assert samples[("anabranch_scalable_splits_total", broker_labels)] == 1
    assert samples[("anabranch_scalable_merges_total", broker_labels)] == 0
    assert samples[("anabranch_scalable_controller_elections_total", broker_labels)] == 1
    assert samples[("anabranch_scalable_assignment_changes_total", broker_labels)] >= 1
    assert samples[("anabranch_scalable_controller_sessions_renewed_total", broker_labels)] == 0
    assert samples[("anabranch_scalable_watch_sessions", broker_labels)] == 1
    assert samples[("anabranch_scalable_consumers", broker_labels)] == 1
    # A segment is a topic: its counters and backlog are the per-topic families.
    segment = {**labels, "topic": "segment://public/default/orders/8000-ffff-1"}
    key = ("anabranch_in_messages_total", tuple(sorted(segment.items())))
    assert samples[key] == 1
    key = (
        "anabranch_subscription_back_log",
        tuple(sorted({**segment, "subscription": "s"}.items())),
    )
    assert samples[key] == 1


async def test_checkpoint_group_gets_every_segment_and_no_cursors(
    broker: InProcessBroker, client: RawClient
) -> None:
    await broker.service.scalable.create(TOPIC, 1)
    await broker.service.scalable.split(TOPIC, 0)
    response = await client.subscribe(1, TOPIC, "cp", "r1", 1, consumer_type=pb.CHECKPOINT)
    assert not response.HasField("error"), response.message
    assert segment_ids(response.assignment) == [1, 0, 2]  # sealed 0 too, dealt by range
    for segment in ("0000-ffff-0", "0000-7fff-1", "8000-ffff-2"):
        topic = broker.service.loaded_topic(f"segment://public/default/orders/{segment}")
        assert topic is None or "cp" not in [c.name for c in topic.ledger.cursors()]
    # The sealed segment never "drains" for a checkpoint group: it stays assigned.
    await client.none(is_assignment_update(1), within=0.3)
    stream = await client.subscribe(2, TOPIC, "cp", "w1", 2)
    assert stream.error == pb.NotAllowedError


async def test_unsubscribe_rebalances_at_once(broker: InProcessBroker, client: RawClient) -> None:
    broker.service.scalable.grace_period_ms = 60_000  # expiry cannot be what moves segments
    await broker.service.scalable.create(TOPIC, 2)
    await client.subscribe(1, TOPIC, "s", "w1", 1)
    leaving = await RawClient.connect(broker.port)
    try:
        await leaving.subscribe(1, TOPIC, "s", "w2", 1)
        assert segment_ids(await client.assignment_update(1)) == [0]
        await leaving.unsubscribe(2, 1)
        assert segment_ids(await client.assignment_update(1)) == [0, 1]
        paths = TopicPaths(TopicName.parse(TOPIC))
        assert await broker.service.store.get(paths.consumer("s", "w2")) is None
        await leaving.unsubscribe(3, 1)  # again, and an unknown id: still SUCCESS
        await leaving.unsubscribe(4, 99)
    finally:
        await leaving.close()


async def test_a_name_taken_over_by_another_connection_revokes_the_old_one(
    broker: InProcessBroker, client: RawClient
) -> None:
    await broker.service.scalable.create(TOPIC, 2)
    assert segment_ids((await client.subscribe(1, TOPIC, "s", "w1", 1)).assignment) == [0, 1]
    other = await RawClient.connect(broker.port)
    try:
        taken = await other.subscribe(1, TOPIC, "s", "w1", 2)
        assert segment_ids(taken.assignment) == [0, 1]
        assert segment_ids(await client.assignment_update(1)) == []
    finally:
        await other.close()


async def _send_to(broker: InProcessBroker, segment: str, value: bytes) -> None:
    async with Client(broker.service_url) as pulsar:
        producer = await pulsar.create_producer(segment)
        await producer.send(value, key="k")
        await producer.close()


async def _ack_all(broker: InProcessBroker, segment: str, subscription: str) -> None:
    async with Client(broker.service_url) as pulsar:
        consumer = await pulsar.subscribe(segment, subscription)
        message = await consumer.receive()
        assert message is not None
        await consumer.acknowledge(message)
        await consumer.close()


async def _assignment_with(client: RawClient, wanted: list[int]) -> pb.ScalableConsumerAssignment:
    """The first pushed assignment naming exactly ``wanted`` (earlier epochs' pushes of
    the unchanged share are skipped)."""
    while True:
        update = await client.assignment_update(1)
        if sorted(segment_ids(update)) == wanted:
            return update


async def test_the_ack_that_drains_a_parent_hands_out_its_children_without_a_poll(
    broker: InProcessBroker, client: RawClient
) -> None:
    # A poll interval no test waits for: only the drain wake-up can assign the children.
    broker.service.scalable.drain_poll_interval_s = 3600.0
    await broker.service.scalable.create(TOPIC, 1)
    assert segment_ids((await client.subscribe(1, TOPIC, "s", "w1", 1)).assignment) == [0]
    parent = "segment://public/default/orders/0000-ffff-0"
    await _send_to(broker, parent, b"before the split")
    await broker.service.scalable.split(TOPIC, 0)
    await _ack_all(broker, parent, "s")
    assert (await _assignment_with(client, [1, 2])).layout_epoch == 1


async def test_a_chain_of_empty_sealed_generations_resolves_at_once(
    broker: InProcessBroker, client: RawClient
) -> None:
    """A split storm seals children before anyone reads them: once the parent drains, the
    empty generations below it drain with it, not one poll interval each."""
    broker.service.scalable.drain_poll_interval_s = 3600.0
    scalable = broker.service.scalable
    await scalable.create(TOPIC, 1)
    assert segment_ids((await client.subscribe(1, TOPIC, "s", "w1", 1)).assignment) == [0]
    parent = "segment://public/default/orders/0000-ffff-0"
    await _send_to(broker, parent, b"before the splits")
    await scalable.split(TOPIC, 0)  # -> 1, 2
    await scalable.split(TOPIC, 1)  # -> 3, 4
    await scalable.split(TOPIC, 3)  # -> 5, 6
    await scalable.merge(TOPIC, 5, 6)  # -> 7
    await _ack_all(broker, parent, "s")
    update = await _assignment_with(client, [2, 4, 7])
    assert update.layout_epoch == 4
