"""Client behaviour checked frame by frame against a scripted broker."""

from __future__ import annotations

import asyncio

import pytest

from anabranch.aio import Client, Producer
from anabranch.client.connection import ConnectionPool
from anabranch.client.errors import ConnectionClosed, ProducerQueueFull
from anabranch.errors import NotAllowed
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.batch import decode_batch
from anabranch.protocol.compression import decompress
from anabranch.protocol.frames import encode_command
from anabranch.testing.ports import free_port
from tests.client.fake_broker import FakeBroker

T = pb.BaseCommand
TOPIC = "persistent://public/default/f"


async def test_handshake_and_lookup_follow_redirects(fake: FakeBroker) -> None:
    target = await FakeBroker().start()
    try:
        fake.redirect_to = target.url
        pool = ConnectionPool(fake.url)
        assert await pool.lookup(TOPIC) == ("127.0.0.1", target.port)
        connect = fake.of_type(T.CONNECT)[0].command.connect
        assert connect.protocol_version == 21 and connect.client_version.startswith("anabranch")
        assert connect.feature_flags.supports_auth_refresh
        assert target.of_type(T.LOOKUP)[0].command.lookupTopic.authoritative
        await pool.close()
    finally:
        await target.stop()


async def test_lookup_redirect_loop_is_bounded(fake: FakeBroker) -> None:
    fake.redirect_to = fake.url  # redirects to itself
    pool = ConnectionPool(fake.url, lookup_redirects_max=3)

    # Our fake answers authoritative lookups with Connect, so force redirects always.
    original = fake._answer

    def always_redirect(session, frame):  # type: ignore[no-untyped-def]
        if frame.type == T.LOOKUP:
            frame.command.lookupTopic.authoritative = False
        original(session, frame)

    fake._answer = always_redirect  # type: ignore[method-assign]
    with pytest.raises(Exception, match="redirects"):
        await pool.lookup(TOPIC)
    assert len(fake.of_type(T.LOOKUP)) == 4
    await pool.close()


async def test_ping_is_answered_and_keepalive_pings(fake: FakeBroker) -> None:
    pool = ConnectionPool(fake.url, keepalive_interval_s=0.1)
    conn = await pool.get()
    fake.sessions[-1].write(
        fake.sessions[-1].conn.send(pb.BaseCommand(type=T.PING, ping=pb.CommandPing()))
    )
    await fake.wait_for(T.PONG)
    await fake.wait_for(T.PING, 2)
    assert conn.is_open
    fake.answer_pings = False
    await conn.wait_closed()  # no PONG within the keepalive interval
    assert not conn.is_open
    await pool.close()


async def test_batch_layout_and_sequence_ids(fake: FakeBroker) -> None:
    fake.last_sequence_id = 41
    async with Client(fake.url) as client:
        producer = await client.create_producer(
            TOPIC, batch_messages_max=3, batch_delay_s=10, compression="lz4"
        )
        futures = [await producer.send_async(b"m%d" % i, key="k") for i in range(3)]
        ids = [await f for f in futures]
    sends = fake.of_type(T.SEND)
    assert len(sends) == 1
    frame = sends[0]
    assert frame.command.send.sequence_id == 42 and frame.command.send.num_messages == 3
    assert frame.command.send.highest_sequence_id == 44
    md = frame.metadata
    assert md is not None and md.num_messages_in_batch == 3 and md.partition_key == "k"
    raw = decompress(int(md.compression), frame.payload, md.uncompressed_size, 1 << 20)
    entries = decode_batch(raw, 3)
    assert [p for _, p in entries] == [b"m0", b"m1", b"m2"]
    assert [s.sequence_id for s, _ in entries] == [42, 43, 44]
    assert [i.batch_index for i in ids] == [0, 1, 2]


async def test_pending_queue_blocks_then_fails_fast(fake: FakeBroker) -> None:
    fake.answer_sends = False
    async with Client(fake.url, operation_timeout_s=0.5) as client:
        producer = await client.create_producer(TOPIC, batching=False, pending_messages_max=2)
        await producer.send_async(b"1")
        await producer.send_async(b"2")
        blocked = asyncio.create_task(producer.send_async(b"3"))
        await asyncio.sleep(0.1)
        assert not blocked.done()
        nonblocking = await client.create_producer(
            TOPIC, batching=False, pending_messages_max=1, block_if_queue_full=False
        )
        await nonblocking.send_async(b"x")
        with pytest.raises(ProducerQueueFull):
            await nonblocking.send_async(b"y")
        blocked.cancel()
        await asyncio.gather(blocked, return_exceptions=True)


async def test_blocked_send_resumes_when_the_queue_drains(fake: FakeBroker) -> None:
    fake.answer_sends = False
    async with Client(fake.url, random=lambda: 0.0) as client:
        producer = await client.create_producer(TOPIC, batching=False, pending_messages_max=2)
        first = await producer.send_async(b"1")
        await producer.send_async(b"2")
        first.cancel()  # a cancelled send still holds its room until it leaves the queue
        blocked = asyncio.create_task(producer.send_async(b"3"))
        await asyncio.sleep(0.1)
        assert not blocked.done()
        fake.answer_sends = True
        await fake.drop_connections()  # the resent SENDs are answered, the queue drains
        third = await asyncio.wait_for(blocked, 10)
        assert (await third).entry_id >= 0
        assert [f.payload for f in fake.of_type(T.SEND)][-1] == b"3"


async def test_batch_keeps_each_messages_key_properties_and_event_time(fake: FakeBroker) -> None:
    async with Client(fake.url) as client:
        producer = await client.create_producer(TOPIC, batch_messages_max=3, batch_delay_s=10)
        await producer.send_async(b"a", key="k1", properties={"p": "1", "q": "\u00e9"})
        await producer.send_async(b"b", event_time=1_700_000_000_000)
        last = await producer.send_async(b"c", key="k2")
        await last
    (frame,) = fake.of_type(T.SEND)
    md = frame.metadata
    assert md is not None and not md.HasField("partition_key")  # keys differ
    entries = decode_batch(frame.payload, 3)
    singles = [s for s, _ in entries]
    assert [s.partition_key if s.HasField("partition_key") else None for s in singles] == [
        "k1",
        None,
        "k2",
    ]
    assert {p.key: p.value for p in singles[0].properties} == {"p": "1", "q": "\u00e9"}
    assert [s.event_time for s in singles] == [0, 1_700_000_000_000, 0]
    assert [p for _, p in entries] == [b"a", b"b", b"c"]


async def test_pending_sends_are_resent_in_order_after_a_drop(fake: FakeBroker) -> None:
    fake.answer_sends = False
    async with Client(fake.url, random=lambda: 0.0) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        assert isinstance(producer, Producer)
        futures = [await producer.send_async(b"%d" % i) for i in range(5)]
        await fake.wait_for(T.SEND, 5)
        fake.answer_sends = True
        await fake.drop_connections()
        ids = [await f for f in futures]
        assert ids == sorted(ids)
        resent = [f.command.send.sequence_id for f in fake.of_type(T.SEND)[5:]]
        assert resent == [0, 1, 2, 3, 4]
        assert len(fake.of_type(T.PRODUCER)) == 2


async def test_send_error_fails_the_send_with_a_typed_error(fake: FakeBroker) -> None:
    fake.send_error = pb.NotAllowedError
    async with Client(fake.url) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        with pytest.raises(NotAllowed):
            await producer.send(b"x")


async def test_consumer_flow_refills_at_half_and_acks_whole_batches(fake: FakeBroker) -> None:
    async with Client(fake.url) as client:
        consumer = await client.subscribe(TOPIC, "s", receiver_queue_size=4)
        flows = await fake.wait_for(T.FLOW)
        assert flows[0].command.flow.messagePermits == 4
        cid = fake.of_type(T.SUBSCRIBE)[0].command.subscribe.consumer_id
        from anabranch.protocol.batch import encode_batch

        md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
        md.num_messages_in_batch = 2
        fake.deliver(cid, 7, md, encode_batch([(None, b"a"), (None, b"b")]))
        first = await consumer.receive(timeout=5)
        second = await consumer.receive(timeout=5)
        assert first is not None and second is not None
        assert (first.value, second.value) == (b"a", b"b")
        assert len(fake.of_type(T.FLOW)) == 1
        await consumer.acknowledge(second)
        await consumer.acknowledge(first)
        acks = await fake.wait_for(T.ACK)
        assert [(m.entryId, m.batch_index) for m in acks[0].command.ack.message_id] == [(7, -1)]
        single = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1)
        fake.deliver(cid, 8, single, b"c")
        assert (await consumer.receive(timeout=5)) is not None
        flows = await fake.wait_for(T.FLOW, 2)
        assert flows[1].command.flow.messagePermits == 2


async def test_service_url_with_several_brokers_skips_dead_ones(fake: FakeBroker) -> None:
    second = await FakeBroker().start()
    hosts = f"127.0.0.1:{free_port()},127.0.0.1:{fake.port},127.0.0.1:{second.port}"
    try:
        async with Client(f"pulsar://{hosts}", random=lambda: 0.0) as client:
            producer = await client.create_producer(TOPIC, batching=False)
            await producer.send(b"1")  # the first broker is down: the second one serves
            assert [f.payload for f in fake.of_type(T.SEND)] == [b"1"]
            await fake.stop()
            await asyncio.wait_for(producer.send(b"2"), 10)  # then the third one
            assert [f.payload for f in second.of_type(T.SEND)] == [b"2"]
    finally:
        await second.stop()


async def test_a_malformed_frame_from_the_broker_closes_the_connection(fake: FakeBroker) -> None:
    pool = ConnectionPool(fake.url)
    conn = await pool.get(("127.0.0.1", fake.port))
    unanswered = pb.BaseCommand(
        type=T.GET_SCHEMA, getSchema=pb.CommandGetSchema(request_id=77, topic=TOPIC)
    )  # the fake broker does not answer GET_SCHEMA
    request = asyncio.ensure_future(conn.request(unanswered, request_id=77))
    await fake.wait_for(T.GET_SCHEMA)
    fake.sessions[-1].write(b"\x00\x00\x00\x08\x00\x00\x00\x04junk")  # command size 4: unparsable
    with pytest.raises(ConnectionClosed, match="protocol error"):
        await request
    await asyncio.wait_for(conn.wait_closed(), 5)
    assert not conn.is_open
    await pool.close()


async def test_lazy_batch_messages_and_acks_across_a_reconnect(fake: FakeBroker) -> None:
    """Batch messages decode their own metadata on first read; an ack of a message from
    before a reconnect counts against the redelivered batch, which is acked once whole."""
    from anabranch.protocol.batch import encode_batch

    singles = [
        pb.SingleMessageMetadata(partition_key="k0", sequence_id=5, event_time=9),
        pb.SingleMessageMetadata(properties=[pb.KeyValue(key="a", value="b")], sequence_id=6),
        pb.SingleMessageMetadata(sequence_id=7),
    ]
    batch = encode_batch([(s, f"v{i}".encode()) for i, s in enumerate(singles)])
    md = pb.MessageMetadata(producer_name="p", sequence_id=5, publish_time=11)
    md.num_messages_in_batch = 3
    async with Client(fake.url) as client:
        consumer = await client.subscribe(TOPIC, "s")
        await fake.wait_for(T.FLOW)
        cid = fake.of_type(T.SUBSCRIBE)[0].command.subscribe.consumer_id
        fake.deliver(cid, 7, md, batch)
        old = [await consumer.receive(timeout=5) for _ in range(3)]
        assert all(m is not None for m in old)
        m0, m1, m2 = (m for m in old if m is not None)
        assert (m0.key, m0.event_time, m0.sequence_id, m0.properties) == ("k0", 9, 5, {})
        assert (m1.key, m1.event_time, m1.properties) == (None, None, {"a": "b"})
        assert [m.message_id.batch_index for m in (m0, m1, m2)] == [0, 1, 2]
        assert (m2.message_id.entry_id, m2.message_id.batch_size, m2.publish_time) == (7, 3, 11)
        assert (m2.topic, m2.producer_name, m2.value) == (TOPIC, "p", b"v2")
        await consumer.acknowledge(m0)
        await fake.drop_connections()
        await fake.wait_for(T.SUBSCRIBE, 2)
        await fake.wait_for(T.FLOW, 2)
        cid = fake.of_type(T.SUBSCRIBE)[1].command.subscribe.consumer_id
        fake.deliver(cid, 7, md, batch, redelivery_count=1)
        new = [await consumer.receive(timeout=5) for _ in range(3)]
        assert [m.redelivery_count for m in new if m is not None] == [1, 1, 1]
        n0, _, n2 = new
        assert n0 is not None and n2 is not None
        await consumer.acknowledge(m1)  # before the reconnect: counts against the new batch
        await consumer.acknowledge(n0)
        await asyncio.sleep(0.05)
        assert fake.of_type(T.ACK) == []
        await consumer.acknowledge(n2)
        acks = await fake.wait_for(T.ACK)
        assert [(m.entryId, m.batch_index) for m in acks[0].command.ack.message_id] == [(7, -1)]


async def test_individual_acks_of_one_loop_turn_go_out_as_one_ack_before_a_seek(
    fake: FakeBroker,
) -> None:
    async with Client(fake.url) as client:
        consumer = await client.subscribe(TOPIC, "s")
        await fake.wait_for(T.FLOW)
        cid = fake.of_type(T.SUBSCRIBE)[0].command.subscribe.consumer_id
        for entry in range(3):
            md = pb.MessageMetadata(producer_name="p", sequence_id=entry, publish_time=1)
            fake.deliver(cid, 10 + entry, md, b"x")
        got = [await consumer.receive(timeout=5) for _ in range(3)]
        for msg in got:  # no await that suspends in between: one turn of the loop
            assert msg is not None
            await consumer.acknowledge(msg)
        assert fake.of_type(T.ACK) == []  # not sent yet: grouped until the turn ends
        acks = await fake.wait_for(T.ACK)
        assert [m.entryId for m in acks[0].command.ack.message_id] == [10, 11, 12]
        md = pb.MessageMetadata(producer_name="p", sequence_id=3, publish_time=1)
        fake.deliver(cid, 13, md, b"y")
        last = await consumer.receive(timeout=5)
        assert last is not None
        await consumer.acknowledge(last)
        seek = asyncio.create_task(consumer.seek(0))
        await fake.wait_for(T.SEEK)
        kinds = [f.type for f in fake.frames if f.type in (T.ACK, T.SEEK)]
        assert kinds == [T.ACK, T.ACK, T.SEEK]  # the grouped ack went out before the seek
        seek.cancel()


async def test_frames_written_in_one_loop_turn_share_one_socket_write(
    fake: FakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = ConnectionPool(fake.url)
    conn = await pool.get()
    assert conn._wire is not None and conn._wire.transport is not None
    transport = conn._wire.transport
    writes: list[bytes] = []
    write = transport.write

    def counted(data: bytes | bytearray | memoryview) -> None:
        writes.append(bytes(data))
        write(data)

    monkeypatch.setattr(transport, "write", counted)
    for _ in range(3):
        conn.send_command(commands.ping())
    assert writes == []  # queued until the loop turn ends
    await asyncio.sleep(0)
    assert writes == [encode_command(commands.ping()) * 3]
    # A request that must be on the wire at once (a join-ahead) takes what is queued along.
    conn.send_command(commands.ping())
    lookup = pb.CommandLookupTopic(topic=TOPIC, request_id=7, authoritative=True)
    answer = conn.request_now(T(type=T.LOOKUP, lookupTopic=lookup), 7)
    assert len(writes) == 2 and writes[1].startswith(encode_command(commands.ping()))
    await answer
    assert len(fake.of_type(T.PING)) == 4
    await pool.close()
