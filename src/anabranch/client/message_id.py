"""``MessageId``: where a message is stored (ledger, entry, batch index, partition).

A MessageId is ordered like upstream's ``MessageIdImpl.compareTo`` (segment, ledger, entry,
partition, then batch index, where a non-batched id's ``batch_index`` -1 sorts first), is
hashable, and round-trips through ``to_bytes()``/``from_bytes()``. Without a segment the
bytes are a serialized ``MessageIdData``, exactly what upstream's ``toByteArray`` writes; a
scalable-topic id (``segment_id`` set) uses the V5 layout ``[segmentId:8][len:4][MessageIdData]``.

Example:
    >>> a, b = MessageId(3, 7), MessageId(3, 7, batch_index=2)
    >>> (a < b, MessageId.from_bytes(b.to_bytes()) == b, MessageId.earliest() < a)
    (True, True, True)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import total_ordering

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from anabranch.errors import InvalidArgument
from anabranch.protocol._generated import pulsar_api_pb2 as pb

_U64_MASK = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1
_SEGMENT_HEADER = struct.Struct(">qi")


def _signed64(value: int) -> int:
    """Upstream uses -1 ledger/entry ids (earliest); on the wire they are uint64."""
    return value - (1 << 64) if value > _I64_MAX else value


@total_ordering
@dataclass(frozen=True, slots=True)
class MessageId:
    """The position of one message; ``batch_size`` is informative and not compared.

    Example:
        >>> MessageId(1, 2, partition=3)
        MessageId(ledger_id=1, entry_id=2, batch_index=-1, partition=3, segment_id=None)
    """

    ledger_id: int
    entry_id: int
    batch_index: int = -1
    partition: int = -1
    segment_id: int | None = None
    batch_size: int = field(default=0, compare=False, repr=False)

    @staticmethod
    def earliest() -> MessageId:
        """The position before the first message (upstream ``MessageId.earliest``)."""
        return MessageId(-1, -1)

    @staticmethod
    def latest() -> MessageId:
        """The position after the last message (upstream ``MessageId.latest``)."""
        return MessageId(_I64_MAX, _I64_MAX)

    @property
    def entry(self) -> MessageId:
        """This id without its batch index: the stored entry that holds the message."""
        return MessageId(self.ledger_id, self.entry_id, -1, self.partition, self.segment_id)

    def _key(self) -> tuple[int, int, int, int, int]:
        seg = -1 if self.segment_id is None else self.segment_id
        return (seg, self.ledger_id, self.entry_id, self.partition, self.batch_index)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, MessageId):
            return NotImplemented
        return self._key() < other._key()

    def to_proto(self) -> pb.MessageIdData:
        """The wire ``MessageIdData`` (defaults left unset, as upstream clients do)."""
        data = pb.MessageIdData(
            ledgerId=self.ledger_id & _U64_MASK, entryId=self.entry_id & _U64_MASK
        )
        if self.partition != -1:
            data.partition = self.partition
        if self.batch_index != -1:
            data.batch_index = self.batch_index
        if self.batch_size:
            data.batch_size = self.batch_size
        return data

    @staticmethod
    def from_proto(
        data: pb.MessageIdData, partition: int | None = None, segment_id: int | None = None
    ) -> MessageId:
        """Build from ``MessageIdData``; ``partition`` overrides the wire value if given."""
        return MessageId(
            _signed64(int(data.ledgerId)),
            _signed64(int(data.entryId)),
            int(data.batch_index),
            int(data.partition) if partition is None else partition,
            segment_id,
            int(data.batch_size),
        )

    @staticmethod
    def entry_from_proto(
        data: pb.MessageIdData, partition: int | None = None, segment_id: int | None = None
    ) -> MessageId:
        """``from_proto(data, partition, segment_id).entry`` in one step (once per received
        entry).

        >>> MessageId.entry_from_proto(MessageId(1, 2, 3).to_proto())
        MessageId(ledger_id=1, entry_id=2, batch_index=-1, partition=-1, segment_id=None)
        """
        return MessageId(
            _signed64(int(data.ledgerId)),
            _signed64(int(data.entryId)),
            -1,
            int(data.partition) if partition is None else partition,
            segment_id,
        )

    def to_bytes(self) -> bytes:
        """Serialize (see the module docstring for the layout)."""
        raw = bytes(self.to_proto().SerializeToString())
        if self.segment_id is None:
            return raw
        return _SEGMENT_HEADER.pack(self.segment_id, len(raw)) + raw

    @staticmethod
    def from_bytes(data: bytes) -> MessageId:
        """Parse ``to_bytes()`` output (or upstream's serialized MessageIdData).

        A plain MessageIdData starts with the tag byte 0x08 (field 1, varint); a V5 id
        starts with a big-endian segment id, whose first byte is 0 below 2**56.
        """
        segment_id: int | None = None
        if data[:1] != b"\x08":
            if len(data) < _SEGMENT_HEADER.size:
                raise InvalidArgument(f"{len(data)} bytes are not a message id")
            segment_id, size = _SEGMENT_HEADER.unpack_from(data)
            data = data[_SEGMENT_HEADER.size :]
            if size != len(data):
                raise InvalidArgument("message id length does not match its header")
        proto = pb.MessageIdData()
        try:
            proto.ParseFromString(data)
        except DecodeError as err:
            raise InvalidArgument(f"unparsable message id: {err}") from err
        if not proto.IsInitialized():
            raise InvalidArgument("message id lacks ledger or entry id")
        return MessageId.from_proto(proto, segment_id=segment_id)
