"""Fixtures shared by the storage tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from anabranch.metadata.memory import MemoryMetadataStore


@pytest.fixture
async def store() -> AsyncIterator[MemoryMetadataStore]:
    """A fresh in-memory metadata store for ledgers' records, closed after the test."""
    made = MemoryMetadataStore()
    try:
        yield made
    finally:
        await made.close()
