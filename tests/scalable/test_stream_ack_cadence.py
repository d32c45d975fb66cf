"""A stream consumer never stalls after a split, however rarely it acknowledges.

The application acknowledges cumulatively every message, every N messages (as a batch or
Spark-like consumer does: strictly every N-th, with no flush on idle), or only at the end;
a segment is split (twice, or split then merged) while it consumes, and the producer keeps
going. Each test checks what the application saw: every (key, seq) exactly once, in per-key
order, with no receive timing out before the last message. Before the fix the children of
the split segment were held back until it drained, and it could not drain: its last
messages waited for an ack that only a later message would bring.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from anabranch.aio import Message
from anabranch.client.stream_consumer import StreamConsumer
from tests.scalable.conftest import eventually
from tests.scalable.stream_world import World, parse, world_with

RECEIVE_TIMEOUT_S = 5.0
"""Far above the few ms a message takes here: a receive that times out is a stall."""
QUIET_S = 0.3


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with world_with(tmp_path) as w:
        yield w


class App:
    """The application: receives, and acknowledges cumulatively every ``every``-th message
    (None: never on its own)."""

    def __init__(self, stream: StreamConsumer, every: int | None) -> None:
        self.stream = stream
        self.every = every
        self.got: list[Message] = []

    async def take(self, count: int) -> None:
        """Receive ``count`` more messages; a receive that times out fails (a stall)."""
        for _ in range(count):
            msg = await self.stream.receive(timeout=RECEIVE_TIMEOUT_S)
            assert msg is not None, (
                f"stalled after {len(self.got)} messages, acknowledging every {self.every}: "
                f"held {self.stream.segment_ids}, subscribed {self.stream.connected_segment_ids}"
            )
            self.got.append(msg)
            if self.every is not None and len(self.got) % self.every == 0:
                await self.stream.acknowledge_cumulative(msg)

    async def finish(self) -> None:
        """Nothing more arrives; then acknowledge everything received."""
        assert await self.stream.receive(timeout=QUIET_S) is None, "more messages than sent"
        await self.stream.acknowledge_cumulative(self.got[-1])

    def by_key(self) -> dict[str | None, list[int]]:
        seen: dict[str | None, list[int]] = defaultdict(list)
        for msg in self.got:
            key, seq = parse(msg)
            seen[key].append(seq)
        return dict(seen)


EVERY = [1, 7, 50, None]
"""Ack cadences: every message, a prime that never lines up with a batch, a batch larger
than what is left of the parent after the split, and never (until the end)."""


@pytest.mark.parametrize("every", EVERY)
async def test_a_split_of_the_only_segment_never_stalls_the_stream(
    world: World, every: int | None
) -> None:
    topic = "topic://public/default/cadence"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic)
    stream = await world.client.subscribe_stream(topic, "spark", consumer_name="w1")
    app = App(stream, every)
    await world.produce(producer, 103)
    await app.take(61)
    await world.admin.split_segment(topic, 0)  # -> 1, 2
    await world.produce(producer, 150)
    await app.take(103 - 61 + 150)
    await app.finish()
    assert app.by_key() == world.expected()
    assert {m.message_id.segment_id for m in app.got} == {0, 1, 2}
    # The final cumulative ack drains the parent: it retires from the assignment.
    await eventually(lambda: stream.segment_ids == [1, 2], "the drained parent retires")
    await stream.close()
    await producer.close()


@pytest.mark.parametrize("every", [7, None])
async def test_two_splits_and_a_merge_never_stall_the_stream(
    world: World, every: int | None
) -> None:
    topic = "topic://public/default/cadence-dag"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic, batching=False)
    stream = await world.client.subscribe_stream(
        topic, "spark", consumer_name="w1", receiver_queue_size=16
    )
    app = App(stream, every)
    await world.produce(producer, 97)
    await app.take(40)
    await world.admin.split_segment(topic, 0)  # -> 1 [0000-7fff], 2 [8000-ffff]
    await world.produce(producer, 97)
    await world.admin.split_segment(topic, 1)  # -> 3 [0000-3fff], 4 [4000-7fff]
    await world.produce(producer, 97)
    await world.admin.merge_segments(topic, 4, 2)  # -> 5 [4000-ffff]
    await world.produce(producer, 97)
    await app.take(4 * 97 - 40)
    await app.finish()
    assert app.by_key() == world.expected()
    assert {m.message_id.segment_id for m in app.got} == {0, 1, 2, 3, 4, 5}
    await eventually(lambda: stream.segment_ids == [3, 5], "drained segments retire")
    await stream.close()
    await producer.close()


async def test_unkeyed_messages_never_stall_the_stream(world: World) -> None:
    topic = "topic://public/default/cadence-unkeyed"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic)
    stream = await world.client.subscribe_stream(topic, "spark", consumer_name="w1")
    app = App(stream, 7)
    await world.produce(producer, 60, keyed=False)
    await app.take(20)
    await world.admin.split_segment(topic, 0)
    await world.produce(producer, 60, keyed=False)
    await app.take(100)
    await app.finish()
    # Without a key there is no order across segments to keep: each arrives once.
    assert sorted(app.by_key()[None]) == world.expected()[None]
    await stream.close()
    await producer.close()


async def test_a_split_while_the_receiver_queue_is_full_of_unacked_messages(
    world: World,
) -> None:
    """The parent's receiver queue is full when it is sealed, most of the parent is still
    on the broker, and the children are carried to this consumer at once: the application,
    acking every 13, gets the rest of the parent before any child's message."""
    topic = "topic://public/default/cadence-queue"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic, batching=False)
    stream = await world.client.subscribe_stream(
        topic, "spark", consumer_name="w1", receiver_queue_size=10
    )
    app = App(stream, 13)
    await world.produce(producer, 200)
    await app.take(5)  # nothing acknowledged: 5 taken, the queue refilled behind them
    await world.admin.split_segment(topic, 0)
    await world.produce(producer, 200)
    await app.take(395)
    await app.finish()
    assert app.by_key() == world.expected()
    segments = [m.message_id.segment_id for m in app.got]
    assert segments[:200] == [0] * 200, "a child's message came before the parent's last"
    await eventually(lambda: stream.segment_ids == [1, 2], "the drained parent retires")
    await stream.close()
    await producer.close()


async def test_a_restart_gets_the_unacknowledged_tail_of_the_parent_first(
    world: World,
) -> None:
    """The application received the whole parent and most of the children but acknowledged
    only up to a message in the parent, then restarted: nothing unacknowledged is lost, and
    the parent's tail comes again before any child's message."""
    topic = "topic://public/default/cadence-restart"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic)
    first = await world.client.subscribe_stream(topic, "spark", consumer_name="w1")
    app = App(first, 100)
    await world.produce(producer, 120)
    await world.admin.split_segment(topic, 0)
    await world.produce(producer, 80)
    await app.take(199)  # acknowledged up to the 100th: 20 of the parent's 120 are not
    assert [m.message_id.segment_id for m in app.got[:120]] == [0] * 120
    await first.close(leave=False)  # a crash: the session waits for w1
    again = await world.client.subscribe_stream(topic, "spark", consumer_name="w1")
    replay = App(again, 1)
    everything = {(k, i) for k, n in world.expected().items() for i in n}
    unacked = everything - {parse(m) for m in app.got[:100]}  # the 200th was never taken
    assert len(unacked) == 100
    while not unacked <= {parse(m) for m in replay.got}:
        await replay.take(1)
    await replay.finish()
    # A batch acknowledged part way comes again whole (batch-index acks are off, as
    # upstream's default): the parent's acknowledged head may repeat, its tail must.
    segments = [m.message_id.segment_id for m in replay.got]
    assert segments[: segments.count(0)] == [0] * segments.count(0), "a child before the parent"
    for key, seqs in replay.by_key().items():
        assert seqs == sorted(seqs), f"{key} out of order after the restart"
    await eventually(lambda: again.segment_ids == [1, 2], "the drained parent retires")
    await again.close()
    await producer.close()


async def test_two_consumers_acking_every_n_share_the_children(world: World) -> None:
    """The sealed parent's children go to its consumer until it drains, then are dealt
    between both consumers; together they see everything, each key in order."""
    topic = "topic://public/default/cadence-two"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic)
    streams = [
        await world.client.subscribe_stream(topic, "spark", consumer_name=f"w{i}") for i in (1, 2)
    ]
    await eventually(lambda: sorted(streams[0].segment_ids + streams[1].segment_ids) == [0], "")
    apps = [App(s, 7) for s in streams]
    await world.produce(producer, 100)
    await world.admin.split_segment(topic, 0)
    await world.produce(producer, 100)
    everything: set[tuple[str | None, int]] = set()
    loop = asyncio.get_running_loop()
    progress = [loop.time()]

    async def drain(app: App) -> None:
        while len(everything) < 200:
            assert loop.time() - progress[0] < RECEIVE_TIMEOUT_S, f"stalled at {len(everything)}"
            msg = await app.stream.receive(timeout=0.1)
            if msg is None:
                continue
            progress[0] = loop.time()
            everything.add(parse(msg))
            app.got.append(msg)
            if len(app.got) % 7 == 0:
                await app.stream.acknowledge_cumulative(msg)

    await asyncio.gather(*(drain(a) for a in apps))
    assert everything == {(k, i) for k, n in world.expected().items() for i in n}
    for app in apps:
        firsts: dict[str | None, list[int]] = defaultdict(list)
        for key, seq in map(parse, app.got):
            if seq not in firsts[key]:
                firsts[key].append(seq)
        for key, seqs in firsts.items():
            assert seqs == sorted(seqs), f"{app.stream.consumer_name} saw {key} out of order"
    # The parent drained: its children were dealt to both consumers.
    await eventually(
        lambda: sorted(streams[0].segment_ids + streams[1].segment_ids) == [1, 2], "re-dealt"
    )
    assert streams[0].segment_ids and streams[1].segment_ids
    for stream in streams:
        await stream.close()
    await producer.close()


async def drop_connection(world: World, stream: StreamConsumer, topic: str) -> None:
    """Close the client's connection: every segment consumer reconnects."""
    old = await world.client._pool.get()
    await old.close()
    parent = stream._segments[0]
    await eventually(lambda: parent._conn not in (None, old), "the parent reconnected")


async def unload_parent(world: World, stream: StreamConsumer, topic: str) -> None:
    """The broker unloads the parent (as an ownership move does): its consumer alone
    reconnects, while its children's messages stay queued."""
    parent = stream._segments[0]
    name = topic.replace("topic:", "segment:") + "/0000-ffff-0"
    assert await world.node.service.unload_topic(name)
    await eventually(lambda: parent._filter_up_to is not None, "the parent reconnected")


@pytest.mark.parametrize("drop", [drop_connection, unload_parent])
@pytest.mark.parametrize(("taken", "queue"), [(5, 1000), (120, 10)])
async def test_a_reconnect_never_brings_the_parent_after_its_children(
    world: World,
    taken: int,
    queue: int,
    drop: Callable[[World, StreamConsumer, str], Awaitable[None]],
) -> None:
    """A reconnect after the split, while the parent is not drained and its children are
    subscribed: with the parent's last messages still queued (5 taken of its 103, all
    queued) or taken but not acknowledged (120 taken, acknowledged up to the 100th).
    Whatever the broker sends again, this session never gets a message of the parent
    after one of its children, and loses nothing."""
    topic = "topic://public/default/cadence-drop"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic, batching=False)
    stream = await world.client.subscribe_stream(
        topic, "spark", consumer_name="w1", receiver_queue_size=queue
    )
    app = App(stream, 50)
    await world.produce(producer, 103)
    await world.admin.split_segment(topic, 0)
    await world.produce(producer, 100)
    await app.take(taken)
    await eventually(lambda: stream.connected_segment_ids == [0, 1, 2], "children joined")
    await drop(world, stream, topic)
    everything = {(k, i) for k, n in world.expected().items() for i in n}
    while {parse(m) for m in app.got} != everything:
        await app.take(1)
    await app.finish()
    segments = [m.message_id.segment_id for m in app.got]
    first_child = next(i for i, s in enumerate(segments) if s != 0)
    assert 0 not in segments[first_child:], "the parent came again after its children"
    firsts: dict[str | None, list[int]] = defaultdict(list)
    for key, seq in map(parse, app.got):
        if seq not in firsts[key]:
            firsts[key].append(seq)
    assert firsts == world.expected()
    await eventually(lambda: stream.segment_ids == [1, 2], "the drained parent retires")
    await stream.close()
    await producer.close()


async def test_an_ack_lost_with_the_connection_is_sent_again(world: World) -> None:
    """The application acknowledges everything while the connection is down: the acks are
    lost, the broker would send it all again. Nothing comes again to this session (it took
    it all already), and the acks are sent again: the parent drains and retires."""
    topic = "topic://public/default/cadence-lost-ack"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic, batching=False)
    stream = await world.client.subscribe_stream(topic, "spark", consumer_name="w1")
    app = App(stream, None)
    await world.produce(producer, 103)
    await world.admin.split_segment(topic, 0)
    await world.produce(producer, 100)
    await app.take(203)
    old = await world.client._pool.get()
    await old.close()
    assert all(c._conn is None for c in stream._segments.values()), "acks would go out"
    await stream.acknowledge_cumulative(app.got[-1])  # lost with the connection
    await eventually(
        lambda: all(c._conn not in (None, old) for c in stream._segments.values()), "reconnected"
    )
    assert await stream.receive(timeout=QUIET_S) is None, "the session got a message again"
    await eventually(lambda: stream.segment_ids == [1, 2], "the parent drains and retires")
    await stream.close()
    await producer.close()
