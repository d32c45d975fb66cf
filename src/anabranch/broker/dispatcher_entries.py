"""What a dispatcher needs to know about a stored entry, batch-ack bitsets, and seek by time.

A stored entry is the message section of a SEND exactly as received:
``[0x0e01][crc32c][metadataSize][MessageMetadata][payload]`` or the same without the
checksum header. :func:`entry_info` reads only the metadata (never the payload).

Two bitsets describe a partially acknowledged batch, and they point opposite ways:

- the cursor's (``Cursor.batch_ack_state``): ``bytes``, bit ``i`` of byte ``i // 8`` (LSB
  first, like Java's ``BitSet.toByteArray``) set = index ``i`` acknowledged;
- the wire's (``ack_set`` on MessageIdData and CommandMessage): int64 words as Java's
  ``BitSet.toLongArray``, set = index still unacknowledged. Trailing zero words may be
  missing, so a missing word means "all acknowledged".

Example:
    >>> acked = wire_to_acked([0b1010], 4)         # indexes 1 and 3 still unacked
    >>> acked_to_wire(acked, 4)
    ([10], 2)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import mmh3
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch.limits import BATCH_MESSAGES_MAX
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.frames import MAGIC_CHECKSUM
from anabranch.storage.api import ManagedLedger, Position

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

HASH_RANGE_SIZE = 65536
"""Key_Shared hash slots (upstream ``StickyKeyConsumerSelector.DEFAULT_RANGE_SIZE``)."""

_U64_MASK = (1 << 64) - 1

NONE_KEY = b"NONE_KEY"
"""The sticky key of a message without ordering or partition key (upstream's NONE_KEY)."""


class EntryInfo(NamedTuple):
    """The metadata facts dispatch decisions use."""

    batch_size: int
    sticky_key: bytes
    deliver_at_ms: int | None
    publish_time_ms: int
    chunk: Chunk | None = None
    """Set on the chunks of a chunked message (PIP-37)."""


class Chunk(NamedTuple):
    """Where an entry sits in a chunked message: ``message`` names the message (producer
    and uuid), ``chunk_id`` counts from 0 to ``chunks`` - 1."""

    message: str
    chunk_id: int
    chunks: int

    @property
    def last(self) -> bool:
        """Whether this is the message's final chunk."""
        return self.chunk_id >= self.chunks - 1


def entry_metadata(data: bytes) -> pb.MessageMetadata:
    """Parse the MessageMetadata of a stored entry (DecodeError/struct.error if damaged).

    >>> from anabranch.protocol.frames import encode_entry
    >>> md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=7)
    >>> entry_metadata(encode_entry(md, b"x")).publish_time
    7
    """
    offset = 0
    if len(data) >= 2 and _U16.unpack_from(data, 0)[0] == MAGIC_CHECKSUM:
        offset = 6
    (size,) = _U32.unpack_from(data, offset)
    if size > len(data) - offset - 4:
        raise DecodeError(f"metadata size {size} does not fit the entry")
    metadata = pb.MessageMetadata()
    metadata.ParseFromString(data[offset + 4 : offset + 4 + size])
    return metadata


def entry_info(data: bytes) -> EntryInfo:
    """The dispatch facts of an entry; an unparsable entry counts as one keyless message
    (it is still delivered: the client, not the broker, rejects corrupt messages)."""
    try:
        md = entry_metadata(data)
    except (DecodeError, struct.error, RuntimeError, ValueError):
        return EntryInfo(1, NONE_KEY, None, 0)
    batch = md.num_messages_in_batch if md.HasField("num_messages_in_batch") else 1
    chunk = None
    if md.HasField("uuid") and md.num_chunks_from_msg > 1:
        chunk = Chunk(f"{md.producer_name}/{md.uuid}", md.chunk_id, md.num_chunks_from_msg)
    return EntryInfo(
        min(max(batch, 1), BATCH_MESSAGES_MAX),  # a producer's count, so bounded
        sticky_key(md),
        md.deliver_at_time if md.HasField("deliver_at_time") else None,
        md.publish_time,
        chunk,
    )


def sticky_key(md: pb.MessageMetadata) -> bytes:
    """Ordering key, else partition key, else NONE_KEY (upstream ``peekStickyKey``)."""
    if md.HasField("ordering_key"):
        return bytes(md.ordering_key)
    if md.HasField("partition_key"):
        if md.partition_key_b64_encoded:
            import base64

            try:
                return base64.b64decode(md.partition_key)
            except ValueError:  # a producer's bad base64 (binascii.Error, non-ASCII)
                pass  # must not poison dispatch: the key as sent is the key
        return str(md.partition_key).encode("utf-8")
    return NONE_KEY


def hash_slot(key: bytes) -> int:
    """Key_Shared slot: ``(Murmur3_32(key) & 0x7fffffff) % 65536`` as upstream.

    >>> hash_slot(b"hello") == (0x248bfa47 & 0x7fffffff) % 65536
    True
    """
    return (mmh3.hash(key, 0, signed=False) & 0x7FFFFFFF) % HASH_RANGE_SIZE


# --- batch-index ack bitsets -------------------------------------------------------------


def _mask(batch_size: int) -> int:
    return (1 << batch_size) - 1 if batch_size > 0 else 0


def wire_to_acked(words: Sequence[int], batch_size: int) -> bytes:
    """Wire ack_set (set = unacked) -> cursor bitset (set = acked) for ``batch_size``.

    Only the words that ``batch_size`` covers are read, and the work is integer bit
    operations: the cost follows the stored batch size, never the client's word count.

    >>> wire_to_acked([0b0110], 4).hex(), wire_to_acked([], 3).hex()
    ('09', '07')
    """
    mask = _mask(batch_size)
    unacked = 0
    for i, word in enumerate(words[: (batch_size + 63) // 64]):
        unacked |= (word & _U64_MASK) << (64 * i)
    return (~unacked & mask).to_bytes((batch_size + 7) // 8, "little")


def merge_acked(a: bytes | None, b: bytes) -> bytes:
    """Union of two cursor bitsets (acks only accumulate)."""
    if not a:
        return b
    size = max(len(a), len(b))
    merged = int.from_bytes(a, "little") | int.from_bytes(b, "little")
    return merged.to_bytes(size, "little")


def acked_count(acked: bytes, batch_size: int) -> int:
    """Indexes below ``batch_size`` set in a cursor bitset."""
    return (int.from_bytes(acked, "little") & _mask(batch_size)).bit_count()


def acked_to_wire(acked: bytes, batch_size: int) -> tuple[list[int], int]:
    """Cursor bitset -> (wire ack_set words as signed int64, unacked count)."""
    mask = _mask(batch_size)
    unacked_bits = ~int.from_bytes(acked, "little") & mask
    words = [(unacked_bits >> (64 * i)) & _U64_MASK for i in range((batch_size + 63) // 64)]
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in words]
    return signed, unacked_bits.bit_count()


# --- seek by publish time ------------------------------------------------------------------


async def read_info(ledger: ManagedLedger, position: Position) -> EntryInfo | None:
    """The EntryInfo of the entry at ``position`` (None if it is not there)."""
    entries = await ledger.read(position, 1)
    if not entries or entries[0].position != position:
        return None
    return entry_info(entries[0].data)


async def find_by_publish_time(ledger: ManagedLedger, timestamp_ms: int) -> Position:
    """The first position whose publish time is >= ``timestamp_ms`` (binary search over
    the retained entries, publish times being non-decreasing as upstream assumes); the
    position after the last entry when none is.
    """
    ledgers: Any = getattr(ledger, "ledgers", None)
    spans = [(i.ledger_id, i.entries) for i in ledgers or () if i.entries > 0]
    if not spans:
        return await _scan_by_publish_time(ledger, timestamp_ms)
    starts: list[int] = []
    total = 0
    for _, count in spans:
        starts.append(total)
        total += count

    def at(index: int) -> Position:
        k = max(j for j, s in enumerate(starts) if s <= index)
        return Position(spans[k][0], index - starts[k])

    lo, hi = 0, total
    while lo < hi:
        mid = (lo + hi) // 2
        info = await read_info(ledger, at(mid))
        if info is not None and info.publish_time_ms >= timestamp_ms:
            hi = mid
        else:
            lo = mid + 1
    if lo == total:
        last = at(total - 1)
        return last.next()
    return at(lo)


async def _scan_by_publish_time(ledger: ManagedLedger, timestamp_ms: int) -> Position:
    """Linear fallback for a ledger that does not expose its ledger list."""
    position = Position(-1, -1)
    last: Position | None = None
    while True:
        entries = await ledger.read(position, 100)
        if not entries:
            return last.next() if last is not None else position
        for entry in entries:
            if entry_info(entry.data).publish_time_ms >= timestamp_ms:
                return entry.position
        last = entries[-1].position
        position = last.next()
