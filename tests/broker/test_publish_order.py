"""A topic stores every producer's sends in the order they arrived, also when a
transaction's op record (a metadata write) makes one group of sends wait before it can
reach the ledger, and after a send fails retriably nothing later of that producer is
stored before its resend (seed 5003 of the fault harness: a metadata partition stalled a
join, later plain sends of the same producers were stored first, and the stalled ones,
failing after that, were answered as duplicates on retry: acknowledged and lost)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from anabranch.broker.topic import PersistentTopic
from anabranch.clock import SystemClock
from anabranch.errors import (
    Closed,
    MetadataUnavailable,
    TransactionConflict,
    TransactionTooLarge,
)
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import encode_entry
from anabranch.storage.api import EARLIEST, ManagedLedger, Position
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.transactions.buffer import NoTransactionBuffer
from anabranch.transactions.ids import TxnId


class HeldJoinBuffer(NoTransactionBuffer):
    """Transactions whose join waits on ``release`` (a metadata store that hangs),
    then fails with ``error`` or succeeds; appends go straight to the ledger."""

    def __init__(self, ledger: ManagedLedger) -> None:
        super().__init__(ledger)
        self.ledger = ledger
        self.release = asyncio.Event()
        self.error: Exception | None = None
        self.joined: set[TxnId] = set()

    async def prepare(self, txn_id: TxnId, role: str | None = None) -> None:
        if txn_id in self.joined:
            return
        await self.release.wait()
        if self.error is not None:
            raise self.error
        self.joined.add(txn_id)

    async def append_many(self, txn_id: TxnId, entries: Sequence[bytes]) -> list[Position]:
        await self.prepare(txn_id)
        return list(await self.ledger.append_many(entries))


def entry(producer: str, sequence_id: int) -> bytes:
    md = pb.MessageMetadata(producer_name=producer, sequence_id=sequence_id, publish_time=0)
    return encode_entry(md, f"{producer}:{sequence_id}".encode())


async def stored(ledger: ManagedLedger) -> list[bytes]:
    return [e.data for e in await ledger.read(EARLIEST.next(), 100)]


async def topic_with_held_join() -> tuple[PersistentTopic, HeldJoinBuffer, ManagedLedger]:
    ledger = await MemoryManagedLedgerFactory().open("t")
    buffer = HeldJoinBuffer(ledger)
    topic = PersistentTopic(
        "persistent://public/default/t",
        ledger,
        store=MemoryMetadataStore(),
        clock=SystemClock(),
        dedup_enabled=True,
        transaction_buffer=buffer,
    )
    return topic, buffer, ledger


def attach(topic: PersistentTopic, name: str) -> SimpleNamespace:
    producer = SimpleNamespace(
        name=name, access_mode=pb.Shared, requested_epoch=None, detach=lambda: None
    )
    assert topic.add_producer(producer) is None  # type: ignore[arg-type]
    return producer


async def test_a_stalled_join_holds_later_sends_and_its_failure_fails_them_for_a_resend() -> None:
    topic, buffer, ledger = await topic_with_held_join()
    a = attach(topic, "a")
    attach(topic, "b")
    txn = TxnId(0, 1)
    # One loop iteration: a transactional send of "a", a plain one of "a" and of "b".
    held = topic.publish("a", 0, None, entry("a", 0), 1, txn=txn)
    first = topic.publish("a", 1, None, entry("a", 1), 1)
    other = topic.publish("b", 0, None, entry("b", 0), 1)
    await asyncio.sleep(0.01)
    # Next iteration (a later group): the next send of "a".
    second = topic.publish("a", 2, None, entry("a", 2), 1)
    await asyncio.sleep(0.05)
    assert not second.done(), "a later send was stored before an earlier one of its producer"
    assert await stored(ledger) == []
    buffer.error = MetadataUnavailable("metadata store unreachable")
    buffer.release.set()
    results = await asyncio.gather(held, first, other, second, return_exceptions=True)
    # The client resends everything of "a" from its failed send on (the error is
    # retriable): nothing of "a" after it may be stored first, or the resent send would
    # be answered as a duplicate. "b" is not affected.
    assert isinstance(results[0], MetadataUnavailable)
    assert isinstance(results[1], Closed) and isinstance(results[3], Closed)
    assert isinstance(results[2], Position)
    assert await stored(ledger) == [entry("b", 0)]
    # Until "a" reconnects, its sends are refused; then its resends are stored in order.
    with pytest.raises(Closed):
        topic.publish("a", 3, None, entry("a", 3), 1)
    topic.remove_producer(a)  # type: ignore[arg-type]
    attach(topic, "a")
    buffer.error = None
    resent = [
        topic.publish("a", n, None, entry("a", n), 1, txn=txn if n == 0 else None) for n in range(4)
    ]
    assert all(isinstance(p, Position) for p in await asyncio.gather(*resent))
    assert await stored(ledger) == [entry("b", 0)] + [entry("a", n) for n in range(4)]
    await topic.close()


async def test_after_a_final_refusal_later_sends_wait_for_a_reconnect() -> None:
    topic, buffer, ledger = await topic_with_held_join()
    a = attach(topic, "a")
    buffer.error = TransactionTooLarge("transaction 0:3 has too many entries")
    buffer.release.set()
    big = topic.publish("a", 0, None, entry("a", 0), 1, txn=TxnId(0, 3))
    after = topic.publish("a", 1, None, entry("a", 1), 1)
    # The official clients resend after this error too (reconnecting): a later send stored
    # first would turn that resend into a "duplicate" of a transaction still open, which
    # would then commit without it. Ours fails the send alone and resends the later ones
    # once it reconnects.
    with pytest.raises(TransactionTooLarge):
        await big
    with pytest.raises(Closed):
        await after
    topic.remove_producer(a)  # type: ignore[arg-type]
    attach(topic, "a")
    assert isinstance(await topic.publish("a", 1, None, entry("a", 1), 1), Position)
    assert await stored(ledger) == [entry("a", 1)]
    await topic.close()


async def test_a_send_of_a_finished_transaction_fails_alone() -> None:
    topic, buffer, ledger = await topic_with_held_join()
    attach(topic, "a")
    buffer.error = TransactionConflict("transaction 0:4 is already ABORTED")
    buffer.release.set()
    late = topic.publish("a", 0, None, entry("a", 0), 1, txn=TxnId(0, 4))
    after = topic.publish("a", 1, None, entry("a", 1), 1)
    with pytest.raises(TransactionConflict):
        await late
    assert isinstance(await after, Position)
    assert await stored(ledger) == [entry("a", 1)]
    await topic.close()


async def test_groups_behind_a_joined_transaction_keep_send_order() -> None:
    topic, buffer, ledger = await topic_with_held_join()
    attach(topic, "a")
    buffer.release.set()
    txn = TxnId(0, 2)
    futures = []
    for sequence_id in range(6):
        # Alternate transactional and plain sends, one per loop iteration, pipelined.
        futures.append(
            topic.publish(
                "a",
                sequence_id,
                None,
                entry("a", sequence_id),
                1,
                txn=txn if sequence_id % 2 == 0 else None,
            )
        )
        await asyncio.sleep(0)
    positions = await asyncio.gather(*futures)
    assert positions == sorted(positions)
    assert await stored(ledger) == [entry("a", n) for n in range(6)]
    await topic.close()
