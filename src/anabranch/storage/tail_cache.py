"""The newest appended entries of a managed ledger, kept in memory for tailing readers.

Appends go in as whole batches, in (ledger id, first entry) order; the oldest batches
leave once the cache holds more than ``limit_bytes`` (the newest batch always stays, so a
batch over the limit is still served once). A read finds the batch holding its first
entry by bisection — a tailing reader reads the end — and returns the run of consecutive
entries it has, or None when the cache does not hold the first one.

Every ledger of a broker draws on one :class:`TailCacheBudget` too (Pulsar's
``managedLedgerCacheSizeMB``): a per-ledger limit alone lets a broker with many topics
hold that limit once per topic. Past the budget the batches added longest ago leave,
whichever ledger holds them, so idle topics give their memory to busy ones.

Example:
    >>> cache = TailCache(limit_bytes=10)
    >>> cache.add(7, 0, [b"a", b"b"], 2)
    >>> cache.add(7, 2, [b"c"], 1)
    >>> cache.get(7, 1, 5)
    [b'b', b'c']
    >>> cache.get(8, 0, 1) is None
    True
"""

from __future__ import annotations

import bisect
import operator
from collections import deque

_KEY = operator.itemgetter(0, 1)

_Batch = tuple[int, int, list[bytes], int, int]
"""(ledger id, first entry, payloads, size, serial in the budget's order)."""


class TailCacheBudget:
    """The bytes every :class:`TailCache` sharing it may hold together.

    It remembers the order batches came in, across caches; past ``limit_bytes`` it
    evicts the oldest batch anywhere. A batch a cache dropped itself (its own limit, or
    its ledger closed) leaves a stale mark here, skipped when reached and swept out
    when stale marks outnumber live ones, so the order stays as long as what is cached.

    Example:
        >>> budget = TailCacheBudget(limit_bytes=4)
        >>> idle, busy = TailCache(10, budget), TailCache(10, budget)
        >>> idle.add(1, 0, [b"aa"], 2)
        >>> busy.add(2, 0, [b"bb", b"cc"], 4)
        >>> idle.get(1, 0, 1) is None, busy.get(2, 0, 2), budget.held
        (True, [b'bb', b'cc'], 4)
    """

    stale_slack = 1024
    """Stale marks allowed beyond the live ones before they are swept out."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.held = 0
        self._order: deque[tuple[TailCache, int]] = deque()
        self._serial = 0
        self._live = 0
        self._stale = 0
        self.evicted_bytes = 0
        """Bytes the budget took from caches (metrics): what idle topics gave up."""

    def _admit(self, cache: TailCache, size: int) -> int:
        self._serial += 1
        self._order.append((cache, self._serial))
        self.held += size
        self._live += 1
        order = self._order
        while self.held > self.limit and len(order) > 1:
            victim, serial = order.popleft()
            size_freed = victim._drop_oldest(serial)
            if size_freed is None:
                self._stale -= 1
            else:
                self.held -= size_freed
                self.evicted_bytes += size_freed
                self._live -= 1
        return self._serial

    def _released(self, size: int, count: int) -> None:
        """``count`` batches of ``size`` bytes in all left a cache by its own doing."""
        self.held -= size
        self._live -= count
        self._stale += count
        if self._stale > self._live + self.stale_slack:
            # Linear in what is held: one pass over the caches named, one over the marks.
            caches = {id(cache): cache for cache, _ in self._order}
            held = {batch[4] for cache in caches.values() for batch in cache._batches}
            self._order = deque(mark for mark in self._order if mark[1] in held)
            self._stale = 0


class TailCache:
    """Bounded in bytes (its own ``limit_bytes``, and ``budget`` with other caches); see
    the module docstring. ``limit_bytes <= 0`` caches nothing."""

    def __init__(self, limit_bytes: int, budget: TailCacheBudget | None = None) -> None:
        self._limit = limit_bytes
        self._budget = budget
        self._batches: deque[_Batch] = deque()
        self._bytes = 0

    @property
    def held(self) -> int:
        """What the cache holds now."""
        return self._bytes

    def add(self, ledger_id: int, first: int, payloads: list[bytes], size: int) -> None:
        """Keep a batch appended at ``(ledger_id, first)`` of ``size`` bytes."""
        if self._limit <= 0:
            return
        budget = self._budget
        serial = 0 if budget is None else budget._admit(self, size)
        self._batches.append((ledger_id, first, payloads, size, serial))
        self._bytes += size
        freed = count = 0
        while self._bytes > self._limit and len(self._batches) > 1:
            dropped = self._batches.popleft()[3]
            self._bytes -= dropped
            freed += dropped
            count += 1
        if count and budget is not None:
            budget._released(freed, count)

    def clear(self) -> None:
        """Forget everything (the ledger closed), giving it back to the budget."""
        count, freed = len(self._batches), self._bytes
        self._batches.clear()
        self._bytes = 0
        if count and self._budget is not None:
            self._budget._released(freed, count)

    def _drop_oldest(self, serial: int) -> int | None:
        """The budget evicts batch ``serial``: its size, or None when already gone."""
        batches = self._batches
        if not batches or batches[0][4] != serial:
            return None
        size = batches.popleft()[3]
        self._bytes -= size
        return size

    def get(self, ledger_id: int, first: int, count: int) -> list[bytes] | None:
        """Up to ``count`` consecutive entries from ``first``; None when not cached."""
        batches = self._batches
        at = max(bisect.bisect_right(batches, (ledger_id, first), key=_KEY) - 1, 0)
        out: list[bytes] = []
        want = first
        for i in range(at, len(batches)):
            lid, start, payloads, _, _ = batches[i]
            if lid != ledger_id or start + len(payloads) <= want:
                if out:
                    break
                continue
            if start > want:
                break
            take = payloads[want - start : want - start + count - len(out)]
            out += take
            want += len(take)
            if len(out) == count:
                break
        return out or None
