"""Real-peer tests: the official C++-based ``pulsar-client`` talks to a tiny fake broker.

The fake broker is built from our own ``ProtocolConnection`` (broker role), so these
tests check both directions: we decode what the official client sends (CONNECT with
protocol v21 and feature flags, PRODUCER, SEND with every compression codec) and the
official client accepts what we answer (CONNECTED, lookups, PRODUCER_SUCCESS, receipts).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pulsar

from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.batch import decode_batch
from anabranch.protocol.compression import decompress
from anabranch.protocol.connection import ProtocolConnection, Role
from anabranch.protocol.frames import Frame

T = pb.BaseCommand


@dataclass
class FakeBroker:
    """Answers just enough of the protocol for a producer; records every frame."""

    frames: list[Frame] = field(default_factory=list)
    url: str = ""
    next_entry: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ProtocolConnection(Role.BROKER)
        try:
            while data := await reader.read(65536):
                for frame in conn.receive_data(data):
                    self.frames.append(frame)
                    reply = self.answer(conn, frame)
                    if reply:
                        writer.write(reply)
                await writer.drain()
        finally:
            writer.close()

    def answer(self, conn: ProtocolConnection, frame: Frame) -> bytes:
        cmd = frame.command
        if frame.type == T.CONNECT:
            flags = pb.FeatureFlags(supports_auth_refresh=True)
            version = conn.negotiate_version()
            return conn.send(commands.connected("anabranch-test", version, 5242880, flags))
        if frame.type == T.PING:
            return conn.send(commands.pong())
        if frame.type == T.PARTITIONED_METADATA:
            return conn.send(
                commands.partitioned_metadata_response(cmd.partitionMetadata.request_id, 0)
            )
        if frame.type == T.LOOKUP:
            return conn.send(commands.lookup_response(cmd.lookupTopic.request_id, self.url))
        if frame.type == T.PRODUCER:
            return conn.send(commands.producer_success(cmd.producer.request_id, "fake-producer"))
        if frame.type == T.SEND:
            self.next_entry += 1
            receipt = commands.send_receipt(
                cmd.send.producer_id, cmd.send.sequence_id, ledger_id=1, entry_id=self.next_entry
            )
            return conn.send(receipt)
        if frame.type in (T.CLOSE_PRODUCER, T.CLOSE_CONSUMER):
            request_id = cmd.close_producer.request_id or cmd.close_consumer.request_id
            return conn.send(commands.success(request_id))
        return b""


CODECS = {
    pb.NONE: pulsar.CompressionType.NONE,
    pb.LZ4: pulsar.CompressionType.LZ4,
    pb.ZLIB: pulsar.CompressionType.ZLib,
    pb.ZSTD: pulsar.CompressionType.ZSTD,
    pb.SNAPPY: pulsar.CompressionType.SNAPPY,
}
PAYLOAD = b"anabranch " * 200


def run_official_producer(url: str) -> None:
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        for codec in CODECS.values():
            producer = client.create_producer(
                "persistent://public/default/t", compression_type=codec, batching_enabled=False
            )
            producer.send(PAYLOAD)
            producer.close()
        batched = client.create_producer(
            "persistent://public/default/t",
            compression_type=pulsar.CompressionType.LZ4,
            batching_enabled=True,
            batching_max_messages=3,
            batching_max_publish_delay_ms=10_000,
        )
        for i in range(3):
            batched.send_async(b"m%d" % i, None)
        batched.flush()
        batched.close()
    finally:
        client.close()


async def test_official_client_frames_decode() -> None:
    broker = FakeBroker()
    server = await asyncio.start_server(broker.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    broker.url = f"pulsar://127.0.0.1:{port}"
    async with server:
        await asyncio.to_thread(run_official_producer, broker.url)

    connect = broker.frames[0]
    assert connect.type == T.CONNECT
    # pulsar-client 3.13 embeds the C++ client 4.2.0, which sends v20 (not v21) and these
    # two flags; recorded here so a change in the real peer shows up as a failure.
    assert connect.command.connect.protocol_version == 20
    assert connect.command.connect.client_version.startswith("Pulsar-CPP-v")
    flags = connect.command.connect.feature_flags
    assert flags.supports_auth_refresh
    assert flags.supports_broker_entry_metadata
    assert not flags.supports_scalable_topics

    sends = [f for f in broker.frames if f.type == T.SEND]
    assert len(sends) == len(CODECS) + 1
    for frame, codec in zip(sends, CODECS, strict=False):
        assert frame.checksum_ok is True
        assert frame.metadata is not None
        assert frame.metadata.compression == codec
        size = frame.metadata.uncompressed_size if codec != pb.NONE else len(frame.payload)
        assert decompress(codec, frame.payload, size, max_size=1 << 20) == PAYLOAD

    batch = sends[-1]
    assert batch.metadata is not None
    assert batch.metadata.num_messages_in_batch == 3
    assert batch.command.send.num_messages == 3
    raw = decompress(
        batch.metadata.compression, batch.payload, batch.metadata.uncompressed_size, 1 << 20
    )
    assert [p for _, p in decode_batch(raw, 3)] == [b"m0", b"m1", b"m2"]
