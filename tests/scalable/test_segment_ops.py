"""StorageSegmentOps over real (in-memory) managed ledgers: every method idempotent."""

from __future__ import annotations

import pytest

from anabranch.broker.service import managed_ledger_name
from anabranch.core.names import SegmentName
from anabranch.errors import LedgerSealed
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import encode_entry
from anabranch.scalable.segment_ops import (
    StorageSegmentOps,
    decode_dedup_snapshot,
    segment_ledger_name,
)
from anabranch.storage.api import EARLIEST
from anabranch.storage.memory import MemoryManagedLedgerFactory

SEGMENT = SegmentName.parse("segment://public/default/orders/0000-7fff-1")


def entry(producer: str, sequence_id: int, batch: int = 1) -> bytes:
    md = pb.MessageMetadata(
        producer_name=producer, sequence_id=sequence_id, publish_time=0, num_messages_in_batch=batch
    )
    return encode_entry(md, b"payload")


def test_ledger_name_is_the_brokers() -> None:
    assert segment_ledger_name(SEGMENT) == managed_ledger_name(SEGMENT)


async def test_create_is_idempotent_with_cursors_at_earliest(
    ops: StorageSegmentOps, ledgers: MemoryManagedLedgerFactory
) -> None:
    await ops.create_segment(SEGMENT, ["b", "a"])
    await ops.create_segment(SEGMENT, ["a", "c"])
    assert await ops.segment_subscriptions(SEGMENT) == ["a", "b", "c"]
    ledger = await ledgers.open(segment_ledger_name(SEGMENT))
    try:
        await ledger.append(b"x")
        assert {c.name: c.mark_delete_position for c in ledger.cursors()} == {
            "a": EARLIEST,
            "b": EARLIEST,
            "c": EARLIEST,
        }
        assert all(c.backlog() == 1 for c in ledger.cursors())
    finally:
        await ledger.close()


async def test_terminate_seals_and_returns_the_dedup_snapshot(
    ops: StorageSegmentOps, ledgers: MemoryManagedLedgerFactory
) -> None:
    await ops.create_segment(SEGMENT, ["s"])
    writer = await ledgers.open(segment_ledger_name(SEGMENT))
    await writer.append(entry("p1", 0))
    await writer.append(entry("p1", 1, batch=3))
    await writer.append(entry("p2", 7))
    await writer.append(b"not an entry")
    await writer.close()
    snapshot = decode_dedup_snapshot(await ops.terminate_segment(SEGMENT))
    assert snapshot == {"p1": 3, "p2": 7}
    assert decode_dedup_snapshot(await ops.terminate_segment(SEGMENT)) == snapshot
    sealed = await ledgers.open(segment_ledger_name(SEGMENT))
    try:
        with pytest.raises(LedgerSealed):
            await sealed.append(b"late")
        assert len(await sealed.read(EARLIEST, max_entries=10)) == 4
    finally:
        await sealed.close()


async def test_backlog_remove_and_delete(
    ops: StorageSegmentOps, ledgers: MemoryManagedLedgerFactory
) -> None:
    await ops.create_segment(SEGMENT, ["s"])
    assert await ops.segment_backlog(SEGMENT, "s") == 0
    assert await ops.segment_backlog(SEGMENT, "missing") == 0
    await ops.remove_subscription(SEGMENT, "s")
    await ops.remove_subscription(SEGMENT, "s")
    assert await ops.segment_subscriptions(SEGMENT) == []
    await ops.create_segment(SEGMENT, ["t"])
    await ops.delete_segment(SEGMENT)
    assert await ops.segment_subscriptions(SEGMENT) == []
