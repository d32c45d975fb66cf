"""A read-through cache of the records under one prefix, kept fresh by a prefix watch.

Every producer, consumer and lookup reads its namespace's policies, its topic's policies
and its partitioned metadata. On etcd each read is a network round trip, and a reconnect
storm after a failover repeats them for every client. Pulsar's brokers read these through
a metadata cache invalidated by watches; this is ours.

Rules:

* :meth:`RecordCache.get` answers from memory (a record, or "absent") while the watch is
  live. Otherwise it reads the store, and it keeps the answer only if the watch was live
  for the whole read and no change to that path arrived meanwhile (the read may predate
  the change).
* The watch only ever *drops* entries: a change to a cached path removes it, and the next
  get reads the store. So an entry is never older than the last change the watch has
  delivered: a change made on another broker is seen within the watch's delay.
* A writer in this process calls :meth:`RecordCache.forget` after each write, so its own
  next read is fresh without waiting for the event (read your writes).
* On any watch failure (the store unreachable, history compacted) everything is dropped
  and reads go to the store until the watch is back, from a new revision.
* At most ``max_entries`` entries are kept (least recently used dropped first), so names
  a client makes up cannot grow it.

Example:
    >>> import asyncio
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo() -> list[bytes | None]:
    ...     store = MemoryMetadataStore()
    ...     await store.put("/admin/a", b"1")
    ...     cache = RecordCache(store, "/admin/")
    ...     await cache.start()
    ...     seen = []
    ...     for _ in range(2):
    ...         record = await cache.get("/admin/a")  # the second one is a hit
    ...         seen.append(None if record is None else record.value)
    ...     await store.put("/admin/a", b"2")  # as if another broker wrote it
    ...     while cache.cached("/admin/a"):
    ...         await asyncio.sleep(0)  # the watch drops the entry
    ...     record = await cache.get("/admin/a")
    ...     seen.append(None if record is None else record.value)
    ...     await cache.close()
    ...     await store.close()
    ...     return seen
    >>> asyncio.run(demo())
    [b'1', b'1', b'2']
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from anabranch import limits
from anabranch.errors import Closed, Compacted
from anabranch.metadata.api import MetadataStore, Record
from anabranch.supervisor import GiveUp, Supervised

log = logging.getLogger(__name__)


class RecordCache:
    """See the module docstring."""

    def __init__(
        self,
        store: MetadataStore,
        prefix: str,
        *,
        max_entries: int = limits.METADATA_CACHE_ENTRIES_MAX,
        on_give_up: GiveUp | None = None,
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._max = max_entries
        self._on_give_up = on_give_up
        self._entries: OrderedDict[str, Record | None] = OrderedDict()
        self._reading: dict[str, int] = {}
        """Paths with reads in flight, and how many."""
        self._changed: set[str] = set()
        """Paths among ``_reading`` changed since their reads began: not kept."""
        self._live = False
        self._epoch = 0
        """Bumped whenever the watch goes down or comes up: reads across it are not kept."""
        self._loop: Supervised | None = None
        self._closed = False
        self.hits = 0
        self.misses = 0
        self.dropped = 0
        """Entries dropped by a change the watch delivered (metrics)."""
        self.seen_revision = 0
        """The store revision the watch has caught up with (0: not live)."""

    async def start(self) -> None:
        """Start the watch (the cache serves nothing before it is live)."""
        if self._closed:
            raise Closed("the record cache is closed")
        if self._loop is None:
            self._loop = Supervised(
                f"record-cache {self._prefix}", self._watch_loop, on_give_up=self._on_give_up
            ).start()

    async def close(self) -> None:
        """Stop the watch and drop everything; reads then go to the store. Idempotent."""
        self._closed = True
        self._down()
        if self._loop is not None:
            await self._loop.stop()
            self._loop = None

    @property
    def live(self) -> bool:
        """Whether answers come from memory now."""
        return self._live

    @property
    def size(self) -> int:
        """Entries held now (metrics)."""
        return len(self._entries)

    def cached(self, path: str) -> bool:
        """Whether ``path`` has an entry (tests)."""
        return path in self._entries

    async def get(self, path: str) -> Record | None:
        """The record at ``path`` (None: absent), from memory when the watch vouches."""
        if self._live and path in self._entries:
            self._entries.move_to_end(path)
            self.hits += 1
            return self._entries[path]
        self.misses += 1
        if not self._live or not path.startswith(self._prefix):
            return await self._store.get(path)
        epoch = self._epoch
        self._reading[path] = self._reading.get(path, 0) + 1
        try:
            record = await self._store.get(path)
            if self._epoch == epoch and path not in self._changed:
                self._entries[path] = record
                self._entries.move_to_end(path)
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
            return record
        finally:
            left = self._reading[path] - 1
            if left:
                self._reading[path] = left
            else:
                del self._reading[path]
                self._changed.discard(path)

    def forget(self, path: str) -> None:
        """``path`` was written by this process: its next read goes to the store."""
        self._drop(path)

    def _drop(self, path: str) -> None:
        if self._entries.pop(path, _MISSING) is not _MISSING:
            self.dropped += 1
        if path in self._reading:
            self._changed.add(path)

    def _down(self) -> None:
        self._live = False
        self._epoch += 1
        self._entries.clear()
        self.seen_revision = 0

    async def _watch_loop(self) -> None:
        delay = limits.METADATA_CACHE_RETRY_S
        while not self._closed:
            try:
                revision = await self._store.current_revision()
                watch = self._store.watch(self._prefix, prefix=True, start_revision=revision + 1)
                try:
                    # Live from here: a read that begins now sees revision >= ``revision``,
                    # and every later change reaches the watch.
                    self._epoch += 1
                    self._live = True
                    self.seen_revision = revision
                    delay = limits.METADATA_CACHE_RETRY_S
                    async for event in watch:
                        self._drop(event.path)
                        self.seen_revision = event.revision
                finally:
                    self._down()
                    await watch.close()
                return  # the store ended the watch: it is closing
            except Closed:
                return
            except Compacted:
                continue  # fell behind the store's history: start again from now
            except Exception as err:
                log.warning(
                    "record cache %s: watch failed (%s); retrying in %.1fs",
                    self._prefix,
                    err,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, 8 * limits.METADATA_CACHE_RETRY_S)


_MISSING = object()
