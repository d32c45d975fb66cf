"""Fixtures for the scalable-topic tests: metadata stores (memory, SQLite, a real etcd),
managed ledgers in memory, and the segment ops over them.

The etcd server is started once per module and stopped in ``finally``; each test gets
its own key namespace on it. A missing etcd binary is a failure, never a skip.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from anabranch.metadata.api import MetadataStore
from anabranch.scalable.segment_ops import StorageSegmentOps
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.etcd import EtcdServer

_namespaces = itertools.count()

EVENTUALLY_ROUNDS = 5_000
"""Polls of a condition that background tasks make true (10 ms apart on a real store)."""


async def eventually(condition: Callable[[], bool], what: str) -> None:
    """Wait for ``condition`` while background tasks run; fail with ``what`` if it never
    holds."""
    for _ in range(EVENTUALLY_ROUNDS):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer.start(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["memory", "sqlite", "etcd"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[MetadataStore]:
    backend: MetadataStore
    if request.param == "memory":
        from anabranch.metadata.memory import MemoryMetadataStore

        backend = MemoryMetadataStore()
    elif request.param == "sqlite":
        from anabranch.metadata.sqlite import SqliteMetadataStore

        backend = await SqliteMetadataStore.open(tmp_path / "meta.db")
    else:
        from anabranch.metadata.etcd import EtcdMetadataStore

        server: EtcdServer = request.getfixturevalue("etcd_server")
        backend = await EtcdMetadataStore.open(
            server.endpoint, namespace=f"/scalable-{next(_namespaces)}"
        )
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture
async def memory_store() -> AsyncIterator[MetadataStore]:
    from anabranch.metadata.memory import MemoryMetadataStore

    backend = MemoryMetadataStore()
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture
async def ledgers() -> AsyncIterator[MemoryManagedLedgerFactory]:
    factory = MemoryManagedLedgerFactory()
    try:
        yield factory
    finally:
        await factory.close()


@pytest.fixture
async def ops(ledgers: MemoryManagedLedgerFactory) -> AsyncIterator[StorageSegmentOps]:
    segment_ops = StorageSegmentOps(ledgers)
    try:
        yield segment_ops
    finally:
        await segment_ops.close()
