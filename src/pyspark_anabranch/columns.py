"""Stored entries of one segment range decoded straight into Arrow columns (no ``Message``).

An executor reads a segment range ``[start, end)`` entry by entry. :class:`EntryDecoder` keeps
the range's state (the last position taken, so a redelivered entry adds nothing; whether the
range is done) and decodes entries with the protobuf parser into :class:`Columns`.
:class:`ChunkBuilder` collects a chunk of entries into a :class:`Chunk` of Arrow columns: runs
of batches lying wholly inside the range go through the vectorized walk of
:mod:`~pyspark_anabranch.bulk_decode`, everything else (single messages, batches the range
starts or ends inside, messages with properties, layouts the walk does not know) through
:class:`EntryDecoder`. Both paths give the same rows; ``tests/spark/test_columns.py`` checks
them against :func:`anabranch.protocol.batch.decode_batch`.

Example::

    builder = ChunkBuilder(EntryDecoder("segment://t/ns/x/0000-ffff-0", 0, 1 << 62))
    builder.add(ledger_id, entry_id, metadata, payload)
    chunk = builder.finish()
"""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch.client.consumer import UNCOMPRESSED_BYTES_MAX
from anabranch.errors import InvalidMessage
from anabranch.limits import BATCH_MESSAGES_MAX
from anabranch.protocol._generated import pulsar_api_pb2 as pb
from anabranch.protocol.compression import decompress
from pyspark_anabranch.bulk_decode import decode_run
from pyspark_anabranch.planning import encode_position

_I32 = struct.Struct(">i")

BULK_MIN_MESSAGES = 16
"""Batches smaller than this are decoded message by message: numpy's fixed cost per call
would outweigh the vectorized walk."""
BULK_RUN_BYTES = 4 << 20
"""A run of whole batches is decoded at once up to this many payload bytes."""

PROPERTIES_TYPE = pa.map_(pa.string(), pa.string())
EVENT_MS_MAX = (2**63 - 1) // 1000
"""Event times above this cannot be a microsecond timestamp: they read as null, like 0
(Pulsar's "not set")."""


class StoredBatch(NamedTuple):
    """A stored batch entry: its base position (messages follow at ``base + 1 + index``),
    number of messages, decompressed payload and publish time (ms)."""

    base: int
    messages: int
    payload: bytes
    publish: int


@dataclass
class Columns:
    """Decoded messages, column by column, as Python lists (publish/event times in ms)."""

    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    publish: list[int] = field(default_factory=list)
    event: list[int | None] = field(default_factory=list)
    properties: list[list[tuple[str, str]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)


@dataclass
class Chunk:
    """Decoded messages as Arrow/numpy columns (publish/event times in ms)."""

    keys: pa.Array
    values: pa.Array
    positions: npt.NDArray[np.int64]
    publish_ms: npt.NDArray[np.int64]
    event_ms: pa.Array
    properties: pa.Array | None

    def __len__(self) -> int:
        return len(self.positions)

    @classmethod
    def of(cls, cols: Columns, properties: bool) -> Chunk:
        return cls(
            pa.array(cols.keys, pa.binary()),
            pa.array(cols.values, pa.binary()),
            np.array(cols.positions, np.int64),
            np.array(cols.publish, np.int64),
            pa.array(cols.event, pa.int64()),
            pa.array(cols.properties, PROPERTIES_TYPE) if properties else None,
        )

    @classmethod
    def concat(cls, parts: list[Chunk]) -> Chunk:
        if len(parts) == 1:
            return parts[0]
        props = [p.properties for p in parts]
        return cls(
            pa.concat_arrays([p.keys for p in parts]),
            pa.concat_arrays([p.values for p in parts]),
            np.concatenate([p.positions for p in parts]),
            np.concatenate([p.publish_ms for p in parts]),
            pa.concat_arrays([p.event_ms for p in parts]),
            None if props[0] is None else pa.concat_arrays(props),
        )


class EntryDecoder:
    """Decodes the entries of one segment range ``[start, end)``, in order, with the protobuf
    parser. ``done`` turns true once the range's last position has been taken (or passed)."""

    def __init__(self, name: str, start: int, end: int) -> None:
        self.name = name
        self.start = start
        self.end = end
        self.last = start - 1
        self.done = end <= start

    def count(self, md: pb.MessageMetadata) -> int:
        """Messages in an entry (checked against the batch limit)."""
        if not md.HasField("num_messages_in_batch"):
            return 1
        count = int(md.num_messages_in_batch)
        if not 0 <= count <= BATCH_MESSAGES_MAX:
            raise InvalidMessage(f"{self.name}: batch declares {count} messages")
        return count

    def claim_whole(self, base: int, count: int) -> bool:
        """Take every message of the batch at ``base`` if all of them lie inside the range and
        after what was taken; the caller then decodes them all."""
        first, last = base + 1, base + count
        if count == 0 or first < self.start or first <= self.last or last >= self.end:
            return False
        self.last = last
        self.done = last >= self.end - 1
        return True

    def positions(self, base: int, md: pb.MessageMetadata) -> npt.NDArray[np.int64]:
        """The positions an entry at ``base`` adds to the range, from its metadata alone (no
        payload decoding: what the driver needs to cut a range at a record limit)."""
        if not md.HasField("num_messages_in_batch"):
            first = last = base
        else:
            first, last = base + 1, base + self.count(md)
        first = max(first, self.start, self.last + 1)
        last = min(last, self.end - 1)
        if base >= self.end or last >= self.end - 1:
            self.done = True
        if last < first:
            return np.zeros(0, np.int64)
        self.last = last
        return np.arange(first, last + 1, dtype=np.int64)

    def add(
        self,
        base: int,
        md: pb.MessageMetadata,
        payload: bytes,
        out: Columns,
        properties: bool = False,
    ) -> None:
        """Append the messages of one (decompressed) entry at ``base`` that fall in the range."""
        publish = int(md.publish_time)
        if not md.HasField("num_messages_in_batch"):
            self._single(base, md, payload, publish, out, properties)
            return
        batch = StoredBatch(base, self.count(md), payload, publish)
        if self.claim_whole(base, batch.messages):
            self.whole_batch(batch, out, properties)
        else:
            self._batch_in_range(batch, out, properties)

    def whole_batch(self, batch: StoredBatch, out: Columns, properties: bool) -> None:
        """Every message of a claimed batch (compacted-out messages are skipped)."""
        base, count, payload, publish = batch
        total = len(payload)
        offset = 0
        for index in range(count):
            single, start, offset = self._next(payload, offset, total, index)
            if single.compacted_out:
                continue
            value = None if single.null_value else payload[start:offset]
            self._append(single, value, base + 1 + index, publish, out, properties)
        if offset != total:
            raise InvalidMessage(f"{self.name}: {total - offset} bytes after the batch's messages")

    def _batch_in_range(self, batch: StoredBatch, out: Columns, properties: bool) -> None:
        """A batch the range starts or ends inside, or that was partly taken already."""
        base, count, payload, publish = batch
        lo, hi, last = self.start, self.end, self.last
        total = len(payload)
        offset = 0
        for index in range(count):
            single, start, offset = self._next(payload, offset, total, index)
            pos = base + 1 + index
            if pos >= hi:
                self.done = True
                break
            if pos < lo or pos <= last or single.compacted_out:
                continue
            last = pos
            value = None if single.null_value else payload[start:offset]
            self._append(single, value, pos, publish, out, properties)
            if pos >= hi - 1:
                self.done = True
                break
        self.last = last

    def _next(
        self, payload: bytes, offset: int, total: int, index: int
    ) -> tuple[pb.SingleMessageMetadata, int, int]:
        """The batch message at ``offset``: its metadata, where its value starts and ends."""
        if total - offset < 4:
            raise InvalidMessage(f"{self.name}: batch truncated before message {index}")
        (meta_size,) = _I32.unpack_from(payload, offset)
        offset += 4
        end_meta = offset + meta_size
        if meta_size < 0 or end_meta > total:
            raise InvalidMessage(f"{self.name}: message {index} metadata does not fit")
        try:
            single = pb.SingleMessageMetadata.FromString(payload[offset:end_meta])
        except DecodeError as err:
            raise InvalidMessage(f"{self.name}: message {index}: {err}") from err
        if not single.HasField("payload_size"):
            raise InvalidMessage(f"{self.name}: message {index} metadata lacks payload_size")
        size = single.payload_size
        end = end_meta + size
        if size < 0 or end > total:
            raise InvalidMessage(f"{self.name}: message {index} payload does not fit")
        return single, end_meta, end

    def _append(  # noqa: PLR0917 (one message's columns)
        self,
        single: pb.SingleMessageMetadata | pb.MessageMetadata,
        value: bytes | None,
        position: int,
        publish: int,
        out: Columns,
        properties: bool,
    ) -> None:
        """One message: its value, position, publish time, and key, event time and
        properties from its metadata."""
        out.positions.append(position)
        out.publish.append(publish)
        if not single.HasField("partition_key") or single.null_partition_key:
            out.keys.append(None)
        elif single.partition_key_b64_encoded:
            out.keys.append(self._b64_key(single.partition_key))
        else:
            out.keys.append(single.partition_key.encode())
        out.values.append(value)
        event = int(single.event_time)
        out.event.append(event if 0 < event <= EVENT_MS_MAX else None)
        if properties:
            out.properties.append([(p.key, p.value) for p in single.properties])

    def _b64_key(self, text: str) -> bytes:
        try:
            return base64.b64decode(text, validate=True)
        except binascii.Error as err:
            raise InvalidMessage(f"{self.name}: a key flagged base64 is not: {err}") from err

    def _single(  # noqa: PLR0917 (private)
        self,
        pos: int,
        md: pb.MessageMetadata,
        value: bytes,
        publish: int,
        out: Columns,
        properties: bool,
    ) -> None:
        """A non-batched message at ``pos``."""
        if pos >= self.end:
            self.done = True
            return
        if pos < self.start or pos <= self.last:
            return
        self.last = pos
        self._append(md, None if md.null_value else value, pos, publish, out, properties)
        if pos >= self.end - 1:
            self.done = True


@dataclass
class _Run:
    """Claimed whole batches waiting for one vectorized decode."""

    batches: list[StoredBatch] = field(default_factory=list)
    size: int = 0


class ChunkBuilder:
    """Collects entries into one :class:`Chunk`, in order (see the module docstring)."""

    def __init__(self, decoder: EntryDecoder, properties: bool = False) -> None:
        self.decoder = decoder
        self.properties = properties
        self.parts: list[Chunk] = []
        self.cols = Columns()
        self.run = _Run()
        self.rows = 0

    def add(self, ledger_id: int, entry_id: int, md: pb.MessageMetadata, payload: bytes) -> None:
        """Decode one stored entry (compressed or not) into the chunk."""
        base = encode_position(ledger_id, entry_id, -1)
        payload = decompress(
            int(md.compression), payload, int(md.uncompressed_size), UNCOMPRESSED_BYTES_MAX
        )
        count = self.decoder.count(md)
        self.rows += count
        bulk = (
            not self.properties
            and md.HasField("num_messages_in_batch")
            and count >= BULK_MIN_MESSAGES
            and self.decoder.claim_whole(base, count)
        )
        if not bulk:
            self._end_run()
            self.decoder.add(base, md, payload, self.cols, self.properties)
            return
        self._end_columns()
        run = self.run
        run.batches.append(StoredBatch(base, count, payload, int(md.publish_time)))
        run.size += len(payload)
        if run.size >= BULK_RUN_BYTES:
            self._end_run()

    def finish(self) -> Chunk | None:
        """The chunk's columns (None if no message of the range was in its entries)."""
        self._end_run()
        self._end_columns()
        parts, self.parts = self.parts, []
        self.rows = 0
        parts = [p for p in parts if len(p)]
        return Chunk.concat(parts) if parts else None

    def _end_columns(self) -> None:
        if len(self.cols):
            self.parts.append(Chunk.of(self.cols, self.properties))
            self.cols = Columns()

    def _end_run(self) -> None:
        batches, self.run = self.run.batches, _Run()
        if not batches:
            return
        decoded = decode_run([b.payload for b in batches], [b.messages for b in batches])
        if decoded is None:  # a layout the vectorized walk does not know: one by one
            cols = Columns()
            for batch in batches:
                self.decoder.whole_batch(batch, cols, self.properties)
            self.parts.append(Chunk.of(cols, self.properties))
            return
        bases = np.array([b.base for b in batches], np.int64)
        publish_ms = np.array([b.publish for b in batches], np.int64)
        self.parts.append(
            Chunk(
                decoded.keys,
                decoded.values,
                bases[decoded.entry] + 1 + decoded.index,
                publish_ms[decoded.entry],
                decoded.event_ms,
                None,
            )
        )
