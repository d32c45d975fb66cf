"""A hostile client must not stall the broker (issue 15, DESIGN.md §3.2's counts row).

Counts a client sends in ACK / FLOW / REDELIVER are checked against what the broker stored
(or clamped to ``limits``) before any loop or allocation; producers, consumers and spawned
handler tasks of one connection are capped. Every test ends with a PING answered: the
broker runs on the test's event loop, so a stall shows as a missing PONG (or, for a loop
that never yields, as the pytest timeout below).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from anabranch import limits
from anabranch.broker import command_table
from anabranch.broker.consumer import Consumer
from anabranch.broker.dispatcher_key_shared import StickySelector
from anabranch.broker.session import Session
from anabranch.broker.subscription import Subscription
from anabranch.errors import ConsumerAssignError
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from anabranch.testing.broker import InProcessBroker
from tests.broker.test_core_protocol import RawClient

pytestmark = pytest.mark.timeout(60)

T = pb.BaseCommand
TOPIC = "persistent://public/default/hostile"
SHARED = pb.CommandSubscribe.Shared
EARLIEST_POS = pb.CommandSubscribe.Earliest
WAIT_S = 10.0
"""Only turns a hang into a failure; never a performance assertion."""


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, metadata="memory") as b:
        yield b


@pytest.fixture
async def client(broker: InProcessBroker) -> AsyncIterator[RawClient]:
    c = await RawClient.open(broker.port)
    try:
        await c.handshake()
        yield c
    finally:
        await c.close()


async def expect(client: RawClient, kind: int) -> Any:
    return await asyncio.wait_for(client.expect(kind), WAIT_S)


async def assert_responsive(client: RawClient) -> None:
    """PING gets its PONG (frames queued before it are skipped)."""
    await client.send(commands.ping())
    while True:
        frame = await asyncio.wait_for(client.recv(), WAIT_S)
        assert frame is not None, "the broker closed the connection"
        if frame.type == T.PONG:
            return


async def produce_batch(client: RawClient, num_messages: int, producer_id: int = 1) -> None:
    """Store one entry whose metadata declares ``num_messages`` (payload not a real batch:
    the broker never decodes it)."""
    await client.send(commands.producer(TOPIC, producer_id, 100 + producer_id))
    await expect(client, T.PRODUCER_SUCCESS)
    md = pb.MessageMetadata(
        producer_name=f"p{producer_id}",
        sequence_id=1,
        publish_time=1,
        num_messages_in_batch=num_messages,
    )
    await client.send(commands.send(producer_id, 1, num_messages=1), md, b"x" * 16)
    await expect(client, T.SEND_RECEIPT)


async def subscribe(client: RawClient, consumer_id: int = 1, permits: int = 1000) -> Any:
    """A Shared consumer from the earliest entry; returns the first MESSAGE's command."""
    await client.send(
        commands.subscribe(
            TOPIC, "sub", SHARED, consumer_id, 200 + consumer_id, initial_position=EARLIEST_POS
        )
    )
    await expect(client, T.SUCCESS)
    await client.send(commands.flow(consumer_id, permits))
    return (await expect(client, T.MESSAGE)).command.message


def broker_consumer(broker: InProcessBroker, consumer_id: int = 1) -> Consumer:
    assert broker.node is not None
    found = [
        s.consumers[consumer_id]
        for s in broker.node.server.sessions
        if isinstance(s.consumers.get(consumer_id), Consumer)
    ]
    assert len(found) == 1
    consumer = found[0]
    assert isinstance(consumer, Consumer)
    return consumer


async def ack(client: RawClient, msg_id: pb.MessageIdData, request_id: int) -> Any:
    await client.send(commands.ack(1, [msg_id], request_id=request_id))
    return (await expect(client, T.ACK_RESPONSE)).command.ackResponse


# --- ACK -------------------------------------------------------------------------------------


async def test_ack_with_huge_batch_size_is_refused_and_the_broker_answers(
    client: RawClient,
) -> None:
    await produce_batch(client, 4)
    message = await subscribe(client)
    pos = message.message_id
    for size in (2**31 - 1, 5):
        bad = pb.MessageIdData(
            ledgerId=pos.ledgerId, entryId=pos.entryId, batch_index=0, ack_set=[0b1110]
        )
        bad.batch_size = size
        response = await ack(client, bad, request_id=size)
        assert response.HasField("error"), f"batch size {size} of a 4-message batch accepted"
        await assert_responsive(client)
    # The right size (or none) is fine, and a partial ack then a full one acks the entry.
    good = pb.MessageIdData(
        ledgerId=pos.ledgerId, entryId=pos.entryId, batch_index=0, ack_set=[0b1110], batch_size=4
    )
    assert not (await ack(client, good, request_id=1)).HasField("error")
    rest = pb.MessageIdData(ledgerId=pos.ledgerId, entryId=pos.entryId, ack_set=[0])
    assert not (await ack(client, rest, request_id=2)).HasField("error")
    await assert_responsive(client)


async def test_ack_with_extreme_ids_and_a_huge_ack_set_is_answered(client: RawClient) -> None:
    await produce_batch(client, 4)
    message = await subscribe(client)
    pos = message.message_id
    # A position the broker never stored, with the largest batch size the field holds.
    nowhere = pb.MessageIdData(
        ledgerId=2**64 - 1, entryId=2**63 - 1, ack_set=[-1], batch_size=2**31 - 1
    )
    assert (await ack(client, nowhere, request_id=1)).HasField("error")
    await assert_responsive(client)
    # 200k ack-set words for a 4-message batch: only the first word is read.
    words = pb.MessageIdData(ledgerId=pos.ledgerId, entryId=pos.entryId, ack_set=[-1] * 200_000)
    assert not (await ack(client, words, request_id=2)).HasField("error")
    await assert_responsive(client)


async def test_stored_batch_count_is_bounded_for_dispatch_and_acks(
    broker: InProcessBroker, client: RawClient
) -> None:
    # A hostile producer declares 2^31-1 messages in one entry: the broker sizes the batch
    # by its own bound, so a partial ack of it costs no 2^31 loop.
    await produce_batch(client, 2**31 - 1)
    message = await subscribe(client, permits=2**31 - 1)
    pos = message.message_id
    held = broker_consumer(broker).pending
    assert max(e.batch_size for e in held.values()) <= limits.BATCH_MESSAGES_MAX
    partial = pb.MessageIdData(ledgerId=pos.ledgerId, entryId=pos.entryId, ack_set=[1])
    assert not (await ack(client, partial, request_id=1)).HasField("error")
    await assert_responsive(client)


async def test_ack_with_too_many_message_ids_is_refused(client: RawClient) -> None:
    await produce_batch(client, 1)
    message = await subscribe(client)
    pos = message.message_id
    # The same (valid) id over and over: each would be a cheap no-op, the count is refused.
    ids = [pos] * (limits.ACK_MESSAGE_IDS_MAX + 1)
    await client.send(commands.ack(1, ids, request_id=7))
    response = (await expect(client, T.ACK_RESPONSE)).command.ackResponse
    assert response.HasField("error")
    await assert_responsive(client)


# --- FLOW and REDELIVER --------------------------------------------------------------------


async def test_flow_permits_are_clamped(broker: InProcessBroker, client: RawClient) -> None:
    await produce_batch(client, 1)
    await subscribe(client, permits=2**32 - 1)
    await client.send(commands.flow(1, 2**32 - 1))
    await assert_responsive(client)
    assert broker_consumer(broker).permits <= limits.CONSUMER_PERMITS_MAX
    await assert_responsive(client)


async def test_redeliver_with_many_ids_is_bounded(
    broker: InProcessBroker, client: RawClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await produce_batch(client, 1)
    message = await subscribe(client)
    consumer = broker_consumer(broker)
    assert isinstance(consumer.subscription, Subscription)
    dispatcher = consumer.subscription.dispatcher
    seen: list[int] = []
    real = dispatcher.redeliver

    def counting(c: Consumer, positions: Any) -> None:
        seen.append(-1 if positions is None else len(positions))
        real(c, positions)

    monkeypatch.setattr(dispatcher, "redeliver", counting)
    pos = message.message_id
    ids = [pos] + [
        pb.MessageIdData(ledgerId=2**63 - 1, entryId=i)
        for i in range(3 * limits.REDELIVER_MESSAGE_IDS_MAX)
    ]
    body = pb.CommandRedeliverUnacknowledgedMessages(consumer_id=1)
    body.message_ids.extend(ids)
    await client.send(
        T(type=T.REDELIVER_UNACKNOWLEDGED_MESSAGES, redeliverUnacknowledgedMessages=body)
    )
    # The one real id (first) is still redelivered.
    again = (await expect(client, T.MESSAGE)).command.message
    assert (again.message_id.entryId, again.redelivery_count) == (pos.entryId, 1)
    assert seen and max(seen) <= limits.REDELIVER_MESSAGE_IDS_MAX
    await assert_responsive(client)


# --- per-connection caps --------------------------------------------------------------------


async def test_producers_per_connection_are_capped(
    broker: InProcessBroker, client: RawClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "SESSION_PRODUCERS_MAX", 2)
    for pid in (1, 2):
        await client.send(commands.producer(TOPIC, pid, pid))
        await expect(client, T.PRODUCER_SUCCESS)
    await client.send(commands.producer(TOPIC, 3, 3))
    error = (await expect(client, T.ERROR)).command.error
    assert (error.request_id, error.error) == (3, pb.TooManyRequests)
    await assert_responsive(client)
    other = await RawClient.open(broker.port)
    try:
        await other.handshake()
        await other.send(commands.producer(TOPIC, 1, 1))
        await expect(other, T.PRODUCER_SUCCESS)
    finally:
        await other.close()
    # Closing one makes room again.
    await client.send(commands.close_producer(1, 4))
    await expect(client, T.SUCCESS)
    await client.send(commands.producer(TOPIC, 3, 5))
    await expect(client, T.PRODUCER_SUCCESS)


async def test_consumers_per_connection_are_capped(
    broker: InProcessBroker, client: RawClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "SESSION_CONSUMERS_MAX", 2)
    for cid in (1, 2):
        await client.send(commands.subscribe(TOPIC, f"s{cid}", SHARED, cid, cid))
        await expect(client, T.SUCCESS)
    await client.send(commands.subscribe(TOPIC, "s3", SHARED, 3, 3))
    error = (await expect(client, T.ERROR)).command.error
    assert (error.request_id, error.error) == (3, pb.TooManyRequests)
    await assert_responsive(client)
    other = await RawClient.open(broker.port)
    try:
        await other.handshake()
        await other.send(commands.subscribe(TOPIC, "s3", SHARED, 1, 1))
        await expect(other, T.SUCCESS)
    finally:
        await other.close()


async def test_lookup_flood_runs_bounded_tasks_and_others_are_answered(
    broker: InProcessBroker, client: RawClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = command_table.TABLE[T.LOOKUP]
    real = entry.handler
    running = 0
    peak = 0

    async def slow_lookup(session: Session, frame: Frame) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(0.01)
            result = real(session, frame)
            if result is not None:
                await result
        finally:
            running -= 1

    monkeypatch.setitem(command_table.TABLE, T.LOOKUP, replace(entry, handler=slow_lookup))
    count = 20_000
    flood = b"".join(
        client.conn.send(
            T(type=T.LOOKUP, lookupTopic=pb.CommandLookupTopic(topic=TOPIC, request_id=i))
        )
        for i in range(count)
    )
    other = await RawClient.open(broker.port)
    try:
        await other.handshake()
        client.writer.write(flood)
        await assert_responsive(other)
        answered = 0
        while answered < count:
            frame = await asyncio.wait_for(client.recv(), WAIT_S)
            assert frame is not None, "the flooding connection was closed"
            if frame.type == T.LOOKUP_RESPONSE:
                answered += 1
        await assert_responsive(other)
        await assert_responsive(client)
    finally:
        await other.close()
    assert peak <= limits.SESSION_HANDLER_TASKS_MAX, f"{peak} lookups ran at once"


# --- Key_Shared STICKY hash ranges ----------------------------------------------------------


async def test_sticky_subscribe_with_every_slot_as_a_range_is_refused(client: RawClient) -> None:
    # 65,536 disjoint one-slot ranges: valid-looking, and quadratic to check pairwise.
    body = pb.CommandSubscribe(
        topic=TOPIC, subscription="ks", subType=pb.CommandSubscribe.Key_Shared,
        consumer_id=1, request_id=1,
    )  # fmt: skip
    body.keySharedMeta.keySharedMode = pb.STICKY
    body.keySharedMeta.hashRanges.extend(pb.IntRange(start=i, end=i) for i in range(65_536))
    await client.send(T(type=T.SUBSCRIBE, subscribe=body))
    error = (await expect(client, T.ERROR)).command.error
    assert (error.request_id, error.error) == (1, pb.ConsumerAssignError)
    await assert_responsive(client)


def test_sticky_selector_matches_a_linear_scan() -> None:
    rng = random.Random(15)
    sel: StickySelector[int] = StickySelector()
    owned: list[tuple[int, int, int]] = []
    for consumer in range(200):
        ranges = []
        for _ in range(rng.randint(1, 5)):
            start = rng.randrange(65_536)
            ranges.append((start, min(start + rng.randrange(300), 65_535)))
        clash = any(
            a <= d and c <= b for i, (a, b) in enumerate(ranges) for c, d in ranges[i + 1 :]
        ) or any(a <= e and s <= b for a, b in ranges for s, e, _ in owned)
        if clash:
            with pytest.raises(ConsumerAssignError):
                sel.add(consumer, ranges)
        else:
            sel.add(consumer, ranges)
            owned.extend((a, b, consumer) for a, b in ranges)
        if consumer % 50 == 49:
            gone = owned[0][2]
            sel.remove(gone)
            owned = [r for r in owned if r[2] != gone]
    for slot in range(0, 65_536, 7):
        expected = next((c for s, e, c in owned if s <= slot <= e), None)
        assert sel.select(slot) == expected
