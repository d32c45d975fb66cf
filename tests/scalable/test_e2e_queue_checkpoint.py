"""Queue and checkpoint consumers of scalable topics against a real in-process broker.

Topics are created, split and merged through the admin HTTP API; the consumers follow the
DAG through their DAG-watch sessions. Messages are produced straight to the segment topics
(routed by ``segment_hash`` like the scalable producer), so each test knows exactly which
segment holds what.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import anabranch
from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.client.checkpoint import Checkpoint, SegmentPosition
from anabranch.client.checkpoint_consumer import CheckpointConsumer
from anabranch.client.consumer import InitialPosition
from anabranch.client.message import Message
from anabranch.client.producer import Producer
from anabranch.client.queue_consumer import (
    ORIGIN_MESSAGE_ID,
    REAL_TOPIC,
    QueueConsumer,
)
from anabranch.core.hash_range import segment_hash
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import SegmentLayout, segment_name
from anabranch.testing.broker import InProcessBroker

KEYS = [f"key-{i}" for i in range(12)]
RECEIVE_TIMEOUT_S = 5.0
QUIET_S = 0.3


@dataclass
class World:
    broker: InProcessBroker
    admin: AdminClient
    client: Client
    producers: dict[str, Producer] = field(default_factory=dict)
    sent: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    async def create(self, topic: str, segments: int) -> None:
        await self.admin.create_scalable_topic(topic, segments)

    async def layout(self, topic: str) -> SegmentLayout:
        return SegmentLayout.from_dict(await self.admin.get_scalable_topic(topic))

    async def produce(self, topic: str, rounds: int, *, batching: bool = False) -> None:
        """``rounds`` messages per key, value ``key:seq``, each to the key's active segment."""
        layout = await self.layout(topic)
        name = TopicName.parse(topic)
        for _ in range(rounds):
            for key in KEYS:
                seg = layout.find_active(segment_hash(key))
                target = str(segment_name(name, seg))
                if target not in self.producers:
                    producer = await self.client.create_producer(target, batching=batching)
                    assert isinstance(producer, Producer)
                    self.producers[target] = producer
                seq = len(self.sent[key])
                self.sent[key].append(seq)
                await self.producers[target].send_async(f"{key}:{seq}".encode(), key=key)
        for producer in self.producers.values():
            await producer.flush()

    def total(self) -> int:
        return sum(len(v) for v in self.sent.values())


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin, Client(broker.service_url) as client:
            yield World(broker, admin, client)


def _parse(msg: Message) -> tuple[str, int]:
    key, seq = msg.value.decode().split(":")
    assert key == msg.key
    return key, int(seq)


async def _drain(consumer: QueueConsumer | CheckpointConsumer, count: int) -> list[Message]:
    out: list[Message] = []
    while len(out) < count:
        msg = await consumer.receive(timeout=RECEIVE_TIMEOUT_S)
        assert msg is not None, f"only {len(out)} of {count} messages arrived"
        out.append(msg)
        if isinstance(consumer, QueueConsumer):
            await consumer.acknowledge(msg)
    assert await consumer.receive(timeout=QUIET_S) is None, "more messages than produced"
    return out


def _assert_in_order_exactly_once(messages: list[Message], sent: dict[str, list[int]]) -> None:
    seen: dict[str, list[int]] = defaultdict(list)
    for msg in messages:
        key, seq = _parse(msg)
        seen[key].append(seq)
    assert dict(seen) == {k: v for k, v in sent.items() if v}


# --- queue consumer ----------------------------------------------------------------------------


async def test_queue_consumer_receives_everything_across_a_split(world: World) -> None:
    topic = "topic://public/default/q-split"
    await world.create(topic, 2)
    queue = await world.client.subscribe_queue(
        topic, "jobs", initial_position=InitialPosition.EARLIEST
    )
    try:
        await world.produce(topic, 3)
        await world.admin.split_segment(topic, 0)
        await world.produce(topic, 3)
        messages = await _drain(queue, world.total())
        values = sorted(_parse(m) for m in messages)
        assert values == sorted((k, s) for k, seqs in world.sent.items() for s in seqs)
        assert {m.message_id.segment_id for m in messages} >= {2, 3}
        assert all(m.topic == topic for m in messages)
        # The drained sealed parent retires once every message of it is acknowledged.
        for _ in range(200):
            if 0 not in queue.segment_ids:
                break
            await asyncio.sleep(0.05)
        assert queue.segment_ids == [1, 2, 3]
    finally:
        await queue.close()


async def test_queue_nack_redelivers_with_count_then_dead_letters(world: World) -> None:
    topic = "topic://public/default/q-dlq"
    await world.create(topic, 1)
    queue = await world.client.subscribe_queue(
        topic,
        "work",
        initial_position=InitialPosition.EARLIEST,
        nack_redelivery_delay_s=0.05,
        max_redeliveries=2,
    )
    dlq = await world.client.subscribe(
        queue.dead_letter_topic, "audit", initial_position=InitialPosition.EARLIEST
    )
    try:
        producer = await world.client.create_producer(
            str(segment_name(TopicName.parse(topic), (await world.layout(topic)).segments[0])),
            batching=False,
        )
        await producer.send(b"poison", key="p")
        await producer.send(b"good", key="g")
        counts: dict[bytes, list[int]] = defaultdict(list)
        acked = False
        while len(counts[b"poison"]) < 3 or not acked:
            msg = await queue.receive(timeout=RECEIVE_TIMEOUT_S)
            assert msg is not None
            counts[msg.value].append(msg.redelivery_count)
            if msg.value == b"good" and msg.redelivery_count == 1:
                await queue.acknowledge(msg)
                acked = True
            else:
                await queue.negative_acknowledge(msg)
        assert counts[b"poison"] == [0, 1, 2]
        assert counts[b"good"] == [0, 1]
        dead = await dlq.receive(timeout=RECEIVE_TIMEOUT_S)
        assert dead is not None and dead.value == b"poison" and dead.key == "p"
        assert dead.properties[REAL_TOPIC] == topic
        assert dead.properties[ORIGIN_MESSAGE_ID].startswith("0:")
        assert queue.dead_letter_topic == "persistent://public/default/q-dlq-work-DLQ"
        assert await queue.receive(timeout=QUIET_S) is None, "a dead letter came back"
        assert await dlq.receive(timeout=0.1) is None
    finally:
        await dlq.close()
        await queue.close()


async def test_queue_consumer_created_after_a_split_drains_the_sealed_parent(world: World) -> None:
    topic = "topic://public/default/q-late"
    await world.create(topic, 1)
    await world.produce(topic, 2)
    await world.admin.split_segment(topic, 0)
    await world.produce(topic, 2)
    queue = await world.client.subscribe_queue(
        topic, "late", initial_position=InitialPosition.EARLIEST
    )
    try:
        assert queue.segment_ids == [0, 1, 2]
        messages = await _drain(queue, world.total())
        assert sorted(_parse(m) for m in messages) == sorted(
            (k, s) for k, seqs in world.sent.items() for s in seqs
        )
        assert {m.message_id.segment_id for m in messages} == {0, 1, 2}
    finally:
        await queue.close()


async def test_queue_subscription_survives_a_split_while_offline(world: World) -> None:
    """The split gives the children the parent's cursors (at EARLIEST), so a queue
    subscription restarted with the default LATEST still gets what was produced to them."""
    topic = "topic://public/default/q-offline"
    await world.create(topic, 1)
    queue = await world.client.subscribe_queue(topic, "ops")
    await queue.close()
    await world.admin.split_segment(topic, 0)
    await world.produce(topic, 2)
    queue = await world.client.subscribe_queue(topic, "ops")
    try:
        messages = await _drain(queue, world.total())
        assert {m.message_id.segment_id for m in messages} == {1, 2}
    finally:
        await queue.close()


async def test_two_queue_consumers_share_a_subscription_across_a_merge(world: World) -> None:
    topic = "topic://public/default/q-shared"
    await world.create(topic, 2)
    a = await world.client.subscribe_queue(topic, "pool", initial_position=InitialPosition.EARLIEST)
    b = await world.client.subscribe_queue(topic, "pool", initial_position=InitialPosition.EARLIEST)
    try:
        await world.produce(topic, 3)
        await world.admin.merge_segments(topic, 0, 1)
        await world.produce(topic, 3)
        got: list[Message] = []

        async def take(queue: QueueConsumer) -> None:
            while (msg := await queue.receive(timeout=QUIET_S * 2)) is not None:
                got.append(msg)
                await queue.acknowledge(msg)

        await asyncio.gather(take(a), take(b))
        values = sorted(_parse(m) for m in got)
        assert values == sorted((k, s) for k, seqs in world.sent.items() for s in seqs)
        assert 2 in {m.message_id.segment_id for m in got}
    finally:
        await a.close()
        await b.close()


async def test_queue_nack_backoff_doubles_the_delay(world: World) -> None:
    topic = "topic://public/default/q-backoff"
    await world.create(topic, 1)
    queue = await world.client.subscribe_queue(
        topic,
        "retry",
        initial_position=InitialPosition.EARLIEST,
        nack_redelivery_delay_s=0.05,
        nack_backoff_max_s=0.3,
    )
    try:
        producer = await world.client.create_producer(topic)
        await producer.send(b"flaky", key="f")
        loop = asyncio.get_running_loop()
        times: list[float] = []
        for expected_count in range(5):
            msg = await queue.receive(timeout=RECEIVE_TIMEOUT_S)
            assert msg is not None and msg.redelivery_count == expected_count
            times.append(loop.time())
            await queue.negative_acknowledge(msg)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # Never earlier than the backoff says: 0.05, 0.1, 0.2, then capped at 0.3.
        for gap, delay in zip(gaps, [0.05, 0.1, 0.2, 0.3], strict=True):
            assert gap >= delay * 0.9, gaps
    finally:
        await queue.close()


# --- checkpoint consumer -------------------------------------------------------------------------


async def test_earliest_checkpoint_consumer_replays_the_dag_in_order(world: World) -> None:
    topic = "topic://public/default/cp-replay"
    await world.create(topic, 2)  # 0 [0000-7fff], 1 [8000-ffff]
    await world.produce(topic, 3, batching=True)
    await world.admin.split_segment(topic, 0)  # -> 2 [0000-3fff], 3 [4000-7fff]
    await world.produce(topic, 3, batching=True)
    await world.admin.split_segment(topic, 1)  # -> 4 [8000-bfff], 5 [c000-ffff]
    await world.produce(topic, 3, batching=True)
    await world.admin.merge_segments(topic, 3, 4)  # -> 6 [4000-bfff]
    await world.produce(topic, 3, batching=True)
    layout = await world.layout(topic)
    assert layout.epoch == 3

    reader = await world.client.create_checkpoint_consumer(topic, Checkpoint.earliest())
    try:
        messages = await _drain(reader, world.total())
        _assert_in_order_exactly_once(messages, world.sent)
        # DAG order: every message of a parent comes before any message of its children.
        index: dict[int, list[int]] = defaultdict(list)
        for i, msg in enumerate(messages):
            assert msg.message_id.segment_id is not None
            index[msg.message_id.segment_id].append(i)
        for seg in layout:
            for parent in seg.parent_ids:
                if index[parent] and index[seg.segment_id]:
                    assert max(index[parent]) < min(index[seg.segment_id]), (parent, seg)
        cp = reader.checkpoint()
        assert cp.epoch == 3
        assert all(cp.position(s.segment_id).complete for s in layout.sealed_segments())
        assert not any(cp.position(s.segment_id).complete for s in layout.active_segments())
    finally:
        await reader.close()


async def test_checkpoint_resumes_across_a_split_without_loss_or_duplicates(world: World) -> None:
    topic = "topic://public/default/cp-resume"
    await world.create(topic, 2)
    await world.produce(topic, 4, batching=True)
    first = await world.client.create_checkpoint_consumer(topic, Checkpoint.earliest())
    head = [await first.receive(timeout=RECEIVE_TIMEOUT_S) for _ in range(world.total() // 2 + 1)]
    saved = first.checkpoint().to_bytes()
    await first.close()

    await world.admin.split_segment(topic, 1)
    await world.produce(topic, 3, batching=True)
    cp = Checkpoint.from_bytes(saved)
    assert cp.epoch == 0
    second = await world.client.create_checkpoint_consumer(topic, cp)
    try:
        tail = await _drain(second, world.total() - len(head))
        got = [m for m in head if m is not None] + tail
        _assert_in_order_exactly_once(got, world.sent)
        assert {m.message_id.segment_id for m in tail} >= {2, 3}
        # A checkpoint of the resumed consumer covers the one it started from.
        assert second.checkpoint().covers(cp)
        # Seeking back to the saved checkpoint replays exactly the same tail.
        await second.seek(cp)
        again = await _drain(second, len(tail))
        assert [m.message_id for m in again] != [] and sorted(_parse(m) for m in again) == sorted(
            _parse(m) for m in tail
        )
    finally:
        await second.close()


async def test_latest_checkpoint_skips_old_data(world: World) -> None:
    topic = "topic://public/default/cp-latest"
    await world.create(topic, 2)
    await world.produce(topic, 2)
    await world.admin.split_segment(topic, 0)
    await world.produce(topic, 2)
    old = {k: list(v) for k, v in world.sent.items()}
    reader = await world.client.create_checkpoint_consumer(topic, Checkpoint.latest())
    try:
        cp = reader.checkpoint()
        assert cp.position(0).complete
        assert all(cp.position(s) != SegmentPosition.start() for s in (1, 2, 3))
        assert await reader.receive(timeout=QUIET_S) is None
        await world.produce(topic, 2)
        messages = await _drain(reader, world.total() - sum(len(v) for v in old.values()))
        new = {k: v[len(old.get(k, [])) :] for k, v in world.sent.items()}
        _assert_in_order_exactly_once(messages, new)
    finally:
        await reader.close()


async def test_queue_ack_timeout_redelivers_then_dead_letters(world: World) -> None:
    topic = "topic://public/default/q-timeout"
    await world.create(topic, 2)
    queue = await world.client.subscribe_queue(
        topic,
        "slow",
        initial_position=InitialPosition.EARLIEST,
        ack_timeout_s=0.1,
        max_redeliveries=1,
        dead_letter_topic="persistent://public/default/slow-letters",
    )
    dlq = await world.client.subscribe(
        queue.dead_letter_topic, "audit", initial_position="earliest"
    )
    try:
        await world.produce(topic, 1)
        first = await queue.receive(timeout=RECEIVE_TIMEOUT_S)
        assert first is not None and first.redelivery_count == 0
        # Everything else is acked at once; only ``first`` times out.
        for _ in range(world.total() - 1):
            msg = await queue.receive(timeout=RECEIVE_TIMEOUT_S)
            assert msg is not None and msg.value != first.value
            await queue.acknowledge(msg)
        again = await queue.receive(timeout=RECEIVE_TIMEOUT_S)
        assert again is not None and again.value == first.value
        assert again.redelivery_count == 1
        assert again.message_id == first.message_id
        # Its next timeout exceeds max_redeliveries: dead-lettered instead of delivered.
        assert await queue.receive(timeout=1.0) is None
        dead = await dlq.receive(timeout=RECEIVE_TIMEOUT_S)
        assert dead is not None and dead.value == first.value
    finally:
        await dlq.close()
        await queue.close()


async def test_checkpoint_consumer_survives_a_connection_drop_mid_batch(world: World) -> None:
    topic = "topic://public/default/cp-drop"
    await world.create(topic, 2)
    await world.produce(topic, 5, batching=True)
    reader = await world.client.create_checkpoint_consumer(topic, Checkpoint.earliest())
    try:
        head = [await reader.receive(timeout=RECEIVE_TIMEOUT_S) for _ in range(7)]
        assert any(m is not None and m.message_id.batch_index > 0 for m in head), "no batches"
        for fut in list(world.client._pool._connections.values()):
            await fut.result().close()
        await world.admin.split_segment(topic, 0)
        await world.produce(topic, 2, batching=True)
        tail = await _drain(reader, world.total() - len(head))
        _assert_in_order_exactly_once([m for m in head if m is not None] + tail, world.sent)
    finally:
        await reader.close()


async def test_blocking_api_produce_queue_checkpoint_resume(world: World) -> None:
    """DESIGN.md §3.5 with the blocking client (run on a thread; the broker is on this loop)."""
    topic = "topic://public/default/sync-api"
    await world.create(topic, 2)
    url = world.broker.service_url

    def run() -> tuple[list[bytes], list[Message]]:
        with anabranch.Client(url) as client:
            producer = client.create_producer(topic)
            queue = client.subscribe_queue(topic, subscription="jobs", initial_position="earliest")
            reader = client.create_checkpoint_consumer(topic, start=anabranch.Checkpoint.earliest())
            for i in range(10):
                producer.send(f"{i}".encode(), key=f"k{i % 3}")
            got: list[bytes] = []
            while len(got) < 10:
                msg = queue.receive(timeout=RECEIVE_TIMEOUT_S)
                assert msg is not None
                queue.acknowledge(msg)
                got.append(msg.value)
            read = [reader.receive(timeout=RECEIVE_TIMEOUT_S) for _ in range(4)]
            saved = reader.checkpoint().to_bytes()
            reader.close()
            resumed = client.create_checkpoint_consumer(
                topic, start=anabranch.Checkpoint.from_bytes(saved)
            )
            read += [resumed.receive(timeout=RECEIVE_TIMEOUT_S) for _ in range(6)]
            assert resumed.receive(timeout=QUIET_S) is None
            return got, [m for m in read if m is not None]

    got, read = await asyncio.to_thread(run)
    assert sorted(got) == sorted(f"{i}".encode() for i in range(10))
    assert len(read) == 10
    for key in ("k0", "k1", "k2"):
        values = [int(m.value) for m in read if m.key == key]
        assert values == sorted(values) and len(values) == len(set(values))
    assert sorted(int(m.value) for m in read) == list(range(10))


async def test_checkpoint_consumer_group_shares_segments_and_merges_checkpoints(
    world: World,
) -> None:
    topic = "topic://public/default/cp-group"
    await world.create(topic, 4)
    client = world.client
    m1 = await client.create_checkpoint_consumer(topic, consumer_group="g", consumer_name="m1")
    m2 = await client.create_checkpoint_consumer(topic, consumer_group="g", consumer_name="m2")
    try:
        for _ in range(200):  # m1 had all four until m2 joined
            if m1.assigned_segments and len(m1.assigned_segments) == 2:
                break
            await asyncio.sleep(0.02)
        assert m1.assigned_segments is not None and m2.assigned_segments is not None
        assert sorted(m1.assigned_segments + m2.assigned_segments) == [0, 1, 2, 3]
        assert len(m1.assigned_segments) == len(m2.assigned_segments) == 2
        await world.produce(topic, 3, batching=True)
        got: dict[str, list[Message]] = {"m1": [], "m2": []}

        async def take(member: CheckpointConsumer) -> None:
            while (msg := await member.receive(timeout=QUIET_S * 2)) is not None:
                assert member.assigned_segments is not None
                assert msg.message_id.segment_id in member.assigned_segments
                got[member.consumer_name].append(msg)

        await asyncio.gather(take(m1), take(m2))
        assert got["m1"] and got["m2"]
        # A key lives in one segment, so in one member: per-key order is per member.
        _assert_in_order_exactly_once(got["m1"] + got["m2"], world.sent)
        merged = m1.checkpoint().merge(m2.checkpoint())
    finally:
        await m1.close()
        await m2.close()
    # The merged group position: nothing of the old data is read again.
    reader = await client.create_checkpoint_consumer(
        topic, Checkpoint.from_bytes(merged.to_bytes())
    )
    try:
        assert await reader.receive(timeout=QUIET_S) is None
        old = {k: len(v) for k, v in world.sent.items()}
        await world.produce(topic, 1)
        messages = await _drain(reader, len(KEYS))
        assert all(_parse(m)[1] == old[m.key or ""] for m in messages)
    finally:
        await reader.close()


async def test_live_split_and_merge_keep_per_key_order_for_both_consumers(world: World) -> None:
    """The scalable producer sends keyed messages while segments split and merge; a
    checkpoint consumer reading live keeps every key in order, exactly once, and a queue
    consumer gets every message."""
    topic = "topic://public/default/live"
    await world.create(topic, 2)
    reader = await world.client.create_checkpoint_consumer(topic, Checkpoint.earliest())
    queue = await world.client.subscribe_queue(
        topic, "live", initial_position=InitialPosition.EARLIEST
    )
    producer = await world.client.create_producer(topic, batching=True)
    sent: dict[str, list[int]] = defaultdict(list)
    rounds = 40

    async def produce() -> None:
        for i in range(rounds):
            futures = []
            for key in KEYS:
                sent[key].append(i)
                futures.append(await producer.send_async(f"{key}:{i}".encode(), key=key))
            await asyncio.gather(*futures)
            await asyncio.sleep(0.005)

    async def reshape() -> None:
        await asyncio.sleep(0.05)
        await world.admin.split_segment(topic, 0)  # -> 2, 3
        await asyncio.sleep(0.05)
        await world.admin.split_segment(topic, 1)  # -> 4, 5
        await asyncio.sleep(0.05)
        await world.admin.merge_segments(topic, 3, 4)  # -> 6

    try:
        await asyncio.gather(produce(), reshape())
        total = rounds * len(KEYS)
        read = await _drain(reader, total)
        _assert_in_order_exactly_once(read, sent)
        # Traffic spanned the reshaping: the first and the last generation both hold data.
        assert {0, 1, 6} <= {m.message_id.segment_id for m in read}
        queued = await _drain(queue, total)
        assert sorted(_parse(m) for m in queued) == sorted(
            (k, s) for k, seqs in sent.items() for s in seqs
        )
        assert (await world.layout(topic)).epoch == 3
    finally:
        await reader.close()
        await queue.close()
