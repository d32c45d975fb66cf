"""Tiered storage: sealed ledgers as objects in S3, read back through a bounded cache.

One :class:`TieredStorage` per broker (the managed-ledger factory hands it to every
ledger it opens). It uploads one object per sealed ledger (format:
:mod:`~anabranch.storage.offload_format`) under a key unique to the attempt, like
Pulsar's ``<uuid>-ledger-<id>``, with a create-only put: a retry after a lost answer, or
two brokers racing, write two objects and never overwrite one that metadata points to;
the loser's object is deleted. Reads of a ledger whose hot copy is gone fetch the index
once (cached) and then the asked run of entries plus a read-ahead (cached too), so a
consumer reading from the start costs one GET per ``OFFLOAD_READ_AHEAD_BYTES``.

Example (a bucket in memory stands in for :class:`S3ObjectStore`):
    >>> class Bucket:
    ...     bucket = "b"
    ...     def __init__(self) -> None:
    ...         self.objects: dict[str, bytes] = {}
    ...     async def put_new(self, key: str, data: bytes) -> None:
    ...         self.objects[key] = data
    ...     async def get_range(self, key: str, start: int, end: int) -> bytes:
    ...         return self.objects[key][start:end]
    >>> async def demo(storage: TieredStorage) -> None:
    ...     key = await storage.offload("t/ns/persistent/x", 7, [b"a", b"b"])
    ...     print(key)
    ...     state = OffloadState(key, storage.bucket, 0, 0, hot_deleted=True)
    ...     print(await storage.read(state, 7, 2, 0, 2, 1 << 20, True))
    >>> asyncio.run(demo(TieredStorage(Bucket())))  # doctest: +ELLIPSIS
    offload/t%2Fns%2Fpersistent%2Fx/00000000000000000007-...
    [b'a', b'b']
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

from anabranch import limits
from anabranch.errors import ObjectStoreUnavailable, ValueTooLarge
from anabranch.storage.base import OffloadState
from anabranch.storage.ledger import disk_name
from anabranch.storage.object_store import S3ObjectStore, S3Settings
from anabranch.storage.offload_format import (
    LedgerIndex,
    ReadCache,
    decode_index,
    encode_ledger,
    index_length,
)

OFFLOAD_READ_CACHE_BYTES = limits.OFFLOAD_READ_CACHE_BYTES_MAX
OFFLOAD_READ_AHEAD_BYTES = limits.OFFLOAD_READ_AHEAD_BYTES
OFFLOAD_OBJECT_BYTES_MAX = limits.OFFLOAD_OBJECT_BYTES_MAX

READ_RETRY_S = 15.0
"""How long a read of an offloaded ledger retries an unavailable object store."""
READ_RETRY_FIRST_S = 0.1
READ_RETRY_MAX_DELAY_S = 2.0


def object_key(managed_ledger: str, ledger_id: int) -> str:
    """A fresh key for one offload attempt of ``ledger_id``.

    >>> object_key("t/ns/persistent/x", 7)[:43]
    'offload/t%2Fns%2Fpersistent%2Fx/00000000000'
    """
    return f"offload/{disk_name(managed_ledger)}/{ledger_id:020d}-{uuid.uuid4().hex}"


class TieredStorage:
    """The object store plus the read cache; see the module docstring."""

    def __init__(
        self,
        store: S3ObjectStore,
        *,
        cache_bytes: int = OFFLOAD_READ_CACHE_BYTES,
        read_ahead_bytes: int = OFFLOAD_READ_AHEAD_BYTES,
        read_retry_s: float = READ_RETRY_S,
    ) -> None:
        self.store = store
        self.cache = ReadCache(min(cache_bytes, limits.OFFLOAD_READ_CACHE_BYTES_MAX))
        self.read_ahead_bytes = read_ahead_bytes
        self.read_retry_s = read_retry_s
        self.bytes_offloaded = 0
        self.objects_offloaded = 0

    @classmethod
    def s3(cls, settings: S3Settings) -> TieredStorage:
        return cls(S3ObjectStore(settings))

    @property
    def bucket(self) -> str:
        return self.store.bucket

    async def offload(self, managed_ledger: str, ledger_id: int, payloads: Sequence[bytes]) -> str:
        """Upload one sealed ledger; returns the new object's key."""
        # CRCs and the join of up to a whole ledger: off the event loop.
        blob = await asyncio.to_thread(encode_ledger, ledger_id, payloads)
        if len(blob) > OFFLOAD_OBJECT_BYTES_MAX:
            raise ValueTooLarge("offloaded ledger", len(blob), OFFLOAD_OBJECT_BYTES_MAX)
        key = object_key(managed_ledger, ledger_id)
        await self.store.put_new(key, blob)
        self.bytes_offloaded += len(blob)
        self.objects_offloaded += 1
        return key

    async def _index(self, state: OffloadState, ledger_id: int, entries: int) -> LedgerIndex:
        cached = self.cache.get((state.key, "index"))
        if isinstance(cached, LedgerIndex):
            return cached
        blob = await self._get_range(state.key, 0, index_length(entries))
        index = decode_index(blob, ledger_id, entries)
        self.cache.put((state.key, "index"), index, index.nbytes)
        return index

    async def read(  # noqa: PLR0917 (the _read_ledger signature plus where the object is)
        self,
        state: OffloadState,
        ledger_id: int,
        entries: int,
        first: int,
        count: int,
        max_bytes: int,
        at_least_one: bool,
    ) -> list[bytes]:
        """Entries ``first..first+count-1`` (stopping at ``max_bytes``, but at least one
        when ``at_least_one``) of an offloaded ledger of ``entries`` entries."""
        count = min(count, entries - first)
        if count <= 0:
            return []
        out: list[bytes] = []
        used = 0
        index: LedgerIndex | None = None
        k = first
        while k < first + count:
            data = self.cache.get((state.key, k))
            if not isinstance(data, bytes):
                if index is None:
                    index = await self._index(state, ledger_id, entries)
                await self._fetch(state, index, k, first + count)
                data = self.cache.get((state.key, k))
                if not isinstance(data, bytes):  # larger than the whole cache
                    [data] = await self._get(state, index, k, 1)
            if (out or not at_least_one) and used + len(data) > max_bytes:
                break
            out.append(data)
            used += len(data)
            k += 1
        return out

    async def _get(self, state: OffloadState, index: LedgerIndex, at: int, n: int) -> list[bytes]:
        start, end = index.span(at, n)
        blob = await self._get_range(state.key, start, end)
        return index.split(at, n, blob)

    async def _get_range(self, key: str, start: int, end: int) -> bytes:
        """A ranged GET that rides out a short outage: a consumer's dispatcher that fails
        a read waits for the next event before it tries again, so a blip must not reach
        it (a longer outage does, after ``read_retry_s``)."""
        delay = READ_RETRY_FIRST_S
        deadline = time.monotonic() + self.read_retry_s
        while True:
            try:
                return await self.store.get_range(key, start, end)
            except ObjectStoreUnavailable:
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, READ_RETRY_MAX_DELAY_S)

    async def _fetch(self, state: OffloadState, index: LedgerIndex, at: int, want_end: int) -> None:
        """Fetch from ``at`` through ``want_end`` plus read-ahead into the cache."""
        budget = self.read_ahead_bytes
        end = at
        size = 0
        while end < index.entries and (end < want_end or size < budget):
            size += index.lengths[end]
            end += 1
            if size >= budget + self.read_ahead_bytes:  # a huge ask is served in slices
                break
        for k, data in enumerate(await self._get(state, index, at, end - at), start=at):
            self.cache.put((state.key, k), data, len(data) + 64)

    async def delete(self, key: str) -> None:
        """Delete an offloaded object (the ledger was trimmed or the offload lost a race)."""
        self.cache.discard_prefix(key)
        await self.store.delete(key)
