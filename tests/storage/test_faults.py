"""Disk faults through the faulty file, fencing between owners, corruption on reopen."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from anabranch.errors import CorruptRecord, LedgerFenced, StorageIOError
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.storage.record_format import encode
from anabranch.testing.faulty_file import FaultPlan, FaultyOpener

CONFIG = ManagedLedgerConfig(ledger_entries_max=1000)


def ledger_files(data: Path) -> list[Path]:
    return sorted(data.glob("*/*.log"))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("where", ["write", "sync", "partial-write"])
async def test_disk_fault_fails_append_until_reopen(
    tmp_path: Path, store: MemoryMetadataStore, code: int, where: str
) -> None:
    # Creating the ledger file syncs once (sync call 1); appends are one write + one sync
    # each, so the 4th append hits write call 4 / sync call 5.
    plan = FaultPlan(errno_code=code, partial=where == "partial-write")
    if where == "sync":
        plan.fail_sync_calls = {5}
    else:
        plan.fail_write_calls = {4}
    faulty = FileManagedLedgerFactory(tmp_path, store, opener=FaultyOpener(plan))
    ml = await faulty.open("t", CONFIG)
    acked = [await ml.append(f"ok{i}".encode()) for i in range(3)]
    with pytest.raises(StorageIOError):
        await ml.append(b"doomed")
    assert plan.failures == 1
    assert ml.last_confirmed == acked[-1]  # nothing un-durable was acknowledged
    for _ in range(2):  # the ledger no longer trusts its file, even though the disk is back
        with pytest.raises(StorageIOError):
            await ml.append(b"later")
    assert [e.position for e in await ml.read(EARLIEST, 100)] == acked
    await ml.close()
    await faulty.close()

    healthy = FileManagedLedgerFactory(tmp_path, store)
    reopened = await healthy.open("t", CONFIG)
    entries = await reopened.read(EARLIEST, 100)
    assert [e.position for e in entries[:3]] == acked
    assert [e.data for e in entries[:3]] == [b"ok0", b"ok1", b"ok2"]
    # The failed entry's outcome is unknown (it may have reached the file), nothing else.
    assert [e.data for e in entries[3:]] in ([], [b"doomed"])
    if where == "partial-write":
        assert len(entries) == 3  # the half-written record was a torn tail: truncated
    new = await reopened.append(b"after")
    assert (await reopened.read(new))[0].data == b"after"
    await healthy.close()


async def test_second_opener_fences_first(tmp_path: Path, store: MemoryMetadataStore) -> None:
    first = await FileManagedLedgerFactory(tmp_path, store).open("t", CONFIG)
    acked = await first.append(b"by first")
    cursor = await first.open_cursor("sub", EARLIEST)
    second_factory = FileManagedLedgerFactory(tmp_path, store)
    second = await second_factory.open("t", CONFIG)
    with pytest.raises(LedgerFenced):
        await first.append(b"after takeover")
    with pytest.raises(LedgerFenced):  # later appends too, without touching the disk
        await first.append(b"again")
    with pytest.raises(LedgerFenced):
        await cursor.acknowledge_cumulative(acked)
        await cursor.flush()
    entries = await second.read(EARLIEST, 10)
    assert [e.data for e in entries] == [b"by first"]
    assert (await second.append(b"by second")) > acked
    await first.close()
    await second_factory.close()


async def test_torn_tail_truncated_on_recovery(tmp_path: Path, store: MemoryMetadataStore) -> None:
    factory = FileManagedLedgerFactory(tmp_path, store)
    ml = await factory.open("t", CONFIG)
    acked = [await ml.append(f"e{i}".encode()) for i in range(5)]
    # Simulate a crash mid-write: half a record at the end of the open ledger's file.
    [path] = ledger_files(tmp_path)
    with path.open("ab") as f:
        f.write(encode(b"never acknowledged")[:7])
    size_with_tail = path.stat().st_size
    reopened = await FileManagedLedgerFactory(tmp_path, store).open("t", CONFIG)
    assert [e.position for e in await reopened.read(EARLIEST, 100)] == acked
    assert path.stat().st_size == size_with_tail - 7
    await reopened.append(b"next")
    entries = await reopened.read(EARLIEST, 100)
    assert [e.data for e in entries] == [b"e0", b"e1", b"e2", b"e3", b"e4", b"next"]
    await ml.close()


async def test_corrupt_middle_record_refused(tmp_path: Path, store: MemoryMetadataStore) -> None:
    factory = FileManagedLedgerFactory(tmp_path, store)
    ml = await factory.open("t", CONFIG)
    for i in range(5):
        await ml.append(f"entry-{i}".encode())
    await ml.close()
    [path] = ledger_files(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[8 + 3] ^= 0x40  # inside the first record's payload
    path.write_bytes(bytes(raw))
    # Recovering the open ledger finds damage before the tail: refuse to open.
    with pytest.raises(CorruptRecord):
        await FileManagedLedgerFactory(tmp_path, store).open("t", CONFIG)


async def test_corrupt_closed_ledger_never_served(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    factory = FileManagedLedgerFactory(tmp_path, store)
    ml = await factory.open("t", CONFIG)
    for i in range(5):
        await ml.append(f"entry-{i}".encode())
    await ml.close()
    ml = await FileManagedLedgerFactory(tmp_path, store).open("t", CONFIG)  # closes ledger 1
    await ml.close()
    [path] = ledger_files(tmp_path)[:1]
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0x01  # the last acknowledged record of a closed ledger
    path.write_bytes(bytes(raw))
    reader = await FileManagedLedgerFactory(tmp_path, store).open("t", CONFIG)
    with pytest.raises(CorruptRecord):
        await reader.read(EARLIEST, 100)
    await reader.close()


async def test_append_backpressure_keeps_call_order(
    tmp_path: Path, store: MemoryMetadataStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from anabranch import limits

    monkeypatch.setattr(limits, "STORAGE_APPEND_QUEUE_ENTRIES_MAX", 4)
    factory = FileManagedLedgerFactory(tmp_path, store)
    ml = await factory.open("t", ManagedLedgerConfig(ledger_entries_max=7))
    import asyncio

    positions = await asyncio.gather(*(ml.append(str(i).encode()) for i in range(300)))
    assert positions == sorted(positions) and len(set(positions)) == 300
    assert [e.data for e in await ml.read(EARLIEST, 1000)] == [str(i).encode() for i in range(300)]
    await factory.close()
