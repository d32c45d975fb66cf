"""The transaction coordinator on real stores (memory, SQLite, etcd).

Names follow upstream's ``TransactionCoordinatorV5Test`` where a case matches one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from anabranch import limits
from anabranch.errors import (
    BadVersion,
    InvalidArgument,
    InvalidTxnStatus,
    TransactionConflict,
    TransactionCoordinatorNotFound,
    TransactionNotFound,
)
from anabranch.metadata.api import Check, MetadataStore, Put
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.metadata.sqlite import SqliteMetadataStore
from anabranch.storage.api import Position
from anabranch.testing.clock import ManualClock
from anabranch.transactions import records
from anabranch.transactions.coordinator import SWEEP_LEADER_PATH, TransactionCoordinator
from anabranch.transactions.ids import TxnId
from anabranch.transactions.records import OpKind, TxnOp, TxnState

Finals = list[tuple[TxnId, TxnState]]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def finals() -> Finals:
    return []


@pytest.fixture
async def tc(
    store: MetadataStore, clock: ManualClock, finals: Finals
) -> AsyncIterator[TransactionCoordinator]:
    coordinator = TransactionCoordinator(
        store,
        clock,
        partitions=4,
        sweep_interval_s=0,
        gc_retention_s=10,
        on_final=lambda txn, state: finals.append((txn, state)),
    )
    await coordinator.start()
    yield coordinator
    await coordinator.close()


async def write_op(store: MetadataStore, txn: TxnId, seq: int, op: TxnOp) -> None:
    """A participant's guarded op-record write (version 1 of the header means OPEN)."""
    await store.commit(
        [
            Check(records.header_path(txn), expected_version=1),
            Put(records.op_path(txn, seq), records.encode_op(op)),
        ]
    )


async def keys(store: MetadataStore, prefix: str) -> list[str]:
    return [record.path for record in (await store.list_prefix(prefix)).records]


# --- NEW_TXN ----------------------------------------------------------------------------------


async def test_new_transaction_creates_header_with_sequential_least_bits(
    tc: TransactionCoordinator, store: MetadataStore, clock: ManualClock
) -> None:
    made = [await tc.new_txn(5_000, tc_id=1) for _ in range(3)]
    assert made == [TxnId(1, 0), TxnId(1, 1), TxnId(1, 2)]
    assert await tc.new_txn(5_000, tc_id=2) == TxnId(2, 0)
    record = await store.get(records.header_path(made[0]))
    assert record is not None and record.stat.version == 1
    header = records.decode_header(record.value)
    assert header.state is TxnState.OPEN
    assert (header.created_at, header.timeout_ms) == (clock.wall_ms(), 5_000)
    deadline_keys = await keys(store, records.IDX_DEADLINE)
    assert records.deadline_index_path(header.deadline, made[0]) in deadline_keys
    assert len(deadline_keys) == 4


async def test_new_transaction_round_robins_and_clamps(tc: TransactionCoordinator) -> None:
    made = [await tc.new_txn(0) for _ in range(5)]
    assert [txn.most_bits for txn in made] == [0, 1, 2, 3, 0]
    header = await tc.get(made[0])
    assert header is not None and header.timeout_ms == limits.TXN_TIMEOUT_DEFAULT_MS
    capped = await tc.get(await tc.new_txn(10**12, owner="alice"))
    assert capped is not None and capped.timeout_ms == limits.TXN_TIMEOUT_MAX_MS
    assert capped.owner == "alice"


async def test_new_transaction_unknown_coordinator(tc: TransactionCoordinator) -> None:
    with pytest.raises(TransactionCoordinatorNotFound):
        await tc.new_txn(1_000, tc_id=4)


async def test_two_coordinators_take_disjoint_blocks(
    tc: TransactionCoordinator, store: MetadataStore, clock: ManualClock
) -> None:
    other = TransactionCoordinator(store, clock, partitions=4, sweep_interval_s=0)
    await other.start()
    first, second = await tc.new_txn(1_000, tc_id=0), await other.new_txn(1_000, tc_id=0)
    assert (first, second) == (TxnId(0, 0), TxnId(0, limits.TXN_ID_BLOCK))
    assert await tc.new_txn(1_000, tc_id=0) == TxnId(0, 1)
    counter = await store.get(records.seq_path(0))
    assert counter is not None and json.loads(counter.value) == {"next": 2 * limits.TXN_ID_BLOCK}


async def test_concurrent_new_and_end_keep_ids_unique(
    tc: TransactionCoordinator, store: MetadataStore, clock: ManualClock
) -> None:
    other = TransactionCoordinator(store, clock, partitions=4, sweep_interval_s=0)
    await other.start()
    made = await asyncio.gather(
        *(c.new_txn(10_000, tc_id=i % 2) for i in range(30) for c in (tc, other))
    )
    assert len(set(made)) == len(made) == 60
    ended = await asyncio.gather(
        *((tc if i % 2 else other).end_txn(txn, TxnState.COMMITTED) for i, txn in enumerate(made))
    )
    assert ended == [TxnState.COMMITTED] * 60
    assert await keys(store, records.IDX_DEADLINE) == []
    assert tc.metrics.committed + other.metrics.committed == 60


# --- END_TXN ----------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [TxnState.COMMITTED, TxnState.ABORTED])
async def test_end_transaction_cases_header_and_moves_indexes(
    tc: TransactionCoordinator,
    store: MetadataStore,
    clock: ManualClock,
    finals: Finals,
    state: TxnState,
) -> None:
    txn = await tc.new_txn(5_000)
    clock.advance(1)
    assert await tc.end_txn(txn, state) is state
    record = await store.get(records.header_path(txn))
    assert record is not None and record.stat.version == 2
    header = records.decode_header(record.value)
    assert (header.state, header.finalized_at) == (state, clock.wall_ms())
    assert await keys(store, records.IDX_DEADLINE) == []
    assert await keys(store, records.IDX_FINAL) == [
        records.final_index_path(state, clock.wall_ms(), txn)
    ]
    assert finals == [(txn, state)]
    assert tc.metrics.header_cas == {"ok": 1, "conflict": 0, "reject": 0}


async def test_end_transaction_idempotent_retry_republishes(
    tc: TransactionCoordinator, finals: Finals
) -> None:
    txn = await tc.new_txn(5_000)
    await tc.end_txn(txn, TxnState.COMMITTED)
    assert await tc.end_txn(txn, TxnState.COMMITTED) is TxnState.COMMITTED
    assert finals == [(txn, TxnState.COMMITTED)] * 2
    assert tc.metrics.committed == 1 and tc.metrics.header_cas["ok"] == 1


async def test_end_transaction_fails_on_mismatched_action(
    tc: TransactionCoordinator, finals: Finals
) -> None:
    txn = await tc.new_txn(5_000)
    await tc.end_txn(txn, TxnState.COMMITTED)
    with pytest.raises(InvalidTxnStatus):
        await tc.end_txn(txn, TxnState.ABORTED)
    assert finals == [(txn, TxnState.COMMITTED)]
    assert tc.metrics.header_cas["reject"] == 1


async def test_end_transaction_fails_for_unknown_txn(tc: TransactionCoordinator) -> None:
    with pytest.raises(TransactionNotFound):
        await tc.end_txn(TxnId(0, 999), TxnState.COMMITTED)
    with pytest.raises(InvalidArgument):
        await tc.end_txn(await tc.new_txn(1_000), TxnState.OPEN)


async def test_commit_after_deadline_aborts(
    tc: TransactionCoordinator, clock: ManualClock, finals: Finals
) -> None:
    txn = await tc.new_txn(1_000)
    clock.advance(1.001)
    with pytest.raises(InvalidTxnStatus, match="timed out"):
        await tc.end_txn(txn, TxnState.COMMITTED)
    header = await tc.get(txn)
    assert header is not None and header.state is TxnState.ABORTED
    assert finals == [(txn, TxnState.ABORTED)]
    assert (tc.metrics.aborted, tc.metrics.timed_out, tc.metrics.committed) == (1, 1, 0)
    # The client's retry of its commit now gets the same precise answer.
    with pytest.raises(InvalidTxnStatus):
        await tc.end_txn(txn, TxnState.COMMITTED)


async def test_a_commit_at_the_deadline_still_commits(
    tc: TransactionCoordinator, clock: ManualClock
) -> None:
    txn = await tc.new_txn(1_000)
    clock.advance(1.0)
    assert await tc.end_txn(txn, TxnState.COMMITTED) is TxnState.COMMITTED


async def test_late_op_write_fails_after_the_header_cas(
    tc: TransactionCoordinator, store: MetadataStore
) -> None:
    txn = await tc.new_txn(5_000)
    await write_op(store, txn, 0, TxnOp(OpKind.WRITE, "t"))
    await tc.end_txn(txn, TxnState.ABORTED)
    with pytest.raises(BadVersion):
        await write_op(store, txn, 1, TxnOp(OpKind.WRITE, "t"))


# --- ADD_PARTITION / ADD_SUBSCRIPTION ---------------------------------------------------------


async def test_check_open(tc: TransactionCoordinator, clock: ManualClock) -> None:
    txn, short = await tc.new_txn(5_000), await tc.new_txn(1_000)
    assert (await tc.check_open(txn)).state is TxnState.OPEN
    with pytest.raises(TransactionNotFound):
        await tc.check_open(TxnId(3, 77))
    clock.advance(2)
    with pytest.raises(TransactionConflict, match="timed out"):
        await tc.check_open(short)
    await tc.end_txn(txn, TxnState.COMMITTED)
    with pytest.raises(TransactionConflict, match="COMMITTED"):
        await tc.check_open(txn)


# --- sweeps -----------------------------------------------------------------------------------


async def test_sweep_timeouts_aborts_expired_and_leaves_unexpired(
    tc: TransactionCoordinator, clock: ManualClock, finals: Finals
) -> None:
    expiring = [await tc.new_txn(1_000) for _ in range(3)]
    lasting = await tc.new_txn(60_000)
    assert await tc.sweep_timeouts() == 0
    clock.advance(1.0)
    assert await tc.sweep_timeouts() == 0  # at the deadline, not past it
    clock.advance(0.001)
    assert await tc.sweep_timeouts() == 3
    assert sorted(finals) == sorted((txn, TxnState.ABORTED) for txn in expiring)
    for txn in expiring:
        header = await tc.get(txn)
        assert header is not None and header.state is TxnState.ABORTED
    header = await tc.get(lasting)
    assert header is not None and header.state is TxnState.OPEN
    assert await tc.sweep_timeouts() == 0
    assert tc.metrics.timed_out == 3 and tc.stats()["timedOut"] == 3


async def test_sweep_timeouts_tolerates_a_racing_commit(
    tc: TransactionCoordinator, store: MetadataStore, clock: ManualClock
) -> None:
    txn = await tc.new_txn(1_000)
    other = TransactionCoordinator(store, clock, partitions=4, sweep_interval_s=0)
    await other.start()
    clock.advance(2)
    results = await asyncio.gather(tc.sweep_timeouts(), other.sweep_timeouts())
    assert sorted(results) == [0, 1]
    header = await tc.get(txn)
    assert header is not None and header.state is TxnState.ABORTED


async def test_sweep_gc_deletes_header_when_no_ops_remain(
    tc: TransactionCoordinator, store: MetadataStore, clock: ManualClock
) -> None:
    txn = await tc.new_txn(5_000)
    await write_op(store, txn, 0, TxnOp(OpKind.WRITE, "t"))
    await tc.end_txn(txn, TxnState.COMMITTED)
    await store.delete(records.op_path(txn, 0))  # the participant applied the outcome
    assert await tc.sweep_gc() == 0  # retention has not passed
    clock.advance(11)
    assert await tc.sweep_gc() == 1
    assert await tc.get(txn) is None
    assert await keys(store, records.IDX_FINAL) == []
    assert tc.metrics.gc_collected == 1
    with pytest.raises(TransactionNotFound):
        await tc.end_txn(txn, TxnState.COMMITTED)


async def test_sweep_gc_retains_header_and_refans_out_when_ops_remain(
    tc: TransactionCoordinator, store: MetadataStore, clock: ManualClock, finals: Finals
) -> None:
    kept, gone = await tc.new_txn(5_000), await tc.new_txn(5_000)
    await write_op(store, kept, 0, TxnOp(OpKind.ACK, "t", "s", (Position(1, 2),)))
    await tc.end_txn(kept, TxnState.ABORTED)
    await tc.end_txn(gone, TxnState.COMMITTED)
    finals.clear()
    clock.advance(11)
    assert await tc.sweep_gc() == 1
    assert finals == [(kept, TxnState.ABORTED)]
    header = await tc.get(kept)
    assert header is not None and header.state is TxnState.ABORTED
    assert await tc.get(gone) is None
    await store.delete(records.op_path(kept, 0))
    assert await tc.sweep_gc() == 1
    assert await keys(store, records.ROOT + "/") == [
        records.PARALLELISM,
        *[records.seq_path(p) for p in (0, 1)],
    ]


async def test_one_gc_pass_collects_every_due_page(
    tc: TransactionCoordinator,
    store: MetadataStore,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pages of 100: a pass must go on past the first page, and delete more headers than
    # fit in one commit (64 per commit of 128 ops).
    monkeypatch.setattr(limits, "TXN_SWEEP_BATCH", 100)
    committed = [await tc.new_txn(5_000) for _ in range(230)]
    aborted = [await tc.new_txn(5_000) for _ in range(3)]
    for txn in committed:
        await tc.end_txn(txn, TxnState.COMMITTED)
    for txn in aborted:
        await tc.end_txn(txn, TxnState.ABORTED)
    clock.advance(11)
    assert await tc.sweep_gc() == 233
    assert await keys(store, records.HEADERS) == []
    assert await keys(store, records.IDX_FINAL) == []
    assert await tc.sweep_gc() == 0


async def test_gc_of_a_page_with_a_header_already_gone_collects_the_others(
    tc: TransactionCoordinator, store: MetadataStore, clock: ManualClock
) -> None:
    txns = [await tc.new_txn(5_000) for _ in range(5)]
    for txn in txns:
        await tc.end_txn(txn, TxnState.COMMITTED)
    # Another broker's pass deleted one header; its index key is still listed here.
    await store.delete(records.header_path(txns[2]))
    clock.advance(11)
    assert await tc.sweep_gc() == 4
    assert await keys(store, records.HEADERS) == []
    assert await keys(store, records.IDX_FINAL) == []


# --- lifecycle --------------------------------------------------------------------------------


async def test_start_fails_on_parallelism_mismatch(
    tc: TransactionCoordinator, store: MetadataStore, clock: ManualClock
) -> None:
    persisted = await store.get(records.PARALLELISM)
    assert persisted is not None and persisted.value == b"4"
    same = TransactionCoordinator(store, clock, partitions=4, sweep_interval_s=0)
    await same.start()
    different = TransactionCoordinator(store, clock, partitions=8, sweep_interval_s=0)
    with pytest.raises(InvalidArgument, match="partitions"):
        await different.start()


async def test_restart_serves_transactions_of_the_old_coordinator(
    tmp_path: Path, clock: ManualClock
) -> None:
    path = tmp_path / "meta.db"
    store = await SqliteMetadataStore.open(path)
    old = TransactionCoordinator(store, clock, partitions=2, sweep_interval_s=0)
    await old.start()
    made = [await old.new_txn(10_000, tc_id=0) for _ in range(2)]
    await old.close()
    await store.close()

    store = await SqliteMetadataStore.open(path)
    try:
        new = TransactionCoordinator(store, clock, partitions=2, sweep_interval_s=0)
        await new.start()
        assert await new.end_txn(made[0], TxnState.COMMITTED) is TxnState.COMMITTED
        assert await new.end_txn(made[1], TxnState.ABORTED) is TxnState.ABORTED
        fresh = await new.new_txn(10_000, tc_id=0)
        assert fresh == TxnId(0, limits.TXN_ID_BLOCK)  # the old block is never reused
        await new.close()
    finally:
        await store.close()


# --- admin, stats, metrics --------------------------------------------------------------------


async def test_transaction_metadata(tc: TransactionCoordinator, store: MetadataStore) -> None:
    txn = await tc.new_txn(5_000)
    await write_op(store, txn, 0, TxnOp(OpKind.WRITE, "seg-a", first_after=Position(3, 4)))
    await write_op(store, txn, 1, TxnOp(OpKind.ACK, "seg-b", "sub", (Position(1, 1),)))
    await write_op(store, txn, 2, TxnOp(OpKind.ACK, "seg-b", "cum", (Position(2, 9),), True))
    meta = await tc.transaction_metadata(txn)
    header = await tc.get(txn)
    assert header is not None
    assert meta["txnId"] == str(txn) and meta["status"] == "OPEN"
    assert (meta["openTimestamp"], meta["timeoutAt"]) == (header.created_at, header.deadline)
    assert meta["producedPartitions"] == {"seg-a": {"startPosition": "3:4", "aborted": False}}
    assert meta["ackedPartitions"] == {
        "seg-b": {"sub": {"cumulativeAckPosition": None}, "cum": {"cumulativeAckPosition": "2:9"}}
    }
    with pytest.raises(TransactionNotFound):
        await tc.transaction_metadata(TxnId(0, 12345))


async def test_slow_transactions(tc: TransactionCoordinator, clock: ManualClock) -> None:
    old = await tc.new_txn(limits.TXN_TIMEOUT_MAX_MS)
    done = await tc.new_txn(60_000)
    await tc.end_txn(done, TxnState.COMMITTED)
    clock.advance(30)
    young = await tc.new_txn(1_000)
    slow = await tc.slow_transactions(older_than_ms=10_000)
    assert [entry["txnId"] for entry in slow] == [str(old)]
    everything = await tc.slow_transactions(older_than_ms=0)
    assert {entry["txnId"] for entry in everything} == {str(old)}
    clock.advance(0.5)
    assert {e["txnId"] for e in await tc.slow_transactions(0)} == {str(old), str(young)}
    assert len(await tc.slow_transactions(0, limit=1)) == 1


async def test_stats_and_metrics(tc: TransactionCoordinator, clock: ManualClock) -> None:
    a, b, c = [await tc.new_txn(1_000, tc_id=i) for i in (0, 0, 1)]
    assert tc.metrics.open == 3
    await tc.end_txn(a, TxnState.COMMITTED)
    await tc.end_txn(b, TxnState.ABORTED)
    stats = tc.stats()
    assert {k: stats[k] for k in ("partitions", "created", "committed", "aborted", "open")} == {
        "partitions": 4,
        "created": 3,
        "committed": 1,
        "aborted": 1,
        "open": 1,
    }
    assert stats["perPartition"]["0"] == {
        "created": 2,
        "committed": 1,
        "aborted": 1,
        "timedOut": 0,
        "open": 0,
    }
    assert stats["perPartition"]["1"]["open"] == 1
    assert tc.metrics.commit_latency.count == 1
    clock.advance(2)  # past c's deadline: no longer counted open here
    assert tc.stats()["open"] == 0 and tc.metrics.open == 0
    assert c.most_bits == 1


async def test_on_final_failure_does_not_fail_end_txn(
    store: MetadataStore, clock: ManualClock
) -> None:
    def broken(txn: TxnId, state: TxnState) -> None:
        raise RuntimeError("participant wake-up failed")

    tc = TransactionCoordinator(store, clock, partitions=1, sweep_interval_s=0, on_final=broken)
    await tc.start()
    txn = await tc.new_txn(1_000)
    assert await tc.end_txn(txn, TxnState.COMMITTED) is TxnState.COMMITTED
    await tc.close()


# --- the sweep leader (memory store only: it runs on the manual clock) ------------------------


async def wait_for(condition: Callable[[], bool], clock: ManualClock) -> None:
    for _ in range(200):
        if condition():
            return
        await clock.settle()
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


async def test_only_the_sweep_leader_sweeps(clock: ManualClock) -> None:
    store = MemoryMetadataStore()
    first = TransactionCoordinator(
        store,
        clock,
        partitions=1,
        owner_id="a",
        sweep_interval_s=1,
        gc_interval_s=5,
        gc_retention_s=1,
    )
    second = TransactionCoordinator(
        store,
        clock,
        partitions=1,
        owner_id="b",
        sweep_interval_s=1,
        gc_interval_s=5,
        gc_retention_s=1,
    )
    await first.start()

    async def leader() -> bytes | None:
        record = await store.get(SWEEP_LEADER_PATH)
        return None if record is None else record.value

    for _ in range(100):
        if await leader() == b"a":
            break
        await asyncio.sleep(0.005)
    await second.start()
    txn = await first.new_txn(1_000)
    await wait_for(lambda: clock.sleepers >= 1, clock)
    clock.advance(2)
    await wait_for(lambda: first.metrics.timed_out == 1, clock)
    assert second.metrics.timed_out == 0
    header = await first.get(txn)
    assert header is not None and header.state is TxnState.ABORTED

    # The leader steps down on close; the other broker takes over the sweeps (and GC).
    await first.close()
    for _ in range(100):
        if await leader() == b"b":
            break
        await asyncio.sleep(0.005)
    assert await leader() == b"b"
    late = await second.new_txn(1_000)
    for _ in range(8):
        clock.advance(1)
        await clock.settle()
        await asyncio.sleep(0.005)
    await wait_for(lambda: second.metrics.timed_out == 1, clock)
    await wait_for(lambda: second.metrics.gc_collected == 2, clock)
    assert await second.get(late) is None and await second.get(txn) is None
    await second.close()
    assert await leader() is None
