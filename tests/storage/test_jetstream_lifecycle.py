"""The JetStream ledger factory as a broker uses it: connecting at start (NATS down,
wrong credentials) and a ledger whose stream was deleted behind its back (fenced on
reopen, then cleared by ``delete_lost``). Real single-node NATS servers, one per test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from anabranch.errors import LedgerFenced, StorageIOError
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig
from anabranch.storage.jetstream_client import NatsAuthError
from anabranch.storage.jetstream_ledger import JetStreamManagedLedgerFactory
from anabranch.testing.nats import NatsCluster, NatsNode, find_nats_binary

BIG = ManagedLedgerConfig(ledger_entries_max=100_000)
OPEN_GUARD_S = 60.0
"""Hang guard on an open that waits for NATS to come up."""


async def test_nats_down_at_start_then_up(tmp_path: Path, store: MemoryMetadataStore) -> None:
    node = NatsNode("n1", tmp_path / "n1", find_nats_binary(), peers=1)
    node.write_config([])
    factory = JetStreamManagedLedgerFactory([node.url], store, replicas=1)
    factory.start_connect_timeout_s = 0.5
    factory.unavailable_wait_s = 0.5
    try:
        await factory.connect_at_start()  # no error: it keeps trying in the background
        with pytest.raises(StorageIOError, match="unreachable; retrying in the background") as err:
            await factory.open("t", BIG)
        assert err.value.retriable
        node.launch()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + OPEN_GUARD_S
        while True:
            try:
                ml = await factory.open("t", BIG)
                break
            except StorageIOError:
                assert loop.time() < deadline, "no connection after NATS came up"
        assert (await ml.append(b"x")).entry_id == 0
    finally:
        await factory.close()
        node.kill()


async def test_wrong_credentials_fail_at_start(tmp_path: Path, store: MemoryMetadataStore) -> None:
    cluster = NatsCluster.start(tmp_path / "nats", nodes=1, auth=("broker", "s3cret"))
    factory = JetStreamManagedLedgerFactory(
        cluster.urls, store, replicas=1, user="broker", password="wrong"
    )
    try:
        with pytest.raises(NatsAuthError, match="refused our credentials") as caught:
            await factory.connect_at_start()
        assert "wrong" not in str(caught.value)
    finally:
        await factory.close()
        cluster.stop()


async def test_a_deleted_stream_is_fenced_on_reopen_and_cleared_by_delete_lost(
    tmp_path: Path, store: MemoryMetadataStore
) -> None:
    cluster = NatsCluster.start(tmp_path / "nats", nodes=1)
    factory = JetStreamManagedLedgerFactory(cluster.urls, store, replicas=1)
    try:
        ml = await factory.open("t", BIG)
        await ml.append(b"history")
        cursor = await ml.open_cursor("sub", EARLIEST)
        await cursor.flush()
        await ml.close()
        assert not await factory.delete_lost("t")  # the stream is there: nothing deleted
        client = await factory.client()
        await client.delete_stream(ml.stream)
        with pytest.raises(LedgerFenced, match="deleted behind our back"):
            await factory.open("t", BIG)
        assert await factory.delete_lost("t")
        assert (await store.list_prefix("/js-managed-ledgers/")).records == []
        fresh = await factory.open("t", BIG)  # the name starts afresh, empty
        assert fresh.entry_count == 0 and list(fresh.cursors()) == []
        assert (await fresh.append(b"new")).entry_id == 0
    finally:
        await factory.close()
        cluster.stop()
