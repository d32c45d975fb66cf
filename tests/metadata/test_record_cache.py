"""The policy cache (``metadata/record_cache.py``) on every backend: hits read nothing, a
change made elsewhere is seen once the watch delivers it, this process reads its own
writes at once, a read that raced a change is not kept, a broken watch sends reads to the
store, and the entries are bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anabranch import limits
from anabranch.broker.policies import ClusterData, Policies, TenantInfo, namespace_path
from anabranch.broker.topic_policies import TopicPolicyStore
from anabranch.core.names import NamespaceName, TopicName
from anabranch.metadata.api import MetadataStore, Record, WatchEvent
from anabranch.metadata.memory import MemoryMetadataStore
from anabranch.metadata.record_cache import RecordCache
from anabranch.testing.broker import InProcessBroker
from tests.metadata_backends import etcd_server, store

__all__ = ["etcd_server", "store"]  # pytest fixtures

PREFIX = "/admin/"
A, B = "/admin/a", "/admin/b"


class Proxy:
    """The store, with its reads counted, optionally held at a gate after they read, and
    its watches optionally held (no event passes) or failing."""

    def __init__(self, store: MetadataStore) -> None:
        self._store = store
        self.gets = 0
        self.read_gate: asyncio.Event | None = None
        self.watch_gate = asyncio.Event()
        self.watch_gate.set()
        self.fail_watches = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def get(self, path: str) -> Record | None:
        self.gets += 1
        record = await self._store.get(path)
        if self.read_gate is not None:
            await self.read_gate.wait()
        return record

    def watch(self, path: str, **kw: Any) -> HeldWatch:
        return HeldWatch(self, self._store.watch(path, **kw))


class HeldWatch:
    def __init__(self, proxy: Proxy, inner: Any) -> None:
        self._proxy = proxy
        self._inner = inner

    def __aiter__(self) -> HeldWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._proxy.fail_watches:
            raise RuntimeError("the watch broke")
        event: WatchEvent = await self._inner.__anext__()
        await self._proxy.watch_gate.wait()
        if self._proxy.fail_watches:
            raise RuntimeError("the watch broke")
        return event

    async def close(self) -> None:
        await self._inner.close()


async def until(done: Callable[[], bool]) -> None:
    for _ in range(2000):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never happened")


async def caught_up(cache: RecordCache, store: MetadataStore) -> None:
    """Wait until the watch has delivered every change made so far."""
    revision = await store.current_revision()
    await until(lambda: cache.seen_revision >= revision)


async def started(store: MetadataStore, **kw: Any) -> RecordCache:
    cache = RecordCache(store, PREFIX, **kw)
    await cache.start()
    await until(lambda: cache.live)
    return cache


def value(record: Record | None) -> bytes | None:
    return None if record is None else record.value


async def test_hits_read_nothing_and_another_writers_change_is_seen(
    store: MetadataStore,
) -> None:
    proxy = Proxy(store)
    await store.put(A, b"1")
    cache = await started(cast(MetadataStore, proxy))
    try:
        for _ in range(3):
            assert value(await cache.get(A)) == b"1"
            assert value(await cache.get(B)) is None  # absent is an answer too
        assert proxy.gets == 2 and cache.hits == 4
        await store.put(A, b"2")  # another broker's write: no forget here
        await store.put(B, b"x")
        await caught_up(cache, store)
        assert value(await cache.get(A)) == b"2" and value(await cache.get(B)) == b"x"
        assert proxy.gets == 4
        await store.put("/elsewhere", b"-")  # outside the prefix: not cached, not watched
        assert value(await cache.get("/elsewhere")) == b"-"
        assert value(await cache.get("/elsewhere")) == b"-"
        assert proxy.gets == 6
    finally:
        await cache.close()


async def test_this_process_reads_its_own_writes_at_once(store: MetadataStore) -> None:
    proxy = Proxy(store)
    await store.put(A, b"1")
    cache = await started(cast(MetadataStore, proxy))
    try:
        assert value(await cache.get(A)) == b"1"
        proxy.watch_gate.clear()  # the watch falls behind
        await store.put(A, b"2")
        cache.forget(A)  # what a local writer does
        assert value(await cache.get(A)) == b"2"
        await store.put(A, b"3")  # someone else's, not yet delivered: still the old one
        assert value(await cache.get(A)) == b"2"
        proxy.watch_gate.set()
        await caught_up(cache, store)
        assert value(await cache.get(A)) == b"3"
    finally:
        await cache.close()


async def test_a_read_that_raced_a_change_is_not_kept(store: MetadataStore) -> None:
    proxy = Proxy(store)
    await store.put(A, b"old")
    cache = await started(cast(MetadataStore, proxy))
    try:
        proxy.read_gate = asyncio.Event()
        reading = asyncio.ensure_future(cache.get(A))  # reads "old", then waits
        await until(lambda: proxy.gets == 1)
        await store.put(A, b"new")
        await caught_up(cache, store)  # the change arrives during the read
        proxy.read_gate.set()
        assert value(await reading) == b"old"  # this caller's answer predates it,
        assert not cache.cached(A)  # so it is not kept
        assert value(await cache.get(A)) == b"new"
    finally:
        await cache.close()


async def test_a_broken_watch_sends_reads_to_the_store_until_it_is_back(
    store: MetadataStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "METADATA_CACHE_RETRY_S", 0.05)
    proxy = Proxy(store)
    await store.put(A, b"1")
    cache = await started(cast(MetadataStore, proxy))
    try:
        await cache.get(A)
        proxy.fail_watches = True
        proxy.watch_gate.clear()
        await store.put(A, b"2")  # wakes the watch, which breaks
        proxy.watch_gate.set()
        await until(lambda: not cache.live)
        assert not cache.cached(A)
        reads = proxy.gets
        assert value(await cache.get(A)) == b"2"
        assert value(await cache.get(A)) == b"2"
        assert proxy.gets == reads + 2  # nothing kept while down
        proxy.fail_watches = False
        await until(lambda: cache.live)
        await cache.get(A)
        await cache.get(A)
        assert proxy.gets == reads + 3
    finally:
        await cache.close()


async def test_entries_are_bounded_least_recently_used_first() -> None:
    store = MemoryMetadataStore()
    cache = await started(store, max_entries=3)
    try:
        for i in range(10):
            await cache.get(f"/admin/t{i}")
        await cache.get("/admin/t7")  # used again: kept over t8
        await cache.get("/admin/t10")
        assert [cache.cached(f"/admin/t{i}") for i in range(11)] == [False] * 7 + [
            True,
            False,
            True,
            True,
        ]
    finally:
        await cache.close()
        await store.close()


# --- random interleavings against the memory store ---------------------------------------------

PATHS = [f"/admin/k{i}" for i in range(3)]
ops = st.lists(
    st.tuples(
        st.sampled_from(["get", "local", "remote", "remote-delete", "local-delete", "lag", "go"]),
        st.integers(0, len(PATHS) - 1),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_reads_own_writes_and_converge_under_any_interleaving(
    steps: list[tuple[str, int]],
) -> None:
    async def run() -> None:
        store = MemoryMetadataStore()
        proxy = Proxy(store)
        cache = await started(cast(MetadataStore, proxy))
        counter = 0
        try:
            for kind, i in steps:
                path = PATHS[i]
                counter += 1
                if kind == "get":
                    await cache.get(path)
                elif kind in ("local", "local-delete"):
                    if kind == "local":
                        await store.put(path, b"%d" % counter)
                    else:
                        await store.delete(path)
                    cache.forget(path)
                    # Read your writes, whatever the watch is doing.
                    assert value(await cache.get(path)) == value(await store.get(path))
                elif kind == "remote":
                    await store.put(path, b"%d" % counter)
                elif kind == "remote-delete":
                    await store.delete(path)
                elif kind == "lag":
                    proxy.watch_gate.clear()
                else:
                    proxy.watch_gate.set()
                    await asyncio.sleep(0)
            proxy.watch_gate.set()
            await caught_up(cache, store)
            for path in PATHS:  # once the watch caught up, every answer is the store's
                assert value(await cache.get(path)) == value(await store.get(path))
        finally:
            await cache.close()
            await store.close()

    asyncio.run(run())


async def test_policies_read_their_own_writes_through_the_cache() -> None:
    """Every write of the admin records a producer, consumer or lookup reads forgets what
    it wrote: with the watch held, the next read still sees it."""
    store = MemoryMetadataStore()
    proxy = Proxy(store)
    held = cast(MetadataStore, proxy)
    cache = await started(held)
    policies = Policies(held)
    policies.cache = cache
    overrides = TopicPolicyStore(held, cache)
    name = "persistent://t/ns/x"
    topic = TopicName.parse(name)
    try:
        await policies.create_cluster("c", ClusterData(service_url="http://h:8080"))
        await policies.create_tenant("t", TenantInfo(allowed_clusters=["c"]))
        await policies.create_namespace("t/ns")
        assert not (await policies.namespace_policies("t/ns")).deduplication_enabled
        assert await policies.get_partitions(name) == 0
        assert not await policies.topic_exists(name)
        assert (await overrides.get(topic)).message_ttl_in_seconds is None
        hits = cache.hits
        proxy.watch_gate.clear()  # from here only the writers' forgetting keeps it fresh
        await policies.update_namespace_policies(
            "t/ns", lambda p: msgspec.structs.replace(p, deduplication_enabled=True)
        )
        assert (await policies.namespace_policies("t/ns")).deduplication_enabled
        await policies.create_partitioned_topic(name, 3)
        assert await policies.get_partitions(name) == 3
        await policies.update_partitioned_topic(name, 5)
        assert (await policies.get_partitioned_topic(name)).partitions == 5
        assert await policies.delete_partitioned_topic(name) == 5
        assert await policies.get_partitions(name) == 0
        await policies.register_topic(name)
        assert await policies.topic_exists(name)
        await policies.unregister_topic(name)
        assert not await policies.topic_exists(name)
        await overrides.update(
            topic, lambda p: msgspec.structs.replace(p, message_ttl_in_seconds=9)
        )
        assert (await overrides.get(topic)).message_ttl_in_seconds == 9
        await overrides.delete(topic)
        assert (await overrides.get(topic)).message_ttl_in_seconds is None
        assert await policies.get_partitions(name) == 0
        assert cache.hits > hits  # and unchanged records were still answered from memory
    finally:
        await cache.close()
        await store.close()


async def test_a_topic_loads_with_the_stored_deduplication_not_a_cached_one(
    tmp_path: Path,
) -> None:
    """A topic keeps the deduplication it loaded with: that read must not lag a change
    another broker acknowledged, so it bypasses the cache."""
    async with InProcessBroker(tmp_path) as broker:
        service = broker.service
        proxy = Proxy(service.store)
        await service.policy_cache.close()
        service.policies.cache = await started(cast(MetadataStore, proxy))
        try:
            ns = await service.policies.namespace_policies("public/default")
            assert not ns.deduplication_enabled  # cached now
            proxy.watch_gate.clear()
            # Another broker's write: this one's cache does not hear of it yet.
            enabled = msgspec.structs.replace(ns, deduplication_enabled=True)
            path = namespace_path(NamespaceName.parse("public/default"))
            await service.store.put(path, msgspec.json.encode(enabled))
            assert not (
                await service.policies.namespace_policies("public/default")
            ).deduplication_enabled
            topic = await service.get_topic("persistent://public/default/fresh", create=True)
            assert topic.dedup is not None
        finally:
            await service.policies.cache.close()
