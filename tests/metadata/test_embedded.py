"""Behaviour specific to the embedded stores: injected clock, bounds, SQLite restarts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from anabranch import limits
from anabranch.errors import Compacted, SessionExpired
from anabranch.metadata import memory, sqlite
from anabranch.metadata.api import Delete, EventKind, MetadataStore, Put
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.metadata.sqlite import SqliteMetadataStore
from anabranch.testing.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["memory", "sqlite"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock
) -> AsyncIterator[MetadataStore]:
    backend: MemoryMetadataStore | SqliteMetadataStore
    if request.param == "memory":
        backend = MemoryMetadataStore(clock)
    else:
        backend = await SqliteMetadataStore.open(tmp_path / "meta.db", clock=clock)
    try:
        yield backend
    finally:
        await backend.close()


async def test_manual_clock_expires_session_at_next_call(
    store: MetadataStore, clock: ManualClock
) -> None:
    session = await store.open_session(10.0, auto_keepalive=False)
    await store.put("/eph", b"", session=session)
    clock.advance(6.0)
    await session.keepalive()  # deadline moves to now + 10
    clock.advance(6.0)
    assert not session.expired
    clock.advance(4.0)
    assert session.expired
    with pytest.raises(SessionExpired):
        await store.put("/eph2", b"", session=session)
    await session.wait_expired()
    assert await store.get("/eph") is None


async def test_sweeper_expires_idle_sessions_with_a_delete_event(
    store: MetadataStore, clock: ManualClock
) -> None:
    session = await store.open_session(5.0, auto_keepalive=False)
    stat = await store.put("/idle", b"", session=session)
    watch = store.watch("/idle", start_revision=stat.mod_revision + 1)
    clock.advance(5.0)
    event = await watch.__anext__()  # no store call: the sweeper did it
    await watch.close()
    assert (event.kind, event.path) == (EventKind.DELETE, "/idle")
    assert session.expired


async def test_auto_keepalive_survives_many_ttls_in_small_steps(
    store: MetadataStore, clock: ManualClock
) -> None:
    session = await store.open_session(3.0)
    await store.put("/kept", b"", session=session)
    for _ in range(30):  # 30 s = 10 TTLs, in steps of a third of one
        clock.advance(1.0)
        await clock.settle()
    assert not session.expired
    assert await store.get("/kept") is not None
    await session.close()
    assert await store.get("/kept") is None


async def test_slow_watcher_overflow_ends_with_compacted(
    store: MetadataStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "METADATA_WATCH_QUEUE_EVENTS_MAX", 5)
    watch = store.watch("/slow/", prefix=True)
    for i in range(6):
        await store.put(f"/slow/{i}", b"")
    with pytest.raises(Compacted):
        await watch.__anext__()
    with pytest.raises(StopAsyncIteration):
        await watch.__anext__()


async def test_history_is_compacted_past_its_bound(
    store: MetadataStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "METADATA_CHANGELOG_REVISIONS_MAX", 10)
    monkeypatch.setattr(memory, "HISTORY_TRIM_REVISIONS", 1)
    monkeypatch.setattr(sqlite, "AUTO_COMPACT_SLACK_REVISIONS", 1)
    first = await store.put("/hist", b"0")
    for i in range(1, 30):
        last = await store.put("/hist", str(i).encode())
    with pytest.raises(Compacted) as err:
        await store.watch("/hist", start_revision=first.mod_revision).__anext__()
    assert err.value.compact_revision > first.mod_revision
    recent = store.watch("/hist", start_revision=last.mod_revision)
    assert (await recent.__anext__()).value == b"29"
    await recent.close()


async def test_sqlite_survives_restart_and_replays_history(tmp_path: Path) -> None:
    store = await SqliteMetadataStore.open(tmp_path / "meta.db")
    first = await store.put("/a", b"1")
    await store.put("/b", b"2")
    await store.close()
    again = await SqliteMetadataStore.open(tmp_path / "meta.db")
    try:
        assert await again.current_revision() == first.mod_revision + 1
        watch = again.watch("/", prefix=True, start_revision=first.mod_revision)
        replayed = [await watch.__anext__() for _ in range(2)]
        third = await again.put("/a", b"3")
        live = await watch.__anext__()
        await watch.close()
    finally:
        await again.close()
    assert [(e.path, e.value) for e in replayed] == [("/a", b"1"), ("/b", b"2")]
    assert (live.path, live.value, live.version, live.revision) == (
        "/a",
        b"3",
        2,
        third.mod_revision,
    )


async def test_sqlite_batches_larger_than_one_statement_survive_restart(tmp_path: Path) -> None:
    # The writer stores a batch with multi-row statements of at most
    # _ROWS_PER_STATEMENT rows: concurrent commits (one group-commit batch when they
    # meet in the queue) of several chunks and a remainder must land whole, deletes
    # included, and replay from the changelog.
    size, per_commit = 2 * sqlite._ROWS_PER_STATEMENT + 7, limits.METADATA_TXN_OPS_MAX
    names = [f"/big/{n:04}" for n in range(size)]
    slices = [range(start, min(start + per_commit, size)) for start in range(0, size, per_commit)]
    store = await SqliteMetadataStore.open(tmp_path / "meta.db")
    try:
        await asyncio.gather(
            *(store.commit([Put(names[n], bytes([n % 256])) for n in part]) for part in slices)
        )
        middle = await store.current_revision()
        await asyncio.gather(
            *(
                store.commit(
                    [Delete(names[n]) if n % 2 == 0 else Put(names[n], b"again") for n in part]
                )
                for part in slices
            )
        )
    finally:
        await store.close()
    again = await SqliteMetadataStore.open(tmp_path / "meta.db")
    try:
        page = await again.list_prefix("/big/")
        # A sentinel ends the replay, so a lost changelog row fails instead of hanging.
        await again.put("/big/~end", b"")
        watch = again.watch("/big/", prefix=True, start_revision=1)
        replayed = []
        while (event := await watch.__anext__()).path != "/big/~end":
            replayed.append(event)
        await watch.close()
    finally:
        await again.close()
    odd = names[1::2]
    assert [(r.path, r.value, r.stat.version) for r in page.records] == [
        (path, b"again", 2) for path in odd
    ]
    assert len(replayed) == 2 * size
    created, changed = replayed[:size], replayed[size:]
    assert sorted((e.kind, e.path, e.version) for e in created) == [
        (EventKind.PUT, path, 1) for path in names
    ]
    assert all(e.revision <= middle for e in created)
    assert sorted((e.kind.name, e.path) for e in changed) == sorted(
        [("DELETE", path) for path in names[::2]] + [("PUT", path) for path in odd]
    )
    assert all(e.revision > middle for e in changed)


async def test_sqlite_sessions_of_a_dead_process_expire_one_ttl_after_restart(
    tmp_path: Path,
) -> None:
    old_clock = ManualClock()
    store = await SqliteMetadataStore.open(tmp_path / "meta.db", clock=old_clock)
    session = await store.open_session(10.0)
    await store.put("/owned", b"", session=session)
    await store.close()  # like a crash: the session row and its key stay on disk

    clock = ManualClock()
    again = await SqliteMetadataStore.open(tmp_path / "meta.db", clock=clock)
    try:
        clock.advance(9.0)
        await clock.settle()
        assert await again.get("/owned") is not None
        stat = (await again.list_prefix("/owned")).revision
        watch = again.watch("/owned", start_revision=stat + 1)
        clock.advance(1.0)
        event = await watch.__anext__()
        await watch.close()
    finally:
        await again.close()
    assert (event.kind, event.path) == (EventKind.DELETE, "/owned")
