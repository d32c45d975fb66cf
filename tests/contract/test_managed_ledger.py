"""One contract suite for every ManagedLedgerFactory: memory (reference), files, and
JetStream (a real 3-node NATS cluster, R3, fsync before ack, no tail cache so every read
goes to the stream)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from anabranch.errors import InvalidArgument, LedgerFenced, LedgerSealed
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.storage.api import (
    EARLIEST,
    LATEST,
    ManagedLedger,
    ManagedLedgerConfig,
    ManagedLedgerFactory,
    Position,
)
from anabranch.storage.jetstream_client import StreamNotFound
from anabranch.storage.jetstream_ledger import (
    JetStreamManagedLedger,
    JetStreamManagedLedgerFactory,
)
from anabranch.storage.ledger import FileManagedLedgerFactory
from anabranch.storage.memory import MemoryManagedLedgerFactory
from anabranch.testing.nats import NatsCluster

SMALL = ManagedLedgerConfig(ledger_entries_max=3, cursor_persist_interval_ms=10_000)


@dataclass
class Backend:
    kind: str
    tmp: Path
    store: MemoryMetadataStore = field(default_factory=MemoryMetadataStore)
    factories: list[ManagedLedgerFactory] = field(default_factory=list)
    nats: NatsCluster | None = None
    prefix: str = "ab"

    def factory(self) -> ManagedLedgerFactory:
        """A factory over the same durable state (a restarted broker for files)."""
        if self.kind == "memory":
            if not self.factories:
                self.factories.append(MemoryManagedLedgerFactory())
            return self.factories[0]
        made: ManagedLedgerFactory
        if self.kind == "jetstream":
            assert self.nats is not None
            made = JetStreamManagedLedgerFactory(
                self.nats.urls, self.store, prefix=self.prefix, tail_cache_bytes=0
            )
        else:
            made = FileManagedLedgerFactory(self.tmp / "data", self.store)
        self.factories.append(made)
        return made

    async def open(self, name: str = "t", config: ManagedLedgerConfig = SMALL) -> ManagedLedger:
        return await self.factory().open(name, config)


_tests = itertools.count()


@pytest.fixture(params=["memory", "files", "jetstream"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    b = Backend(request.param, tmp_path)
    if request.param == "jetstream":
        b.nats = request.getfixturevalue("nats_cluster")
        b.prefix = f"t{next(_tests)}"  # each test its own streams on the shared cluster
    try:
        yield b
    finally:
        for f in b.factories:
            await f.close()
        await b.store.close()


async def fill(ml: ManagedLedger, n: int, prefix: str = "m") -> list[Position]:
    return [await ml.append(f"{prefix}{i}".encode()) for i in range(n)]


async def test_positions_increase_across_rollover(backend: Backend) -> None:
    ml = await backend.open()
    positions = await fill(ml, 10)
    assert positions == sorted(positions) and len(set(positions)) == 10
    assert len({p.ledger_id for p in positions}) == 4  # 3 entries per ledger
    assert [p.entry_id for p in positions[:4]] == [0, 1, 2, 0]
    assert ml.last_confirmed == positions[-1]
    assert ml.entry_count == 10
    entries = await ml.read(EARLIEST, max_entries=100)
    assert [e.data for e in entries] == [f"m{i}".encode() for i in range(10)]
    assert [e.position for e in entries] == positions
    mid = await ml.read(positions[4], max_entries=3)
    assert [e.position for e in mid] == positions[4:7]
    # A position just past a ledger's end continues in the next ledger.
    after_first_ledger = await ml.read(positions[2].next(), max_entries=1)
    assert after_first_ledger[0].position == positions[3]
    assert await ml.read(ml.last_confirmed.next()) == []


async def test_read_byte_budget_returns_at_least_one(backend: Backend) -> None:
    ml = await backend.open()
    await ml.append(b"x" * 100)
    await ml.append(b"y" * 100)
    assert len(await ml.read(EARLIEST, max_entries=10, max_bytes=10)) == 1
    assert len(await ml.read(EARLIEST, max_entries=10, max_bytes=150)) == 1
    assert len(await ml.read(EARLIEST, max_entries=10, max_bytes=200)) == 2
    with pytest.raises(InvalidArgument):
        await ml.read(EARLIEST, max_entries=0)


async def test_append_many_in_order(backend: Backend) -> None:
    ml = await backend.open()
    positions = await ml.append_many([b"a", b"b", b"c", b"d"])
    assert positions == sorted(positions)
    assert [e.data for e in await ml.read(positions[0], 10)] == [b"a", b"b", b"c", b"d"]


async def test_append_many_interleaves_with_appends_across_rollover(backend: Backend) -> None:
    ml = await backend.open()  # 3 entries per ledger: the burst spans ledgers
    single = asyncio.ensure_future(ml.append(b"s0"))
    burst = asyncio.ensure_future(ml.append_many([f"b{i}".encode() for i in range(7)]))
    after = asyncio.ensure_future(ml.append(b"s1"))
    positions = [await single, *await burst, await after]
    assert positions == sorted(positions) and len(set(positions)) == 9
    entries = await ml.read(EARLIEST, 100)
    assert [e.position for e in entries] == positions
    assert [e.data for e in entries] == [b"s0", *(f"b{i}".encode() for i in range(7)), b"s1"]
    assert await ml.append_many([]) == []


async def test_cancelling_one_append_leaves_the_others(backend: Backend) -> None:
    ml = await backend.open(config=ManagedLedgerConfig(ledger_entries_max=1000))
    tasks = [asyncio.ensure_future(ml.append(f"e{i}".encode())) for i in range(20)]
    await asyncio.sleep(0)  # every append is queued (one batch in the file backend)
    tasks[3].cancel()
    tasks[11].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    kept = [(i, r) for i, r in enumerate(done) if isinstance(r, Position)]
    assert {i for i, _ in kept} >= set(range(20)) - {3, 11}  # only the cancelled ones may fail
    assert all(isinstance(r, asyncio.CancelledError) for r in done if not isinstance(r, Position))
    stored = {e.position: e.data for e in await ml.read(EARLIEST, 100)}
    for i, position in kept:
        assert stored[position] == f"e{i}".encode()
    # A cancelled append was either stored whole or not at all; later appends still work.
    assert len(stored) in (18, 19, 20)
    assert (await ml.read(await ml.append(b"later")))[0].data == b"later"


async def test_data_survives_reopen_and_reopen_fences(backend: Backend) -> None:
    ml = await backend.open()
    positions = await fill(ml, 5)
    ml2 = await backend.open()
    assert [e.position for e in await ml2.read(EARLIEST, 100)] == positions
    with pytest.raises(LedgerFenced):
        await ml.append(b"late")
    new = await ml2.append(b"new")
    assert new > positions[-1]
    assert (await ml2.read(new))[0].data == b"new"


async def test_wait_for_entries(backend: Backend) -> None:
    ml = await backend.open()
    first = await ml.append(b"1")
    await ml.wait_for_entries(EARLIEST)  # already satisfied
    waiter = asyncio.ensure_future(ml.wait_for_entries(first))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    second = await ml.append(b"2")
    await waiter
    assert ml.last_confirmed == second
    sealed_waiter = asyncio.ensure_future(ml.wait_for_entries(second))
    await asyncio.sleep(0.01)
    assert not sealed_waiter.done()
    await ml.terminate()
    await sealed_waiter


async def test_terminate_seals(backend: Backend) -> None:
    ml = await backend.open()
    positions = await fill(ml, 4)
    end = await ml.terminate()
    assert end == positions[-1] == ml.terminated_at
    assert ml.is_terminated
    assert await ml.terminate() == end  # idempotent
    with pytest.raises(LedgerSealed):
        await ml.append(b"after")
    assert len(await ml.read(EARLIEST, 100)) == 4
    await ml.close()
    reopened = await backend.open()
    assert reopened.is_terminated and reopened.terminated_at == end
    with pytest.raises(LedgerSealed):
        await reopened.append(b"after reopen")
    assert [e.position for e in await reopened.read(EARLIEST, 100)] == positions


async def test_terminate_empty(backend: Backend) -> None:
    ml = await backend.open()
    assert await ml.terminate() == EARLIEST
    with pytest.raises(LedgerSealed):
        await ml.append(b"x")


async def test_cursor_cumulative_individual_backlog(backend: Backend) -> None:
    ml = await backend.open()
    positions = await fill(ml, 8)
    cursor = await ml.open_cursor("sub", EARLIEST)
    assert cursor.backlog() == 8
    assert cursor.read_position == positions[0]
    await cursor.acknowledge_cumulative(positions[1])
    assert cursor.mark_delete_position == positions[1]
    assert cursor.backlog() == 6
    await cursor.acknowledge([positions[3], positions[4], positions[6]])
    assert cursor.backlog() == 3
    assert cursor.is_acknowledged(positions[3]) and not cursor.is_acknowledged(positions[2])
    # Acking the gap absorbs the ranges into mark-delete, across a ledger boundary.
    await cursor.acknowledge([positions[2]])
    assert cursor.mark_delete_position == positions[4]
    assert cursor.read_position == positions[5]
    assert cursor.backlog() == 2
    with pytest.raises(InvalidArgument):
        await cursor.acknowledge([ml.last_confirmed.next()])
    latest = await ml.open_cursor("tail", LATEST)
    assert latest.backlog() == 0
    await ml.append(b"more")
    assert latest.backlog() == 1 and cursor.backlog() == 3
    assert {c.name for c in ml.cursors()} == {"sub", "tail"}


async def test_cursor_reset(backend: Backend) -> None:
    ml = await backend.open()
    positions = await fill(ml, 6)
    cursor = await ml.open_cursor("sub", EARLIEST)
    await cursor.acknowledge_cumulative(positions[5])
    assert cursor.backlog() == 0
    await cursor.reset(positions[2])
    assert cursor.read_position == positions[2]
    assert cursor.backlog() == 4
    assert not cursor.is_acknowledged(positions[2]) and cursor.is_acknowledged(positions[1])
    await cursor.reset(EARLIEST)
    assert cursor.backlog() == 6
    await cursor.reset(LATEST)
    assert cursor.backlog() == 0


async def test_cursors_durable_across_reopen(backend: Backend) -> None:
    ml = await backend.open()
    positions = await fill(ml, 7)
    a = await ml.open_cursor("a", EARLIEST)
    b = await ml.open_cursor("b", EARLIEST)
    await a.acknowledge_cumulative(positions[2])
    await a.acknowledge([positions[5]])
    await a.set_batch_ack_state(positions[4], b"\x05")
    await a.flush()
    await b.acknowledge_cumulative(positions[0])
    await ml.close()  # close persists b's unflushed change
    ml2 = await backend.open()
    a2 = await ml2.open_cursor("a", LATEST)  # existing: the initial position is ignored
    b2 = await ml2.open_cursor("b")
    assert a2.mark_delete_position == positions[2]
    assert a2.is_acknowledged(positions[5]) and not a2.is_acknowledged(positions[4])
    assert a2.batch_ack_state(positions[4]) == b"\x05"
    assert a2.backlog() == 3
    assert b2.mark_delete_position == positions[0]
    await ml2.delete_cursor("b")
    await ml2.close()
    ml3 = await backend.open()
    assert [c.name for c in ml3.cursors()] == ["a"]


async def test_fenced_owner_cannot_persist_cursor(backend: Backend) -> None:
    ml = await backend.open()
    p = await ml.append(b"x")
    cursor = await ml.open_cursor("sub", EARLIEST)
    await backend.open()
    with pytest.raises(LedgerFenced):
        await cursor.acknowledge_cumulative(p)
        await cursor.flush()


async def test_trim_below_slowest_cursor(backend: Backend) -> None:
    ml = await backend.open()
    positions = await fill(ml, 10)  # ledgers of 3, 3, 3, 1
    slow = await ml.open_cursor("slow", EARLIEST)
    fast = await ml.open_cursor("fast", EARLIEST)
    await fast.acknowledge_cumulative(positions[9])
    assert await ml.trim() == 0  # "slow" has read nothing
    await slow.acknowledge_cumulative(positions[6])  # first two ledgers fully consumed
    assert await ml.trim() == 2
    assert ml.entry_count == 4
    entries = await ml.read(EARLIEST, 100)
    assert [e.position for e in entries] == positions[6:]
    assert slow.backlog() == 3 and fast.backlog() == 0
    await ml.close()
    ml2 = await backend.open()
    assert [e.position for e in await ml2.read(EARLIEST, 100)] == positions[6:]


async def test_a_trim_of_every_entry_keeps_the_end_across_reopen(backend: Backend) -> None:
    ml = await backend.open()
    positions = await fill(ml, 6)  # two full ledgers
    cursor = await ml.open_cursor("c", EARLIEST)
    await cursor.acknowledge_cumulative(positions[-1])
    await cursor.flush()
    await ml.close()
    ml = await backend.open()  # every backend closes both and opens an empty ledger
    assert await ml.trim() == 2
    assert ml.entry_count == 0
    end = ml.last_confirmed
    assert end > positions[-1] and end.entry_id == -1  # not EARLIEST: ids never go back
    assert (await ml.open_cursor("c", EARLIEST)).backlog() == 0
    await ml.close()
    ml = await backend.open()
    assert ml.last_confirmed > positions[-1]
    assert ml.last_confirmed.entry_id == -1
    later = await ml.append(b"later")
    assert later > positions[-1] and ml.last_confirmed == later


async def test_trim_respects_retention(backend: Backend) -> None:
    keep = ManagedLedgerConfig(ledger_entries_max=3, retention_ms=-1, retention_bytes=-1)
    ml = await backend.open(config=keep)
    positions = await fill(ml, 7)
    cursor = await ml.open_cursor("c", EARLIEST)
    await cursor.acknowledge_cumulative(positions[-1])
    assert await ml.trim() == 0
    await cursor.flush()
    sized = ManagedLedgerConfig(ledger_entries_max=3, retention_ms=-1, retention_bytes=4)
    ml2 = await backend.open(config=sized)  # 6 bytes per full ledger: 2 must go
    assert await ml2.trim() == 2
    assert ml2.entry_count == 1


async def test_delete(backend: Backend) -> None:
    ml = await backend.open("doomed")
    await fill(ml, 5)
    await ml.open_cursor("c", EARLIEST)
    await ml.delete()
    fresh = await backend.open("doomed")
    assert fresh.entry_count == 0 and fresh.cursors() == []
    assert await fresh.read(EARLIEST) == []
    if backend.kind == "files":
        await fresh.delete()
        assert not (backend.tmp / "data" / "doomed").exists()
        assert (await backend.store.list_prefix("/managed-ledgers/")).records == []
        assert (await backend.store.list_prefix("/ledgers/")).records == []
    if backend.kind == "jetstream":
        assert isinstance(fresh, JetStreamManagedLedger)
        stream = fresh.stream
        await fresh.delete()
        client = await backend.factories[-1].client()  # type: ignore[attr-defined]
        with pytest.raises(StreamNotFound):
            await client.stream_info(stream)
        assert (await backend.store.list_prefix("/js-managed-ledgers/")).records == []


async def test_concurrent_appends_get_distinct_ordered_positions(backend: Backend) -> None:
    ml = await backend.open(config=ManagedLedgerConfig(ledger_entries_max=50))
    results = await asyncio.gather(*(ml.append(str(i).encode()) for i in range(200)))
    assert len(set(results)) == 200
    assert results == sorted(results)  # call order = position order
    entries = await ml.read(EARLIEST, 1000)
    assert [e.data for e in entries] == [str(i).encode() for i in range(200)]


@pytest.mark.parametrize("kind", ["memory", "files"])
async def test_an_idle_ledger_rolls_over_when_due_and_is_then_trimmed(
    kind: str, tmp_path: Path
) -> None:
    from anabranch.testing.clock import ManualClock

    clock = ManualClock()
    store = MemoryMetadataStore()
    factory: ManagedLedgerFactory = (
        MemoryManagedLedgerFactory(clock)
        if kind == "memory"
        else FileManagedLedgerFactory(tmp_path / "data", store, clock=clock)
    )
    try:
        config = ManagedLedgerConfig(ledger_entries_max=100, ledger_age_ms=60_000)
        ml = await factory.open("idle", config)
        assert not await ml.roll_over_if_due()  # empty: nothing to roll
        positions = await fill(ml, 3)
        cursor = await ml.open_cursor("c", EARLIEST)
        await cursor.acknowledge_cumulative(positions[-1])
        assert not await ml.roll_over_if_due()  # young
        assert await ml.trim() == 0  # the open ledger is never trimmed
        clock.advance(61)
        assert await ml.roll_over_if_due()
        assert await ml.trim() == 1
        assert ml.entry_count == 0 and cursor.backlog() == 0
        later = await ml.append(b"later")
        assert later.ledger_id > positions[-1].ledger_id
        assert [e.data for e in await ml.read(EARLIEST, 10)] == [b"later"]
        await ml.close()
    finally:
        await factory.close()
        await store.close()
