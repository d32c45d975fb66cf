"""Non-persistent topics over raw protocol frames: what the official clients never send
but a hostile or older one may (seeks, last-message-id, acks with receipts, cumulative
acks, transactional acks, topic listings by mode), each answered as upstream does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import Frame
from anabranch.testing.broker import InProcessBroker
from tests.scalable.wire import RawClient

T = pb.BaseCommand
TOPIC = "non-persistent://public/default/wire"
Mode = pb.CommandGetTopicsOfNamespace


@pytest.fixture
async def wired(tmp_path: Path) -> AsyncIterator[tuple[InProcessBroker, RawClient]]:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        client = await RawClient.connect(broker.port)
        try:
            yield broker, client
        finally:
            await client.close()


def reply_to(request_id: int) -> Callable[[Frame], bool]:
    return lambda f: f.type in (T.SUCCESS, T.ERROR) and f.body.request_id == request_id


def acked(request_id: int) -> Callable[[Frame], bool]:
    return lambda f: f.type == T.ACK_RESPONSE and f.body.request_id == request_id


async def test_consumer_commands_on_a_non_persistent_subscription(
    wired: tuple[InProcessBroker, RawClient],
) -> None:
    broker, client = wired
    await client.send(commands.subscribe(TOPIC, "s", pb.CommandSubscribe.Exclusive, 1, 1))
    assert (await client.next(reply_to(1))).type == T.SUCCESS
    await client.send(commands.flow(1, 10))
    await client.producer(TOPIC, 7, "p")
    receipt = await client.produce(7, "p", 0, b"hello")
    assert receipt.type == T.SEND_RECEIPT
    message = await client.next(lambda f: f.type == T.MESSAGE)
    msg_id = message.command.message.message_id
    assert (msg_id.ledgerId, msg_id.entryId) == (
        receipt.command.send_receipt.message_id.ledgerId,
        receipt.command.send_receipt.message_id.entryId,
    )
    # Acks of every kind are accepted (a receipt says so) and change nothing.
    for request_id, cumulative in ((10, False), (11, True)):
        await client.send(commands.ack(1, [msg_id], cumulative, request_id=request_id))
        answer = await client.next(acked(request_id))
        assert not answer.command.ackResponse.HasField("error")
    txn_ack = commands.ack(1, [msg_id], request_id=12)
    txn_ack.ack.txnid_most_bits, txn_ack.ack.txnid_least_bits = 0, 1
    await client.send(txn_ack)
    refused = await client.next(acked(12))
    assert refused.command.ackResponse.error == pb.NotAllowedError
    # Nothing is stored: no seek, no last message id, no redelivery.
    seek = pb.CommandSeek(consumer_id=1, request_id=20, message_publish_time=0)
    await client.send(T(type=T.SEEK, seek=seek))
    assert (await client.next(reply_to(20))).command.error.error == pb.NotAllowedError
    last = pb.CommandGetLastMessageId(consumer_id=1, request_id=21)
    await client.send(T(type=T.GET_LAST_MESSAGE_ID, getLastMessageId=last))
    assert (await client.next(reply_to(21))).command.error.error == pb.NotAllowedError
    redeliver = pb.CommandRedeliverUnacknowledgedMessages(consumer_id=1)
    kind = T.REDELIVER_UNACKNOWLEDGED_MESSAGES
    await client.send(T(type=kind, redeliverUnacknowledgedMessages=redeliver))
    await client.none(lambda f: f.type == T.MESSAGE, within=0.3)
    # A compacted view of what is never kept is refused.
    compacted = commands.subscribe(TOPIC, "c", pb.CommandSubscribe.Exclusive, 2, 31)
    compacted.subscribe.read_compacted = True
    await client.send(compacted)
    assert (await client.next(reply_to(31))).command.error.error == pb.NotAllowedError
    # Unsubscribing ends the subscription.
    unsubscribe = pb.CommandUnsubscribe(consumer_id=1, request_id=30)
    await client.send(T(type=T.UNSUBSCRIBE, unsubscribe=unsubscribe))
    assert (await client.next(reply_to(30))).type == T.SUCCESS
    loaded = broker.service.loaded_non_persistent_topic(TOPIC)
    assert loaded is not None and loaded.subscriptions == {}


async def test_topic_listing_by_mode(wired: tuple[InProcessBroker, RawClient]) -> None:
    _, client = wired
    await client.producer(TOPIC, 1, "p")
    await client.producer("persistent://public/default/stored", 2, "q")

    async def listing(request_id: int, mode: int) -> list[str]:
        body = pb.CommandGetTopicsOfNamespace(request_id=request_id, namespace="public/default")
        body.mode = mode  # type: ignore[assignment]
        await client.send(T(type=T.GET_TOPICS_OF_NAMESPACE, getTopicsOfNamespace=body))
        frame = await client.next(lambda f: f.type == T.GET_TOPICS_OF_NAMESPACE_RESPONSE)
        return sorted(frame.command.getTopicsOfNamespaceResponse.topics)

    assert await listing(1, Mode.PERSISTENT) == ["persistent://public/default/stored"]
    assert await listing(2, Mode.NON_PERSISTENT) == [TOPIC]
    assert await listing(3, Mode.ALL) == [TOPIC, "persistent://public/default/stored"]


async def test_a_consumer_that_stops_reading_its_socket_loses_messages_not_memory(
    wired: tuple[InProcessBroker, RawClient],
) -> None:
    broker, stuck = wired
    # Permits galore, but the connection is never read: its output buffer fills, and
    # the broker drops instead of queueing more for it.
    await stuck.send(commands.subscribe(TOPIC, "stuck", pb.CommandSubscribe.Exclusive, 1, 1))
    assert (await stuck.next(reply_to(1))).type == T.SUCCESS
    await stuck.send(commands.flow(1, 1_000_000))
    producer = await RawClient.connect(broker.port)
    try:
        await producer.producer(TOPIC, 1, "p")
        payload = b"x" * 10_000
        count = 4_000  # 40 MB: over the output bound plus any socket buffers
        for sequence_id in range(count):
            md = pb.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1)
            await producer.send(commands.send(1, sequence_id), md, payload)
        last = await producer.next(
            lambda f: f.type == T.SEND_RECEIPT and f.body.sequence_id == count - 1, wait_s=60
        )
        assert last.command.send_receipt.message_id.entryId == count - 1
        topic = broker.service.loaded_non_persistent_topic(TOPIC)
        assert topic is not None
        sub = topic.subscriptions["stuck"]
        assert sub.messages_dropped > 0
        assert sub.messages_out + sub.messages_dropped == count
        # What went out is bounded by the connection's output limit (and the kernel's
        # socket buffers), not by the 40 MB published.
        assert sub.bytes_out < 20 * 1024 * 1024
    finally:
        await producer.close()
