"""On-disk record framing: ``[length:u32 BE][crc32c:u32 BE][payload]``, no I/O.

The checksum covers the 4 length bytes and the payload, so a flipped length is caught
even when it still points inside the buffer. A reader classifies every position in a
buffer as one of:

* a whole, valid record;
* the clean end (no bytes left);
* a **torn tail**: the final record is incomplete (short header, short payload, or a
  checksum mismatch on a record that ends exactly at the end of the data, or a tail of
  zero bytes from an extended but never written file). A crashed
  writer leaves this; recovery truncates it. Only meaningful in ``recovery`` mode;
* **corruption**: a length over :data:`~anabranch.limits.STORAGE_RECORD_BYTES_MAX`, or a
  checksum mismatch with more data after the record. Raised as
  :class:`~anabranch.errors.CorruptRecord` with the offset, never skipped: the reader does
  not resynchronise on later bytes, so damaged records are never joined to good ones.

In ``strict`` mode (a range known to hold only complete, acknowledged records) a torn tail
is corruption too.

Example:
    >>> buf = encode(b"a") + encode(b"bc")
    >>> [p for _, p in scan(buf, where="demo").records]
    [b'a', b'bc']
    >>> scan(buf[:-1], where="demo", recovery=True).torn
    'short payload'
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import google_crc32c

from anabranch import limits
from anabranch.errors import CorruptRecord, ValueTooLarge

HEADER = struct.Struct(">II")
HEADER_BYTES = HEADER.size
_LENGTH = struct.Struct(">I")
_crc_value = google_crc32c.value
_crc_extend = google_crc32c.extend
_HEADER_PACK = HEADER.pack
_LENGTH_CRCS_MAX = 4096
"""Payload lengths whose length-field crc is memoised (entries repeat a few sizes)."""


def checksum(length_bytes: bytes, payload: bytes) -> int:
    """crc32c over the length field and then the payload."""
    return int(_crc_extend(_crc_value(length_bytes), payload))


_length_crcs: dict[int, int] = {}


def header(payload: bytes) -> bytes:
    """The 8-byte header of ``payload``'s record (no length check: see :func:`encode`).

    >>> header(b"bc") + b"bc" == encode(b"bc")
    True
    """
    n = len(payload)
    seed = _length_crcs.get(n)
    if seed is None:
        seed = length_crc(n)
    return _HEADER_PACK(n, _crc_extend(seed, payload))


def length_crc(n: int) -> int:
    """crc32c of the 4-byte length field ``n`` (memoised for the first few thousand
    lengths seen: the seed every record of that length extends)."""
    seed = int(_crc_value(_LENGTH.pack(n)))
    if len(_length_crcs) < _LENGTH_CRCS_MAX:
        _length_crcs[n] = seed
    return seed


def encode(payload: bytes) -> bytes:
    """One framed record.

    >>> encode(b"")[:4]
    b'\\x00\\x00\\x00\\x00'
    """
    n = len(payload)
    if n > limits.STORAGE_RECORD_BYTES_MAX:
        # Checked before writing (and again when read): the reader would call it corrupt.
        raise ValueTooLarge("record", n, limits.STORAGE_RECORD_BYTES_MAX)
    length_bytes = _LENGTH.pack(n)
    return HEADER.pack(n, checksum(length_bytes, payload)) + payload


@dataclass(frozen=True, slots=True)
class ScanResult:
    """Records found, where the valid data ends, and why the scan stopped early (if)."""

    records: list[tuple[int, bytes]]
    """(absolute offset of the record's header, payload) in order."""
    valid_end: int
    """Absolute offset just past the last valid record: truncate here."""
    torn: str | None
    """Why the tail is torn (recovery mode only), or None for a clean end."""


def scan(
    buf: bytes | memoryview,
    *,
    where: str,
    base_offset: int = 0,
    recovery: bool = False,
    max_records: int | None = None,
) -> ScanResult:
    """Decode every record in ``buf`` (which starts at file offset ``base_offset``).

    ``recovery=True`` reports an incomplete final record as ``torn``; otherwise it raises
    CorruptRecord. ``max_records`` stops after that many records (the rest is not checked).
    """
    view = memoryview(buf)
    end = len(view)
    pos = 0
    out: list[tuple[int, bytes]] = []
    record_max = limits.STORAGE_RECORD_BYTES_MAX
    while pos < end:
        if max_records is not None and len(out) >= max_records:
            return ScanResult(out, base_offset + pos, None)
        torn: str | None = None
        if end - pos < HEADER_BYTES:
            torn = "short header"
        else:
            length, crc = HEADER.unpack_from(view, pos)
            if length > record_max:
                raise CorruptRecord(where, base_offset + pos, f"bad length {length}")
            stop = pos + HEADER_BYTES + length
            if stop > end:
                torn = "short payload"
            else:
                payload = bytes(view[pos + HEADER_BYTES : stop])
                if checksum(bytes(view[pos : pos + 4]), payload) != crc:
                    if stop != end and not (recovery and _all_zero(view[pos:])):
                        raise CorruptRecord(where, base_offset + pos, "checksum mismatch")
                    torn = "checksum mismatch at tail" if stop == end else "zero-filled tail"
                else:
                    out.append((base_offset + pos, payload))
                    pos = stop
                    continue
        if not recovery:
            raise CorruptRecord(where, base_offset + pos, torn)
        return ScanResult(out, base_offset + pos, torn)
    return ScanResult(out, base_offset + pos, None)


def _all_zero(view: memoryview) -> bool:
    # A file extended but never written (crash before the data blocks) reads as zeros.
    return not view.tobytes().strip(b"\x00")


def decode_one(buf: bytes, *, where: str, offset: int) -> bytes:
    """Decode exactly one complete record occupying all of ``buf`` (strict)."""
    result = scan(buf, where=where, base_offset=offset)
    if len(result.records) != 1:
        raise CorruptRecord(where, offset, f"expected one record, found {len(result.records)}")
    return result.records[0][1]
