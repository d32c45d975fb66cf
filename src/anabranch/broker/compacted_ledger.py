"""A compacted ledger: the stored form of a topic's compacted view, and reads of it.

Each entry of the managed ledger ``<topic ledger>/__compacted-<generation>`` is
``[original ledger id][original entry id][removed-bits length][removed bits][the original
entry]`` (big-endian int64, int64, uint16): readers see the original message ids, and a
batch keeps its position and indexes, the indexes compaction removed being marked
acknowledged (the bits, cursor-style: set = acknowledged). :class:`CompactedView` keeps a
sparse in-memory index (one position every ``INDEX_STRIDE`` entries) to seek by original
position.

Example:
    >>> decode_compacted(encode_compacted(Position(3, 4), b"", b"entry"))
    (Position(ledger_id=3, entry_id=4), b'', b'entry')
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from anabranch.storage.api import EARLIEST, Entry, ManagedLedger, Position

READ_BATCH_ENTRIES = 256
"""Entries per read of a compacted ledger (and of the topic, while compacting)."""
INDEX_STRIDE = 64
"""Every this many compacted entries one (original, compacted) position is kept in memory,
so a read seeks with a bisect and at most this many skipped entries."""
_HEADER = struct.Struct(">qqH")


def encode_compacted(position: Position, removed: bytes, data: bytes) -> bytes:
    """One compacted-ledger entry (see the module docstring).

    >>> decode_compacted(encode_compacted(Position(3, 4), b"\\x01", b"xy"))
    (Position(ledger_id=3, entry_id=4), b'\\x01', b'xy')
    """
    return _HEADER.pack(position[0], position[1], len(removed)) + removed + data


def decode_compacted(data: bytes) -> tuple[Position, bytes, bytes]:
    """(original position, removed-index bits, original entry) of a compacted entry."""
    ledger_id, entry_id, size = _HEADER.unpack_from(data, 0)
    start = _HEADER.size
    return Position(ledger_id, entry_id), data[start : start + size], data[start + size :]


@dataclass(slots=True)
class CompactedView:
    """An opened compacted ledger and its sparse position index."""

    horizon: Position
    name: str
    generation: int
    ledger: ManagedLedger
    originals: list[Position] = field(default_factory=list)
    compacted: list[Position] = field(default_factory=list)
    entries: int = 0
    last: Position | None = None
    """The last original position in the view (None: the view is empty)."""
    last_removed: bytes = b""

    def note(self, original: Position, at: Position, removed: bytes) -> None:
        """Index one compacted entry (called in order, while writing or loading)."""
        if self.entries % INDEX_STRIDE == 0:
            self.originals.append(original)
            self.compacted.append(at)
        self.entries += 1
        self.last = original
        self.last_removed = removed

    async def read_from(self, start: Position, max_entries: int) -> list[tuple[Entry, bytes]]:
        """Compacted entries at or after original position ``start``."""
        i = bisect_right(self.originals, start) - 1
        at = self.compacted[i] if i >= 0 else EARLIEST
        out: list[tuple[Entry, bytes]] = []
        while len(out) < max_entries:
            entries = await self.ledger.read(at, READ_BATCH_ENTRIES)
            if not entries:
                break
            for entry in entries:
                original, removed, data = decode_compacted(entry.data)
                if original < start:
                    continue
                out.append((Entry(original, data), removed))
                if len(out) >= max_entries:
                    break
            at = entries[-1].position.next()
        return out

    async def scan(self) -> AsyncIterator[tuple[Entry, bytes]]:
        at = EARLIEST
        while True:
            entries = await self.ledger.read(at, READ_BATCH_ENTRIES)
            if not entries:
                return
            for entry in entries:
                original, removed, data = decode_compacted(entry.data)
                yield Entry(original, data), removed
            at = entries[-1].position.next()
