"""What the compactor sees of stored entries: their messages (key, tombstone, batch index)
and the chunks of chunked messages (PIP-37), which count as one message.

Example:
    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.protocol._generated import pulsar_api_pb2 as pb
    >>> md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=0,
    ...                         partition_key="k")
    >>> [m.key for m in entry_messages(Entry(Position(1, 0), encode_entry(md, b"v")))]
    [b'k']
"""

from __future__ import annotations

import struct
from typing import Any

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch.admin.messages import split_batch, split_entry
from anabranch.broker.dispatcher_entries import Chunk, entry_metadata
from anabranch.core.compaction import Message
from anabranch.errors import InvalidMessage
from anabranch.storage.api import Entry, ManagedLedger, Position

CHUNKED_MESSAGE_ENTRIES_MAX = 10_000
"""A chunked message whose first chunk is more entries than this before the horizon and
that is still unfinished is abandoned, not in progress."""


def entry_messages(entry: Entry, removed: bytes = b"") -> list[Message]:
    """The messages of a stored entry as the compaction plan sees them (indexes set in
    ``removed`` were compacted away before and are skipped). An entry that cannot be
    parsed has no key anyone could rely on: it counts as one keyless message.

    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.protocol._generated import pulsar_api_pb2 as pb
    >>> md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=0,
    ...                         partition_key="k")
    >>> entry_messages(Entry(Position(1, 0), encode_entry(md, b"")))
    [Message(position=Position(ledger_id=1, entry_id=0), batch_index=-1, key=b'k', tombstone=True)]
    """
    try:
        stored = split_entry(entry)
        singles = split_batch(stored)
    except (InvalidMessage, struct.error):
        return [Message(entry.position, -1, None, False)]
    batched = stored.metadata.HasField("num_messages_in_batch")
    gone = int.from_bytes(removed, "little")
    out: list[Message] = []
    for index, (single, payload) in enumerate(singles):
        if gone >> index & 1:
            continue
        meta: Any = single if single is not None else stored.metadata
        key: bytes | None = None
        if meta.HasField("partition_key") and not meta.null_partition_key:
            key = str(meta.partition_key).encode()
        tombstone = bool(meta.null_value) or not payload
        out.append(Message(entry.position, index if batched else -1, key, tombstone))
    return out


class ChunkGroups:
    """The chunks of chunked messages (PIP-37) seen by phase one: a chunked message is one
    message, keyed and judged at its last chunk, and survives with all its chunks. Memory:
    a position per chunk of the chunked messages up to the horizon (each chunk is up to a
    whole max-size message, so this is small next to the data).

    >>> from anabranch.broker.dispatcher_entries import Chunk
    >>> from anabranch.protocol.frames import encode_entry
    >>> from anabranch.protocol._generated import pulsar_api_pb2 as pb
    >>> md = pb.MessageMetadata(producer_name="p", sequence_id=1, publish_time=0,
    ...                         partition_key="k")
    >>> groups = ChunkGroups()
    >>> groups.add(Entry(Position(1, 0), encode_entry(md, b"a")), Chunk("p/u", 0, 2))
    []
    >>> [m.position for m in groups.add(Entry(Position(1, 1), encode_entry(md, b"b")),
    ...                                  Chunk("p/u", 1, 2))]
    [Position(ledger_id=1, entry_id=1)]
    >>> sorted(tuple(p) for p in groups.with_earlier_chunks({(1, 1): frozenset({0})}))
    [(1, 0), (1, 1)]
    """

    def __init__(self) -> None:
        self._open: dict[str, list[Position]] = {}
        self._earlier: dict[Position, list[Position]] = {}

    def add(self, entry: Entry, chunk: Chunk) -> list[Message]:
        """One chunk; the message (at the last chunk's position) once it is complete."""
        positions = self._open.setdefault(chunk.message, [])
        if chunk.chunk_id != len(positions):
            positions.clear()  # a producer's resend restarts its message: keep the new one
            if chunk.chunk_id != 0:
                self._open.pop(chunk.message, None)
                return []  # the start of this message is gone (trimmed): not readable
        positions.append(entry.position)
        if not chunk.last:
            return []
        del self._open[chunk.message]
        self._earlier[entry.position] = positions[:-1]
        key: bytes | None = None
        try:
            md = entry_metadata(entry.data)
            if md.HasField("partition_key") and not md.null_partition_key:
                key = str(md.partition_key).encode()
        except (DecodeError, struct.error, ValueError):
            pass
        return [Message(entry.position, -1, key, False)]

    def unfinished_before(self, horizon: Position, ledger: ManagedLedger) -> Position | None:
        """Where to stop instead of ``horizon`` when a chunked message is still being
        written across it (None: nothing is). One that started more than
        ``CHUNKED_MESSAGE_ENTRIES_MAX`` entries earlier is abandoned (its producer died) and
        dropped instead, so it cannot hold compaction back for ever."""
        starts = [
            group[0]
            for group in self._open.values()
            if group and ledger.backlog(group[0], horizon) < CHUNKED_MESSAGE_ENTRIES_MAX
        ]
        if not starts:
            return None
        first = min(starts)
        return Position(first[0], first[1] - 1)

    def with_earlier_chunks(
        self, keep: dict[tuple[int, int], frozenset[int]]
    ) -> dict[tuple[int, int], frozenset[int]]:
        """``keep`` plus the earlier chunks of every surviving chunked message."""
        out = dict(keep)
        for last, earlier in self._earlier.items():
            if last in keep:
                for position in earlier:
                    out[position] = frozenset({0})
        return out
