"""A data directory an operator damaged between runs: a second broker on it, a metadata
store older than its ledger files, a damaged later ledger, an unreadable metadata file.
Each either recovers what is intact or refuses with a typed error naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from anabranch.errors import CorruptRecord, MetadataError, NotAllowed, StorageError
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.metadata.sqlite import SqliteMetadataStore
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig, Position
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.storage.segment_file import SegmentFile
from anabranch.testing.broker import InProcessBroker

TWO_PER_LEDGER = ManagedLedgerConfig(ledger_entries_max=2)


async def write_topic(data: Path, store: MemoryMetadataStore, count: int) -> None:
    factory = FileManagedLedgerFactory(data, store)
    ml = await factory.open("t", TWO_PER_LEDGER)
    for i in range(count):
        await ml.append(f"m{i}".encode())
    await ml.close()
    await factory.close()


def flip_a_byte(data: Path, index: int) -> None:
    """Flip a byte mid-file in the ``index``-th ledger file (a bad disk block)."""
    path = sorted(data.glob("*/*.log"))[index]
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))


async def test_a_second_broker_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    # It started and took every topic over, fencing the first broker's ledgers.
    async with InProcessBroker(tmp_path, metadata="sqlite"):
        with pytest.raises(NotAllowed, match="in use by another broker"):
            async with InProcessBroker(tmp_path, metadata="sqlite"):
                pass
    async with InProcessBroker(tmp_path, metadata="sqlite"):
        pass  # the lock went with the first broker


async def test_a_metadata_store_older_than_the_ledger_files_is_refused(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    # A store that lost its journal handed out ledger id 1 again: the new ledger truncated
    # the old file of that id, and the topic came back empty.
    await write_topic(tmp_path, store, 3)
    forgetful = MemoryMetadataStore()
    factory = FileManagedLedgerFactory(tmp_path, forgetful)
    try:
        with pytest.raises(StorageError, match="older than the data directory"):
            await factory.connect_at_start()
        with pytest.raises(StorageError, match="refusing to overwrite"):
            await factory.open("t", TWO_PER_LEDGER)
    finally:
        await factory.close()
        await forgetful.close()
    reopened = FileManagedLedgerFactory(tmp_path, store)
    await reopened.connect_at_start()
    ml = await reopened.open("t", TWO_PER_LEDGER)
    assert [e.data for e in await ml.read(EARLIEST, 10)] == [b"m0", b"m1", b"m2"]
    await ml.close()
    await reopened.close()


def test_a_new_ledger_never_overwrites_a_file_holding_data(tmp_path: Path) -> None:
    old = SegmentFile.create(tmp_path, 7)
    old.append_batch([b"acknowledged"], sync=True)
    old.close()
    with pytest.raises(StorageError, match="refusing to overwrite"):
        SegmentFile.create(tmp_path, 7)
    again = SegmentFile.open_existing(tmp_path, 7)
    assert again.recover() == (1, len(b"acknowledged"))
    again.close()


async def test_a_damaged_later_ledger_does_not_hide_the_intact_ones_before_it(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    # A read spanning ledgers 1 and 2 failed as a whole: consumers of ledger 1 got nothing.
    await write_topic(tmp_path, store, 4)
    flip_a_byte(tmp_path, 1)
    factory = FileManagedLedgerFactory(tmp_path, store)
    ml = await factory.open("t", TWO_PER_LEDGER)
    try:
        got = await ml.read(EARLIEST, 10)
        assert [e.data for e in got] == [b"m0", b"m1"]
        with pytest.raises(CorruptRecord):
            await ml.read(Position(got[-1].position[0] + 1, 0), 10)
    finally:
        await ml.close()
        await factory.close()


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
async def test_an_unusable_metadata_file_is_a_typed_error(tmp_path: Path, damage: str) -> None:
    # sqlite3's own errors escaped: the CLI printed a traceback, not one line.
    db = tmp_path / "metadata.db"
    made = await SqliteMetadataStore.open(db)
    await made.put("/k", b"v")
    await made.close()
    if damage == "truncated":
        with db.open("r+b") as f:
            f.truncate(100)
    else:
        db.write_bytes(b"not a database" * 100)
    with pytest.raises(MetadataError, match="cannot open metadata store"):
        await SqliteMetadataStore.open(db)
