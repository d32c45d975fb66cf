"""The metadata-store contract: every backend (memory, SQLite, etcd) must pass all of it.

Revisions are compared relative to each other, never as absolute numbers, because the
etcd backend shares one server (and its global revision counter) between tests.
Session tests use real, short TTLs (etcd cannot take a fake clock) but never assert on
durations: they wait for the event (a DELETE on a watch) instead.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from anabranch import limits
from anabranch.errors import (
    BadVersion,
    Closed,
    Compacted,
    InvalidArgument,
    SessionExpired,
    ValueTooLarge,
)
from anabranch.metadata.api import (
    MUST_NOT_EXIST,
    Check,
    Delete,
    EventKind,
    MetadataStore,
    Put,
    Record,
    Watch,
    WatchEvent,
)

SESSION_TTL_S = 1.0
"""Short but above etcd's 1 s minimum lease in the test server."""


async def take(watch: Watch, count: int) -> list[WatchEvent]:
    return [await watch.__anext__() for _ in range(count)]


def summary(events: list[WatchEvent]) -> list[tuple[EventKind, str, bytes, int]]:
    return [(e.kind, e.path, e.value, e.version) for e in events]


async def snapshot(store: MetadataStore, prefix: str = "/") -> tuple[int, list[Record]]:
    page = await store.list_prefix(prefix)
    return page.revision, page.records


# --- get / put / delete ----------------------------------------------------------------------


async def test_get_absent_is_none(store: MetadataStore) -> None:
    assert await store.get("/nothing/here") is None


async def test_put_creates_then_bumps_version(store: MetadataStore) -> None:
    first = await store.put("/k", b"1")
    second = await store.put("/k", b"2")
    record = await store.get("/k")
    assert first.version == 1
    assert second.version == 2
    assert second.create_revision == first.create_revision == first.mod_revision
    assert second.mod_revision > first.mod_revision
    assert record is not None
    assert (record.value, record.stat) == (b"2", second)
    assert await store.current_revision() >= second.mod_revision


async def test_expected_version_forms(store: MetadataStore) -> None:
    created = await store.put("/v", b"a", expected_version=MUST_NOT_EXIST)
    exact = await store.put("/v", b"b", expected_version=created.version)
    anything = await store.put("/v", b"c", expected_version=None)
    assert (created.version, exact.version, anything.version) == (1, 2, 3)
    with pytest.raises(BadVersion) as must_not_exist:
        await store.put("/v", b"x", expected_version=MUST_NOT_EXIST)
    assert (must_not_exist.value.path, must_not_exist.value.expected) == ("/v", 0)
    assert must_not_exist.value.actual == 3
    with pytest.raises(BadVersion) as stale:
        await store.put("/v", b"x", expected_version=2)
    assert (stale.value.expected, stale.value.actual) == (2, 3)
    with pytest.raises(BadVersion) as absent:
        await store.put("/absent", b"x", expected_version=1)
    assert (absent.value.path, absent.value.actual) == ("/absent", 0)


async def test_bad_version_leaves_store_unchanged(store: MetadataStore) -> None:
    await store.put("/u", b"keep")
    before = await snapshot(store)
    with pytest.raises(BadVersion):
        await store.put("/u", b"lost", expected_version=7)
    with pytest.raises(BadVersion):
        await store.delete("/u", expected_version=7)
    with pytest.raises(BadVersion):
        await store.commit([Put("/u2", b"x"), Check("/u", expected_version=7)])
    assert await snapshot(store) == before
    assert await store.current_revision() == before[0]


async def test_delete_semantics(store: MetadataStore) -> None:
    assert await store.delete("/d") is False
    assert await store.delete("/d", expected_version=MUST_NOT_EXIST) is False
    stat = await store.put("/d", b"x")
    with pytest.raises(BadVersion) as err:
        await store.delete("/d", expected_version=stat.version + 1)
    assert err.value.actual == stat.version
    assert await store.get("/d") is not None
    assert await store.delete("/d", expected_version=stat.version) is True
    assert await store.get("/d") is None
    with pytest.raises(BadVersion):
        await store.delete("/d", expected_version=1)


async def test_recreated_key_starts_at_version_one_with_new_create_revision(
    store: MetadataStore,
) -> None:
    first = await store.put("/r", b"1")
    await store.delete("/r")
    second = await store.put("/r", b"2", expected_version=MUST_NOT_EXIST)
    assert second.version == 1
    assert second.create_revision > first.create_revision


# --- commit ----------------------------------------------------------------------------------


async def test_commit_applies_every_op_at_one_revision(store: MetadataStore) -> None:
    await store.put("/c/old", b"o")
    guard = await store.put("/c/guard", b"g")
    result = await store.commit(
        [
            Put("/c/a", b"1", expected_version=MUST_NOT_EXIST),
            Put("/c/b", b"2"),
            Delete("/c/old"),
            Delete("/c/missing"),
            Check("/c/guard", expected_version=guard.version),
            Check("/c/guard", expected_create_revision=guard.create_revision),
        ]
    )
    stat_a, stat_b, deleted, not_deleted, check1, check2 = result.results
    assert isinstance(stat_a, type(guard)) and isinstance(stat_b, type(guard))
    assert stat_a.mod_revision == stat_b.mod_revision == result.revision
    assert (deleted, not_deleted, check1, check2) == (True, False, None, None)
    assert [r.path for r in (await store.list_prefix("/c/")).records] == [
        "/c/a",
        "/c/b",
        "/c/guard",
    ]


async def test_failing_check_aborts_every_write(store: MetadataStore) -> None:
    await store.put("/t/existing", b"e")
    before = await snapshot(store)
    with pytest.raises(BadVersion) as err:
        await store.commit(
            [
                Put("/t/a", b"1"),
                Delete("/t/existing"),
                Check("/t/nope", expected_version=5),
                Put("/t/b", b"2"),
            ]
        )
    assert err.value.path == "/t/nope"
    assert await snapshot(store) == before


async def test_check_on_create_revision_fences_a_recreated_key(store: MetadataStore) -> None:
    old = await store.put("/leader", b"me")
    await store.delete("/leader")
    await store.put("/leader", b"other")
    with pytest.raises(BadVersion) as err:
        await store.commit(
            [Check("/leader", expected_create_revision=old.create_revision), Put("/w", b"x")]
        )
    assert err.value.path == "/leader"
    assert await store.get("/w") is None


async def test_commit_writing_one_path_twice_is_rejected(store: MetadataStore) -> None:
    before = await snapshot(store)
    with pytest.raises(InvalidArgument):
        await store.commit([Put("/dup", b"1"), Put("/dup", b"2")])
    with pytest.raises(InvalidArgument):
        await store.commit([Put("/dup", b"1"), Delete("/dup")])
    with pytest.raises(InvalidArgument):
        await store.commit([Put(f"/many/{i}", b"") for i in range(limits.METADATA_TXN_OPS_MAX + 1)])
    assert await snapshot(store) == before


async def test_concurrent_cas_failures_do_not_affect_their_neighbours(
    store: MetadataStore,
) -> None:
    stats = [await store.put(f"/batch/{i:02d}", b"0") for i in range(40)]

    async def cas(i: int) -> str:
        expected = stats[i].version if i % 2 == 0 else stats[i].version + 5
        try:
            await store.put(f"/batch/{i:02d}", b"1", expected_version=expected)
        except BadVersion:
            return "bad"
        return "ok"

    outcomes = await asyncio.gather(*(cas(i) for i in range(40)))
    assert outcomes == ["ok" if i % 2 == 0 else "bad" for i in range(40)]
    values = [r.value for r in (await store.list_prefix("/batch/")).records]
    assert values == [b"1" if i % 2 == 0 else b"0" for i in range(40)]


async def test_racing_creates_and_cas_have_one_winner_each_around_a_compaction(
    store: MetadataStore,
) -> None:
    """Writes queued together (one group commit where the backend has them) with a
    compaction among them: each condition is judged on the writes before it."""
    revision = await store.current_revision()

    async def attempt(expected: int) -> bool:
        try:
            await store.put("/race/k", b"v", expected_version=expected)
        except BadVersion:
            return False
        return True

    async def compact() -> bool:
        await store.compact(revision)
        return False

    creates = [attempt(MUST_NOT_EXIST) for _ in range(15)]
    won = await asyncio.gather(*creates[:5], compact(), *creates[5:])
    assert sum(won) == 1
    updates = [attempt(1) for _ in range(15)]
    won = await asyncio.gather(*updates[:7], compact(), *updates[7:])
    assert sum(won) == 1
    record = await store.get("/race/k")
    assert record is not None and record.stat.version == 2


# --- listings --------------------------------------------------------------------------------


async def test_list_prefix_pages_in_order_to_exhaustion(store: MetadataStore) -> None:
    names = [f"/l/{i:03d}" for i in range(25)]
    for name in random.Random(7).sample(names, len(names)):
        await store.put(name, name.encode())
    await store.put("/l0", b"outside")  # sorts right after the prefix
    await store.put("/k/z", b"outside")
    seen: list[str] = []
    start_after: str | None = None
    while True:
        page = await store.list_prefix("/l/", limit=7, start_after=start_after)
        seen.extend(r.path for r in page.records)
        assert all(r.value == r.path.encode() for r in page.records)
        if not page.more:
            break
        assert len(page.records) == 7
        start_after = page.records[-1].path
    assert seen == names


async def test_list_range_is_half_open_and_pages(store: MetadataStore) -> None:
    for i in range(10):
        await store.put(f"/r/{i}", b"")
    page = await store.list_range("/r/2", "/r/5")
    assert [r.path for r in page.records] == ["/r/2", "/r/3", "/r/4"]
    assert page.more is False
    seen: list[str] = []
    start = "/r/"
    while True:
        page = await store.list_range(start, "/r0", limit=4)
        seen.extend(r.path for r in page.records)
        if not page.more:
            break
        start = page.records[-1].path + "\x00"
    assert seen == [f"/r/{i}" for i in range(10)]


async def test_listing_revision_covers_its_records(store: MetadataStore) -> None:
    stat = await store.put("/rev/a", b"")
    page = await store.list_prefix("/rev/")
    assert page.revision >= stat.mod_revision
    assert page.records[0].stat == stat


async def test_list_children_names_direct_children_sorted(store: MetadataStore) -> None:
    for path in ["/p/b/deep/x", "/p/a", "/p/b", "/p/b!", "/p/c/y", "/pz", "/q"]:
        await store.put(path, b"")
    assert await store.list_children("/p") == ["a", "b", "b!", "c"]
    assert await store.list_children("/p/b") == ["deep"]
    assert await store.list_children("/p/a") == []
    assert await store.list_children("/none") == []


# --- sequential keys -------------------------------------------------------------------------


async def test_sequential_keys_strictly_increase_under_concurrency(store: MetadataStore) -> None:
    created = await asyncio.gather(
        *(store.create_sequential("/seq/item-", str(i).encode()) for i in range(50))
    )
    assert len(set(created)) == 50
    assert all(name.startswith("/seq/item-") for name in created)
    listed = [r.path for r in (await store.list_prefix("/seq/item-")).records]
    assert listed == sorted(created)
    # Creation order equals name order: later creations always sort later.
    later = await store.create_sequential("/seq/item-", b"last")
    assert later > max(created)
    await store.delete(later)
    assert await store.create_sequential("/seq/item-", b"after delete") > later


# --- sessions --------------------------------------------------------------------------------


async def test_ephemeral_key_deleted_on_session_close(store: MetadataStore) -> None:
    session = await store.open_session(SESSION_TTL_S)
    stat = await store.put("/e/closed", b"x", session=session)
    assert stat.session_id == session.id
    await store.put("/e/durable", b"y")
    await session.close()
    await session.close()  # idempotent
    assert session.expired
    assert await store.get("/e/closed") is None
    assert await store.get("/e/durable") is not None
    with pytest.raises(SessionExpired):
        await store.put("/e/again", b"z", session=session)


async def test_ephemeral_key_deleted_on_expiry(store: MetadataStore) -> None:
    session = await store.open_session(SESSION_TTL_S, auto_keepalive=False)
    stat = await store.put("/e/expiring", b"x", session=session)
    watch = store.watch("/e/expiring", start_revision=stat.mod_revision + 1)
    try:
        [event] = await take(watch, 1)
    finally:
        await watch.close()
    assert (event.kind, event.path) == (EventKind.DELETE, "/e/expiring")
    await session.wait_expired()
    assert session.expired
    assert await store.get("/e/expiring") is None
    with pytest.raises(SessionExpired) as err:
        await session.keepalive()
    assert err.value.session_id == session.id


async def test_keepalive_keeps_session_past_its_ttl(store: MetadataStore) -> None:
    auto = await store.open_session(SESSION_TTL_S)
    manual = await store.open_session(SESSION_TTL_S, auto_keepalive=False)
    await store.put("/e/auto", b"", session=auto)
    await store.put("/e/manual", b"", session=manual)
    for _ in range(8):  # 2 TTLs in all
        await asyncio.sleep(SESSION_TTL_S / 4)
        await manual.keepalive()
    assert not auto.expired
    assert not manual.expired
    assert await store.get("/e/auto") is not None
    assert await store.get("/e/manual") is not None
    await auto.close()
    await manual.close()


async def test_overwrite_without_session_makes_key_durable(store: MetadataStore) -> None:
    session = await store.open_session(SESSION_TTL_S)
    await store.put("/e/adopted", b"1", session=session)
    stat = await store.put("/e/adopted", b"2")
    assert stat.session_id is None
    await session.close()
    record = await store.get("/e/adopted")
    assert record is not None and record.value == b"2"


async def test_commit_put_with_session_id_is_ephemeral(store: MetadataStore) -> None:
    session = await store.open_session(SESSION_TTL_S)
    await store.commit([Put("/e/txn", b"", session_id=session.id)])
    await session.close()
    assert await store.get("/e/txn") is None


# --- watches ---------------------------------------------------------------------------------


async def test_key_watch_sees_exactly_the_writes_in_order(store: MetadataStore) -> None:
    watch = store.watch("/w/key")
    await store.put("/w/key", b"1")
    await store.put("/w/other", b"ignored")
    await store.put("/w/key2", b"ignored")
    await store.put("/w/key", b"2")
    await store.delete("/w/key")
    events = await take(watch, 3)
    await watch.close()
    assert summary(events) == [
        (EventKind.PUT, "/w/key", b"1", 1),
        (EventKind.PUT, "/w/key", b"2", 2),
        (EventKind.DELETE, "/w/key", b"", 0),
    ]
    assert [e.revision for e in events] == sorted({e.revision for e in events})


async def test_prefix_watch_includes_commits_in_op_order(store: MetadataStore) -> None:
    watch = store.watch("/w/", prefix=True)
    await store.put("/w/a", b"1")
    result = await store.commit([Put("/w/c", b"2"), Put("/w/b", b"3"), Put("/x", b"no")])
    await store.delete("/w/a")
    await store.put("/w0", b"outside")  # shares the string prefix '/w' but not '/w/'
    await store.put("/w/z", b"4")
    events = await take(watch, 5)
    await watch.close()
    assert summary(events) == [
        (EventKind.PUT, "/w/a", b"1", 1),
        (EventKind.PUT, "/w/c", b"2", 1),
        (EventKind.PUT, "/w/b", b"3", 1),
        (EventKind.DELETE, "/w/a", b"", 0),
        (EventKind.PUT, "/w/z", b"4", 1),
    ]
    assert events[1].revision == events[2].revision == result.revision
    assert events[0].revision < events[1].revision < events[3].revision < events[4].revision


async def test_watch_from_past_revision_replays_then_goes_live(store: MetadataStore) -> None:
    first = await store.put("/h/a", b"1")
    await store.put("/h/b", b"2")
    await store.delete("/h/a")
    watch = store.watch("/h/", prefix=True, start_revision=first.mod_revision)
    replayed = await take(watch, 3)
    await store.put("/h/c", b"3")
    [live] = await take(watch, 1)
    await watch.close()
    assert summary([*replayed, live]) == [
        (EventKind.PUT, "/h/a", b"1", 1),
        (EventKind.PUT, "/h/b", b"2", 1),
        (EventKind.DELETE, "/h/a", b"", 0),
        (EventKind.PUT, "/h/c", b"3", 1),
    ]
    assert replayed[0].revision == first.mod_revision


async def test_list_then_watch_hands_off_without_gaps_or_duplicates(
    store: MetadataStore,
) -> None:
    total = 60
    started = asyncio.Event()

    async def writer() -> None:
        for i in range(total):
            await store.put(f"/hand/{i:03d}", b"")
            if i == total // 3:
                started.set()

    task = asyncio.ensure_future(writer())
    await started.wait()
    page = await store.list_prefix("/hand/")
    listed = [r.path for r in page.records]
    watch = store.watch("/hand/", prefix=True, start_revision=page.revision + 1)
    watched = await take(watch, total - len(listed))
    await watch.close()
    await task
    watched_paths = [e.path for e in watched]
    assert not set(listed) & set(watched_paths)
    assert sorted(listed + watched_paths) == [f"/hand/{i:03d}" for i in range(total)]
    assert watched_paths == sorted(watched_paths)
    assert all(e.revision > page.revision for e in watched)


async def test_watch_from_compacted_revision_raises_compacted(store: MetadataStore) -> None:
    stats = [await store.put("/cmp/k", str(i).encode()) for i in range(5)]
    await store.compact(stats[3].mod_revision)
    with pytest.raises(Compacted) as err:
        watch = store.watch("/cmp/k", start_revision=stats[0].mod_revision)
        await watch.__anext__()
    assert err.value.requested_revision == stats[0].mod_revision
    assert err.value.compact_revision >= stats[3].mod_revision
    kept = store.watch("/cmp/k", start_revision=stats[3].mod_revision)
    events = await take(kept, 2)
    await kept.close()
    assert [e.value for e in events] == [b"3", b"4"]


async def test_closed_watch_stops_iterating(store: MetadataStore) -> None:
    watch = store.watch("/stop")
    await watch.close()
    with pytest.raises(StopAsyncIteration):
        await watch.__anext__()


# --- invalid input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["relative", "", "/trailing/", "/double//slash", "/ctrl\x01char", "/" + "x" * 1100]
)
async def test_invalid_paths_are_rejected(store: MetadataStore, path: str) -> None:
    before = await snapshot(store)
    with pytest.raises(InvalidArgument):
        await store.put(path, b"x")
    with pytest.raises(InvalidArgument):
        await store.get(path)
    with pytest.raises(InvalidArgument):
        await store.commit([Put("/fine", b""), Put(path, b"")])
    assert await snapshot(store) == before


async def test_invalid_values_and_arguments_are_rejected(store: MetadataStore) -> None:
    before = await snapshot(store)
    with pytest.raises(InvalidArgument):
        await store.put("/val", "text")  # type: ignore[arg-type]
    with pytest.raises(ValueTooLarge) as err:
        await store.put("/val", b"x" * (limits.METADATA_VALUE_BYTES_MAX + 1))
    assert err.value.max_size == limits.METADATA_VALUE_BYTES_MAX
    with pytest.raises(InvalidArgument):
        await store.put("/val", b"x", expected_version=-1)
    with pytest.raises(InvalidArgument):
        await store.list_prefix("/", limit=0)
    with pytest.raises(InvalidArgument):
        await store.open_session(limits.METADATA_SESSION_TTL_MAX_S + 1)
    assert await snapshot(store) == before


# --- close -----------------------------------------------------------------------------------


async def test_calls_after_close_raise_closed(store: MetadataStore) -> None:
    await store.put("/closing", b"")
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(Closed):
        await store.get("/closing")
    with pytest.raises(Closed):
        await store.put("/closing", b"")
    with pytest.raises(Closed):
        await store.commit([Delete("/closing")])
    with pytest.raises(Closed):
        await store.list_prefix("/")
    with pytest.raises(Closed):
        await store.open_session(SESSION_TTL_S)
    with pytest.raises(Closed):  # at watch() or at the first read, depending on the backend
        watch = store.watch("/closing")
        await watch.__anext__()


async def test_close_ends_open_watches(store: MetadataStore) -> None:
    watch = store.watch("/ending")
    await store.close()
    with pytest.raises(Closed):
        await watch.__anext__()
