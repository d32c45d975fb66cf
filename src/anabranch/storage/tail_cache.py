"""The newest appended entries of a managed ledger, kept in memory for tailing readers.

Appends go in as whole batches, in (ledger id, first entry) order; the oldest batches
leave once the cache holds more than ``limit_bytes`` (the newest batch always stays, so a
batch over the limit is still served once). A read finds the batch holding its first
entry by bisection — a tailing reader reads the end — and returns the run of consecutive
entries it has, or None when the cache does not hold the first one.

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


class TailCache:
    """Bounded in bytes; see the module docstring. ``limit_bytes <= 0`` caches nothing."""

    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._batches: deque[tuple[int, int, list[bytes], int]] = deque()
        self._bytes = 0

    def add(self, ledger_id: int, first: int, payloads: list[bytes], size: int) -> None:
        """Keep a batch appended at ``(ledger_id, first)`` of ``size`` bytes."""
        if self._limit <= 0:
            return
        self._batches.append((ledger_id, first, payloads, size))
        self._bytes += size
        while self._bytes > self._limit and len(self._batches) > 1:
            self._bytes -= self._batches.popleft()[3]

    def get(self, ledger_id: int, first: int, count: int) -> list[bytes] | None:
        """Up to ``count`` consecutive entries from ``first``; None when not cached."""
        batches = self._batches
        at = max(bisect.bisect_right(batches, (ledger_id, first), key=_KEY) - 1, 0)
        out: list[bytes] = []
        want = first
        for i in range(at, len(batches)):
            lid, start, payloads, _ = batches[i]
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
