"""Fixtures for the scalable-topic tests: metadata stores (memory, SQLite, a real etcd),
managed ledgers in memory, and the segment ops over them.

The etcd server is started once per module and stopped in ``finally``; each test gets
its own key namespace on it. A missing etcd binary is a failure, never a skip.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from anabranch.metadata.api import MetadataStore
from anabranch.scalable.segment_ops import StorageSegmentOps
from anabranch.storage.memory import MemoryManagedLedgerFactory
from tests.metadata_backends import etcd_server, store

__all__ = ["etcd_server", "store"]  # pytest fixtures, shared with other suites

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
