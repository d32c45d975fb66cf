"""The official ``pulsar-client`` (C++ core) produces to our in-process broker.

The client runs its own threads, so it is driven from ``asyncio.to_thread`` while the
broker serves on the test's loop. Stored entries are read back from the ledger and
decoded (decompression, batches) to prove exactly the sent messages were stored.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pulsar
import pytest

from anabranch.broker.topic import PersistentTopic
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.batch import decode_batch
from anabranch.protocol.compression import decompress
from anabranch.protocol.frames import FrameDecoder, encode_entry_frame
from anabranch.storage.api import EARLIEST
from anabranch.testing.broker import InProcessBroker

CODECS = {
    "NONE": pulsar.CompressionType.NONE,
    "LZ4": pulsar.CompressionType.LZ4,
    "ZLIB": pulsar.CompressionType.ZLib,
    "ZSTD": pulsar.CompressionType.ZSTD,
    "SNAPPY": pulsar.CompressionType.SNAPPY,
}


def messages_of(entry: bytes) -> list[bytes]:
    """The message payloads inside one stored entry."""
    [frame] = FrameDecoder().feed(encode_entry_frame(commands.send(1, 1), entry))
    assert frame.checksum_ok is True and frame.metadata is not None
    md = frame.metadata
    payload = frame.payload
    if md.compression != pb.NONE:
        payload = decompress(md.compression, payload, md.uncompressed_size, 5 * 1024 * 1024)
    if not md.HasField("num_messages_in_batch"):
        return [payload]
    return [p for _, p in decode_batch(payload, md.num_messages_in_batch)]


async def stored_messages(topic: PersistentTopic) -> list[bytes]:
    return [m for e in await topic.ledger.read(EARLIEST, 100_000) for m in messages_of(e.data)]


def produce(url: str, topic: str, count: int, **options: object) -> list[str]:
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer(topic, **options)
        ids: list[str] = []
        done = threading.Event()

        def on_sent(result: pulsar.Result, msg_id: pulsar.MessageId) -> None:
            assert result == pulsar.Result.Ok, result
            ids.append(str(msg_id))
            if len(ids) == count:
                done.set()

        for i in range(count):
            producer.send_async(f"message-{i}".encode(), on_sent)
        producer.flush()
        done.wait()
        producer.close()
        return ids
    finally:
        client.close()


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path) as b:
        yield b


@pytest.mark.parametrize("codec", sorted(CODECS))
async def test_batched_with_every_codec(broker: InProcessBroker, codec: str) -> None:
    topic = f"persistent://public/default/batched-{codec.lower()}"
    ids = await asyncio.to_thread(
        produce,
        broker.service_url,
        topic,
        500,
        batching_enabled=True,
        batching_max_messages=100,
        batching_max_publish_delay_ms=5,
        compression_type=CODECS[codec],
    )
    assert len(ids) == 500
    loaded = broker.service.loaded_topic(topic)
    assert loaded is not None
    assert await stored_messages(loaded) == [f"message-{i}".encode() for i in range(500)]
    assert loaded.ledger.entry_count < 500  # batches, not one entry per message


async def test_non_batched(broker: InProcessBroker) -> None:
    topic = "persistent://public/default/plain"
    ids = await asyncio.to_thread(produce, broker.service_url, topic, 50, batching_enabled=False)
    assert len(set(ids)) == 50
    loaded = broker.service.loaded_topic(topic)
    assert loaded is not None
    assert loaded.ledger.entry_count == 50
    assert await stored_messages(loaded) == [f"message-{i}".encode() for i in range(50)]


def access_modes(url: str) -> dict[str, object]:
    topic = "persistent://public/default/exclusive"
    client = pulsar.Client(url, operation_timeout_seconds=30)
    out: dict[str, object] = {}
    try:
        first = client.create_producer(topic, access_mode=pulsar.ProducerAccessMode.Exclusive)
        for mode in ("Exclusive", "Shared"):
            try:
                client.create_producer(topic, access_mode=getattr(pulsar.ProducerAccessMode, mode))
                out[mode] = "created"
            except pulsar.PulsarException as err:
                out[mode] = type(err).__name__
        # WaitForExclusive gets the topic once the current owner closes.
        waiting: dict[str, object] = {}

        def wait_for_it() -> None:
            waiting["producer"] = client.create_producer(
                topic, access_mode=pulsar.ProducerAccessMode.WaitForExclusive
            )

        thread = threading.Thread(target=wait_for_it)
        thread.start()
        first.send(b"from-first")
        first.close()
        thread.join()
        second = waiting["producer"]
        assert isinstance(second, pulsar.Producer)
        second.send(b"from-waiter")
        # ExclusiveWithFencing takes over from the waiter.
        fencer = client.create_producer(
            topic, access_mode=pulsar.ProducerAccessMode.ExclusiveWithFencing
        )
        fencer.send(b"from-fencer")
        try:
            second.send(b"fenced")
            out["fenced_send"] = "sent"
        except pulsar.PulsarException as err:
            out["fenced_send"] = type(err).__name__
        fencer.close()
    finally:
        client.close()
    return out


async def test_producer_access_modes(broker: InProcessBroker) -> None:
    out = await asyncio.to_thread(access_modes, broker.service_url)
    assert out["Exclusive"] == "ProducerFenced"
    assert out["Shared"] == "ProducerBusy"
    assert out["fenced_send"] != "sent"
    loaded = broker.service.loaded_topic("persistent://public/default/exclusive")
    assert loaded is not None
    assert await stored_messages(loaded) == [b"from-first", b"from-waiter", b"from-fencer"]


def produce_then_consume(url: str, count: int) -> list[bytes]:
    topic = "persistent://public/default/end-to-end"
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(topic, "e2e", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic, compression_type=pulsar.CompressionType.LZ4)
        for i in range(count):
            producer.send_async(f"message-{i}".encode(), None)
        producer.flush()
        received = []
        for _ in range(count):
            msg = consumer.receive()
            received.append(msg.data())
            consumer.acknowledge(msg)
        consumer.close()
        producer.close()
        return received
    finally:
        client.close()


async def test_end_to_end_produce_consume(broker: InProcessBroker) -> None:
    received = await asyncio.to_thread(produce_then_consume, broker.service_url, 200)
    assert received == [f"message-{i}".encode() for i in range(200)]
