"""Open transactions are bounded: per connection and per broker, NEW_TXN beyond the cap
gets TooManyRequests and nothing is written; ending one makes room again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from anabranch import limits
from anabranch.aio import Client
from anabranch.client.errors import TooManyRequests
from anabranch.client.txn_spares import SPARES_MAX
from anabranch.errors import ResourceLimitReached
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.clock import ManualClock
from anabranch.transactions.coordinator import TransactionCoordinator
from anabranch.transactions.records import TxnState


async def test_a_connection_holds_at_most_its_cap_of_open_transactions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "TXN_OPEN_PER_CONNECTION_MAX", 3)
    async with (
        InProcessBroker(tmp_path, metadata="memory") as broker,
        # A refused NEW_TXN is retried until the operation timeout: 2 s, not 30.
        Client(broker.service_url, transaction_spares=0, operation_timeout_s=2) as client,
    ):
        txns = [await client.new_transaction(timeout=60) for _ in range(3)]
        revision = await broker.service.store.current_revision()
        with pytest.raises(TooManyRequests):
            await client.new_transaction(timeout=60)
        assert await broker.service.store.current_revision() == revision
        await txns[0].commit()
        fourth = await client.new_transaction(timeout=60)  # room again
        await fourth.abort()


async def test_spares_give_back_the_slots_a_new_transaction_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "TXN_OPEN_PER_CONNECTION_MAX", 2)
    async with (
        InProcessBroker(tmp_path, metadata="memory") as broker,
        Client(broker.service_url, transaction_spares=SPARES_MAX) as client,
    ):
        coordinator = broker.service.txn_coordinator
        assert coordinator is not None
        first = await client.new_transaction(timeout=60)
        for _ in range(1000):  # hang guard: the spare for timeout=60 is opened
            if coordinator.stats()["open"] == 2:
                break
            await asyncio.sleep(0.01)
        assert coordinator.stats()["open"] == 2  # the cap, with the spare
        # No spare for 30 s: the broker refuses the NEW_TXN, the client aborts its spare
        # and asks again.
        second = await client.new_transaction(timeout=30)
        assert second.id != first.id and client._transaction_coordinator().spares_aborted == 1
        await second.commit()
        await first.commit()


async def test_the_broker_holds_at_most_its_cap_of_open_transactions(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path, metadata="memory") as broker:
        coordinator = broker.service.txn_coordinator
        assert coordinator is not None
        coordinator._max_open = 2
        async with (
            Client(broker.service_url, transaction_spares=0, operation_timeout_s=2) as one,
            Client(broker.service_url, transaction_spares=0, operation_timeout_s=2) as two,
        ):
            first = await one.new_transaction(timeout=60)
            await two.new_transaction(timeout=60)
            with pytest.raises(TooManyRequests):
                await one.new_transaction(timeout=60)
            await first.abort()
            await two.new_transaction(timeout=60)


async def test_a_role_holds_at_most_its_cap_of_open_transactions() -> None:
    """Per owner, over every connection and the batch API: one role cannot take the
    broker's whole cap; ending or expiring one makes room; no owner (authentication
    off) is bounded by the broker's cap only."""
    clock = ManualClock()
    store = MemoryMetadataStore()
    coordinator = TransactionCoordinator(
        store, clock, partitions=1, sweep_interval_s=0, max_open_per_owner=2
    )
    await coordinator.start()
    try:
        first = await coordinator.new_txn(1_000, owner="etl")
        await coordinator.new_txn(60_000, owner="etl")
        with pytest.raises(ResourceLimitReached, match="role etl"):
            await coordinator.new_txn(60_000, owner="etl")
        await coordinator.new_txn(60_000, owner="other")
        for _ in range(3):
            await coordinator.new_txn(60_000)
        await coordinator.end_txn(first, TxnState.ABORTED)
        third = await coordinator.new_txn(1_000, owner="etl")
        with pytest.raises(ResourceLimitReached):
            await coordinator.new_txn(60_000, owner="etl")
        clock.advance(2.0)  # ``third`` is past its deadline: no longer counted
        await coordinator.new_txn(60_000, owner="etl")
        assert third is not None
    finally:
        await coordinator.close()
        await store.close()
