"""The official pulsar-client (C++ core) consuming from anabranch: every subscription type,
acks of every kind, negative acks, seek, readers, and durable subscriptions.

The broker runs on the test's event loop; the client has its own threads, so all client
work runs in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pulsar
import pytest

from anabranch.testing.broker import BrokerProcess, InProcessBroker

R = TypeVar("R")
TOPIC = "persistent://public/default/consume"
RECEIVE_MS = 5000


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@contextmanager
def client(url: str) -> Iterator[pulsar.Client]:
    c = pulsar.Client(url, operation_timeout_seconds=15, logger=_quiet_logger())
    try:
        yield c
    finally:
        c.close()


def _quiet_logger() -> Any:
    # The client's own C++ logger: a Python logger is called from the client's threads,
    # which can crash the interpreter when they log while an event loop is torn down.
    return pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)


async def run(fn: Callable[[], R]) -> R:
    return await asyncio.to_thread(fn)


def produce(c: pulsar.Client, n: int, *, topic: str = TOPIC, **kw: Any) -> list[Any]:
    producer = c.create_producer(topic, **kw)
    ids = [producer.send(b"m%d" % i) for i in range(n)]
    producer.close()
    return ids


def drain(consumer: pulsar.Consumer, timeout_ms: int = 500) -> list[Any]:
    out = []
    while True:
        try:
            out.append(consumer.receive(timeout_ms))
        except pulsar.Timeout:
            return out


async def test_shared_and_exclusive(broker: InProcessBroker) -> None:
    def work() -> tuple[list[bytes], list[bytes], str]:
        with client(broker.service_url) as c:
            a = c.subscribe(
                TOPIC, "sh", consumer_type=pulsar.ConsumerType.Shared, receiver_queue_size=1
            )
            b = c.subscribe(
                TOPIC, "sh", consumer_type=pulsar.ConsumerType.Shared, receiver_queue_size=1
            )
            produce(c, 20)
            got_a: list[bytes] = []
            got_b: list[bytes] = []
            for consumer, got in ((a, got_a), (b, got_b)) * 10:
                m = consumer.receive(RECEIVE_MS)
                got.append(m.data())
                consumer.acknowledge(m)
            c.subscribe(TOPIC, "ex")
            try:
                c.subscribe(TOPIC, "ex")
                err = ""
            except pulsar.PulsarException as e:
                err = type(e).__name__
            return got_a, got_b, err

    got_a, got_b, err = await run(work)
    assert sorted(got_a + got_b) == sorted(b"m%d" % i for i in range(20))
    assert got_a and got_b
    assert err == "ConsumerBusy"


async def test_failover_switches_to_the_standby(broker: InProcessBroker) -> None:
    def work() -> tuple[int, int, list[bytes]]:
        with client(broker.service_url) as c:
            kw: dict[str, Any] = {"consumer_type": pulsar.ConsumerType.Failover}
            a = c.subscribe(TOPIC, "fo", consumer_name="a", **kw)
            b = c.subscribe(TOPIC, "fo", consumer_name="b", **kw)
            produce(c, 5)
            got_a, got_b = drain(a), drain(b)
            active, standby = (a, b) if got_a else (b, a)
            for m in got_a + got_b:
                active.acknowledge(m)
            active.close()
            produce(c, 3)
            after = [m.data() for m in drain(standby, 2000)]
            return len(got_a), len(got_b), after

    n_a, n_b, after = await run(work)
    assert sorted((n_a, n_b)) == [0, 5]
    assert after == [b"m0", b"m1", b"m2"]


async def test_key_shared_keeps_per_key_order(broker: InProcessBroker) -> None:
    def work() -> list[list[tuple[str, int]]]:
        with client(broker.service_url) as c:
            consumers = [
                c.subscribe(
                    TOPIC, "ks", consumer_type=pulsar.ConsumerType.KeyShared, consumer_name=f"c{i}"
                )
                for i in range(2)
            ]
            producer = c.create_producer(TOPIC, batching_type=pulsar.BatchingType.KeyBased)
            for i in range(200):
                producer.send_async(b"%d" % i, None, partition_key=f"key-{i % 10}")
            producer.flush()
            producer.close()
            out = []
            for consumer in consumers:
                got = drain(consumer, 1500)
                for m in got:
                    consumer.acknowledge(m)
                out.append([(m.partition_key(), int(m.data())) for m in got])
            return out

    per_consumer = await run(work)
    assert sum(len(x) for x in per_consumer) == 200
    assert all(per_consumer)  # the keys were spread over both consumers
    keys = [{k for k, _ in got} for got in per_consumer]
    assert not keys[0] & keys[1]
    for got in per_consumer:
        for key in {k for k, _ in got}:
            seq = [n for k, n in got if k == key]
            assert seq == sorted(seq)


async def test_individual_cumulative_and_batch_index_acks(broker: InProcessBroker) -> None:
    def work() -> tuple[list[bytes], list[bytes]]:
        with client(broker.service_url) as c:
            kw: dict[str, Any] = {"batch_index_ack_enabled": True}
            first = c.subscribe(TOPIC, "acks", consumer_type=pulsar.ConsumerType.Shared, **kw)
            producer = c.create_producer(TOPIC, batching_max_publish_delay_ms=100)
            for i in range(6):
                producer.send_async(b"m%d" % i, None)
            producer.flush()
            got = drain(first)
            for m in got:
                if m.data() in (b"m0", b"m2", b"m3"):
                    first.acknowledge(m)  # batch-index acks inside one batch
            first.close()
            again = c.subscribe(TOPIC, "acks", consumer_type=pulsar.ConsumerType.Shared, **kw)
            redelivered = [m.data() for m in drain(again)]
            again.close()
            cum = c.subscribe(TOPIC, "cum", initial_position=pulsar.InitialPosition.Earliest)
            msgs = drain(cum)
            cum.acknowledge_cumulative(msgs[-1])
            cum.close()
            cum = c.subscribe(TOPIC, "cum")
            rest = [m.data() for m in drain(cum)]
            return redelivered, rest

    redelivered, rest = await run(work)
    assert sorted(redelivered) == [b"m1", b"m4", b"m5"]
    assert rest == []


async def test_negative_ack_redelivers_with_count(broker: InProcessBroker) -> None:
    def work() -> list[tuple[bytes, int]]:
        with client(broker.service_url) as c:
            consumer = c.subscribe(
                TOPIC,
                "nack",
                consumer_type=pulsar.ConsumerType.Shared,
                negative_ack_redelivery_delay_ms=100,
            )
            produce(c, 1)
            seen = []
            for _ in range(3):
                m = consumer.receive(RECEIVE_MS)
                seen.append((m.data(), m.redelivery_count()))
                consumer.negative_acknowledge(m)
            return seen

    assert await run(work) == [(b"m0", 0), (b"m0", 1), (b"m0", 2)]


async def test_seek_by_id_and_by_time(broker: InProcessBroker) -> None:
    def work() -> tuple[bytes, bytes, bytes]:
        with client(broker.service_url) as c:
            consumer = c.subscribe(TOPIC, "seek")
            ids = produce(c, 3)
            time.sleep(0.05)
            middle = int(time.time() * 1000)
            time.sleep(0.05)
            produce(c, 3)
            for m in drain(consumer):
                consumer.acknowledge(m)
            consumer.seek(ids[1])
            by_id = consumer.receive(RECEIVE_MS).data()
            consumer.seek(middle)
            by_time = consumer.receive(RECEIVE_MS).data()
            consumer.seek(pulsar.MessageId.earliest)
            earliest = consumer.receive(RECEIVE_MS).data()
            return by_id, by_time, earliest

    # The broker resets to ids[1] inclusive; the official client then drops the seek
    # target itself (startMessageId is exclusive by default), so m2 comes first. The
    # second produce() starts its own numbering at m0.
    assert await run(work) == (b"m2", b"m0", b"m0")


async def test_reader_has_message_available_and_last_id(broker: InProcessBroker) -> None:
    def work() -> tuple[int, bool, Any, Any]:
        with client(broker.service_url) as c:
            producer = c.create_producer(TOPIC, batching_max_publish_delay_ms=50)
            for i in range(7):
                producer.send_async(b"m%d" % i, None)
            producer.flush()
            last_sent = producer.send(b"last")
            reader = c.create_reader(TOPIC, pulsar.MessageId.earliest)
            n = 0
            while reader.has_message_available():
                reader.read_next(RECEIVE_MS)
                n += 1
            more = reader.has_message_available()
            consumer = c.subscribe(TOPIC, "last")
            return n, more, consumer.get_last_message_id(), last_sent

    n, more, last_id, last_sent = await run(work)
    assert n == 8 and not more
    assert (last_id.ledger_id(), last_id.entry_id()) == (
        last_sent.ledger_id(),
        last_sent.entry_id(),
    )


async def test_subscription_is_durable_across_restart(tmp_path: Path) -> None:
    proc = BrokerProcess(tmp_path / "data")
    await proc.start()
    try:

        def before() -> None:
            with client(proc.service_url) as c:
                consumer = c.subscribe(TOPIC, "durable")
                produce(c, 4)
                msgs = drain(consumer)
                consumer.acknowledge(msgs[0])
                consumer.acknowledge(msgs[2])
                consumer.close()

        await run(before)
        await proc.stop()
        await proc.start()

        def after() -> list[bytes]:
            with client(proc.service_url) as c:
                consumer = c.subscribe(TOPIC, "durable")
                return sorted(m.data() for m in drain(consumer, 1500))

        assert await run(after) == [b"m1", b"m3"]
    finally:
        await proc.stop()
