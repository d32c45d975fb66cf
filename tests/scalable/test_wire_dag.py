"""DAG watch sessions over the wire (commands 70-72) against an in-process broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from anabranch.broker.scalable_commands import topics_hash
from anabranch.core.names import SegmentName
from anabranch.errors import NotOwner
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.scalable.paths import TOPICS_ROOT
from anabranch.testing.broker import InProcessBroker
from tests.scalable.wire import RawClient, T, namespace_update, watch_namespace

TOPIC = "topic://public/default/orders"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, metadata="memory") as b:
        yield b


@pytest.fixture
async def client(broker: InProcessBroker) -> AsyncIterator[RawClient]:
    c = await RawClient.connect(broker.port)
    try:
        yield c
    finally:
        await c.close()


def segments(update: pb.CommandScalableTopicUpdate) -> dict[int, pb.SegmentInfoProto]:
    return {s.segment_id: s for s in update.dag.segments}


async def test_lookup_auto_creates_and_pushes_every_layout_change(
    broker: InProcessBroker, client: RawClient
) -> None:
    first = await client.lookup(1, "orders")  # a short name means topic://public/default/...
    assert not first.HasField("error"), first.message
    assert first.resolved_topic_name == TOPIC
    assert first.dag.epoch == 0
    [only] = first.dag.segments
    assert (only.segment_id, only.hash_start, only.hash_end, only.state) == (
        0,
        0,
        0xFFFF,
        pb.ACTIVE,
    )
    assert first.dag.controller_broker_url == broker.service_url
    assert [(b.segment_id, b.broker_url) for b in first.dag.segment_brokers] == [
        (0, broker.service_url)
    ]

    await broker.service.scalable.split(TOPIC, 0)
    split = await client.update(1)
    assert split.dag.epoch == 1
    nodes = segments(split)
    assert nodes[0].state == pb.SEALED and list(nodes[0].child_ids) == [1, 2]
    assert nodes[0].sealed_at_epoch == 1
    assert [(n.hash_start, n.hash_end, list(n.parent_ids)) for n in (nodes[1], nodes[2])] == [
        (0x0000, 0x7FFF, [0]),
        (0x8000, 0xFFFF, [0]),
    ]
    assert {b.segment_id for b in split.dag.segment_brokers} == {0, 1, 2}

    await broker.service.scalable.merge(TOPIC, 1, 2)
    merged = await client.update(1)
    assert merged.dag.epoch == 2
    nodes = segments(merged)
    assert nodes[3].state == pb.ACTIVE and list(nodes[3].parent_ids) == [1, 2]
    assert (nodes[3].hash_start, nodes[3].hash_end, nodes[3].created_at_epoch) == (0, 0xFFFF, 2)
    assert all(nodes[i].state == pb.SEALED for i in (0, 1, 2))


async def test_bad_names_are_answered_per_request_and_write_nothing(
    broker: InProcessBroker, client: RawClient
) -> None:
    for session_id, name in enumerate(
        ["topic://public/default/bad name", "segment://public/default/x/0000-ffff-0", "a/b/c/d/e"],
        start=1,
    ):
        update = await client.lookup(session_id, name)
        assert update.error == pb.InvalidTopicName, name
        assert not update.HasField("dag")
    page = await broker.service.store.list_prefix(TOPICS_ROOT + "/")
    assert page.records == []
    # The connection is still up and the failed ids are free again.
    assert not (await client.lookup(1, TOPIC)).HasField("error")


async def test_missing_topic_without_auto_creation(
    broker: InProcessBroker, client: RawClient
) -> None:
    update = await client.lookup(1, TOPIC, create_if_missing=False)
    assert update.error == pb.TopicNotFound
    await broker.service.policies.update_namespace_policies(
        "public/default",
        lambda p: msgspec.structs.replace(p, auto_topic_creation_override=_override(allow=False)),
    )
    assert (await client.lookup(2, TOPIC)).error == pb.TopicNotFound
    assert await broker.service.store.get(TOPICS_ROOT + "/public/default/orders") is None


def _override(*, allow: bool) -> object:
    from anabranch.broker.policies import AutoTopicCreationOverride

    return AutoTopicCreationOverride(allow_auto_topic_creation=allow)


async def test_two_sessions_duplicate_id_and_close(
    broker: InProcessBroker, client: RawClient
) -> None:
    await broker.service.scalable.create(TOPIC, 2)
    other = "topic://public/default/other"
    assert (await client.lookup(1, TOPIC)).dag.epoch == 0
    assert len((await client.lookup(2, other)).dag.segments) == 1
    duplicate = await client.lookup(1, other)
    assert duplicate.error == pb.NotAllowedError
    # The duplicate left session 1 alone: it still follows TOPIC.
    await broker.service.scalable.split(TOPIC, 1)
    assert (await client.update(1)).dag.epoch == 1

    await client.close_session(1)
    await broker.service.scalable.split(TOPIC, 0)
    await broker.service.scalable.split(other, 0)
    assert (await client.update(2)).dag.epoch == 1
    await client.none(lambda f: f.type == T.SCALABLE_TOPIC_UPDATE, within=0.3)
    assert broker.service.scalable_endpoint.watch_count() == 1


async def test_deleted_topic_is_pushed_as_not_found(
    broker: InProcessBroker, client: RawClient
) -> None:
    await client.lookup(1, TOPIC)
    await broker.service.scalable.delete(TOPIC)
    update = await client.update(1)
    assert update.error == pb.TopicNotFound


async def test_connection_close_ends_its_sessions(broker: InProcessBroker) -> None:
    clients = [await RawClient.connect(broker.port) for _ in range(2)]
    for c in clients:
        await c.lookup(7, TOPIC)
    assert broker.service.scalable_endpoint.watch_count() == 2
    await clients[0].close()
    for _ in range(100):
        if broker.service.scalable_endpoint.watch_count() == 1:
            break
        await broker.service.clock.sleep(0.01)
    assert broker.service.scalable_endpoint.watch_count() == 1
    await broker.service.scalable.split(TOPIC, 0)
    assert (await clients[1].update(7)).dag.epoch == 1
    await clients[1].close()


async def test_namespace_watch_snapshot_then_diffs(
    broker: InProcessBroker, client: RawClient
) -> None:
    scalable = broker.service.scalable
    await scalable.create(TOPIC, 1)
    first = await watch_namespace(client, 1, "public/default")
    assert first.WhichOneof("event") == "snapshot" and list(first.snapshot.topics) == [TOPIC]
    billing = await watch_namespace(client, 2, "public/default", {"team": "billing"})
    assert list(billing.snapshot.topics) == []

    other = "topic://public/default/other"
    await (await scalable.controller(other)).create(1, {"team": "billing"})
    for watch_id in (1, 2):
        update = await namespace_update(client, watch_id)
        assert (list(update.diff.added), list(update.diff.removed)) == ([other], [])
    # Subscriptions, sessions and splits are not membership changes.
    await scalable.split(TOPIC, 0)
    await client.subscribe(1, TOPIC, "s", "w1", 1)
    await scalable.delete(TOPIC)
    removed = await namespace_update(client, 1)
    assert (list(removed.diff.added), list(removed.diff.removed)) == ([], [TOPIC])
    await client.none(lambda f: f.type == T.WATCH_SCALABLE_TOPICS_UPDATE, within=0.2)

    # A client whose copy is current gets an empty diff instead of the snapshot.
    again = await watch_namespace(client, 3, "public/default", current_hash=topics_hash([other]))
    assert again.WhichOneof("event") == "diff" and not again.diff.added
    await client.send(
        T(
            type=T.WATCH_SCALABLE_TOPICS_CLOSE,
            watchScalableTopicsClose=pb.CommandWatchScalableTopicsClose(watch_id=1),
        )
    )
    for _ in range(100):
        if broker.service.scalable_endpoint.namespace_watch_count() == 2:
            break
        await broker.service.clock.sleep(0.01)
    assert broker.service.scalable_endpoint.namespace_watch_count() == 2


async def test_namespace_watch_refusals(client: RawClient) -> None:
    assert (await watch_namespace(client, 1, "public/no such ns!")).error == pb.InvalidTopicName
    missing = await watch_namespace(client, 1, "public/missing")
    assert missing.error == pb.TopicNotFound
    assert missing.message == "namespace public/missing not found"  # not where it is kept
    assert not (await watch_namespace(client, 1, "public/default")).HasField("error")
    assert (await watch_namespace(client, 1, "public/default")).error == pb.NotAllowedError


async def test_a_segment_without_a_known_owner_does_not_hold_back_the_dag(
    broker: InProcessBroker, client: RawClient
) -> None:
    """A segment stuck between owners (say its old owner's record is "moving") is left out
    of the DAG's broker hints; the layout itself still reaches the client."""
    service = broker.service
    await service.scalable.create(TOPIC, 2)
    real = service.segment_broker_url

    async def one_is_moving(segment: SegmentName) -> str:
        if segment.descriptor.endswith("-0"):
            raise NotOwner(str(segment), None)
        return await real(segment)

    service.segment_broker_url = one_is_moving
    update = await client.lookup(1, TOPIC)
    assert not update.HasField("error"), update.message
    assert sorted(segments(update)) == [0, 1]
    assert {b.segment_id for b in update.dag.segment_brokers} == {1}
