"""A store seen through a :class:`RecordCache`: hot reads from memory, writes that
forget what they wrote.

The broker's admin metadata (namespace and topic policies, partitioned metadata) is read
on every producer and consumer create and written rarely. Whoever reads through the
cache must also forget, after each write, the paths it wrote, or its own next read could
return the old record until the watch delivers the change (read your writes). This
class keeps the two together, so no writer can forget to forget.

A write that failed is forgotten too: a write that timed out may still have landed.

Example:
    >>> import asyncio
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> from anabranch.metadata.record_cache import RecordCache
    >>> async def demo() -> list[bytes | None]:
    ...     store = MemoryMetadataStore()
    ...     cache = RecordCache(store, "/admin/")
    ...     await cache.start()
    ...     records = CachedRecords(store, cache)
    ...     await records.put("/admin/a", b"1")
    ...     first = await records.get("/admin/a")  # kept by the cache
    ...     await records.put("/admin/a", b"2")  # forgotten at once, no watch needed
    ...     second = await records.get("/admin/a")
    ...     await cache.close()
    ...     await store.close()
    ...     return [None if r is None else r.value for r in (first, second)]
    >>> asyncio.run(demo())
    [b'1', b'2']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from anabranch.metadata.api import Check, MetadataStore, Op, Record, Stat
from anabranch.metadata.record_cache import RecordCache


class CachedRecords:
    """Reads of ``store`` through ``cache`` (when there is one); writes to ``store``."""

    def __init__(self, store: MetadataStore, cache: RecordCache | None = None) -> None:
        self.store = store
        self.cache = cache
        """None: every read goes to the store (set later by a broker that has a cache)."""

    async def get(self, path: str) -> Record | None:
        """The record at ``path``: from the cache if there is one (a hot-path read)."""
        cache = self.cache
        return await (self.store.get(path) if cache is None else cache.get(path))

    def forget(self, paths: Iterable[str]) -> None:
        """Drop ``paths`` from the cache, so the next read of each goes to the store."""
        if self.cache is not None:
            for path in paths:
                self.cache.forget(path)

    async def put(self, path: str, value: bytes, expected_version: int | None = None) -> Stat:
        """:meth:`MetadataStore.put`, then forget ``path``."""
        try:
            return await self.store.put(path, value, expected_version=expected_version)
        finally:
            self.forget([path])

    async def delete(self, path: str, expected_version: int | None = None) -> bool:
        """:meth:`MetadataStore.delete`, then forget ``path``."""
        try:
            return await self.store.delete(path, expected_version=expected_version)
        finally:
            self.forget([path])

    async def commit(self, ops: Sequence[Op]) -> None:
        """:meth:`MetadataStore.commit`, then forget every path it wrote."""
        try:
            await self.store.commit(ops)
        finally:
            self.forget(op.path for op in ops if not isinstance(op, Check))
