"""Chunk groups in the compactor: a chunked message still being written at the horizon
moves the horizon back before its first chunk; one abandoned long ago does not; a resend
that restarts a message keeps the new chunks."""

from __future__ import annotations

from anabranch.broker.compaction_messages import CHUNKED_MESSAGE_ENTRIES_MAX, ChunkGroups
from anabranch.broker.dispatcher_entries import Chunk
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import encode_entry
from anabranch.storage.api import Entry, Position
from anabranch.storage.memory import MemoryManagedLedgerFactory


def chunk_entry(position: Position, key: str = "k") -> Entry:
    md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=0, partition_key=key)
    return Entry(position, encode_entry(md, b"part"))


async def test_an_unfinished_message_holds_the_horizon_back() -> None:
    ledger = await MemoryManagedLedgerFactory().open("t")
    positions = await ledger.append_many([b"x"] * 20)
    groups = ChunkGroups()
    groups.add(chunk_entry(positions[15]), Chunk("p/a", 0, 3))
    groups.add(chunk_entry(positions[17]), Chunk("p/a", 1, 3))
    horizon = positions[-1]
    held = groups.unfinished_before(horizon, ledger)
    assert held == Position(positions[15][0], positions[15][1] - 1)
    assert held == positions[14]  # everything before the first chunk is compacted


async def test_an_abandoned_message_does_not_hold_it_back() -> None:
    ledger = await MemoryManagedLedgerFactory().open("t")
    positions = await ledger.append_many([b"x"] * (CHUNKED_MESSAGE_ENTRIES_MAX + 5))
    groups = ChunkGroups()
    groups.add(chunk_entry(positions[0]), Chunk("p/a", 0, 3))  # its producer died
    assert groups.unfinished_before(positions[-1], ledger) is None


def test_a_restarted_message_keeps_the_new_chunks() -> None:
    groups = ChunkGroups()
    groups.add(chunk_entry(Position(1, 0)), Chunk("p/a", 0, 2))
    groups.add(chunk_entry(Position(1, 1)), Chunk("p/a", 0, 2))  # resent from the start
    done = groups.add(chunk_entry(Position(1, 2)), Chunk("p/a", 1, 2))
    assert [m.position for m in done] == [Position(1, 2)] and done[0].key == b"k"
    keep = groups.with_earlier_chunks({(1, 2): frozenset({0})})
    assert set(keep) == {(1, 1), (1, 2)}


def test_a_message_whose_start_is_gone_is_dropped() -> None:
    groups = ChunkGroups()
    assert groups.add(chunk_entry(Position(2, 0)), Chunk("p/b", 1, 2)) == []
    assert groups.add(chunk_entry(Position(2, 1)), Chunk("p/b", 2, 3)) == []
    assert groups.with_earlier_chunks({}) == {}
