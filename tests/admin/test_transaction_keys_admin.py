"""Transaction-key admin endpoints, CLI and ``anabranch_txn_transaction_key_*`` metrics
against a real broker (the key PIP's admin API and metrics)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import anabranch
from anabranch.admin.client import AdminClient
from anabranch.aio import Client
from anabranch.testing.broker import InProcessBroker
from anabranch.transactions.records import TxnState
from tests.admin.test_transactions_admin import (
    V2,
    V3,
    ThreadBroker,
    cli,
    cli_json,
    samples,
    status_of,
    value,
)

KEYS = "/transaction-keys"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    async with InProcessBroker(tmp_path, ledgers="memory") as b:
        yield b


@pytest.fixture
async def admin(broker: InProcessBroker) -> AsyncIterator[AdminClient]:
    assert broker.http_url is not None
    async with AdminClient(broker.http_url) as client:
        yield client


async def test_list_get_delete_and_metrics(broker: InProcessBroker, admin: AdminClient) -> None:
    before = samples(await admin.metrics())
    assert value(before, "anabranch_txn_transaction_key_count") == 0
    assert await admin.list_transaction_keys() == []
    holder = Client(broker.service_url, transaction_key="etl-7")
    other = Client(broker.service_url, transaction_key="other")
    successor = Client(broker.service_url, transaction_key="etl-7")
    try:
        txn = await holder.new_transaction(timeout=60)
        await other.claim_transaction_key()
        listed = await admin.list_transaction_keys()
        assert [(k["owner"], k["transactionKey"], k["epoch"]) for k in listed] == [
            ("", "etl-7", 0),
            ("", "other", 0),
        ]
        info = await admin.get_transaction_key("etl-7")
        assert info["txnId"] == str(txn.id) and info["txnStatus"] == "OPEN"
        assert info["connections"] == 1 and info["ageMs"] >= 0
        # The v3 prefix serves the same, and the key is a path segment.
        assert (await admin.request("GET", f"{V3}{KEYS}/etl-7"))["epoch"] == 0

        # A second holder bumps the epoch: the metrics follow (the key watch feeds them).
        await successor.claim_transaction_key()
        keys = broker.service.txn_keys
        assert keys is not None
        for _ in range(200):
            if any(r.key == "etl-7" and r.epoch == 1 for r in keys.known()):
                break
            await asyncio.sleep(0.01)
        found = samples(await admin.metrics())
        assert value(found, "anabranch_txn_transaction_key_count") == 2
        assert value(found, "anabranch_txn_transaction_key_epoch",
                     owner="", transaction_key="etl-7") == 1  # fmt: skip
        assert value(found, "anabranch_txn_transaction_key_age_seconds",
                     owner="", transaction_key="other") >= 0  # fmt: skip

        deleted = await admin.delete_transaction_key("other")
        assert deleted["transactionKey"] == "other" and deleted["epoch"] == 0
        assert await status_of(admin.get_transaction_key("other")) == 404
        assert await status_of(admin.delete_transaction_key("other")) == 404
        assert await status_of(admin.get_transaction_key("a&b")) == 400
        assert await status_of(admin.get_transaction_key("etl-7", owner="alice")) == 404
        with pytest.raises(anabranch.ExpiredTransactionError):
            await txn.commit()
    finally:
        for client in (holder, other, successor):
            await client.close()


async def test_delete_aborts_and_fences_the_holder(
    broker: InProcessBroker, admin: AdminClient
) -> None:
    holder = Client(broker.service_url, transaction_key="job")
    try:
        txn = await holder.new_transaction(timeout=60)
        await admin.request("DELETE", f"{V2}{KEYS}/job")
        tc = broker.service.txn_coordinator
        assert tc is not None
        header = await tc.get(txn.id)
        assert header is not None and header.state is TxnState.ABORTED
        with pytest.raises(anabranch.ExpiredTransactionError, match="fenced"):
            await txn.commit()
        with pytest.raises(anabranch.ExpiredTransactionError):
            await holder.new_transaction(timeout=60)
        # A new client claims the key again, above the deleted epoch.
        fresh = Client(broker.service_url, transaction_key="job")
        try:
            assert await fresh.claim_transaction_key() == 1
        finally:
            await fresh.close()
    finally:
        await holder.close()


@pytest.fixture
def threaded(tmp_path: Path) -> Iterator[ThreadBroker]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = InProcessBroker(tmp_path, ledgers="memory")
    try:
        asyncio.run_coroutine_threadsafe(broker.__aenter__(), loop).result()
        yield ThreadBroker(broker, loop)
        asyncio.run_coroutine_threadsafe(broker.__aexit__(None, None, None), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_cli(threaded: ThreadBroker) -> None:
    url = threaded.broker.http_url
    assert url is not None
    with anabranch.Client(threaded.broker.service_url, transaction_key="etl-7") as client:
        txn = client.new_transaction(timeout=60)
        listed = cli_json(url, "list-transaction-keys")
        assert [(k["transactionKey"], k["epoch"]) for k in listed] == [("etl-7", 0)]
        assert "etl-7" in cli(url, "list-transaction-keys")
        got = cli_json(url, "get-transaction-key", "etl-7")
        assert got["txnId"] == str(txn.id) and got["txnStatus"] == "OPEN"
        assert "etl-7" in cli(url, "get-transaction-key", "etl-7")
        cli(url, "get-transaction-key", "nope", code=1)
        cli(url, "get-transaction-key", "etl-7", "--owner", "alice", code=1)
        assert cli_json(url, "delete-transaction-key", "etl-7")["epoch"] == 0
        assert cli_json(url, "list-transaction-keys") == []
        cli(url, "delete-transaction-key", "etl-7", code=1)
