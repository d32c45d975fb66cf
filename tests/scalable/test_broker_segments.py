"""Segment topics under splits on a real broker: sealing goes through the broker's loaded
topic (producers see TopicTerminated, consumers reach the end) and a child rejects a
retried sequence id its parent persisted, also after a restart."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import msgspec
import pytest

from anabranch.broker.policies import Policies
from anabranch.clock import SystemClock
from anabranch.core.names import SegmentName, TopicName
from anabranch.errors import StorageIOError
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.scalable.paths import TopicPaths
from anabranch.scalable.segment_ops import StorageSegmentOps
from anabranch.scalable.service import ScalableTopicService
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker
from tests.scalable.wire import RawClient, T

TOPIC = "topic://public/default/orders"
PARENT = "segment://public/default/orders/0000-ffff-0"
CHILDREN = (
    "segment://public/default/orders/0000-7fff-1",
    "segment://public/default/orders/8000-ffff-2",
)
U64_MAX = 2**64 - 1


async def enable_dedup(policies: Policies) -> None:
    await policies.update_namespace_policies(
        "public/default", lambda p: msgspec.structs.replace(p, deduplication_enabled=True)
    )


async def test_split_through_admin_terminates_the_loaded_segment(
    tmp_path: Path,
) -> None:
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        base = f"{broker.http_url}/admin/v2/scalable/public/default/orders"
        async with aiohttp.ClientSession() as http:
            async with http.put(f"{base}?numInitialSegments=1") as resp:
                assert resp.status == 204, await resp.text()
            client = await RawClient.connect(broker.port)
            try:
                await client.producer(PARENT, 1, "p")
                receipt = await client.produce(1, "p", 0, b"before")
                assert receipt.type == T.SEND_RECEIPT
                await client.send(
                    commands.subscribe(
                        PARENT, "s", pb.CommandSubscribe.Exclusive, 7, 100,
                        initial_position=pb.CommandSubscribe.Earliest,
                    )
                )  # fmt: skip
                await client.next(lambda f: f.type == T.SUCCESS and f.body.request_id == 100)
                await client.send(commands.flow(7, 10))
                message = await client.next(lambda f: f.type == T.MESSAGE)
                assert message.payload == b"before"

                async with http.post(f"{base}/split/0") as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["epoch"] == 1

                # The producer attached before the split: each send is TopicTerminated.
                refused = await client.produce(1, "p", 1, b"after")
                assert refused.type == T.SEND_ERROR
                assert refused.command.send_error.error == pb.TopicTerminatedError
                # The consumer read everything: it is told the segment ended.
                await client.next(
                    lambda f: f.type == T.REACHED_END_OF_TOPIC and f.body.consumer_id == 7
                )
                # A new producer on the sealed segment is refused the same way.
                await client.send(commands.producer(PARENT, 2, 200, "q"))
                error = await client.next(lambda f: f.type == T.ERROR and f.body.request_id == 200)
                assert error.command.error.error == pb.TopicTerminatedError
                # The children are open for business on the same broker.
                await client.producer(CHILDREN[0], 3, "p")
                assert (await client.produce(3, "p", 1, b"child")).type == T.SEND_RECEIPT
            finally:
                await client.close()
        topic = broker.service.loaded_topic(PARENT)
        assert topic is not None and topic.ledger.is_terminated


async def test_child_rejects_a_sequence_id_the_parent_persisted(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        await enable_dedup(broker.service.policies)
        await broker.service.scalable.create(TOPIC, 1)
        client = await RawClient.connect(broker.port)
        try:
            await client.producer(PARENT, 1, "p")
            for seq in range(3):
                assert (await client.produce(1, "p", seq, b"m%d" % seq)).type == T.SEND_RECEIPT
            await broker.service.scalable.split(TOPIC, 0)
            for producer_id, child in enumerate(CHILDREN, start=10):
                success = await client.producer(child, producer_id, "p")
                assert success.last_sequence_id == 2, child
            # The retry of seq 2 (persisted on the parent) is a duplicate on the child.
            retry = await client.produce(10, "p", 2, b"m2")
            assert retry.type == T.SEND_RECEIPT
            assert retry.command.send_receipt.message_id.ledgerId == U64_MAX
            fresh = await client.produce(10, "p", 3, b"m3")
            assert fresh.command.send_receipt.message_id.ledgerId != U64_MAX
            # A merge child takes the highest mark of both parents (3 from the first child).
            await broker.service.scalable.merge(TOPIC, 1, 2)
            merged = await client.producer("segment://public/default/orders/0000-ffff-3", 20, "p")
            assert merged.last_sequence_id == 3
        finally:
            await client.close()
        loaded = broker.service.loaded_topic(CHILDREN[0])
        assert loaded is not None and loaded.ledger.entry_count == 1


async def test_child_dedup_seed_survives_a_restart(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, metadata="sqlite") as broker:
        await enable_dedup(broker.service.policies)
        await broker.service.scalable.create(TOPIC, 1)
        client = await RawClient.connect(broker.port)
        try:
            await client.producer(PARENT, 1, "p")
            for seq in range(5):
                assert (await client.produce(1, "p", seq, b"m")).type == T.SEND_RECEIPT
        finally:
            await client.close()
        await broker.service.scalable.split(TOPIC, 0)
    async with InProcessBroker(tmp_path, metadata="sqlite") as broker:
        client = await RawClient.connect(broker.port)
        try:
            success = await client.producer(CHILDREN[1], 1, "p")
            assert success.last_sequence_id == 4
            retry = await client.produce(1, "p", 3, b"m")
            assert retry.command.send_receipt.message_id.ledgerId == U64_MAX
            # The DAG after the restart is the split one, and this broker leads it again.
            update = await client.lookup(1, TOPIC, create_if_missing=False)
            assert update.dag.epoch == 1
            assert update.dag.controller_broker_url == broker.service_url
        finally:
            await client.close()


async def test_restarted_broker_takes_over_its_dead_predecessors_leadership() -> None:
    """A broker killed while leading leaves its controller key until its session expires;
    the restarted broker (same addresses) takes it over at once instead of waiting."""
    store = MemoryMetadataStore()
    ledgers = MemoryManagedLedgerFactory()

    def incarnation() -> ScalableTopicService:
        ops = StorageSegmentOps(ledgers)
        return ScalableTopicService(
            store, ops, SystemClock(), "http://b1:8080", pulsar_url="pulsar://b1:6650"
        )

    dead = incarnation()
    await dead.start()
    await dead.create(TOPIC, 1)
    # Another broker with other addresses stays a follower while the key is held.
    other = ScalableTopicService(
        store,
        StorageSegmentOps(ledgers),
        SystemClock(),
        "http://b2:8080",
        pulsar_url="pulsar://b2:6650",
    )
    assert not (await other.controller(TOPIC)).is_leader
    restarted = incarnation()  # a new metadata session; the dead one never closes its own
    try:
        controller = await restarted.controller(TOPIC)
        assert controller.is_leader
        layout = await restarted.split(TOPIC, 0)
        assert layout.epoch == 1
    finally:
        await restarted.close()
        await other.close()
        await store.close()


async def test_a_split_cut_short_is_finished_when_the_topic_is_next_looked_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with InProcessBroker(tmp_path, metadata="sqlite") as broker:
        await broker.service.scalable.create(TOPIC, 1)
        ops = broker.service.scalable.ops

        async def crash(segment: SegmentName) -> bytes:
            raise StorageIOError("the broker died here")

        monkeypatch.setattr(ops, "terminate_segment", crash)
        with pytest.raises(StorageIOError):
            await broker.service.scalable.split(TOPIC, 0)
        monkeypatch.undo()
        paths = TopicPaths(TopicName.parse(TOPIC))
        assert await broker.service.store.get(paths.pending_op) is not None
        assert (await broker.service.scalable.get_metadata(TOPIC)).epoch == 0
    async with InProcessBroker(tmp_path, metadata="sqlite") as broker:
        client = await RawClient.connect(broker.port)
        try:
            update = await client.lookup(1, TOPIC, create_if_missing=False)
            assert update.dag.epoch == 1  # the new leader finished the split first
            states = {s.segment_id: s.state for s in update.dag.segments}
            assert states == {0: pb.SEALED, 1: pb.ACTIVE, 2: pb.ACTIVE}
            await client.send(commands.producer(PARENT, 1, 1, "p"))
            refused = await client.next(lambda f: f.type == T.ERROR and f.body.request_id == 1)
            assert refused.command.error.error == pb.TopicTerminatedError
        finally:
            await client.close()
        assert await broker.service.store.get(paths.pending_op) is None
