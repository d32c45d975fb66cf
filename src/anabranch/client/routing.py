"""Partition routing for producers on partitioned ``persistent://`` topics.

Keyed messages go to ``java_string_hash(key) % partitions``: upstream's Java client
default (``HashingScheme.JavaStringHash``: ``String.hashCode() & Integer.MAX_VALUE``).
The C++ client (and so the official Python client) defaults to ``BoostHash``, whose value
depends on the Boost version and platform, so it cannot be reproduced; we pick the Java
default so that our producers and Java producers agree on a key's partition.
``murmur3_32_hash`` (upstream ``Murmur3_32Hash``) is available with ``hashing="murmur3"``.
Keyless messages go round-robin over the partitions.

Example:
    >>> java_string_hash("hello")
    99162322
    >>> r = Router(4)
    >>> (r.partition("hello"), [r.partition(None) for _ in range(5)])
    (2, [0, 1, 2, 3, 0])
"""

from __future__ import annotations

from typing import Literal

import mmh3

Hashing = Literal["java", "murmur3"]
_INT_MAX = 0x7FFFFFFF


def java_string_hash(key: str) -> int:
    """Java's ``String.hashCode()`` (over UTF-16 code units) masked to a non-negative int."""
    h = 0
    data = key.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + (data[i] << 8 | data[i + 1])) & 0xFFFFFFFF
    return h & _INT_MAX


def murmur3_32_hash(key: str) -> int:
    """Upstream's ``Murmur3_32Hash``: murmur3 x86_32 (seed 0) of UTF-8, masked non-negative."""
    return int(mmh3.hash(key.encode("utf-8"), seed=0, signed=False)) & _INT_MAX


class Router:
    """Chooses a partition for each message."""

    def __init__(self, partitions: int, hashing: Hashing = "java", start: int = 0) -> None:
        if partitions < 1:
            raise ValueError(f"a partitioned topic has at least 1 partition, not {partitions}")
        self.partitions = partitions
        self._hash = java_string_hash if hashing == "java" else murmur3_32_hash
        self._next = start

    def partition(self, key: str | None) -> int:
        """The partition for a message with ``key`` (round-robin when None)."""
        if key is not None:
            return self._hash(key) % self.partitions
        index = self._next % self.partitions
        self._next = index + 1
        return index
