"""A terminate in progress is not a seal: an append meanwhile gets a retriable Closed
(a producer resends in order), and a terminate that fails leaves the ledger writable.
Told "sealed" instead, a scalable producer re-routed that one message while the ledger
stored the later ones (the fault harness saw a key out of order)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from anabranch.errors import Closed, LedgerSealed, MetadataUnavailable
from anabranch.metadata.api import CommitResult
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.ledger import FileManagedLedgerFactory


class GatedStore(MemoryMetadataStore):
    """Once armed, the next commit waits for ``gate`` and then fails."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def commit(self, ops: Sequence[Any]) -> CommitResult:
        if self.armed:
            self.armed = False
            self.entered.set()
            await self.gate.wait()
            raise MetadataUnavailable("etcd did not answer in time")
        return await super().commit(ops)


async def test_an_append_during_a_terminate_is_retriable_and_a_failed_one_seals_nothing(
    tmp_path: Path,
) -> None:
    store = GatedStore()
    factory = FileManagedLedgerFactory(tmp_path / "data", store)
    ml = await factory.open("t")
    first = await ml.append(b"a")
    store.armed = True
    terminating = asyncio.create_task(ml.terminate())
    await store.entered.wait()
    with pytest.raises(Closed):
        await ml.append(b"during")
    assert not ml.is_terminated
    store.gate.set()
    with pytest.raises(MetadataUnavailable):
        await terminating
    after = await ml.append(b"after")  # the failed terminate sealed nothing
    assert after > first and not ml.is_terminated
    assert await ml.terminate() == after
    with pytest.raises(LedgerSealed):
        await ml.append(b"sealed")
    await ml.close()
    await factory.close()
