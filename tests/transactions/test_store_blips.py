"""The transaction loops that poll the metadata store while etcd is out of reach.

A paused or failing-over etcd answers nothing for seconds: every periodic pass then fails
with ``MetadataUnavailable``. That is expected and retried on the next tick; the fault
driver saw each pass logged as an ERROR with a traceback instead.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from anabranch.clock import SystemClock
from anabranch.errors import MetadataUnavailable
from anabranch.metadata.api import MetadataStore
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.transactions.coordinator import TransactionCoordinator
from anabranch.transactions.outcomes import TxnOutcomes

PASSES = 3
ROUNDS = 2_000
INTERVAL_S = 0.01


class Unreachable:
    """A store whose reads fail like an etcd that does not answer (the rest delegated)."""

    def __init__(self, store: MemoryMetadataStore) -> None:
        self._store = store
        self.down = False
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _fail(self) -> None:
        self.failed += 1
        raise MetadataUnavailable("etcd at 127.0.0.1:2379: Deadline Exceeded")

    async def current_revision(self) -> int:
        if self.down:
            self._fail()
        return await self._store.current_revision()

    async def list_range(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            self._fail()
        return await self._store.list_range(*args, **kwargs)


async def until_failed(store: Unreachable) -> None:
    for _ in range(ROUNDS):
        if store.failed >= PASSES:
            return
        await asyncio.sleep(INTERVAL_S)
    raise AssertionError(f"only {store.failed} passes hit the store")


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_outcome_re_read_waits_out_an_unreachable_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Unreachable(MemoryMetadataStore())
    outcomes = TxnOutcomes(
        cast(MetadataStore, store), SystemClock(), reconcile_interval_s=INTERVAL_S
    )
    await outcomes.start()
    try:
        with caplog.at_level(logging.WARNING, logger="anabranch.transactions"):
            store.down = True
            await until_failed(store)
            store.down = False
            reconciles = outcomes.reconciles
            for _ in range(ROUNDS):
                if outcomes.reconciles > reconciles:
                    break
                await asyncio.sleep(INTERVAL_S)
    finally:
        await outcomes.close()
    assert outcomes.reconciles > reconciles
    assert not errors(caplog)
    assert any("deferred" in r.getMessage() for r in caplog.records)


async def test_the_timeout_sweep_waits_out_an_unreachable_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Unreachable(MemoryMetadataStore())
    store.down = True
    coordinator = TransactionCoordinator(
        cast(MetadataStore, store), SystemClock(), partitions=1, sweep_interval_s=INTERVAL_S
    )
    with caplog.at_level(logging.WARNING, logger="anabranch.transactions"):
        sweeps = asyncio.create_task(coordinator._run_sweeps())
        try:
            await until_failed(store)
        finally:
            sweeps.cancel()
            await asyncio.gather(sweeps, return_exceptions=True)
    assert not errors(caplog)
    assert any("deferred" in r.getMessage() for r in caplog.records)
