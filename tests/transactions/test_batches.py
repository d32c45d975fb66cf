"""Batch transactions with branches (the broker half of the exactly-once Spark sink).

Layers, bottom up: the pure visibility state with branches (hypothesis), the topic's
buffer with a winners commit (wake, header watch, restart and recovery), the coordinator's
``winners``, the batch service on a manual clock, then the admin batch API end to end on
an in-process broker with our client (two attempts of one partition: speculation).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch import limits
from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.core.txn_buffer_state import TxnBufferState
from anabranch.core.txn_id import BRANCH_PROPERTY
from anabranch.errors import (
    InvalidArgument,
    InvalidTxnStatus,
    TransactionConflict,
    TransactionNotFound,
)
from anabranch.metadata.api import MUST_NOT_EXIST, MetadataStore
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import encode_entry
from anabranch.storage.api import ManagedLedger
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.clock import ManualClock
from anabranch.transactions import records
from anabranch.transactions.batches import TxnBatches
from anabranch.transactions.coordinator import TransactionCoordinator
from anabranch.transactions.ids import TxnId
from anabranch.transactions.metadata_buffer import MetadataTransactionBuffer
from anabranch.transactions.outcomes import TxnOutcomes
from anabranch.transactions.records import TxnState

OPEN, COMMITTED, ABORTED = TxnState.OPEN, TxnState.COMMITTED, TxnState.ABORTED
T1, T2 = TxnId(0, 1), TxnId(0, 2)
TOPIC = "persistent://public/default/sink"


# --- pure state ------------------------------------------------------------------------------

BRANCHES = st.sampled_from([None, "0-a", "0-b", "1-a"])
APPEND = st.tuples(st.sampled_from(["A", "B", "plain"]), BRANCHES, st.booleans())


@settings(max_examples=150, deadline=None)
@given(
    appends=st.lists(APPEND, min_size=1, max_size=25),
    winners=st.frozensets(st.sampled_from(["0-a", "0-b", "1-a"])),
    b_commits=st.booleans(),
)
def test_state_losers_never_readable_winners_readable_plain_pinned(
    appends: list[tuple[str, str | None, bool]], winners: frozenset[str], b_commits: bool
) -> None:
    """A commits naming ``winners``; B commits (no winners) or aborts. Appends flagged
    ``late`` are still in flight when the outcomes arrive."""
    txns = {"A": (0, 1), "B": (0, 2)}
    state = TxnBufferState()
    entry = 0
    landed: list[tuple[tuple[int, int], str, str | None]] = []  # (position, who, branch)
    late: list[tuple[int, str, str | None]] = []
    for who, branch, in_flight in appends:
        lac = (1, entry - 1)
        if who == "plain":
            landed.append(((1, entry), who, None))
            entry += 1
            continue
        token = state.begin_append(txns[who], lac, branch)
        if in_flight:
            late.append((token, who, branch))
            continue
        state.end_append(token, (1, entry))
        landed.append(((1, entry), who, branch))
        entry += 1
    lac = (1, entry - 1)
    limit = state.max_read_position(lac)
    for position, who, _ in landed:  # read-committed: nothing after an open txn's entry
        if who != "plain" or any(p <= position and w != "plain" for p, w, _ in landed):
            assert position > limit
    state.validate()
    state.apply_outcome(txns["A"], committed=True, winners=winners)
    state.apply_outcome(txns["B"], committed=b_commits)
    for token, who, branch in late:
        state.end_append(token, (1, entry))
        landed.append(((1, entry), who, branch))
        entry += 1
    state.validate()
    assert state.max_read_position((1, entry - 1)) == (1, entry - 1)
    for position, who, branch in landed:
        if who == "A":
            visible = branch is not None and branch in winners
        else:
            visible = who == "plain" or b_commits
        assert state.is_aborted(position) is not visible, (position, who, branch)
    assert state.open_count == 0


def test_state_winners_commit_is_idempotent_and_an_empty_set_aborts_everything() -> None:
    state = TxnBufferState()
    state.open_txn((0, 1))
    state.end_append(state.begin_append((0, 1), (1, -1), "0-a"), (1, 0))
    assert state.apply_outcome((0, 1), committed=True, winners=frozenset())
    assert state.is_aborted((1, 0))
    assert not state.apply_outcome((0, 1), committed=True, winners=frozenset())


# --- the topic's buffer ----------------------------------------------------------------------


def branched(seq: int, branch: str | None) -> bytes:
    md = pb.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=0)
    if branch is not None:
        md.properties.add(key=BRANCH_PROPERTY, value=branch)
    return encode_entry(md, f"m{seq}".encode())


async def open_txn(store: MetadataStore, clock: ManualClock, txn: TxnId) -> None:
    header = records.TxnHeader(OPEN, created_at=clock.wall_ms(), timeout_ms=60_000)
    await store.put(records.header_path(txn), records.encode_header(header), MUST_NOT_EXIST)


async def finish(
    store: MetadataStore, clock: ManualClock, txn: TxnId, winners: frozenset[str] | None
) -> None:
    """The coordinator's one finalizing CAS, naming ``winners``."""
    record = await store.get(records.header_path(txn))
    assert record is not None
    header = records.decode_header(record.value)
    final = records.TxnHeader(
        COMMITTED, header.created_at, header.timeout_ms, clock.wall_ms(), winners=winners
    )
    await store.put(records.header_path(txn), records.encode_header(final), expected_version=1)


class Env:
    def __init__(self) -> None:
        self.store = MemoryMetadataStore()
        self.clock = ManualClock()
        self.outcomes = TxnOutcomes(self.store, self.clock)
        self.factory = MemoryManagedLedgerFactory(self.clock)
        self.buffers: list[MetadataTransactionBuffer] = []

    async def buffer(self, ledger: ManagedLedger | None = None) -> MetadataTransactionBuffer:
        ml = ledger or await self.factory.open(TOPIC)
        buf = MetadataTransactionBuffer(
            TOPIC, ml, self.store, self.outcomes, self.clock, on_change=lambda: None
        )
        await buf.recover()
        self.buffers.append(buf)
        return buf


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    e = Env()
    await e.outcomes.start()
    try:
        yield e
    finally:
        for buf in e.buffers:
            await buf.close()
        await e.outcomes.close()
        await e.store.close()


async def test_buffer_winners_commit_aborts_losers_durably_and_across_restart(env: Env) -> None:
    await open_txn(env.store, env.clock, T1)
    buf = await env.buffer()
    win = await buf.append(T1, branched(0, "0-b"))
    lose = await buf.append(T1, branched(1, "0-a"))
    bare = await buf.append(T1, branched(2, None))
    plain = await buf.append(None, branched(3, None))
    assert buf.max_read_position() < win
    await finish(env.store, env.clock, T1, frozenset({"0-b"}))
    env.outcomes.wake(T1, COMMITTED, frozenset({"0-b"}))
    assert buf.max_read_position() == plain
    assert [buf.is_aborted(p) for p in (win, lose, bare, plain)] == [False, True, True, False]
    await buf.wait_persisted()
    record = await env.store.get(records.aborted_path(TOPIC, T1))
    assert record is not None
    assert records.decode_aborted(record.value).positions == (lose, bare)
    assert not (await env.store.list_prefix(records.op_prefix(T1))).records
    await buf.close()
    again = await env.buffer(buf._ledger)
    assert [again.is_aborted(p) for p in (win, lose, bare, plain)] == [False, True, True, False]
    assert again.max_read_position() == plain


async def test_buffer_recovers_a_winners_commit_it_never_applied(env: Env) -> None:
    await open_txn(env.store, env.clock, T1)
    buf = await env.buffer()
    lose = await buf.append(T1, branched(0, "1-x"))
    win = await buf.append(T1, branched(1, "1-y"))
    await buf.close()  # gone before the outcome: the op record stays, the scan finds both
    await finish(env.store, env.clock, T1, frozenset({"1-y"}))
    again = await env.buffer(buf._ledger)
    assert again.is_aborted(lose) and not again.is_aborted(win)
    assert again.max_read_position() == win
    await again.wait_persisted()
    record = await env.store.get(records.aborted_path(TOPIC, T1))
    assert record is not None and records.decode_aborted(record.value).positions == (lose,)
    assert not (await env.store.list_prefix(records.OPS)).records


async def test_buffer_learns_winners_from_the_header_watch(env: Env) -> None:
    """Another broker's commit: no wake here, the watch decodes the header's winners."""
    await open_txn(env.store, env.clock, T2)
    buf = await env.buffer()
    lose = await buf.append(T2, branched(0, "0-a"))
    win = await buf.append(T2, branched(1, "0-b"))
    await finish(env.store, env.clock, T2, frozenset({"0-b"}))
    for _ in range(200):
        if buf.max_read_position() == win:
            break
        await asyncio.sleep(0.005)
    assert buf.is_aborted(lose) and not buf.is_aborted(win)


async def test_buffer_refuses_an_oversized_branch_id(env: Env) -> None:
    await open_txn(env.store, env.clock, T1)
    buf = await env.buffer()
    with pytest.raises(InvalidArgument):
        await buf.append(T1, branched(0, "x" * 129))


# --- coordinator and batches -----------------------------------------------------------------


@pytest.fixture
async def tc() -> AsyncIterator[tuple[TransactionCoordinator, ManualClock, list[Any]]]:
    store, clock, finals = MemoryMetadataStore(), ManualClock(), []
    coordinator = TransactionCoordinator(
        store, clock, partitions=1, sweep_interval_s=0, on_final=lambda *a: finals.append(a)
    )
    await coordinator.start()
    try:
        yield coordinator, clock, finals
    finally:
        await coordinator.close()
        await store.close()


async def test_coordinator_commit_with_winners(
    tc: tuple[TransactionCoordinator, ManualClock, list[Any]],
) -> None:
    coordinator, _, finals = tc
    txn = await coordinator.new_txn(10_000)
    winners = frozenset({"0-a", "1-a"})
    await coordinator.end_txn(txn, COMMITTED, winners=winners)
    header = await coordinator.get(txn)
    assert header is not None and header.winners == winners
    assert finals == [(txn, COMMITTED, winners)]
    await coordinator.end_txn(txn, COMMITTED, winners=winners)  # idempotent, wakes again
    assert finals[-1] == (txn, COMMITTED, winners)
    with pytest.raises(InvalidTxnStatus):
        await coordinator.end_txn(txn, COMMITTED, winners=frozenset({"0-b"}))
    plain = await coordinator.new_txn(10_000)
    await coordinator.end_txn(plain, COMMITTED)
    assert finals[-1] == (plain, COMMITTED)  # the two-argument call stays as it was
    with pytest.raises(InvalidArgument):
        await coordinator.end_txn(plain, ABORTED, winners=frozenset({"a"}))
    with pytest.raises(InvalidArgument):
        await coordinator.end_txn(plain, COMMITTED, winners=frozenset({"x" * 200}))


async def test_batches_lifecycle_on_a_manual_clock(
    tc: tuple[TransactionCoordinator, ManualClock, list[Any]],
) -> None:
    coordinator, clock, _ = tc
    batches = TxnBatches(coordinator._store, coordinator, clock)
    first = await batches.begin("s/k", 3, "q1", timeout_ms=1_000)
    assert (first.state, first.epoch) == (OPEN, 0)
    assert (await batches.begin("s/k", 3, "q1")).txn == first.txn  # a second task
    clock.advance(2.0)  # timed out, the sweep has not run
    with pytest.raises(TransactionConflict):
        await batches.commit("s/k", 3, "q1", 0, ["0-a"])
    second = await batches.begin("s/k", 3, "q1", timeout_ms=1_000)
    assert (second.state, second.epoch) == (OPEN, 1) and second.txn != first.txn
    with pytest.raises(TransactionConflict):  # the stale epoch
        await batches.commit("s/k", 3, "q1", 0, ["0-a"])
    assert (await batches.abort("s/k", 3, 0)).state is OPEN  # a stale abort: nothing
    done = await batches.commit("s/k", 3, "q1", 1, ["0-a"])
    assert done.state is COMMITTED and done.record.winners == frozenset({"0-a"})
    assert (await batches.commit("s/k", 3, "q1", 1, ["0-a"])).state is COMMITTED
    with pytest.raises(InvalidTxnStatus):
        await batches.commit("s/k", 3, "q1", 1, ["0-b"])
    assert (await batches.abort("s/k", 3, 1)).state is COMMITTED  # never undone
    with pytest.raises(TransactionConflict, match="new checkpoint location"):
        await batches.begin("s/k", 3, "q2")
    # The header is collected after its retention: the record still says COMMITTED.
    await coordinator._store.delete(records.header_path(second.txn))
    assert (await batches.begin("s/k", 3, "q1")).state is COMMITTED


async def test_batches_another_query_takes_over_an_open_batch_and_begins_race(
    tc: tuple[TransactionCoordinator, ManualClock, list[Any]],
) -> None:
    coordinator, clock, _ = tc
    batches = TxnBatches(coordinator._store, coordinator, clock)
    got = await asyncio.gather(*(batches.begin("s", 0, "q1") for _ in range(8)))
    assert len({b.txn for b in got}) == 1 and {b.epoch for b in got} == {0}
    assert coordinator.metrics.created - coordinator.metrics.aborted == 1
    taken = await batches.begin("s", 0, "q2")
    assert (taken.epoch, taken.record.query_id) == (1, "q2")
    old = await coordinator.get(got[0].txn)
    assert old is not None and old.state is ABORTED
    with pytest.raises(TransactionConflict):
        await batches.commit("s", 0, "q1", 0, [])


async def test_a_batch_belongs_to_the_role_that_began_it(
    tc: tuple[TransactionCoordinator, ManualClock, list[Any]],
) -> None:
    """As the wire's transaction commands: another role (not a superuser, ``role`` None)
    gets TransactionNotFound for the batch, for new batches of its sink, and for its
    transaction, which the owner's role owns."""
    coordinator, clock, _ = tc
    batches = TxnBatches(coordinator._store, coordinator, clock)
    batch = await batches.begin("s", 0, "q1", owner="alice", role="alice")
    header = await coordinator.get(batch.txn)
    assert header is not None and header.owner == "alice" and batch.record.owner == "alice"
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: batches.get("s", 0, role="bob"),
        lambda: batches.begin("s", 0, "q1", owner="bob", role="bob"),
        lambda: batches.begin("s", 1, "q1", owner="bob", role="bob"),  # alice's sink
        lambda: batches.commit("s", 0, "q1", 0, ["0-b"], role="bob"),
        lambda: batches.abort("s", 0, 0, role="bob"),
    ]
    for call in calls:
        with pytest.raises(TransactionNotFound):
            await call()
    assert (await batches.get("s", 0, role="alice")).state is OPEN  # nothing changed
    assert (await batches.begin("s", 0, "q1", owner="alice", role="alice")).txn == batch.txn
    assert (await batches.get("s", 0)).state is OPEN  # a superuser sees it
    done = await batches.commit("s", 0, "q1", 0, ["0-a"], role="alice")
    assert done.state is COMMITTED and done.record.owner == "alice"
    assert (await batches.begin("other", 0, "q1", owner="bob", role="bob")).state is OPEN


async def test_a_sink_keeps_only_its_last_batches(
    tc: tuple[TransactionCoordinator, ManualClock, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "TXN_BATCHES_RETAINED", 3)
    coordinator, clock, _ = tc
    batches = TxnBatches(coordinator._store, coordinator, clock)
    for batch_id in range(6):
        for key in ("s", "other"):
            batch = await batches.begin(key, batch_id, "q1")
            await batches.commit(key, batch_id, "q1", batch.epoch, ["0-a"])
    kept = await coordinator._store.list_prefix(records.BATCHES)
    assert [records.batch_path(k, n) for k in ("other", "s") for n in (3, 4, 5)] == [
        r.path for r in kept.records
    ]
    with pytest.raises(TransactionNotFound):
        await batches.get("s", 2)
    assert (await batches.begin("s", 5, "q1")).state is COMMITTED  # the last one replays
    with pytest.raises(TransactionConflict):  # a new checkpoint location, batch 0 again
        await batches.begin("s", 0, "q2")
    assert (await batches.begin("s", 6, "q1")).state is OPEN


# --- end to end: admin batch API + our client --------------------------------------------------


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[AdminClient, Client]]:
    async with InProcessBroker(tmp_path, ledgers="memory") as broker:
        assert broker.http_url is not None
        client = Client(broker.service_url)
        admin = AdminClient(broker.http_url)
        try:
            yield admin, client
        finally:
            await admin.close()
            await client.close()


def txn_of(batch: dict[str, Any]) -> TxnId:
    return TxnId(batch["txnId"]["mostSigBits"], batch["txnId"]["leastSigBits"])


async def status_of(call: Any) -> int:
    with pytest.raises(AdminHttpError) as info:
        await call
    return info.value.status


async def test_batch_api_end_to_end(cluster: tuple[AdminClient, Client]) -> None:
    admin, client = cluster
    sink, out = "query-1/sink a", "persistent://public/default/batch-out"
    consumer = await client.subscribe(out, "s", initial_position="earliest")
    batch = await admin.begin_batch(sink, 0, "q1", timeout_ms=30_000)
    assert (batch["state"], batch["epoch"], batch["winners"]) == ("OPEN", 0, None)
    assert batch["sinkKey"] == sink and batch["batchId"] == 0
    # Two attempts of partition 0 (speculation) and one of partition 1, each its own
    # producer (a task's) writing in the batch's transaction under its branch.
    for branch in ("0-a", "0-b", "1-a"):
        producer = await client.create_producer(out)
        txn = await client.resume_transaction(txn_of(batch), timeout=30)
        for i in range(3):
            await producer.send(
                f"{branch}:{i}".encode(), txn=txn, properties={BRANCH_PROPERTY: branch}
            )
        await producer.flush()
        await producer.close()
    done = await admin.commit_batch(sink, 0, "q1", 0, ["0-b", "1-a"])
    assert (done["state"], done["winners"]) == ("COMMITTED", ["0-b", "1-a"])
    sentinel = await client.create_producer(out)
    await sentinel.send(b"end")
    got: list[bytes] = []
    while not got or got[-1] != b"end":
        msg = await consumer.receive(timeout=5.0)
        assert msg is not None, got
        got.append(msg.value)
    rows = sorted(v.decode() for v in got[:-1])
    assert rows == [f"{b}:{i}" for b in ("0-b", "1-a") for i in range(3)]
    # A replay after a crash between the sink's commit and Spark's commit log.
    assert (await admin.begin_batch(sink, 0, "q1"))["state"] == "COMMITTED"
    assert (await admin.commit_batch(sink, 0, "q1", 0, ["0-b", "1-a"]))["state"] == "COMMITTED"
    assert (await admin.abort_batch(sink, 0, 0))["state"] == "COMMITTED"
    assert (await admin.get_batch(sink, 0))["winners"] == ["0-b", "1-a"]
    assert await status_of(admin.begin_batch(sink, 0, "q-new-checkpoint")) == 409
    assert await status_of(admin.commit_batch(sink, 0, "q1", 0, ["0-a"])) == 409
    assert await status_of(admin.get_batch(sink, 1)) == 404


async def test_batch_api_timeout_and_concurrent_begins(cluster: tuple[AdminClient, Client]) -> None:
    admin, _ = cluster
    racing = await asyncio.gather(*(admin.begin_batch("s", 5, "q1") for _ in range(6)))
    assert len({(b["txnId"]["mostSigBits"], b["txnId"]["leastSigBits"]) for b in racing}) == 1
    short = await admin.begin_batch("t", 9, "q1", timeout_ms=100)
    await asyncio.sleep(0.25)
    assert await status_of(admin.commit_batch("t", 9, "q1", 0, ["0-a"])) == 409
    again = await admin.begin_batch("t", 9, "q1", timeout_ms=30_000)
    assert again["epoch"] == 1 and txn_of(again) != txn_of(short)
    assert (await admin.commit_batch("t", 9, "q1", 1, ["0-a"]))["state"] == "COMMITTED"
    assert await status_of(admin.commit_batch("t", 9, "q1", 1, ["x" * 200])) == 400
    assert await status_of(admin.begin_batch("t", -1, "q1")) == 400
