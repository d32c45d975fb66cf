"""The transaction sweep's leadership loop while etcd is out of reach: opening its
session (or campaigning, or resigning) fails with ``MetadataUnavailable`` for as long as
etcd answers nothing. Expected and retried; a fault driver pausing etcd past the session
TTL found each attempt logged as an ERROR with a traceback."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from anabranch.clock import SystemClock
from anabranch.metadata.api import MetadataStore
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.transactions.coordinator import TransactionCoordinator
from tests.transactions.test_store_blips import Unreachable, errors, until_failed


class NoSessions(Unreachable):
    """A store that cannot open a session while it is down."""

    async def open_session(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            self._fail()
        return await self._store.open_session(*args, **kwargs)


async def test_the_sweep_leadership_waits_out_an_unreachable_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = NoSessions(MemoryMetadataStore())
    store.down = True
    coordinator = TransactionCoordinator(cast(MetadataStore, store), SystemClock(), partitions=1)
    with caplog.at_level(logging.WARNING, logger="anabranch.transactions"):
        loop = asyncio.create_task(coordinator._sweep_leader_loop())
        try:
            await until_failed(store)  # three attempts, 0.5 s apart
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
    assert not errors(caplog)
    assert any("deferred" in r.getMessage() for r in caplog.records)
