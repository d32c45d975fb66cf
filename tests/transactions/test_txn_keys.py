"""Transaction keys with epoch fencing at the coordinator level, on every metadata backend
(memory, SQLite, etcd): two ``TransactionKeys`` on one store stand for two brokers.

Sessions are stand-ins with a ``close()`` that records it (the broker's session closes
the socket there).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from anabranch import limits
from anabranch.errors import InvalidArgument, NotFound, TransactionKeyFenced
from anabranch.metadata.api import MetadataStore
from anabranch.testing.clock import ManualClock
from anabranch.transactions.coordinator import TransactionCoordinator
from anabranch.transactions.keys import (
    DELETED,
    KEYS,
    Binding,
    TransactionKeys,
    decode_key_record,
    key_path,
)
from anabranch.transactions.records import TxnState

RACE_ROUNDS = 50
TIMEOUT_MS = 60_000


class FakeSession:
    """What ``TransactionKeys`` needs of a broker session."""

    def __init__(self) -> None:
        self.closed = False
        self.txn_key_binding: Binding | None = None

    def close(self) -> None:
        self.closed = True


@pytest.fixture
async def tc(store: MetadataStore) -> AsyncIterator[TransactionCoordinator]:
    coordinator = TransactionCoordinator(store, ManualClock(), partitions=2, sweep_interval_s=0)
    await coordinator.start()
    yield coordinator
    await coordinator.close()


@pytest.fixture
async def keys(store: MetadataStore, tc: TransactionCoordinator) -> AsyncIterator[TransactionKeys]:
    k = TransactionKeys(store, ManualClock(), tc)
    await k.start()
    yield k
    await k.close()


async def eventually(check: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def fenced(call: Awaitable[object]) -> str:
    with pytest.raises(TransactionKeyFenced) as info:
        await call
    assert "fenced" in str(info.value)
    return str(info.value)


async def test_a_new_connection_fences_the_old(
    keys: TransactionKeys, tc: TransactionCoordinator, store: MetadataStore
) -> None:
    old_session, new_session = FakeSession(), FakeSession()
    old = await keys.connect(old_session, "", "etl-7", -1)
    assert old.epoch == 0
    txn = await keys.new_txn(old, TIMEOUT_MS, tc_id=None, owner=None)
    record = await store.get(key_path("", "etl-7"))
    assert record is not None and decode_key_record(record.value).txn == txn

    new = await keys.connect(new_session, "", "etl-7", -1)
    assert new.epoch == 1
    assert old.fenced and old_session.closed and not new_session.closed
    header = await tc.get(txn)
    assert header is not None and header.state is TxnState.ABORTED  # the old txn is gone
    await fenced(keys.new_txn(old, TIMEOUT_MS, tc_id=None, owner=None))
    text = await fenced(keys.end_txn(old, txn, TxnState.COMMITTED))
    assert "aborted because its transaction key was fenced" in text
    with pytest.raises(TransactionKeyFenced):
        keys.check(old)
    # The old client reconnecting with its epoch is refused; the new one works on.
    await fenced(keys.connect(FakeSession(), "", "etl-7", 0))
    second = await keys.new_txn(new, TIMEOUT_MS, tc_id=None, owner=None)
    assert await keys.end_txn(new, second, TxnState.COMMITTED) is TxnState.COMMITTED
    assert keys.metrics.aborted_by_fence == 1


async def test_reconnect_with_the_same_epoch_keeps_the_transaction(
    keys: TransactionKeys, tc: TransactionCoordinator
) -> None:
    first = await keys.connect(FakeSession(), "", "job", -1)
    txn = await keys.new_txn(first, TIMEOUT_MS, tc_id=0, owner=None)
    # The connection dropped; the client comes back with its epoch and retries END_TXN.
    keys.release(first.session)
    again = await keys.connect(FakeSession(), "", "job", first.epoch)
    assert again.epoch == first.epoch == 0
    header = await tc.get(txn)
    assert header is not None and header.state is TxnState.OPEN
    assert await keys.end_txn(again, txn, TxnState.COMMITTED) is TxnState.COMMITTED
    assert await keys.end_txn(again, txn, TxnState.COMMITTED) is TxnState.COMMITTED  # retry


async def test_one_open_transaction_per_key(
    keys: TransactionKeys, tc: TransactionCoordinator
) -> None:
    binding = await keys.connect(FakeSession(), "", "k", -1)
    first = await keys.new_txn(binding, TIMEOUT_MS, tc_id=None, owner=None)
    second = await keys.new_txn(binding, TIMEOUT_MS, tc_id=None, owner=None)
    h1, h2 = await tc.get(first), await tc.get(second)
    assert h1 is not None and h1.state is TxnState.ABORTED
    assert h2 is not None and h2.state is TxnState.OPEN


@pytest.mark.parametrize("key", ["a&b", "", "x" * (limits.TXN_KEY_BYTES_MAX + 1)])
async def test_bad_keys_write_nothing(
    keys: TransactionKeys, store: MetadataStore, key: str
) -> None:
    with pytest.raises(InvalidArgument):
        await keys.connect(FakeSession(), "", key, -1)
    assert (await store.list_prefix("/txn/key")).records == []


async def test_owners_are_separate(keys: TransactionKeys) -> None:
    a = await keys.connect(FakeSession(), "alice", "k", -1)
    b = await keys.connect(FakeSession(), "bob", "k", -1)
    c = await keys.connect(FakeSession(), "", "k", -1)
    assert (a.epoch, b.epoch, c.epoch) == (0, 0, 0)
    assert not (a.fenced or b.fenced or c.fenced)
    assert [(k["owner"], k["transactionKey"]) for k in await keys.list_keys()] == [
        ("", "k"),
        ("alice", "k"),
        ("bob", "k"),
    ]


async def test_another_broker_closes_its_older_connection(
    store: MetadataStore, tc: TransactionCoordinator, keys: TransactionKeys
) -> None:
    other = TransactionKeys(store, ManualClock(), tc)
    await other.start()
    try:
        session = FakeSession()
        old = await other.connect(session, "", "etl-7", -1)
        await keys.connect(FakeSession(), "", "etl-7", -1)
        await eventually(lambda: session.closed, "the other broker to close its connection")
        assert old.fenced
        await eventually(lambda: len(other.known()) == 1, "the watch to see the record")
        assert other.known()[0].epoch == 1
    finally:
        await other.close()


async def test_a_fenced_connection_closes_after_its_inflight_command(
    keys: TransactionKeys,
) -> None:
    session = FakeSession()
    old = await keys.connect(session, "", "k", -1)
    with keys.command(session):
        await keys.connect(FakeSession(), "", "k", -1)
        assert old.fenced and not session.closed  # its answer has not gone out yet
    assert session.closed


async def test_admin_get_list_delete(
    keys: TransactionKeys, tc: TransactionCoordinator, store: MetadataStore
) -> None:
    session = FakeSession()
    binding = await keys.connect(session, "", "etl-7", -1)
    txn = await keys.new_txn(binding, TIMEOUT_MS, tc_id=None, owner=None)
    info = await keys.describe("", "etl-7")
    assert info["epoch"] == 0 and info["txnId"] == str(txn) and info["txnStatus"] == "OPEN"
    assert info["connections"] == 1 and info["owner"] == ""
    assert [k["transactionKey"] for k in await keys.list_keys()] == ["etl-7"]

    deleted = await keys.delete("", "etl-7")
    assert deleted["epoch"] == 0
    header = await tc.get(txn)
    assert header is not None and header.state is TxnState.ABORTED
    assert binding.fenced and session.closed
    await fenced(keys.new_txn(binding, TIMEOUT_MS, tc_id=None, owner=None))
    with pytest.raises(NotFound):
        await keys.describe("", "etl-7")
    with pytest.raises(NotFound):
        await keys.delete("", "etl-7")
    assert await keys.list_keys() == []
    # The old holder can never come back, even once the key is claimed again.
    await fenced(keys.connect(FakeSession(), "", "etl-7", 0))
    again = await keys.connect(FakeSession(), "", "etl-7", -1)
    assert again.epoch == 1  # past the deleted record's epoch
    await fenced(keys.connect(FakeSession(), "", "etl-7", 0))
    assert (await store.list_prefix(DELETED)).records == []
    assert len((await store.list_prefix(KEYS)).records) == 1


async def test_race_old_owner_commits_while_a_new_owner_fences(
    keys: TransactionKeys, tc: TransactionCoordinator, store: MetadataStore
) -> None:
    """Exactly one winner each round, and each reply matches the header."""
    rng = random.Random(7)
    other = TransactionKeys(store, ManualClock(), tc)  # the new owner on another broker
    await other.start()
    wins = {"commit": 0, "fence": 0}
    try:
        for round_ in range(RACE_ROUNDS):
            key = f"race-{round_}"
            old = await keys.connect(FakeSession(), "", key, -1)
            txn = await keys.new_txn(old, TIMEOUT_MS, tc_id=None, owner=None)
            where = other if round_ % 2 else keys

            async def commit(old: Binding = old, txn: object = txn) -> str:
                await asyncio.sleep(rng.random() * 0.003)
                try:
                    await keys.end_txn(old, txn, TxnState.COMMITTED)  # type: ignore[arg-type]
                except TransactionKeyFenced:
                    return "fenced"
                return "committed"

            async def fence(key: str = key, where: TransactionKeys = where) -> int:
                await asyncio.sleep(rng.random() * 0.003)
                return (await where.connect(FakeSession(), "", key, -1)).epoch

            reply, epoch = await asyncio.gather(commit(), fence())
            assert epoch == 1
            header = await tc.get(txn)
            assert header is not None
            if reply == "committed":
                assert header.state is TxnState.COMMITTED
                wins["commit"] += 1
            else:
                assert header.state is TxnState.ABORTED
                wins["fence"] += 1
            # A retry by the old owner answers what the header says.
            if header.state is TxnState.COMMITTED:
                assert await keys.end_txn(old, txn, TxnState.COMMITTED) is TxnState.COMMITTED
            else:
                await fenced(keys.end_txn(old, txn, TxnState.COMMITTED))
    finally:
        await other.close()
    assert sum(wins.values()) == RACE_ROUNDS
    # The random delays interleave both ways (seeded: about 10-30 of each per backend).
    assert wins["commit"] > 0 and wins["fence"] > 0, wins
