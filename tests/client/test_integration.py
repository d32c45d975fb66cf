"""The async client against our in-process broker: produce, consume, acks, redelivery,
subscription types, seek, readers, partitions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from anabranch.aio import Client, Consumer, MessageId, PartitionedConsumer, Producer
from anabranch.client.errors import MessageTooBig
from anabranch.client.routing import java_string_hash
from anabranch.errors import NotAllowed
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/t"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path) as b:
        yield b


@pytest.fixture
async def client(broker: InProcessBroker) -> AsyncIterator[Client]:
    async with Client(broker.service_url) as c:
        yield c


async def _drain(consumer: Consumer | PartitionedConsumer, wait_s: float = 0.5) -> list[bytes]:
    out = []
    while (msg := await consumer.receive(wait_s)) is not None:
        out.append(msg.value)
        await consumer.acknowledge(msg)
    return out


@pytest.mark.parametrize("compression", ["none", "lz4", "zlib", "zstd", "snappy"])
@pytest.mark.parametrize("batching", [True, False])
async def test_produce_consume_each_codec(client: Client, compression: str, batching: bool) -> None:
    consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
    producer = await client.create_producer(TOPIC, compression=compression, batching=batching)
    futures = [
        await producer.send_async(
            b"v%d" % i * 50, key=f"k{i}", properties={"i": str(i)}, event_time=1000 + i
        )
        for i in range(30)
    ]
    ids = [await f for f in futures]
    assert ids == sorted(ids) and len(set(ids)) == 30
    assert (ids[0].batch_index >= 0) is batching
    for i in range(30):
        msg = await consumer.receive(timeout=5)
        assert msg is not None
        assert (msg.value, msg.key, msg.properties) == (b"v%d" % i * 50, f"k{i}", {"i": str(i)})
        assert msg.message_id == ids[i] and msg.event_time == 1000 + i
        assert msg.topic == TOPIC and abs(msg.publish_time - time.time() * 1000) < 60_000
        await consumer.acknowledge(msg)
    assert await consumer.receive(timeout=0.2) is None


async def test_an_awaited_send_does_not_wait_for_the_batch_delay(client: Client) -> None:
    """As upstream's synchronous send: the caller waits, so the open batch goes out at the
    end of this loop turn. Awaited sends from tasks in the same turn still share a batch."""
    producer = await client.create_producer(TOPIC, batch_delay_s=3600)  # never, in a test
    lone = await producer.send(b"lone")
    together = await asyncio.gather(*(producer.send(b"t%d" % i) for i in range(10)))
    assert lone.batch_index == 0 and lone < together[0]
    assert [m.batch_index for m in together] == list(range(10))
    assert len({(m.ledger_id, m.entry_id) for m in together}) == 1
    queued = await producer.send_async(b"queued")  # nobody waits: the delay holds it
    await asyncio.sleep(0.2)
    assert not queued.done()
    await producer.flush()
    assert (await queued).entry_id == together[0].entry_id + 1


async def test_message_too_big_fails_only_that_send(client: Client) -> None:
    producer = await client.create_producer(TOPIC, batching=False)
    with pytest.raises(MessageTooBig):
        await producer.send(b"x" * (6 * 1024 * 1024))
    assert (await producer.send(b"ok")).entry_id >= 0


async def _enable_dedup(broker: InProcessBroker) -> None:
    await broker.service.policies.update_namespace_policies(
        "public/default", lambda old: msgspec.structs.replace(old, deduplication_enabled=True)
    )


async def test_sequence_ids_continue_from_the_broker(
    broker: InProcessBroker, client: Client
) -> None:
    await _enable_dedup(broker)
    consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
    first = await client.create_producer(TOPIC, producer_name="p1", batching=False)
    for _ in range(3):
        await first.send(b"a")
    await first.close()
    second = await client.create_producer(TOPIC, producer_name="p1", batching=False)
    assert isinstance(second, Producer)
    await second.send(b"b")
    seqs = []
    for _ in range(4):
        msg = await consumer.receive(timeout=5)
        assert msg is not None
        seqs.append(msg.sequence_id)
    assert seqs == [0, 1, 2, 3]


async def test_individual_and_cumulative_acks_survive_resubscribe(client: Client) -> None:
    consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
    producer = await client.create_producer(TOPIC, batching=False)
    for i in range(6):
        await producer.send(b"%d" % i)
    msgs = [await consumer.receive(timeout=5) for _ in range(6)]
    assert all(m is not None for m in msgs)
    await consumer.acknowledge_cumulative(msgs[2])  # type: ignore[arg-type]
    await consumer.acknowledge(msgs[4])  # type: ignore[arg-type]
    await consumer.close()
    again = await client.subscribe(TOPIC, "s")
    assert await _drain(again) == [b"3", b"5"]


async def test_batch_acked_when_all_its_messages_are(client: Client) -> None:
    consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
    producer = await client.create_producer(TOPIC, batch_delay_s=0.2)
    futures = [await producer.send_async(b"%d" % i) for i in range(4)]
    await producer.flush()
    assert len({(await f).entry for f in futures}) == 1
    msgs = [await consumer.receive(timeout=5) for _ in range(4)]
    for m in msgs[:3]:
        await consumer.acknowledge(m)  # type: ignore[arg-type]
    await consumer.close()
    # The batch is not acked yet: it comes back whole.
    again = await client.subscribe(TOPIC, "s")
    assert await _drain(again) == [b"0", b"1", b"2", b"3"]
    await again.close()
    third = await client.subscribe(TOPIC, "s")
    assert await _drain(third) == []


async def test_cumulative_ack_rejected_on_shared(client: Client) -> None:
    consumer = await client.subscribe(TOPIC, "s", subscription_type="shared")
    with pytest.raises(NotAllowed):
        await consumer.acknowledge_cumulative(MessageId(1, 1))


async def test_nack_redelivers_with_count(client: Client) -> None:
    consumer = await client.subscribe(
        TOPIC, "s", subscription_type="shared", nack_redelivery_delay_s=0.1,
        initial_position="earliest",
    )  # fmt: skip
    producer = await client.create_producer(TOPIC)
    await producer.send(b"x")
    msg = await consumer.receive(timeout=5)
    assert msg is not None and msg.redelivery_count == 0
    started = time.monotonic()
    await consumer.negative_acknowledge(msg)
    again = await consumer.receive(timeout=5)
    assert again is not None and again.value == b"x" and again.redelivery_count == 1
    assert time.monotonic() - started >= 0.09


@pytest.mark.parametrize("sub_type", ["exclusive", "shared"])
async def test_ack_timeout_redelivers(client: Client, sub_type: str) -> None:
    consumer = await client.subscribe(
        TOPIC, "s", subscription_type=sub_type, ack_timeout_s=0.3, initial_position="earliest"
    )
    producer = await client.create_producer(TOPIC, batching=False)
    await producer.send(b"a")
    await producer.send(b"b")
    first = await consumer.receive(timeout=5)
    second = await consumer.receive(timeout=5)
    assert first is not None and second is not None
    await consumer.acknowledge(second)
    again = await consumer.receive(timeout=5)
    assert again is not None and again.value == b"a" and again.redelivery_count >= 1
    await consumer.acknowledge(again)
    assert await consumer.receive(timeout=0.6) is None


async def test_shared_spreads_and_failover_has_one_active(client: Client) -> None:
    a = await client.subscribe(TOPIC, "sh", subscription_type="shared", receiver_queue_size=2)
    b = await client.subscribe(TOPIC, "sh", subscription_type="shared", receiver_queue_size=2)
    f1 = await client.subscribe(TOPIC, "fo", subscription_type="failover", consumer_name="c1")
    f2 = await client.subscribe(TOPIC, "fo", subscription_type="failover", consumer_name="c2")
    producer = await client.create_producer(TOPIC, batching=False)
    for i in range(20):
        await producer.send(b"%d" % i)
    got_a, got_b = await asyncio.gather(_drain(a), _drain(b))
    assert got_a and got_b and sorted(got_a + got_b) == sorted(b"%d" % i for i in range(20))
    got_1, got_2 = await asyncio.gather(_drain(f1), _drain(f2))
    assert sorted([len(got_1), len(got_2)]) == [0, 20]


async def test_key_shared_keeps_each_key_on_one_consumer(client: Client) -> None:
    consumers = [
        await client.subscribe(TOPIC, "ks", subscription_type="key_shared") for _ in range(2)
    ]
    producer = await client.create_producer(TOPIC, batching=False)
    for i in range(40):
        await producer.send(b"%d" % i, key=f"key-{i % 8}")
    owners: dict[str, set[int]] = {}
    total = 0
    for index, consumer in enumerate(consumers):
        while (msg := await consumer.receive(0.5)) is not None:
            assert msg.key is not None
            owners.setdefault(msg.key, set()).add(index)
            await consumer.acknowledge(msg)
            total += 1
    assert total == 40 and all(len(v) == 1 for v in owners.values()) and len(owners) == 8


async def test_seek_by_id_and_by_time(client: Client) -> None:
    consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
    producer = await client.create_producer(TOPIC, batching=False)
    ids = [await producer.send(b"%d" % i) for i in range(5)]
    assert len(await _drain(consumer)) == 5
    await consumer.seek(ids[2])
    assert await _drain(consumer) == [b"2", b"3", b"4"]
    await consumer.seek(0)
    assert await _drain(consumer) == [b"%d" % i for i in range(5)]


async def test_reader_and_has_message_available(client: Client) -> None:
    producer = await client.create_producer(TOPIC, batching=False)
    empty = await client.create_reader(TOPIC, "earliest")
    assert not await empty.has_message_available()
    ids = [await producer.send(b"%d" % i) for i in range(4)]
    reader = await client.create_reader(TOPIC, "earliest")
    seen = []
    while await reader.has_message_available():
        msg = await reader.read_next(timeout=5)
        assert msg is not None
        seen.append(msg.value)
    assert seen == [b"0", b"1", b"2", b"3"]
    after = await client.create_reader(TOPIC, ids[1])
    first = await after.read_next(timeout=5)
    assert first is not None and first.value == b"2"
    inclusive = await client.create_reader(TOPIC, ids[1], start_inclusive=True)
    first = await inclusive.read_next(timeout=5)
    assert first is not None and first.value == b"1"
    latest = await client.create_reader(TOPIC, "latest")
    assert not await latest.has_message_available()
    await producer.send(b"new")
    msg = await latest.read_next(timeout=5)
    assert msg is not None and msg.value == b"new"


async def test_partitioned_topic_routes_keys(broker: InProcessBroker, client: Client) -> None:
    topic = "persistent://public/default/parts"
    await broker.service.policies.create_partitioned_topic(topic, 3)
    producer = await client.create_producer(topic, batching=False)
    keys = [f"user-{i}" for i in range(12)]
    for key in keys:
        mid = await producer.send(key.encode(), key=key)
        assert mid.partition == java_string_hash(key) % 3
    keyless = [(await producer.send(b"x")).partition for _ in range(3)]
    assert sorted(keyless) == [0, 1, 2]
    for partition in range(3):
        part = await client.subscribe(
            f"{topic}-partition-{partition}", "per-part", initial_position="earliest"
        )
        values = [v for v in await _drain(part) if v != b"x"]
        assert values == [k.encode() for k in keys if java_string_hash(k) % 3 == partition]
    whole = await client.subscribe(topic, "whole", initial_position="earliest")
    assert isinstance(whole, PartitionedConsumer)
    assert sorted(await _drain(whole)) == sorted([k.encode() for k in keys] + [b"x"] * 3)
