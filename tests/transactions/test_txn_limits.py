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
from anabranch.testing.broker import InProcessBroker


async def test_a_connection_holds_at_most_its_cap_of_open_transactions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "TXN_OPEN_PER_CONNECTION_MAX", 3)
    async with (
        InProcessBroker(tmp_path, metadata="memory") as broker,
        Client(broker.service_url, transaction_spares=0) as client,
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
            Client(broker.service_url, transaction_spares=0) as one,
            Client(broker.service_url, transaction_spares=0) as two,
        ):
            first = await one.new_transaction(timeout=60)
            await two.new_transaction(timeout=60)
            with pytest.raises(TooManyRequests):
                await one.new_transaction(timeout=60)
            await first.abort()
            await two.new_transaction(timeout=60)
