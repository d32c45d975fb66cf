"""The etcd backend against a real etcd: faults the contract suite cannot express.

Watches must resume without gaps or duplicates when the client's connection is cut (via a
TCP proxy) and when etcd itself restarts; leases must expire into DELETE events; errors
must carry their facts and never leak grpc types. One etcd serves the module (tests use
distinct namespaces); tests that stop their server start their own.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from anabranch import limits
from anabranch.errors import (
    BadVersion,
    Closed,
    Compacted,
    InvalidArgument,
    MetadataUnavailable,
    SessionExpired,
    ValueTooLarge,
)
from anabranch.metadata.api import Check, Delete, EventKind, Put, Record, WatchEvent
from anabranch.metadata.etcd import EtcdMetadataStore, EtcdWatch
from anabranch.testing.etcd import EtcdNotFound, EtcdServer
from anabranch.testing.tcp_proxy import TcpProxy
from tests.metadata_backends import etcd_server

__all__ = ["etcd_server"]  # a pytest fixture

_namespaces = itertools.count()

WRITE_ATTEMPTS_MAX = 1_000
"""Retries of one test write while etcd restarts (each waits 20 ms: 20 s in all)."""


@pytest.fixture
def namespace() -> str:
    return f"/etcd-test-{next(_namespaces)}"


@pytest.fixture
async def store(etcd_server: EtcdServer, namespace: str) -> AsyncIterator[EtcdMetadataStore]:
    backend = await EtcdMetadataStore.open(etcd_server.endpoint, namespace=namespace)
    try:
        yield backend
    finally:
        await backend.close()


async def put_retrying(store: EtcdMetadataStore, path: str, value: bytes) -> None:
    """Create ``path`` exactly once even if etcd is restarting.

    A create that failed with MetadataUnavailable may have landed; the retry's BadVersion
    (the key exists) says it did, so no write is ever doubled.
    """
    for _ in range(WRITE_ATTEMPTS_MAX):
        try:
            await store.put(path, value, expected_version=0)
            return
        except BadVersion:
            return
        except MetadataUnavailable:
            await asyncio.sleep(0.02)
    raise AssertionError(f"could not write {path} in {WRITE_ATTEMPTS_MAX} attempts")


async def collect(watch: EtcdWatch, count: int, progress: asyncio.Event | None = None,
                  progress_at: int = 0) -> list[WatchEvent]:  # fmt: skip
    events: list[WatchEvent] = []
    async for event in watch:
        events.append(event)
        if progress is not None and len(events) >= progress_at:
            progress.set()
        if len(events) == count:
            break
    return events


def assert_exact_sequence(events: list[WatchEvent], expected: list[tuple[str, bytes]]) -> None:
    assert [(e.path, e.value) for e in events] == expected
    assert all(e.kind is EventKind.PUT and e.version == 1 for e in events)
    revisions = [e.revision for e in events]
    assert revisions == sorted(revisions)
    assert len(set(revisions)) == len(revisions)  # one write per revision here: no repeats


# --- watch resume ----------------------------------------------------------------------------


async def test_watch_resumes_without_gaps_after_the_connection_is_cut(
    etcd_server: EtcdServer, namespace: str
) -> None:
    proxy = await TcpProxy.start("127.0.0.1", etcd_server.client_port)
    watcher = await EtcdMetadataStore.open(proxy.endpoint, namespace=namespace)
    writer = await EtcdMetadataStore.open(etcd_server.endpoint, namespace=namespace)
    try:
        start = await writer.current_revision() + 1
        watch = watcher.watch("/drop/", prefix=True, start_revision=start)
        expected = [(f"/drop/{i:03d}", str(i).encode()) for i in range(90)]
        first_batch_seen = asyncio.Event()
        collector = asyncio.ensure_future(collect(watch, 92, first_batch_seen, 30))

        for path, value in expected[:30]:  # before: delivered live
            await writer.put(path, value)
        await first_batch_seen.wait()
        proxy.refuse()
        proxy.drop()
        for path, value in expected[30:60]:  # during: the watcher cannot reconnect
            await writer.put(path, value)
        # One multi-key commit while disconnected: its events must come back together.
        commit = await writer.commit([Put("/drop/zz-a", b"a"), Put("/drop/zz-b", b"b")])
        await asyncio.sleep(0.3)  # let the watcher fail a few reconnect attempts
        proxy.accept()
        for path, value in expected[60:]:  # after
            await writer.put(path, value)

        events = await collector
        await watch.close()
    finally:
        await watcher.close()
        await writer.close()
        await proxy.close()

    together = [e for e in events if e.path.startswith("/drop/zz-")]
    assert [(e.path, e.revision) for e in together] == [
        ("/drop/zz-a", commit.revision),
        ("/drop/zz-b", commit.revision),
    ]
    assert_exact_sequence([e for e in events if e not in together], expected)
    assert events.index(together[0]) == 60  # exactly where it was written
    assert watch.reconnects >= 1
    assert proxy.connections_total >= 2  # the watcher really came back through the proxy


async def test_watch_resumes_without_gaps_across_an_etcd_restart(
    etcd_server: EtcdServer, namespace: str
) -> None:
    watcher = await EtcdMetadataStore.open(etcd_server.endpoint, namespace=namespace)
    writer = await EtcdMetadataStore.open(etcd_server.endpoint, namespace=namespace)
    try:
        watch = watcher.watch("/restart/", prefix=True)  # from "now": only the writes below
        expected = [(f"/restart/{i:03d}", str(i).encode()) for i in range(120)]
        some_seen = asyncio.Event()
        collector = asyncio.ensure_future(collect(watch, len(expected), some_seen, 20))

        async def write_all() -> None:
            for path, value in expected:  # keeps writing before, during and after
                await put_retrying(writer, path, value)

        writes = asyncio.ensure_future(write_all())
        await some_seen.wait()
        await asyncio.to_thread(etcd_server.restart)
        await writes
        events = await collector
        await watch.close()
    finally:
        await watcher.close()
        await writer.close()

    assert_exact_sequence(events, expected)
    assert watch.reconnects >= 1


# --- sessions --------------------------------------------------------------------------------


async def test_lease_expiry_deletes_ephemeral_keys_with_a_delete_event(
    etcd_server: EtcdServer, store: EtcdMetadataStore, namespace: str
) -> None:
    observer = await EtcdMetadataStore.open(etcd_server.endpoint, namespace=namespace)
    try:
        session = await store.open_session(1.0, auto_keepalive=False)
        stat = await store.put("/live/broker-1", b"b1", session=session)
        durable = await store.put("/live/config", b"c")
        watch = observer.watch("/live/", prefix=True, start_revision=stat.mod_revision)
        created, config, deleted = [event async for event in _take(watch, 3)]
        await session.wait_expired()
        await watch.close()
        remaining = await observer.list_prefix("/live/")
    finally:
        await observer.close()

    assert stat.session_id == session.id
    assert (created.kind, created.path, created.revision) == (
        EventKind.PUT,
        "/live/broker-1",
        stat.mod_revision,
    )
    assert (config.path, config.revision) == ("/live/config", durable.mod_revision)
    assert (deleted.kind, deleted.path, deleted.value) == (EventKind.DELETE, "/live/broker-1", b"")
    assert deleted.revision > durable.mod_revision
    assert [r.path for r in remaining.records] == ["/live/config"]
    assert session.expired
    with pytest.raises(SessionExpired) as err:
        await store.put("/live/broker-1", b"again", session=session)
    assert err.value.session_id == session.id


async def test_closing_the_store_revokes_its_sessions(
    etcd_server: EtcdServer, store: EtcdMetadataStore, namespace: str
) -> None:
    owner = await EtcdMetadataStore.open(etcd_server.endpoint, namespace=namespace)
    session = await owner.open_session(60.0)
    stat = await owner.put("/owned", b"", session=session)
    await owner.close()
    assert session.expired
    assert stat.session_id == session.id
    assert await store.get("/owned") is None


async def test_put_with_a_lease_etcd_no_longer_has_raises_session_expired(
    store: EtcdMetadataStore,
) -> None:
    session = await store.open_session(5.0)
    await store._lease_revoke(session.id)  # behind the session's back
    with pytest.raises(SessionExpired) as err:
        await store.commit([Put("/orphan", b"", session_id=session.id)])
    assert err.value.session_id == session.id
    assert await store.get("/orphan") is None
    await session.close()


async def test_a_keepalive_answered_after_the_deadline_does_not_revive_the_session(
    store: EtcdMetadataStore,
) -> None:
    """A keepalive stuck while etcd was down can land after the session's deadline (and a
    restarted etcd extends every lease): by then the broker saw the session expire, moved
    on and opened a new one, so the old lease is revoked, never refreshed. A revived
    lease kept the old session's ownership records alive for good (a topic "moving"
    forever in the fault harness)."""
    session = await store.open_session(10.0, auto_keepalive=False)
    await store.put("/owned-by-old", b"", session=session)
    real = store._lease_keepalive

    async def late(lease_id: int) -> int:
        ttl = await real(lease_id)  # etcd still has the lease and refreshes it ...
        session._deadline = asyncio.get_running_loop().time()  # ... answered too late
        return ttl

    store._lease_keepalive = late  # type: ignore[method-assign]
    with pytest.raises(SessionExpired):
        await session.keepalive()
    assert session.expired
    await asyncio.gather(*store._revocations)
    assert await store._lease_ttl(session.id) == -1  # revoked, not left to its TTL
    assert await store.get("/owned-by-old") is None


# --- errors carry facts ------------------------------------------------------------------------


async def test_watch_from_a_compacted_revision_raises_compacted(
    store: EtcdMetadataStore,
) -> None:
    stats = [await store.put("/cmp", str(i).encode()) for i in range(4)]
    await store.compact(stats[2].mod_revision)
    await store.compact(stats[1].mod_revision)  # older than done already: a no-op
    watch = store.watch("/cmp", start_revision=stats[0].mod_revision)
    with pytest.raises(Compacted) as err:
        await watch.__anext__()
    assert err.value.requested_revision == stats[0].mod_revision
    assert err.value.compact_revision == stats[2].mod_revision
    with pytest.raises(Compacted):  # the watch stays failed
        await watch.__anext__()
    with pytest.raises(InvalidArgument):
        await store.compact(await store.current_revision() + 100)


async def test_failed_cas_reports_expected_and_actual(store: EtcdMetadataStore) -> None:
    first = await store.put("/cas", b"1")
    await store.put("/cas", b"2")
    with pytest.raises(BadVersion) as stale:
        await store.put("/cas", b"3", expected_version=first.version)
    assert (stale.value.path, stale.value.expected, stale.value.actual) == ("/cas", 1, 2)
    with pytest.raises(BadVersion) as gone:
        await store.delete("/cas-absent", expected_version=4)
    assert (gone.value.path, gone.value.expected, gone.value.actual) == ("/cas-absent", 4, 0)
    await store.delete("/cas")
    again = await store.put("/cas", b"new")
    with pytest.raises(BadVersion) as fenced:
        await store.commit(
            [
                Put("/cas-other", b""),
                Check("/cas", expected_version=1),  # holds: re-created at version 1
                Check("/cas", expected_create_revision=first.create_revision),
            ]
        )
    assert (fenced.value.path, fenced.value.expected, fenced.value.actual) == (
        "/cas",
        first.create_revision,
        again.create_revision,
    )
    assert await store.get("/cas-other") is None


async def test_a_commit_of_128_ops_is_one_revision(store: EtcdMetadataStore) -> None:
    ops = [Put(f"/bulk/{i:03d}", b"", expected_version=0) for i in range(128)]
    result = await store.commit(ops)
    assert len(result.results) == limits.METADATA_TXN_OPS_MAX == 128
    page = await store.list_prefix("/bulk/")
    assert {r.stat.mod_revision for r in page.records} == {result.revision}
    assert len(page.records) == 128
    deleted = await store.commit([Delete(r.path, r.stat.version) for r in page.records])
    assert deleted.results == [True] * 128


async def test_oversized_request_fails_before_it_is_sent(store: EtcdMetadataStore) -> None:
    big = b"x" * limits.METADATA_VALUE_BYTES_MAX
    before = await store.current_revision()
    with pytest.raises(ValueTooLarge) as err:
        await store.commit([Put("/big/a", big), Put("/big/b", big)])
    assert err.value.max_size == limits.ETCD_REQUEST_BYTES_MAX
    assert err.value.size > 2 * limits.METADATA_VALUE_BYTES_MAX
    assert await store.current_revision() == before
    stat = await store.put("/big/one", big)  # one maximal value still fits
    assert stat.version == 1


async def test_namespaces_isolate_keys_and_hide_sequence_counters(
    etcd_server: EtcdServer, store: EtcdMetadataStore
) -> None:
    neighbour = await EtcdMetadataStore.open(etcd_server.endpoint, namespace="/neighbour-ns")
    try:
        await neighbour.put("/shared", b"theirs")
        await store.put("/shared", b"ours")
        name = await store.create_sequential("/q-", b"")
        ours = await store.list_prefix("/")
        everything = await store.list_range("", "\U0010ffff")
        children = await store.list_children("/")
        theirs = await neighbour.get("/shared")
    finally:
        await neighbour.close()
    assert [(r.path, r.value) for r in ours.records] == [(name, b""), ("/shared", b"ours")]
    assert everything.records == ours.records
    assert children == [name[1:], "shared"]
    assert theirs is not None and theirs.value == b"theirs"


# --- availability ------------------------------------------------------------------------------


async def test_stopped_server_raises_metadata_unavailable_then_recovers(tmp_path: Path) -> None:
    server = EtcdServer.start(tmp_path / "etcd")
    try:
        store = await EtcdMetadataStore.open(server.endpoint, namespace="/down")
        try:
            await store.put("/k", b"before")
            await asyncio.to_thread(server.stop)
            failures: list[BaseException] = []
            for call in (
                store.get("/k"),
                store.put("/k", b"x"),
                store.commit([Delete("/k")]),
                store.list_prefix("/"),
                store.open_session(5.0),
                store.current_revision(),
            ):
                with pytest.raises(MetadataUnavailable) as err:
                    await call
                failures.append(err.value)
            with pytest.raises(MetadataUnavailable):
                await EtcdMetadataStore.open(server.endpoint)
            await asyncio.to_thread(server.restart)
            record = await _get_retrying(store, "/k")
        finally:
            await store.close()
    finally:
        server.stop()
    assert all(type(f) is MetadataUnavailable and f.retriable for f in failures)
    assert not any(isinstance(f, grpc.RpcError) for f in failures)
    assert record is not None and record.value == b"before"  # same client, after restart


async def _get_retrying(store: EtcdMetadataStore, path: str) -> Record | None:
    for _ in range(WRITE_ATTEMPTS_MAX):
        try:
            return await store.get(path)
        except MetadataUnavailable:
            await asyncio.sleep(0.02)
    raise AssertionError(f"etcd did not come back for {path}")


# --- the test server itself --------------------------------------------------------------------


def test_server_keeps_data_across_kill_and_restart(tmp_path: Path) -> None:
    server = EtcdServer.start(tmp_path / "etcd")
    try:
        first_pid = server.pid
        revision = asyncio.run(_put_and_revision(server.endpoint))
        server.kill()
        assert not server.running
        server.restart()
        assert server.running and server.pid != first_pid
        assert asyncio.run(_put_and_revision(server.endpoint)) == revision + 1
        assert (tmp_path / "etcd" / "etcd.log").stat().st_size > 0
    finally:
        server.stop()
    assert not server.running


async def _put_and_revision(endpoint: str) -> int:
    store = await EtcdMetadataStore.open(endpoint, namespace="/server-test")
    try:
        return (await store.put("/k", b"")).mod_revision
    finally:
        await store.close()


def test_missing_binary_is_an_error_not_a_skip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(EtcdNotFound, match="etcd-server"):
        EtcdServer.start(tmp_path)


async def _take(watch: EtcdWatch, count: int) -> AsyncIterator[WatchEvent]:
    for _ in range(count):
        yield await watch.__anext__()


async def test_closing_during_a_pending_read_ends_the_watch_cleanly(
    etcd_server: EtcdServer, namespace: str
) -> None:
    store = await EtcdMetadataStore.open(etcd_server.endpoint, namespace=namespace)
    by_watch = store.watch("/idle")
    by_store = store.watch("/idle")
    read_by_watch = asyncio.ensure_future(by_watch.__anext__())
    read_by_store = asyncio.ensure_future(by_store.__anext__())
    await store.put("/elsewhere", b"")  # a round trip: both reads are now waiting on etcd
    await asyncio.sleep(0.1)
    await by_watch.close()
    with pytest.raises(StopAsyncIteration):
        await read_by_watch
    await store.close()
    with pytest.raises(Closed):
        await read_by_store
