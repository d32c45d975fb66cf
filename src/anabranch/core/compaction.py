"""Topic compaction's decision: which messages of a topic survive (no I/O).

Upstream's two-phase compactor, as a pure fold. Phase one feeds every message up to the
compaction horizon, in order, to :meth:`CompactionPlan.add`; the plan keeps only
``key -> where its latest message is`` (never payloads), so memory follows the number of
live keys, not the topic's size. Keys are held as 16-byte digests: a producer choosing
megabyte keys cannot make a compaction hold megabytes per key. A *tombstone* (a keyed
message with an empty payload or ``null_value`` set) removes its key. Messages without a
key are dropped from the compacted view unless ``retain_null_key`` (upstream's
``topicCompactionRetainNullKey``, default off since PIP-318).

Phase two asks :meth:`CompactionPlan.survivors` for the indexes of each entry that stay.
A batch keeps its position: the messages compacted away are reported so that the caller
can mark them acknowledged for the reader (batch indexes are part of message ids and must
not shift).

Example:
    >>> plan = CompactionPlan()
    >>> for m in [Message((1, 0), -1, b"a", False), Message((1, 1), -1, b"b", False),
    ...           Message((1, 2), -1, b"a", False), Message((1, 3), -1, b"b", True)]:
    ...     plan.add(m)
    >>> plan.surviving_entries()
    [(1, 2)]
    >>> plan.survivors((1, 2), 1), plan.survivors((1, 0), 1)
    (frozenset({0}), frozenset())
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b
from typing import NamedTuple

Pos = tuple[int, int]


class Message(NamedTuple):
    """One message as the compactor sees it."""

    position: Pos
    batch_index: int
    """-1 for a non-batched entry, else the index in its batch."""
    key: bytes | None
    tombstone: bool


class CompactionPlan:
    """Phase one's state: latest message per key (see the module docstring)."""

    def __init__(self, *, retain_null_key: bool = False) -> None:
        self.retain_null_key = retain_null_key
        self._latest: dict[bytes, tuple[Pos, int]] = {}
        self._keyless: dict[Pos, set[int]] = {}
        self._last: Pos | None = None
        self._map: dict[Pos, frozenset[int]] | None = None
        self.messages_seen = 0

    def add(self, message: Message) -> None:
        """Fold in the next message; messages must come in (position, index) order."""
        here = message.position
        if self._last is not None and here < self._last:
            raise ValueError(f"message at {here} after {self._last}: out of order")
        self._last = here
        self._map = None
        self.messages_seen += 1
        if message.key is None:
            if self.retain_null_key and not message.tombstone:
                self._keyless.setdefault(here, set()).add(max(message.batch_index, 0))
            return
        # 128 bits: two distinct keys of one topic never meet (2**-64 at 2**32 keys).
        key = blake2b(message.key, digest_size=16).digest()
        if message.tombstone:
            self._latest.pop(key, None)
        else:
            self._latest[key] = (here, max(message.batch_index, 0))

    def add_all(self, messages: Iterable[Message]) -> None:
        for message in messages:
            self.add(message)

    @property
    def keys(self) -> int:
        """Live keys so far."""
        return len(self._latest)

    def _by_entry(self) -> dict[Pos, set[int]]:
        out: dict[Pos, set[int]] = {pos: set(ix) for pos, ix in self._keyless.items()}
        for pos, index in self._latest.values():
            out.setdefault(pos, set()).add(index)
        return out

    def surviving_entries(self) -> list[Pos]:
        """Positions of the entries with at least one surviving message, in order."""
        return sorted(self._by_entry())

    def survivor_map(self) -> dict[Pos, frozenset[int]]:
        """Each surviving entry's surviving batch indexes (index 0 for a plain entry)."""
        if self._map is None:
            self._map = {pos: frozenset(ix) for pos, ix in self._by_entry().items()}
        return self._map

    def survivors(self, position: Pos, batch_size: int) -> frozenset[int]:
        """The indexes of the entry at ``position`` that survive (empty: drop it)."""
        found = self.survivor_map().get(position, frozenset())
        return frozenset(i for i in found if i < max(batch_size, 1))


def removed_bits(survivors: frozenset[int], batch_size: int) -> bytes:
    """A cursor-style bitset (set = acknowledged) marking the compacted-away indexes of
    a batch, so that a reader skips them while batch indexes keep their meaning.

    >>> removed_bits(frozenset({1}), 3).hex()
    '05'
    """
    bits = 0
    for i in range(batch_size):
        if i not in survivors:
            bits |= 1 << i
    return bits.to_bytes((batch_size + 7) // 8, "little")


def compact_model(messages: Iterable[Message], *, retain_null_key: bool = False) -> list[Message]:
    """The reference answer: the messages a compacted read yields, in order.

    >>> compact_model([Message((1, 0), -1, b"k", False), Message((1, 1), -1, None, False)])
    [Message(position=(1, 0), batch_index=-1, key=b'k', tombstone=False)]
    """
    plan = CompactionPlan(retain_null_key=retain_null_key)
    listed = list(messages)
    plan.add_all(listed)
    keep = plan.survivor_map()
    return [m for m in listed if max(m.batch_index, 0) in keep.get(m.position, frozenset())]
