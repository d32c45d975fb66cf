"""The object one sealed ledger becomes in the object store, and reading it back.

Layout (big-endian)::

    header   magic "ABOFFLD1" | version u16 | reserved u16 | ledger id i64 | entries u32
    index    entries x (offset u64, length u32, crc32 u32)     offsets from the object start
    crc32 of header + index (u32)
    data     the entries' payloads, back to back

The header and index come first and their length follows from the entry count the
managed ledger's metadata already holds, so a reader fetches them with one ranged GET and
then any entry, or run of entries, with one more. Every payload carries its CRC32 and
the header+index one of its own: a damaged object raises CorruptRecord instead of
serving wrong bytes.

Example:
    >>> blob = encode_ledger(7, [b"a", b"bc"])
    >>> index = decode_index(blob[: index_length(2)], 7, 2)
    >>> index.span(0, 2)
    (60, 63)
    >>> index.split(0, 2, blob[60:63])
    [b'a', b'bc']
"""

from __future__ import annotations

import struct
import zlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from anabranch.errors import CorruptRecord

MAGIC = b"ABOFFLD1"
VERSION = 1
_HEADER = struct.Struct(">8sHHqI")
_SLOT = struct.Struct(">QII")
_CRC = struct.Struct(">I")


def index_length(entries: int) -> int:
    """Bytes of header + index + its CRC for a ledger of ``entries`` entries.

    >>> index_length(0), index_length(1)
    (28, 44)
    """
    return _HEADER.size + entries * _SLOT.size + _CRC.size


def encode_ledger(ledger_id: int, payloads: Sequence[bytes]) -> bytes:
    """The whole object for one ledger's entries (in entry order)."""
    head = bytearray(_HEADER.pack(MAGIC, VERSION, 0, ledger_id, len(payloads)))
    offset = index_length(len(payloads))
    for data in payloads:
        head += _SLOT.pack(offset, len(data), zlib.crc32(data))
        offset += len(data)
    head += _CRC.pack(zlib.crc32(head))
    return b"".join([bytes(head), *payloads])


@dataclass(frozen=True, slots=True)
class LedgerIndex:
    """Where each entry of an offloaded ledger lies in its object."""

    ledger_id: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    crcs: tuple[int, ...]

    @property
    def entries(self) -> int:
        return len(self.offsets)

    @property
    def nbytes(self) -> int:
        """Rough memory held (for the cache bound)."""
        return 64 + 24 * len(self.offsets)

    def span(self, first: int, count: int) -> tuple[int, int]:
        """The byte range ``[start, end)`` of entries ``first..first+count-1``."""
        last = first + count - 1
        return self.offsets[first], self.offsets[last] + self.lengths[last]

    def split(self, first: int, count: int, blob: bytes) -> list[bytes]:
        """The entries of ``blob`` (fetched with :meth:`span`), each checked."""
        base = self.offsets[first]
        out: list[bytes] = []
        for k in range(first, first + count):
            start = self.offsets[k] - base
            data = blob[start : start + self.lengths[k]]
            if len(data) != self.lengths[k] or zlib.crc32(data) != self.crcs[k]:
                raise CorruptRecord(f"offloaded ledger {self.ledger_id}", self.offsets[k], "crc")
            out.append(data)
        return out


def decode_index(blob: bytes, ledger_id: int, entries: int) -> LedgerIndex:
    """Parse and check the header + index (``blob`` = the first :func:`index_length`
    bytes of the object); CorruptRecord when it is not the object of this ledger."""
    where = f"offloaded ledger {ledger_id}"
    if len(blob) != index_length(entries):
        raise CorruptRecord(where, 0, "short index")
    magic, version, _, stored_id, count = _HEADER.unpack_from(blob, 0)
    if magic != MAGIC or version != VERSION:
        raise CorruptRecord(where, 0, "not an offloaded ledger object")
    if stored_id != ledger_id or count != entries:
        raise CorruptRecord(where, 0, "object of another ledger")
    (crc,) = _CRC.unpack_from(blob, len(blob) - _CRC.size)
    if zlib.crc32(blob[: -_CRC.size]) != crc:
        raise CorruptRecord(where, 0, "index crc")
    table = memoryview(blob)[_HEADER.size : _HEADER.size + entries * _SLOT.size]
    offsets, lengths, crcs = zip(*_SLOT.iter_unpack(table), strict=True) if entries else ((),) * 3
    return LedgerIndex(ledger_id, tuple(offsets), tuple(lengths), tuple(crcs))


class ReadCache:
    """An LRU map bounded in bytes (offloaded indexes and read-ahead entries).

    >>> cache = ReadCache(limit_bytes=4)
    >>> cache.put("a", b"xx", 2); cache.put("b", b"yy", 2); cache.put("c", b"zz", 2)
    >>> cache.get("a") is None, cache.get("c")
    (True, b'zz')
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._items: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: Hashable) -> object | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: Hashable, value: object, size: int) -> None:
        if size > self.limit_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._items[key] = (value, size)
        self._bytes += size
        while self._bytes > self.limit_bytes:
            _, (_, gone) = self._items.popitem(last=False)
            self._bytes -= gone

    def discard_prefix(self, prefix: object) -> None:
        """Forget every key that is a tuple starting with ``prefix``."""
        for key in [k for k in self._items if isinstance(k, tuple) and k and k[0] == prefix]:
            self._bytes -= self._items.pop(key)[1]
