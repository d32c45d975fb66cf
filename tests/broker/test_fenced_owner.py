"""A broker whose ledger another owner fenced gives the topic up without failing sends.

In a cluster the new owner's recovery-open fences the old owner's writer (DESIGN.md §4).
Sends that reach the old owner's ledger afterwards were not stored; the old owner must not
answer them with an error the client gives up on, but close the producer so the client
looks the topic up again and resends them to whoever owns it now.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from anabranch.aio import Client
from anabranch.broker.service import managed_ledger_name
from anabranch.core.names import TopicName
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker

TOPIC = "persistent://public/default/fenced"
ACK_ROUNDS = 2_000


async def take_over(tmp_path: Path, broker: InProcessBroker) -> None:
    """A second "broker" on the same store and disk takes the topic's ledger over."""
    node = broker.node
    assert node is not None
    usurper = FileManagedLedgerFactory(tmp_path / "ledgers", node.store)
    taken = await usurper.open(managed_ledger_name(TopicName.parse(TOPIC)))
    await taken.close()
    await usurper.close()


async def test_sends_after_a_fence_are_resent_and_stored_once(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker, Client(broker.service_url) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        before = await producer.send(b"before")
        await take_over(tmp_path, broker)
        # The old writer is fenced: these sends are refused by the ledger, the producer is
        # closed by the broker, and the client resends them after its new lookup (here the
        # broker reloads the topic, fencing the usurper in turn).
        after = [await producer.send(f"after-{i}".encode()) for i in range(3)]
        assert all(mid > before for mid in after)
        reader = await client.create_reader(TOPIC, "earliest")
        stored = []
        while (msg := await reader.read_next(timeout=2)) is not None:
            stored.append(msg.value)
    assert stored == [b"before", b"after-0", b"after-1", b"after-2"]


async def test_an_unload_after_a_fence_loses_the_cursor_persist_without_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A broker losing its topics (session expired, another owner fenced the ledger) cannot
    # persist the acks since its last cursor persist; the new owner redelivers them. The
    # fault driver saw each such close logged as an ERROR with a traceback.
    async with (
        InProcessBroker(tmp_path, cursor_persist_interval_ms=60_000) as broker,
        Client(broker.service_url) as client,
    ):
        consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
        producer = await client.create_producer(TOPIC, batching=False)
        await producer.send(b"m")
        msg = await consumer.receive(timeout=10)
        assert msg is not None
        await consumer.acknowledge(msg)
        (topic,) = broker.service.loaded_topics()
        for _ in range(ACK_ROUNDS):  # the ack is one-way: wait until the cursor has it
            if not topic.subscriptions["s"].cursor.backlog():
                break
            await asyncio.sleep(0.01)
        assert not topic.subscriptions["s"].cursor.backlog()
        await take_over(tmp_path, broker)
        with caplog.at_level("WARNING", logger="anabranch.broker.subscription"):
            assert await broker.service.unload_topic(TOPIC)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any("cursor not persisted" in r.getMessage() for r in caplog.records)
