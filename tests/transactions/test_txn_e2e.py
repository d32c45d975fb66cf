"""Transactions end to end: a real in-process broker (SQLite metadata, file ledgers) and
our client, upstream's V5TransactionTest / V5TransactionScalableTest scenarios.

Each test checks what an application sees: nothing of a transaction before its commit,
everything after, never anything of an aborted one (a sentinel sent after each aborted
batch proves the reader got past it), and transactional acks that stick only on commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import anabranch
from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.errors import InvalidTxnStatus
from anabranch.testing.broker import BrokerProcess, InProcessBroker

QUIET_S = 0.5
"""How long a consumer must stay silent to count as 'nothing visible'."""
RECEIVE_S = 5.0


@contextlib.asynccontextmanager
async def running(tmp_path: Path, **config: Any) -> AsyncIterator[tuple[InProcessBroker, Client]]:
    async with InProcessBroker(tmp_path, metadata="sqlite", **config) as broker:
        client = Client(broker.service_url)
        try:
            yield broker, client
        finally:
            await client.close()


async def drain(consumer: Any, *, quiet_s: float = QUIET_S) -> list[bytes]:
    """Every message until the consumer stays quiet for ``quiet_s``."""
    out: list[bytes] = []
    while True:
        msg = await consumer.receive(timeout=quiet_s)
        if msg is None:
            return out
        out.append(msg.value)


async def take(consumer: Any, count: int, *, ack: bool = False) -> list[Any]:
    """Exactly ``count`` messages (fails if they do not come); ``ack`` acknowledges each
    cumulatively (a stream consumer gets a child segment only once its parents are
    acknowledged)."""
    out: list[Any] = []
    for _ in range(count):
        msg = await consumer.receive(timeout=RECEIVE_S)
        assert msg is not None, f"only {len(out)} of {count} messages arrived"
        out.append(msg)
        if ack:
            await consumer.acknowledge_cumulative(msg)
    return out


def topic(name: str) -> str:
    return f"persistent://public/default/{name}"


async def test_nothing_visible_before_commit_everything_after(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, client):
        producer = await client.create_producer(topic("vis"))
        consumer = await client.subscribe(topic("vis"), "s", initial_position="earliest")
        txn = await client.new_transaction(timeout=30)
        for i in range(10):
            await producer.send(f"m{i}".encode(), txn=txn)
        assert await drain(consumer) == []
        await txn.commit()
        assert [m.value for m in await take(consumer, 10)] == [f"m{i}".encode() for i in range(10)]
        assert str(txn.state).endswith("COMMITTED")


async def test_an_ending_transaction_sends_its_open_batches_at_once(tmp_path: Path) -> None:
    """Sends queued without waiting (``send_async``) sit in their producer's open batch;
    the commit or abort waits for them, so it sends those batches at once instead of
    after the batch delay (an hour here: waiting it out would hang the test)."""
    async with running(tmp_path) as (broker, client):
        assert broker.http_url is not None
        async with AdminClient(broker.http_url) as admin:
            await admin.create_scalable_topic("topic://public/default/open-batch", 2)
        for name in (topic("open-batch"), "topic://public/default/open-batch"):
            producer = await client.create_producer(name, batch_delay_s=3600)
            if name.startswith("topic://"):
                reader: Any = await client.create_checkpoint_consumer(name)
            else:
                reader = await client.subscribe(name, "s", initial_position="earliest")
            for outcome in ("abort", "commit"):
                txn = await client.new_transaction(timeout=30)
                futures = [
                    await producer.send_async(f"{outcome}-{i}".encode(), key=f"k{i}", txn=txn)
                    for i in range(10)
                ]
                assert not any(f.done() for f in futures)  # held by the batch delay
                await (txn.commit() if outcome == "commit" else txn.abort())
                assert all(f.done() and f.exception() is None for f in futures)
            got = sorted(m.value for m in await take(reader, 10))
            assert got == sorted(f"commit-{i}".encode() for i in range(10)), name
            assert await drain(reader) == []


async def test_aborted_messages_are_never_delivered(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, client):
        producer = await client.create_producer(topic("abort"))
        consumer = await client.subscribe(topic("abort"), "s", initial_position="earliest")
        for batch in range(3):
            txn = await client.new_transaction(timeout=30)
            for i in range(5):
                await producer.send(f"aborted-{batch}-{i}".encode(), txn=txn)
            await txn.abort()
            await producer.send(f"sentinel-{batch}".encode())
        got = [m.value for m in await take(consumer, 3)]
        assert got == [b"sentinel-0", b"sentinel-1", b"sentinel-2"]
        assert await drain(consumer) == []
        assert str(txn.state).endswith("ABORTED")


async def test_commit_across_three_topics_and_four_segments(tmp_path: Path) -> None:
    async with running(tmp_path) as (broker, client):
        assert broker.http_url is not None
        admin = AdminClient(broker.http_url)
        try:
            await admin.create_scalable_topic("topic://public/default/multi", 4)
        finally:
            await admin.close()
        scalable = await client.create_producer("topic://public/default/multi")
        plain = [await client.create_producer(topic(f"multi-{i}")) for i in range(2)]
        stream = await client.subscribe_stream("topic://public/default/multi", "s")
        consumers = [
            await client.subscribe(topic(f"multi-{i}"), "s", initial_position="earliest")
            for i in range(2)
        ]
        keys = [f"key-{i}" for i in range(40)]
        txn = await client.new_transaction(timeout=30)
        for key in keys:
            await scalable.send(key.encode(), key=key, txn=txn)
        for i, producer in enumerate(plain):
            await producer.send(f"plain-{i}".encode(), txn=txn)
        assert await drain(stream) == []
        for consumer in consumers:
            assert await drain(consumer, quiet_s=0.1) == []
        await txn.commit()
        got = sorted(m.value for m in await take(stream, len(keys)))
        assert got == sorted(k.encode() for k in keys)
        for i, consumer in enumerate(consumers):
            assert [m.value for m in await take(consumer, 1)] == [f"plain-{i}".encode()]


async def test_consume_transform_produce_with_cumulative_acks(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, client):
        source = await client.create_producer("topic://public/default/ctp-in")
        for i in range(20):
            await source.send(f"{i}".encode(), key=f"k{i % 4}")
        stream = await client.subscribe_stream("topic://public/default/ctp-in", "etl")
        sink = await client.create_producer(topic("ctp-out"))
        out = await client.subscribe(topic("ctp-out"), "check", initial_position="earliest")
        # First attempt: transform 20, ack them in the txn, abort: nothing out, all redelivered.
        msgs = await take(stream, 20)
        txn = await client.new_transaction(timeout=30)
        for msg in msgs:
            await sink.send(msg.value + b"!", txn=txn)
        await stream.acknowledge_cumulative(msgs[-1], txn=txn)
        await txn.abort()
        assert await drain(out) == []
        # The aborted acks are dropped: a new stream consumer of the subscription gets all 20.
        await stream.close()
        stream = await client.subscribe_stream("topic://public/default/ctp-in", "etl")
        msgs = await take(stream, 20)
        async with client.transaction(timeout=30) as txn2:
            for msg in msgs:
                await sink.send(msg.value + b"!", txn=txn2)
            await stream.acknowledge_cumulative(msgs[-1], txn=txn2)
        assert sorted(m.value for m in await take(out, 20)) == sorted(
            f"{i}!".encode() for i in range(20)
        )
        await stream.close()
        stream = await client.subscribe_stream("topic://public/default/ctp-in", "etl")
        assert await drain(stream) == []  # the committed cumulative ack stuck


async def test_large_transaction_of_500_messages(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, client):
        producer = await client.create_producer(topic("large"))
        consumer = await client.subscribe(topic("large"), "s", initial_position="earliest")
        txn = await client.new_transaction(timeout=60)
        futures = [await producer.send_async(f"{i}".encode(), txn=txn) for i in range(500)]
        await asyncio.gather(*futures)
        assert await drain(consumer, quiet_s=0.2) == []
        await txn.commit()
        got = [m.value for m in await take(consumer, 500)]
        assert got == [f"{i}".encode() for i in range(500)]


async def test_sends_that_wait_for_room_in_the_producer_queue_join_the_transaction(
    tmp_path: Path,
) -> None:
    # A queue of 1: every send after the first waits for a receipt (the path that counts
    # the send in flight while it waits).
    async with running(tmp_path) as (_, client):
        producer = await client.create_producer(
            topic("room"), pending_messages_max=1, batching=False
        )
        consumer = await client.subscribe(topic("room"), "s", initial_position="earliest")
        txn = await client.new_transaction(timeout=30)
        futures = [await producer.send_async(f"r{i}".encode(), txn=txn) for i in range(20)]
        # The last send was queued just now (no receipt yet): the transaction counts it.
        assert txn.unanswered >= 1
        assert await drain(consumer) == []
        await txn.commit()
        assert all(f.done() and not f.exception() for f in futures)
        got = [m.value for m in await take(consumer, 20)]
        assert got == [f"r{i}".encode() for i in range(20)]
        aborted = await client.new_transaction(timeout=30)
        for i in range(6):
            await producer.send_async(f"x{i}".encode(), txn=aborted)
        await aborted.abort()
        await producer.send(b"sentinel")
        assert [m.value for m in await take(consumer, 1)] == [b"sentinel"]


async def test_fifty_concurrent_transactions_mixing_commit_and_abort(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, client):
        producer = await client.create_producer("topic://public/default/conc")
        stream = await client.subscribe_stream("topic://public/default/conc", "s")

        async def one(n: int) -> None:
            txn = await client.new_transaction(timeout=60)
            for i in range(4):
                await producer.send(f"{n}-{i}".encode(), key=f"k{n}", txn=txn)
            if n % 2:
                await txn.abort()
            else:
                await txn.commit()

        await asyncio.gather(*(one(n) for n in range(50)))
        expected = sorted(f"{n}-{i}".encode() for n in range(0, 50, 2) for i in range(4))
        got = sorted(m.value for m in await take(stream, len(expected)))
        assert got == expected
        assert await drain(stream) == []


async def test_transactional_ack_abort_redelivers_then_commit_sticks(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, client):
        producer = await client.create_producer(topic("acks"))
        consumer = await client.subscribe(
            topic("acks"), "s", initial_position="earliest", subscription_type="shared"
        )
        for i in range(5):
            await producer.send(f"{i}".encode())
        msgs = await take(consumer, 5)
        txn = await client.new_transaction(timeout=30)
        for msg in msgs:
            await consumer.acknowledge(msg, txn=txn)
        await txn.abort()
        again = sorted(m.value for m in await take(consumer, 5))
        assert again == [f"{i}".encode() for i in range(5)]
        assert await drain(consumer) == []  # once each: the broker redelivers, not also us
        txn = await client.new_transaction(timeout=30)
        for msg in msgs:
            await consumer.acknowledge(msg, txn=txn)
        await txn.commit()
        await consumer.close()
        consumer = await client.subscribe(
            topic("acks"), "s", initial_position="earliest", subscription_type="shared"
        )
        assert await drain(consumer) == []


async def test_an_open_transaction_pins_later_plain_writes(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, client):
        producer = await client.create_producer(topic("pin"))
        consumer = await client.subscribe(topic("pin"), "s", initial_position="earliest")
        await producer.send(b"before")
        assert [m.value for m in await take(consumer, 1)] == [b"before"]
        txn = await client.new_transaction(timeout=30)
        await producer.send(b"in-txn", txn=txn)
        await producer.send(b"after")
        assert await drain(consumer) == []  # read-committed: "after" waits for the txn
        await txn.commit()
        assert [m.value for m in await take(consumer, 2)] == [b"in-txn", b"after"]


async def test_the_timeout_sweep_aborts_a_dangling_transaction(tmp_path: Path) -> None:
    async with running(tmp_path) as (_, client):
        producer = await client.create_producer(topic("dangling"))
        consumer = await client.subscribe(topic("dangling"), "s", initial_position="earliest")
        txn = await client.new_transaction(timeout=1.0)
        await producer.send(b"dangling", txn=txn)
        await producer.send(b"sentinel")
        # Nobody ends it: the sweep aborts it after its timeout and the sentinel shows.
        assert [m.value for m in await take(consumer, 1)] == [b"sentinel"]
        assert await drain(consumer) == []


@pytest.mark.parametrize("outcome", ["commit", "abort"])
async def test_a_transaction_spanning_a_split_and_a_merge(tmp_path: Path, outcome: str) -> None:
    name = "topic://public/default/span"
    async with running(tmp_path) as (broker, client):
        assert broker.http_url is not None
        admin = AdminClient(broker.http_url)
        try:
            producer = await client.create_producer(name)
            stream = await client.subscribe_stream(name, "s")
            keys = [f"key-{i}" for i in range(16)]
            txn = await client.new_transaction(timeout=60)
            for key in keys:
                await producer.send(f"{key}:parent".encode(), key=key, txn=txn)
            await admin.split_segment(name, 0)  # children 1 and 2 take the keyspace
            for key in keys:
                await producer.send(f"{key}:child".encode(), key=key, txn=txn)
            await admin.merge_segments(name, 1, 2)  # grandchild 3
            for key in keys:
                await producer.send(f"{key}:merged".encode(), key=key, txn=txn)
            await producer.send(b"sentinel", key="key-0")
            assert await drain(stream) == []  # the open txn pins the sealed parents too
            if outcome == "commit":
                await txn.commit()
                got = [m.value for m in await take(stream, 3 * len(keys) + 1, ack=True)]
                for key in keys:
                    mine = [v for v in got if v.startswith(f"{key}:".encode())]
                    assert mine == [f"{key}:{g}".encode() for g in ("parent", "child", "merged")]
            else:
                await txn.abort()
                assert [m.value for m in await take(stream, 1, ack=True)] == [b"sentinel"]
            assert await drain(stream) == []
        finally:
            await admin.close()


@contextlib.contextmanager
def sync_client(tmp_path: Path) -> Iterator[anabranch.Client]:
    """The blocking client on a broker process of its own."""
    broker = BrokerProcess(tmp_path / "data")
    asyncio.run(broker.start())
    try:
        client = anabranch.Client(broker.service_url)
        try:
            yield client
        finally:
            client.close()
    finally:
        asyncio.run(broker.stop())


def received(consumer: anabranch.Consumer) -> list[bytes]:
    """What the blocking ``consumer`` gets until it is quiet for QUIET_S."""
    got = []
    while (msg := consumer.receive(timeout=QUIET_S)) is not None:
        got.append(msg.value)
    return got


def test_the_sync_client_commits_on_exit_and_aborts_on_an_exception(tmp_path: Path) -> None:
    with sync_client(tmp_path) as client:
        producer = client.create_producer(topic("sync"))
        consumer = client.subscribe(topic("sync"), "s", initial_position="earliest")
        with client.transaction(timeout=30) as txn:
            producer.send(b"kept", txn=txn)
        with pytest.raises(RuntimeError), client.transaction(timeout=30) as txn2:
            producer.send(b"dropped", txn=txn2)
            raise RuntimeError("the application failed")
        producer.send(b"sentinel")
        assert received(consumer) == [b"kept", b"sentinel"]
        assert str(txn.state).endswith("COMMITTED") and str(txn2.state).endswith("ABORTED")


def test_the_sync_client_pipelines_commits(tmp_path: Path) -> None:
    # commit_async returns at once with the transaction already COMMITTING, so a loop
    # takes its next transaction while the last commits; every future ends as commit()
    # would, and what abort_async ended is never delivered.
    with sync_client(tmp_path) as client:
        producer = client.create_producer(topic("sync-pipelined"))
        consumer = client.subscribe(topic("sync-pipelined"), "s", initial_position="earliest")
        pending, kept = [], []
        for round_ in range(6):
            txn = client.new_transaction(timeout=30)
            values = [f"r{round_}-{i}".encode() for i in range(10)]
            for value in values:
                producer.send_async(value, txn=txn)
            if round_ == 3:
                pending.append(txn.abort_async())
                continue
            pending.append(txn.commit_async())
            assert str(txn.state).endswith(("COMMITTING", "COMMITTED"))
            with pytest.raises(InvalidTxnStatus):
                producer.send_async(b"late", txn=txn)
            kept += values
        assert [done.result(timeout=30) for done in pending] == [None] * 6
        assert txn.commit_async().result(timeout=30) is None  # committed: a no-op
        aborted = client.new_transaction(timeout=30)
        aborted.abort()
        with pytest.raises(InvalidTxnStatus):
            aborted.commit_async().result(timeout=30)
        producer.send(b"sentinel")
        assert received(consumer) == [*kept, b"sentinel"]
