"""A topic stores every producer's sends in the order they arrived, also when a
transaction's op record (a metadata write) makes one group of sends wait before it can
reach the ledger (seed 5003 of the fault harness: a metadata partition stalled a join,
later plain sends of the same producers were stored first, and the stalled ones, failing
after that, were answered as duplicates on retry: acknowledged and lost)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from anabranch.broker.topic import DUPLICATE_POSITION, PersistentTopic
from anabranch.clock import SystemClock
from anabranch.errors import MetadataUnavailable
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

    async def prepare(self, txn_id: TxnId) -> None:
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


async def test_a_stalled_join_fails_its_send_alone_and_later_sends_wait_for_it() -> None:
    topic, buffer, ledger = await topic_with_held_join()
    txn = TxnId(0, 1)
    # One loop iteration: a transactional send, then a plain one of producer "a".
    held = topic.publish("t", 0, None, entry("t", 0), 1, txn=txn)
    first = topic.publish("a", 0, None, entry("a", 0), 1)
    await asyncio.sleep(0.01)
    # Next iteration (a later group): the next send of "a".
    second = topic.publish("a", 1, None, entry("a", 1), 1)
    await asyncio.sleep(0.05)
    assert not second.done(), "a later send was stored before an earlier one of its producer"
    assert await stored(ledger) == []
    buffer.error = MetadataUnavailable("metadata store unreachable")
    buffer.release.set()
    results = await asyncio.gather(held, first, second, return_exceptions=True)
    assert isinstance(results[0], MetadataUnavailable)
    assert isinstance(results[1], Position) and isinstance(results[2], Position)
    assert results[1] < results[2]
    assert await stored(ledger) == [entry("a", 0), entry("a", 1)]
    # The failed transactional send is not a duplicate on retry; the stored ones are.
    assert topic.publish("a", 0, None, entry("a", 0), 1).result() == DUPLICATE_POSITION
    buffer.error = None
    assert isinstance(await topic.publish("t", 0, None, entry("t", 0), 1, txn=txn), Position)
    await topic.close()


async def test_groups_behind_a_joined_transaction_keep_send_order() -> None:
    topic, buffer, ledger = await topic_with_held_join()
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
