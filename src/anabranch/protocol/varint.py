"""Protobuf base-128 varints, for the few hot paths that write protobuf bytes by hand.

Example:
    >>> varint(1), varint(300)
    (b'\\x01', b'\\xac\\x02')
"""

from __future__ import annotations

U64 = (1 << 64) - 1
"""Mask for writing a signed 64-bit field as protobuf does (two's complement)."""

_BYTES = [bytes([i]) for i in range(0x80)]


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer below 2**64.

    >>> varint(127), varint(128)
    (b'\\x7f', b'\\x80\\x01')
    """
    if value < 0x80:
        return _BYTES[value]
    # Sequence ids, sizes and entry ids are mostly two or three bytes long: no loop for them.
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, (value >> 7) & 0x7F | 0x80, value >> 14))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
