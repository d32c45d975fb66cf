"""The S3 adapter, the offloaded-ledger format and file-ledger offload against real SeaweedFS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.core.retention import Retention
from anabranch.errors import (
    AlreadyExists,
    CorruptRecord,
    NotFound,
    ObjectStoreAccessDenied,
    StorageIOError,
)
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.storage.object_store import S3ObjectStore
from anabranch.storage.offload_format import decode_index, encode_ledger, index_length
from anabranch.storage.tiered import TieredStorage
from anabranch.testing.seaweedfs import SeaweedS3
from tests.tiered.conftest import settings_of


@given(st.integers(0, 2**40), st.lists(st.binary(max_size=64), max_size=20), st.data())
def test_format_round_trip(ledger_id: int, payloads: list[bytes], data: st.DataObject) -> None:
    blob = encode_ledger(ledger_id, payloads)
    index = decode_index(blob[: index_length(len(payloads))], ledger_id, len(payloads))
    assert index.entries == len(payloads)
    if payloads:
        first = data.draw(st.integers(0, len(payloads) - 1))
        count = data.draw(st.integers(1, len(payloads) - first))
        start, end = index.span(first, count)
        assert index.split(first, count, blob[start:end]) == payloads[first : first + count]


def test_format_detects_damage() -> None:
    blob = bytearray(encode_ledger(3, [b"hello", b"world"]))
    with pytest.raises(CorruptRecord):
        decode_index(bytes(blob[: index_length(2)]), 4, 2)  # another ledger's object
    index = decode_index(bytes(blob[: index_length(2)]), 3, 2)
    blob[-1] ^= 0xFF
    start, end = index.span(0, 2)
    with pytest.raises(CorruptRecord):
        index.split(0, 2, bytes(blob[start:end]))
    head = bytearray(blob[: index_length(2)])
    head[30] ^= 1
    with pytest.raises(CorruptRecord):
        decode_index(bytes(head), 3, 2)


async def test_adapter_create_only_ranged_get_delete(seaweed: SeaweedS3) -> None:
    store = S3ObjectStore(settings_of(seaweed))
    await store.check()
    await store.put_new("adapter/a", b"0123456789")
    with pytest.raises(AlreadyExists):
        await store.put_new("adapter/a", b"other")  # If-None-Match: * refuses an overwrite
    assert await store.get_range("adapter/a", 2, 5) == b"234"
    assert await store.size("adapter/a") == 10
    await store.delete("adapter/a")
    await store.delete("adapter/a")  # deletes are idempotent
    with pytest.raises(NotFound):
        await store.get_range("adapter/a", 0, 1)


async def test_wrong_credentials_is_a_clear_error(seaweed: SeaweedS3) -> None:
    store = S3ObjectStore(settings_of(seaweed, secret="not-the-secret"))
    with pytest.raises(ObjectStoreAccessDenied) as caught:
        await store.check()
    assert "s3_secret_access_key" in str(caught.value)
    assert seaweed.endpoint not in str(caught.value)
    with pytest.raises(ObjectStoreAccessDenied):
        await store.put_new("denied/a", b"x")


@pytest.fixture
async def store() -> AsyncIterator[MemoryMetadataStore]:
    s = MemoryMetadataStore()
    yield s
    await s.close()


async def test_file_ledger_offload_then_read_from_s3(
    tmp_path: Path, store: MemoryMetadataStore, seaweed: SeaweedS3
) -> None:
    tiered = TieredStorage(S3ObjectStore(settings_of(seaweed)), read_ahead_bytes=64)
    factory = FileManagedLedgerFactory(tmp_path, store)
    factory.tiered = tiered
    config = ManagedLedgerConfig(ledger_entries_max=10)
    ml = await factory.open("t/ns/persistent/off", config)
    written = [await ml.append(f"m{i}".encode() * 10) for i in range(35)]
    sealed = [info for info in ml.ledgers if info.closed_ms is not None]
    assert len(sealed) == 3
    for info in sealed:
        assert await ml.offload_ledger(info.ledger_id, deletion_lag_ms=0)
        assert not await ml.offload_ledger(info.ledger_id, deletion_lag_ms=0)  # done already
        assert await ml.delete_offloaded_hot(info.ledger_id)
    open_ledger = ml.ledgers[-1].ledger_id
    hot_files = await asyncio.to_thread(lambda: sorted(p.name for p in tmp_path.glob("*/*.log")))
    assert hot_files == [f"{open_ledger:020d}.log"]
    entries = await ml.read(EARLIEST, 100)
    assert [e.position for e in entries] == written
    assert [e.data for e in entries] == [f"m{i}".encode() * 10 for i in range(35)]
    one = await ml.read(written[13], 1)
    assert one[0].data == b"m13" * 10
    await ml.close()
    await factory.close()

    # A restarted broker (a new factory) reads the offloaded ledgers back from S3 too.
    again = FileManagedLedgerFactory(tmp_path, store)
    again.tiered = TieredStorage(S3ObjectStore(settings_of(seaweed)))
    reopened = await again.open("t/ns/persistent/off", config)
    assert [e.data for e in await reopened.read(EARLIEST, 100)][:35] == [
        f"m{i}".encode() * 10 for i in range(35)
    ]
    assert sum(1 for i in reopened.ledgers if not i.hot) == 3
    await reopened.close()
    await again.close()

    # Without an offload driver, reading an offloaded ledger is a clear error.
    bare = FileManagedLedgerFactory(tmp_path, store)
    ml3 = await bare.open("t/ns/persistent/off", config)
    with pytest.raises(StorageIOError, match="no offload driver"):
        await ml3.read(EARLIEST, 10)
    await ml3.close()
    await bare.close()


async def test_trim_deletes_offloaded_objects(
    tmp_path: Path, store: MemoryMetadataStore, seaweed: SeaweedS3
) -> None:
    s3 = S3ObjectStore(settings_of(seaweed))
    factory = FileManagedLedgerFactory(tmp_path, store)
    factory.tiered = TieredStorage(s3)
    ml = await factory.open("t/ns/persistent/trimmed", ManagedLedgerConfig(ledger_entries_max=10))
    cursor = await ml.open_cursor("sub", EARLIEST)
    positions = [await ml.append(b"t%d" % i) for i in range(25)]
    keys = []
    for info in [i for i in ml.ledgers if i.closed_ms is not None]:
        assert await ml.offload_ledger(info.ledger_id, deletion_lag_ms=0)
    for info in ml.ledgers:
        if info.offload is not None:
            keys.append(info.offload.key)
            assert await s3.size(info.offload.key) > 0
    assert len(keys) == 2
    await cursor.acknowledge_cumulative(positions[-1])
    ml.set_retention(Retention(0, 0))
    assert await ml.trim() == 2
    for key in keys:
        with pytest.raises(NotFound):
            await s3.size(key)
    await ml.close()
    await factory.close()


async def test_cold_read_rides_out_a_short_s3_outage(
    tmp_path: Path, store: MemoryMetadataStore, seaweed: SeaweedS3
) -> None:
    """Last in the module: it stops the shared server (and starts it again)."""
    factory = FileManagedLedgerFactory(tmp_path, store)
    factory.tiered = TieredStorage(S3ObjectStore(settings_of(seaweed)))
    config = ManagedLedgerConfig(ledger_entries_max=10)
    ml = await factory.open("t/ns/persistent/outage", config)
    expected = [b"o%d" % i for i in range(15)]
    for data in expected:
        await ml.append(data)
    sealed = ml.ledgers[0]
    assert await ml.offload_ledger(sealed.ledger_id, deletion_lag_ms=0)
    assert await ml.delete_offloaded_hot(sealed.ledger_id)
    await ml.close()
    await factory.close()

    again = FileManagedLedgerFactory(tmp_path, store)
    again.tiered = TieredStorage(S3ObjectStore(settings_of(seaweed)), read_retry_s=30.0)
    reopened = await again.open("t/ns/persistent/outage", config)
    await asyncio.to_thread(seaweed.stop)
    restart = asyncio.create_task(asyncio.to_thread(seaweed.start_again))
    try:
        entries = await reopened.read(EARLIEST, 100)  # retried until S3 is back
    finally:
        await restart
    assert [e.data for e in entries] == expected
    await reopened.close()
    await again.close()
