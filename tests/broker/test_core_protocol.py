"""The broker core over raw protocol frames: handshake, produce, and every connect/produce
row of DESIGN.md §3.2's bad-input table."""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.connection import ProtocolConnection, Role
from anabranch.protocol.frames import Frame, encode_command
from anabranch.storage.api import EARLIEST
from anabranch.testing.broker import InProcessBroker

T = pb.BaseCommand
TOPIC = "persistent://public/default/raw"
U64_MAX = 2**64 - 1


class RawClient:
    """A client made of bytes: frames go out exactly as the test builds them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = ProtocolConnection(Role.CLIENT)
        self.frames: deque[Frame] = deque()

    @classmethod
    async def open(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass

    async def raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send(
        self,
        command: pb.BaseCommand,
        metadata: pb.MessageMetadata | None = None,
        payload: bytes = b"",
    ) -> None:
        await self.raw(self.conn.send(command, metadata, payload))

    async def recv(self) -> Frame | None:
        """The next frame, or None once the broker closed the connection."""
        while not self.frames:
            try:
                data = await self.reader.read(65536)
            except ConnectionError:
                data = b""
            if not data:
                return None
            self.frames.extend(self.conn.receive_data(data))
        return self.frames.popleft()

    async def expect(self, kind: int) -> Frame:
        frame = await self.recv()
        assert frame is not None, f"connection closed while waiting for {T.Type.Name(kind)}"
        assert frame.type == kind, (
            f"expected {T.Type.Name(kind)}, got {frame.type_name}: {frame.command}"
        )
        return frame

    async def closed_by_broker(self) -> list[Frame]:
        """Read until EOF; return whatever frames came before it."""
        seen = []
        while (frame := await self.recv()) is not None:
            seen.append(frame)
        return seen

    async def handshake(self) -> Frame:
        await self.send(commands.connect("raw-test", pb.v21))
        return await self.expect(T.CONNECTED)

    async def producer(
        self, producer_id: int = 1, topic: str = TOPIC, request_id: int = 1
    ) -> Frame:
        await self.send(commands.producer(topic, producer_id, request_id))
        return await self.expect(T.PRODUCER_SUCCESS)

    async def send_message(
        self, producer_id: int, sequence_id: int, payload: bytes, name: str = "p"
    ) -> None:
        md = pb.MessageMetadata(producer_name=name, sequence_id=sequence_id, publish_time=1)
        await self.send(commands.send(producer_id, sequence_id), md, payload)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(
        tmp_path, metadata="memory", max_message_size=1024, handshake_timeout_s=0.5
    ) as b:
        yield b


@pytest.fixture
async def client(broker: InProcessBroker) -> AsyncIterator[RawClient]:
    c = await RawClient.open(broker.port)
    try:
        yield c
    finally:
        await c.close()


async def stored(broker: InProcessBroker, topic: str = TOPIC) -> list[bytes]:
    loaded = broker.service.loaded_topic(topic)
    if loaded is None:
        return []
    return [e.data for e in await loaded.ledger.read(EARLIEST, 10_000)]


# --- handshake and keepalive -----------------------------------------------------------------


async def test_connect_advertises_version_size_and_scalable_flag(client: RawClient) -> None:
    connected = (await client.handshake()).command.connected
    assert connected.protocol_version == 21
    assert connected.max_message_size == 1024
    assert connected.feature_flags.supports_scalable_topics
    await client.send(commands.ping())
    await client.expect(T.PONG)


async def test_older_client_gets_its_own_version(client: RawClient) -> None:
    await client.send(commands.connect("old", 15))
    assert (await client.expect(T.CONNECTED)).command.connected.protocol_version == 15


# --- produce ---------------------------------------------------------------------------------


async def test_pipelined_sends_get_ordered_receipts_after_storage(
    broker: InProcessBroker, client: RawClient
) -> None:
    await client.handshake()
    name = (await client.producer()).command.producer_success.producer_name
    assert name.startswith("standalone-")
    md = pb.MessageMetadata(producer_name=name, sequence_id=0, publish_time=1)
    burst = b"".join(
        client.conn.send(commands.send(1, i), md, f"m{i}".encode()) for i in range(200)
    )
    await client.raw(burst)  # all 200 before reading a single receipt
    receipts = [(await client.expect(T.SEND_RECEIPT)).command.send_receipt for _ in range(200)]
    assert [r.sequence_id for r in receipts] == list(range(200))
    ids = [(r.message_id.ledgerId, r.message_id.entryId) for r in receipts]
    assert ids == sorted(ids) and len(set(ids)) == 200
    assert len(await stored(broker)) == 200


async def test_generated_producer_names_are_unique(client: RawClient) -> None:
    await client.handshake()
    a = (await client.producer(1, request_id=1)).command.producer_success.producer_name
    b = (await client.producer(2, request_id=2)).command.producer_success.producer_name
    assert a != b


async def test_close_producer_then_send_is_refused(client: RawClient) -> None:
    await client.handshake()
    await client.producer()
    await client.send(commands.close_producer(1, 7))
    assert (await client.expect(T.SUCCESS)).command.success.request_id == 7
    await client.send_message(1, 0, b"x")
    assert (await client.expect(T.SEND_ERROR)).command.send_error.error == pb.NotAllowedError


async def test_send_before_producer_is_a_send_error(
    broker: InProcessBroker, client: RawClient
) -> None:
    await client.handshake()
    await client.send_message(5, 0, b"x")
    err = (await client.expect(T.SEND_ERROR)).command.send_error
    assert (err.producer_id, err.error) == (5, pb.NotAllowedError)
    assert await stored(broker) == []


async def test_producer_id_at_u64_max(client: RawClient) -> None:
    await client.handshake()
    await client.producer(U64_MAX)
    await client.send_message(U64_MAX, 0, b"x")
    receipt = (await client.expect(T.SEND_RECEIPT)).command.send_receipt
    assert receipt.producer_id == U64_MAX


async def test_duplicate_producer_id_is_a_request_error(
    broker: InProcessBroker, client: RawClient
) -> None:
    await client.handshake()
    await client.producer(3, request_id=1)
    await client.send(commands.producer(TOPIC, 3, 2))
    err = (await client.expect(T.ERROR)).command.error
    assert (err.request_id, err.error) == (2, pb.ProducerBusy)
    await client.send_message(3, 0, b"still works")  # the first producer is intact
    await client.expect(T.SEND_RECEIPT)
    assert len(await stored(broker)) == 1


async def test_same_producer_name_twice_on_a_topic_is_busy(client: RawClient) -> None:
    await client.handshake()
    await client.send(commands.producer(TOPIC, 1, 1, producer_name="named"))
    await client.expect(T.PRODUCER_SUCCESS)
    await client.send(commands.producer(TOPIC, 2, 2, producer_name="named"))
    assert (await client.expect(T.ERROR)).command.error.error == pb.ProducerBusy


# --- bad input (DESIGN.md §3.2) ----------------------------------------------------------------


async def test_command_before_connect_closes_and_creates_nothing(
    broker: InProcessBroker, client: RawClient
) -> None:
    revision = await broker.service.store.current_revision()
    await client.raw(encode_command(commands.producer(TOPIC, 1, 1)))
    await client.closed_by_broker()
    assert await broker.service.store.current_revision() == revision
    assert broker.service.loaded_topics() == []


async def test_unknown_command_type_closes(client: RawClient) -> None:
    await client.handshake()
    body = bytes([0x08, 0xE7, 0x07])  # BaseCommand{type: 999}
    await client.raw(struct.pack(">II", len(body) + 4, len(body)) + body)
    await client.closed_by_broker()
    assert client.reader.at_eof()


async def test_unhandled_client_command_gets_error_and_close(client: RawClient) -> None:
    await client.handshake()
    # END_TXN_ON_PARTITION is a legal client->broker type that this broker does not serve.
    body = pb.CommandEndTxnOnPartition(request_id=1, txnid_least_bits=0, txnid_most_bits=0)
    await client.raw(encode_command(T(type=T.END_TXN_ON_PARTITION, endTxnOnPartition=body)))
    frames = await client.closed_by_broker()
    assert [f.type for f in frames] == [T.ERROR]


async def test_broker_only_command_from_client_closes(client: RawClient) -> None:
    await client.handshake()
    await client.raw(encode_command(commands.send_receipt(1, 1, 1, 1)))
    frames = await client.closed_by_broker()
    assert [f.type for f in frames] == [T.ERROR]
    assert frames[0].command.error.error == pb.NotAllowedError


async def test_oversized_length_prefix_closes_only_that_connection(
    broker: InProcessBroker, client: RawClient
) -> None:
    healthy = await RawClient.open(broker.port)
    try:
        await healthy.handshake()
        await healthy.producer()
        await client.handshake()
        before = broker.service.protocol_errors
        await client.raw(struct.pack(">I", 2**31 - 1) + b"\x00" * 16)
        await client.closed_by_broker()
        assert broker.service.protocol_errors == before + 1
        await healthy.send_message(1, 0, b"unaffected")
        await healthy.expect(T.SEND_RECEIPT)
        await healthy.send(commands.ping())
        await healthy.expect(T.PONG)
    finally:
        await healthy.close()


@pytest.mark.parametrize("prefix", [-1, 0, 3])
async def test_negative_or_tiny_length_prefix_closes(client: RawClient, prefix: int) -> None:
    await client.handshake()
    await client.raw(struct.pack(">i", prefix) + b"\x00" * 8)
    await client.closed_by_broker()
    assert client.reader.at_eof()


async def test_cmd_size_larger_than_frame_closes(client: RawClient) -> None:
    await client.handshake()
    await client.raw(struct.pack(">II", 8, 100) + b"\x08\x12\x92\x01")
    frames = await client.closed_by_broker()
    assert [f.type for f in frames] == [T.ERROR]


async def test_checksum_mismatch_is_a_send_error_and_not_stored(
    broker: InProcessBroker, client: RawClient
) -> None:
    await client.handshake()
    await client.producer()
    md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    good = bytearray(client.conn.send(commands.send(1, 0), md, b"payload"))
    good[-1] ^= 0xFF  # flip a payload bit: the crc32c no longer matches
    await client.raw(bytes(good))
    err = (await client.expect(T.SEND_ERROR)).command.send_error
    assert (err.sequence_id, err.error) == (0, pb.ChecksumError)
    assert await stored(broker) == []
    await client.send_message(1, 1, b"fine")  # the connection and producer live on
    await client.expect(T.SEND_RECEIPT)
    assert len(await stored(broker)) == 1


async def test_message_too_big_is_per_send(broker: InProcessBroker, client: RawClient) -> None:
    await client.handshake()
    await client.producer()
    await client.send_message(1, 0, b"x" * 2000)  # over max_message_size=1024, frame is fine
    await client.send_message(1, 1, b"small")
    err = (await client.expect(T.SEND_ERROR)).command.send_error
    assert (err.sequence_id, err.error) == (0, pb.NotAllowedError)
    assert "2000" in err.message
    assert (await client.expect(T.SEND_RECEIPT)).command.send_receipt.sequence_id == 1
    assert len(await stored(broker)) == 1


@pytest.mark.parametrize(
    "topic",
    ["persistent://public/default/a b", "persistent://public/default", "bogus://t/ns/x",
     "persistent://public/default/x%2F", "persistent://public/default/" + "x" * 300],
)  # fmt: skip
async def test_invalid_topic_name_is_a_request_error_and_writes_nothing(
    broker: InProcessBroker, client: RawClient, topic: str
) -> None:
    await client.handshake()
    revision = await broker.service.store.current_revision()
    await client.send(commands.producer(topic, 1, 9))
    err = (await client.expect(T.ERROR)).command.error
    assert (err.request_id, err.error) == (9, pb.InvalidTopicName)
    await client.send(commands.ping())  # still connected
    await client.expect(T.PONG)
    assert await broker.service.store.current_revision() == revision


async def test_producer_on_missing_namespace_is_topic_not_found(
    broker: InProcessBroker, client: RawClient
) -> None:
    await client.handshake()
    revision = await broker.service.store.current_revision()
    await client.send(commands.producer("persistent://nope/nope/t", 1, 4))
    assert (await client.expect(T.ERROR)).command.error.error == pb.TopicNotFound
    assert await broker.service.store.current_revision() == revision


async def test_slowloris_partial_frame_closed_by_handshake_timeout(client: RawClient) -> None:
    frame = encode_command(commands.connect("slow", pb.v21))
    await client.raw(frame[:6])  # never the rest
    frames = await client.closed_by_broker()
    assert frames == []


async def test_silent_client_after_connect_closed_by_keepalive(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, keepalive_interval_s=0.3) as broker:
        c = await RawClient.open(broker.port)
        try:
            await c.handshake()
            await c.raw(encode_command(commands.ping())[:5])  # a partial frame, then silence
            frames = await c.closed_by_broker()
            assert [f.type for f in frames] == [T.PING]  # probed once, then closed
        finally:
            await c.close()


# --- lookups and schemas ------------------------------------------------------------------------


async def test_lookup_and_partitioned_metadata(broker: InProcessBroker, client: RawClient) -> None:
    await broker.service.policies.create_partitioned_topic("persistent://public/default/parts", 3)
    await client.handshake()
    await client.send(
        T(type=T.LOOKUP, lookupTopic=pb.CommandLookupTopic(topic=TOPIC, request_id=1))
    )
    lookup = (await client.expect(T.LOOKUP_RESPONSE)).command.lookupTopicResponse
    assert lookup.response == pb.CommandLookupTopicResponse.Connect
    assert lookup.authoritative and lookup.brokerServiceUrl == broker.service_url
    for topic, expected in ((TOPIC, 0), ("persistent://public/default/parts", 3)):
        body = pb.CommandPartitionedTopicMetadata(topic=topic, request_id=2)
        await client.send(T(type=T.PARTITIONED_METADATA, partitionMetadata=body))
        reply = (await client.expect(T.PARTITIONED_METADATA_RESPONSE)).command
        assert reply.partitionMetadataResponse.partitions == expected
    bad = pb.CommandLookupTopic(topic="persistent://x", request_id=3)
    await client.send(T(type=T.LOOKUP, lookupTopic=bad))
    failed = (await client.expect(T.LOOKUP_RESPONSE)).command.lookupTopicResponse
    assert (failed.response, failed.error) == (
        pb.CommandLookupTopicResponse.Failed,
        pb.InvalidTopicName,
    )


async def test_partition_producers_and_topic_listing(
    client: RawClient, broker: InProcessBroker
) -> None:
    base = "persistent://public/default/orders"
    await broker.service.policies.create_partitioned_topic(base, 2)
    await client.handshake()
    await client.producer(1, f"{base}-partition-1", 1)
    body = pb.CommandGetTopicsOfNamespace(request_id=5, namespace="public/default")
    await client.send(T(type=T.GET_TOPICS_OF_NAMESPACE, getTopicsOfNamespace=body))
    topics = (await client.expect(T.GET_TOPICS_OF_NAMESPACE_RESPONSE)).command
    assert f"{base}-partition-1" in topics.getTopicsOfNamespaceResponse.topics
    await client.send(commands.producer(f"{base}-partition-2", 2, 2))  # no such partition
    await client.send(commands.producer(base, 3, 3))  # not the partitioned base name
    errors = [(await client.expect(T.ERROR)).command.error for _ in range(2)]
    codes = {e.request_id: e.error for e in errors}  # both run concurrently: any order
    assert codes == {2: pb.TopicNotFound, 3: pb.NotAllowedError}
    assert await broker.service.policies.list_topics("public/default") == [f"{base}-partition-1"]


async def test_schema_registry_versions(client: RawClient) -> None:
    await client.handshake()
    string = pb.Schema(name="s", type=pb.Schema.String, schema_data=b"")
    labelled = pb.Schema(name="s", type=pb.Schema.String, schema_data=b"")
    labelled.properties.add(key="charset", value="utf-8")
    json_schema = pb.Schema(name="j", type=pb.Schema.Json, schema_data=b'"string"')
    versions = []
    for i, schema in enumerate([string, string, labelled, json_schema]):
        body = pb.CommandGetOrCreateSchema(request_id=i, topic=TOPIC, schema=schema)
        await client.send(T(type=T.GET_OR_CREATE_SCHEMA, getOrCreateSchema=body))
        versions.append((await client.expect(T.GET_OR_CREATE_SCHEMA_RESPONSE)).command)
    answers = [v.getOrCreateSchemaResponse for v in versions]
    numbers = [a.schema_version for a in answers[:3]]
    assert numbers[0] == numbers[1] != numbers[2]
    # A type change is refused under the broker's default strategy (FULL), as upstream.
    assert answers[3].error_code == pb.IncompatibleSchema
    assert "STRING" in answers[3].error_message
    await client.send(
        T(type=T.GET_SCHEMA, getSchema=pb.CommandGetSchema(request_id=9, topic=TOPIC))
    )
    latest = (await client.expect(T.GET_SCHEMA_RESPONSE)).command.getSchemaResponse
    assert latest.schema.properties[0].value == "utf-8" and latest.schema_version == numbers[2]
    missing = pb.CommandGetSchema(request_id=10, topic="persistent://public/default/none")
    await client.send(T(type=T.GET_SCHEMA, getSchema=missing))
    assert (
        await client.expect(T.GET_SCHEMA_RESPONSE)
    ).command.getSchemaResponse.error_code == pb.TopicNotFound


async def test_producer_with_schema_gets_a_version(client: RawClient) -> None:
    await client.handshake()
    cmd = commands.producer(TOPIC, 1, 1)
    cmd.producer.schema.CopyFrom(pb.Schema(name="s", type=pb.Schema.String, schema_data=b""))
    await client.send(cmd)
    success = (await client.expect(T.PRODUCER_SUCCESS)).command.producer_success
    assert success.schema_version == (0).to_bytes(8, "big")
