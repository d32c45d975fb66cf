"""Stream consumers and the scalable producer end to end on a real in-process broker.

Topics are created, split and merged through the admin HTTP API (and the broker's
ScalableTopicService) while the producer and the stream consumers run; each test checks
what the application saw: every (key, seq) exactly once, in per-key order.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import anabranch
from anabranch.admin.client import AdminClient
from anabranch.aio import Client, Message
from anabranch.client.scalable_producer import ScalableProducer
from anabranch.client.stream_consumer import StreamConsumer
from anabranch.errors import InvalidArgument
from anabranch.testing.broker import BrokerProcess
from tests.scalable.conftest import EVENTUALLY_ROUNDS, eventually
from tests.scalable.stream_world import KEYS, World, parse, world_with

RECEIVE_TIMEOUT_S = 5.0
QUIET_S = 0.3


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with world_with(tmp_path) as w:
        yield w


async def _consume(stream: StreamConsumer, count: int) -> list[Message]:
    """``count`` messages, each acknowledged cumulatively; then nothing more."""
    out: list[Message] = []
    while len(out) < count:
        msg = await stream.receive(timeout=RECEIVE_TIMEOUT_S)
        assert msg is not None, f"only {len(out)} of {count} arrived ({stream.segment_ids})"
        out.append(msg)
        await stream.acknowledge_cumulative(msg)
    assert await stream.receive(timeout=QUIET_S) is None, "more messages than produced"
    return out


def _by_key(messages: list[Message]) -> dict[str | None, list[int]]:
    seen: dict[str | None, list[int]] = defaultdict(list)
    for msg in messages:
        key, seq = parse(msg)
        seen[key].append(seq)
    return dict(seen)


async def test_every_key_in_order_once_across_two_splits_and_a_merge(world: World) -> None:
    topic = "topic://public/default/orders"
    await world.admin.create_scalable_topic(topic, 2)
    stream = await world.stream(topic, "worker-1")
    producer = await world.producer(topic)
    scalable = world.node.service.scalable
    changes: list[Callable[[], Awaitable[object]]] = [
        lambda: world.admin.split_segment(topic, 0),  # -> 2, 3
        lambda: world.admin.split_segment(topic, 1),  # -> 4, 5
        lambda: scalable.merge(topic, 3, 4),  # -> 6
    ]

    async def produce() -> None:
        for change in changes:
            await world.produce(producer, 150)
            await change()
        await world.produce(producer, 150)

    producing = asyncio.ensure_future(produce())
    messages = await _consume(stream, 600)
    await producing
    assert _by_key(messages) == world.expected()
    assert all(m.topic == topic for m in messages)
    assert {m.message_id.segment_id for m in messages} >= {0, 1, 2, 5, 6}
    # Drained sealed segments retire from the assignment; the active ones remain.
    await eventually(lambda: stream.segment_ids == [2, 5, 6], "sealed segments retire")
    await stream.close()
    await producer.close()


async def test_a_new_subscription_replays_sealed_backlog_in_dag_order(world: World) -> None:
    topic = "topic://public/default/replay"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic)
    await world.produce(producer, 64)
    await world.admin.split_segment(topic, 0)
    await world.produce(producer, 64)
    await world.admin.split_segment(topic, 1)
    await world.produce(producer, 64)
    stream = await world.stream(topic, "late")
    # The descendants of undrained 0 are carried to its consumer, which joins each once
    # its ancestors handed out their last message (so the replay keeps DAG order).
    assert stream.segment_ids == [0, 1, 2, 3, 4]
    messages = await _consume(stream, 192)
    assert _by_key(messages) == world.expected()
    await stream.close()
    await producer.close()


async def test_two_stream_consumers_share_the_segments(world: World) -> None:
    topic = "topic://public/default/shared"
    await world.admin.create_scalable_topic(topic, 4)
    first = await world.stream(topic, "worker-1")
    second = await world.stream(topic, "worker-2")
    await eventually(
        lambda: len(first.connected_segment_ids) == 2 and len(second.connected_segment_ids) == 2,
        "the segments are dealt two and two",
    )
    assert set(first.segment_ids) | set(second.segment_ids) == {0, 1, 2, 3}
    producer = await world.producer(topic)
    await world.produce(producer, 400)
    counts = {first: 0, second: 0}
    got: list[Message] = []

    async def drain(stream: StreamConsumer) -> None:
        while (msg := await stream.receive(timeout=QUIET_S * 3)) is not None:
            counts[stream] += 1
            got.append(msg)
            await stream.acknowledge_cumulative(msg)

    await asyncio.gather(drain(first), drain(second))
    assert _by_key(got) == world.expected()
    assert counts[first] and counts[second]
    keys_of = {s: {m.key for m in got if m.message_id.segment_id in s.segment_ids} for s in counts}
    assert not keys_of[first] & keys_of[second], "a key was read by both consumers"
    for stream in (first, second):
        await stream.close()
    await producer.close()


async def test_two_stream_consumers_across_splits_lose_nothing(world: World) -> None:
    """Splits re-deal segments between two consumers (a segment can move from one to the
    other); together they see everything, each in per-key order."""
    topic = "topic://public/default/shared-splits"
    await world.admin.create_scalable_topic(topic, 2)
    streams = [await world.stream(topic, "worker-1"), await world.stream(topic, "worker-2")]
    await eventually(lambda: all(s.segment_ids for s in streams), "a segment each")
    producer = await world.producer(topic)
    total = 480
    first_seen: dict[StreamConsumer, dict[str | None, list[int]]] = {
        s: defaultdict(list) for s in streams
    }
    everything: set[tuple[str | None, int]] = set()

    async def produce() -> None:
        for segment_id in (0, 1):
            await world.produce(producer, 160)
            await world.admin.split_segment(topic, segment_id)
        await world.produce(producer, 160)

    async def drain(stream: StreamConsumer) -> None:
        while len(everything) < total:
            msg = await stream.receive(timeout=0.1)
            if msg is None:
                continue
            key, seq = parse(msg)
            everything.add((key, seq))
            if seq not in first_seen[stream][key]:
                first_seen[stream][key].append(seq)
            await stream.acknowledge_cumulative(msg)

    await asyncio.wait_for(asyncio.gather(produce(), *(drain(s) for s in streams)), 60)
    assert everything == {(k, i) for k, n in world.expected().items() for i in n}
    for stream in streams:
        for key, seqs in first_seen[stream].items():
            assert seqs == sorted(seqs), f"{stream.consumer_name} saw {key} out of order"
    for stream in streams:
        await stream.close()
    await producer.close()


async def test_a_restart_within_the_grace_period_keeps_the_segments(tmp_path: Path) -> None:
    async with world_with(tmp_path, grace_s=30.0) as world:
        topic = "topic://public/default/sticky"
        await world.admin.create_scalable_topic(topic, 2)
        first = await world.stream(topic, "worker-1")
        second = await world.stream(topic, "worker-2")
        await eventually(
            lambda: len(first.segment_ids) == 1 and len(second.segment_ids) == 1,
            "one segment each",
        )
        mine, updates = first.segment_ids, second.assignment_updates
        await first.close(leave=False)  # a restart: the segments wait for worker-1
        again = await world.stream(topic, "worker-1")
        assert again.segment_ids == mine
        producer = await world.producer(topic)
        await world.produce(producer, 64)
        messages: list[Message] = []
        while (msg := await again.receive(timeout=QUIET_S * 3)) is not None:
            messages.append(msg)
            await again.acknowledge_cumulative(msg)
        assert messages and {m.message_id.segment_id for m in messages} == set(mine)
        assert second.assignment_updates == updates, "the other consumer was rebalanced"
        assert second.segment_ids != mine
        for closing in (again, second, producer):
            await closing.close()


async def test_the_grace_period_running_out_rebalances(tmp_path: Path) -> None:
    async with world_with(tmp_path, grace_s=0.3) as world:
        topic = "topic://public/default/evict"
        await world.admin.create_scalable_topic(topic, 2)
        first = await world.stream(topic, "worker-1")
        second = await world.stream(topic, "worker-2")
        await eventually(lambda: len(second.segment_ids) == 1, "a share for the second")
        await first.close(leave=False)
        await asyncio.sleep(0.1)
        assert len(second.segment_ids) == 1, "rebalanced before the grace period ran out"
        await eventually(lambda: second.segment_ids == [0, 1], "the second takes over")
        await eventually(lambda: second.connected_segment_ids == [0, 1], "and subscribes")
        await second.close()


async def test_closing_leaves_the_subscription_at_once(world: World) -> None:
    topic = "topic://public/default/leaving"
    await world.admin.create_scalable_topic(topic, 2)
    first = await world.stream(topic, "worker-1")
    second = await world.stream(topic, "worker-2")
    await eventually(lambda: len(second.segment_ids) == 1, "a share for the second")
    await first.close()  # the fixture's grace period is 30 s: only a clean leave is this quick
    await eventually(lambda: second.segment_ids == [0, 1], "the second takes over")
    await second.close()


async def test_the_blocking_client_streams_a_scalable_topic(world: World) -> None:
    topic = "topic://public/default/blocking-stream"
    await world.admin.create_scalable_topic(topic, 2)
    url = world.node.service_url

    def run() -> list[tuple[str | None, int]]:
        with anabranch.Client(url) as client:
            stream = client.subscribe_stream(topic, "sync", consumer_name="sync-1")
            producer = client.create_producer(topic)
            for i in range(40):
                producer.send(f"{KEYS[i % 4]}:{i // 4}".encode(), key=KEYS[i % 4])
            got = []
            while (msg := stream.receive(timeout=RECEIVE_TIMEOUT_S)) is not None:
                got.append(parse(msg))
                stream.acknowledge_cumulative(msg)
                if len(got) == 40:
                    break
            stream.close()
            return got

    got = await asyncio.to_thread(run)
    assert sorted(got) == sorted((KEYS[i % 4], i // 4) for i in range(40))


async def _when_http_serves(call: Callable[[], Awaitable[object]]) -> None:
    """A broker process answers CONNECT before its HTTP port listens: retry until it does."""
    for _ in range(EVENTUALLY_ROUNDS):
        try:
            await call()
            return
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.01)
    raise AssertionError("the admin HTTP port never answered")


async def test_producer_and_stream_consumer_ride_out_a_broker_crash(tmp_path: Path) -> None:
    """SIGKILL mid-flow, restart on the same ports, then a split: the DAG session, the
    segment producers and the controller registration all reconnect; nothing is lost and
    every key's first deliveries stay in order (a crash may redeliver unacked messages)."""
    broker = BrokerProcess(tmp_path / "data")
    await broker.start()
    try:
        topic = "topic://public/default/crash"
        async with (
            AdminClient(f"http://{broker.host}:{broker.http_port}") as admin,
            Client(broker.service_url) as client,
        ):
            await _when_http_serves(lambda: admin.create_scalable_topic(topic, 2))
            world = World(None, admin, client)
            stream = await world.stream(topic, "survivor")
            producer = await world.producer(topic)
            await world.produce(producer, 160)
            got = [await stream.receive(timeout=RECEIVE_TIMEOUT_S) for _ in range(80)]
            for msg in got:
                assert msg is not None
                await stream.acknowledge_cumulative(msg)
            broker.kill()
            await broker.start()
            await world.produce(producer, 160)  # waits for the reconnects, never fails
            await _when_http_serves(lambda: admin.split_segment(topic, 0))
            await world.produce(producer, 160)
            seen: dict[str | None, list[int]] = defaultdict(list)
            messages = [m for m in got if m is not None]
            while len({parse(m) for m in messages}) < 480:
                msg = await stream.receive(timeout=RECEIVE_TIMEOUT_S)
                assert msg is not None, f"{len({parse(m) for m in messages})} of 480 arrived"
                messages.append(msg)
                await stream.acknowledge_cumulative(msg)
            for msg in messages:
                key, seq = parse(msg)
                if seq not in seen[key]:
                    seen[key].append(seq)
            assert seen == world.expected()
            await stream.close()
            await producer.close()
    finally:
        await broker.stop()


async def test_send_many_keeps_key_order_across_a_split_and_waits_for_room(world: World) -> None:
    topic = "topic://public/default/bulk"
    await world.admin.create_scalable_topic(topic, 2)
    stream = await world.stream(topic, "worker-1")
    made = await world.client.create_producer(topic, batch_delay_s=0.002, pending_messages_max=64)
    assert isinstance(made, ScalableProducer)
    producer = made

    async def produce_bulk(count: int) -> None:
        messages = []
        for i in range(count):
            key = KEYS[i % len(KEYS)]
            messages.append((f"{key}:{world.sent[key]}".encode(), key, {"n": str(i)}, None))
            world.sent[key] += 1
        futures = await producer.send_many(messages)  # 200 > 64: it waits for room in between
        ids = await asyncio.gather(*futures)
        assert all(mid.segment_id is not None for mid in ids)

    async def produce() -> None:
        await produce_bulk(200)
        await world.admin.split_segment(topic, 0)
        await produce_bulk(200)

    producing = asyncio.ensure_future(produce())
    messages = await _consume(stream, 400)
    await producing
    assert _by_key(messages) == world.expected()
    assert {m.message_id.segment_id for m in messages} >= {1, 2, 3}
    await stream.close()
    await producer.close()


async def test_send_many_refuses_a_bad_value_without_queueing_the_others(world: World) -> None:
    topic = "topic://public/default/bulk-bad"
    await world.admin.create_scalable_topic(topic, 1)
    producer = await world.producer(topic)
    bad: Any = "not bytes"
    with pytest.raises(InvalidArgument):
        await producer.send_many([(b"fine", "k", None, None), (bad, "k", None, None)])
    await producer.flush()
    assert producer.last_sequence_id == -1  # nothing was sent
    await producer.close()
