"""A producer's first send in a transaction announces its topic (ADD_PARTITION_TO_TXN, not
awaited): the broker writes the topic's op record then, ahead of the batch, when the
connection produces to that topic, and only then (joining pins the topic's readers)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from anabranch.aio import Client
from anabranch.client.txn_join_ahead import JoinAhead
from anabranch.testing.broker import InProcessBroker
from anabranch.transactions import records
from anabranch.transactions.metadata_buffer import MetadataTransactionBuffer

TOPIC = "persistent://public/default/ahead"


async def _eventually(check: Callable[[], bool]) -> None:
    for _ in range(1000):  # a hang guard only
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


async def test_the_first_send_joins_the_topic_before_its_batch_goes_out(tmp_path: Path) -> None:
    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        Client(broker.service_url) as client,
    ):
        producer = await client.create_producer(TOPIC, batch_delay_s=30)
        consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None
        buffer = topic.transaction_buffer
        assert isinstance(buffer, MetadataTransactionBuffer)
        txn = await client.new_transaction(timeout=30)
        sent = [await producer.send_async(b"m", txn=txn) for _ in range(3)]
        # The batch waits for its 30 s delay, yet the topic already holds its op record.
        await _eventually(lambda: buffer.op_writes == 1)
        assert not any(fut.done() for fut in sent)
        page = await broker.service.store.list_prefix(records.writes_index_prefix(topic.name))
        assert len(page.records) == 1
        await producer.flush()
        await asyncio.gather(*sent)
        await txn.commit()
        assert buffer.op_writes == 1  # the batch's append joined nothing more
        got = [await consumer.receive(timeout=10) for _ in range(3)]
        assert [m.value for m in got if m is not None] == [b"m"] * 3


async def test_an_announcement_without_a_producer_on_the_topic_joins_nothing(
    tmp_path: Path,
) -> None:
    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        Client(broker.service_url) as client,
    ):
        await client.create_producer(TOPIC)  # a producer, but on another topic
        other = "persistent://public/default/not-produced"
        await client.subscribe(other, "s")  # loaded here, yet not produced to
        txn = await client.new_transaction(timeout=30)
        conn = await client._pool.get()
        ahead = JoinAhead()
        ahead.announce(conn, other, txn.id)
        await asyncio.gather(*ahead._tasks)  # answered (the open check only)
        await txn.commit()
        page = await broker.service.store.list_prefix(records.writes_index_prefix(other))
        assert page.records == []
        topic = broker.service.loaded_topic(other)
        assert topic is not None and topic.transaction_buffer.max_read_position() is not None
        buffer = topic.transaction_buffer
        assert isinstance(buffer, MetadataTransactionBuffer) and buffer.op_writes == 0


async def test_an_announcement_by_a_short_name_joins_the_produced_topic(tmp_path: Path) -> None:
    """Clients name topics in full, which the broker matches without parsing; a short
    form ("ahead", "public/default/ahead") still finds the producer's topic."""
    async with (
        InProcessBroker(tmp_path, metadata="sqlite") as broker,
        Client(broker.service_url) as client,
    ):
        await client.create_producer(TOPIC)
        topic = broker.service.loaded_topic(TOPIC)
        assert topic is not None
        buffer = topic.transaction_buffer
        assert isinstance(buffer, MetadataTransactionBuffer)
        conn = await client._pool.get()
        for joined, name in enumerate(("ahead", "public/default/ahead"), start=1):
            txn = await client.new_transaction(timeout=30)
            ahead = JoinAhead()
            ahead.announce(conn, name, txn.id)
            await asyncio.gather(*ahead._tasks)
            assert buffer.op_writes == joined
            await txn.abort()
