"""``Checkpoint``: where a checkpoint consumer is in every segment of a scalable topic.

Theory of operation
-------------------
A checkpoint maps segment ids to a :class:`SegmentPosition` and records the layout epoch
it was taken at. A position is either *after* a message id (resume strictly after it;
``MessageId.earliest()`` means "nothing read yet") or *complete* (a sealed segment read to
its end). The consumer reads a segment only once every ancestor is complete, so a
checkpoint never holds a position in a child whose parent is unfinished.

Resuming against the topic's *current* layout (:meth:`Checkpoint.start_positions`) keeps
working across splits and merges that happened after the checkpoint was taken:

    | segment in the current layout                       | starts at                  |
    |-----------------------------------------------------|----------------------------|
    | listed in the checkpoint                            | its position               |
    | not listed, but a descendant of it is listed        | complete (it was read)     |
    | not listed, created at or before the checkpoint     | complete (pruned from view)|
    | not listed, created after the checkpoint's epoch    | earliest (new child)       |

Listed segments that the layout no longer has (pruned) are ignored.

``earliest()`` reads every segment from its beginning; ``latest()`` counts every sealed
segment as complete and starts each active one at its current end (the consumer resolves
that when it starts, so a checkpoint taken afterwards names concrete ids).

Checkpoints merge (:meth:`Checkpoint.merge`): per segment the further position wins and
*complete* beats any id; the epoch is the larger. Merge is commutative, associative and
idempotent, and ``a.merge(b).covers(a)``: consumers of a group can combine theirs.

Encoding (``to_bytes``), big-endian, versioned:

    [0xAB][version=1][kind:1]                           kind 1 earliest, 2 latest
    [0xAB][version=1][kind=0][epoch:8][count:4]
        {[segment_id:8][state:1][len:4][MessageIdData bytes]}*   state 0 after, 1 complete

``from_bytes`` also accepts upstream's ``CheckpointV5`` bytes (``b"\\x01"`` earliest,
``b"\\x02"`` latest, type 0 with per-segment ids; their epoch is unknown, -1).

Example:
    >>> cp = Checkpoint.earliest().advanced(1, MessageId(5, 3)).completed(0)
    >>> cp = cp.with_epoch(2)
    >>> Checkpoint.from_bytes(cp.to_bytes()) == cp
    True
    >>> cp.position(0).complete, cp.position(1).after
    (True, MessageId(ledger_id=5, entry_id=3, batch_index=-1, partition=-1, segment_id=None))
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from functools import total_ordering
from types import MappingProxyType

from anabranch.client.message_id import MessageId
from anabranch.core.segment_layout import Segment, SegmentLayout
from anabranch.errors import InvalidArgument

MAGIC = 0xAB
VERSION = 1
_HEAD = struct.Struct(">BBB")
_EPOCH_COUNT = struct.Struct(">qI")
_ENTRY = struct.Struct(">qBI")
_UPSTREAM_HEAD = struct.Struct(">BqI")
_UPSTREAM_ENTRY = struct.Struct(">qI")


class CheckpointKind(IntEnum):
    """What a checkpoint names: concrete positions, or one of the two symbolic starts."""

    POSITIONS = 0
    EARLIEST = 1
    LATEST = 2


def _plain(mid: MessageId) -> MessageId:
    """A position inside one segment: no segment, no partition, no batch size."""
    return MessageId(mid.ledger_id, mid.entry_id, mid.batch_index)


@total_ordering
@dataclass(frozen=True, slots=True)
class SegmentPosition:
    """Where reading one segment resumes: strictly after ``after``, or ``complete``.

    Positions are totally ordered: by ``after`` id, and *complete* above every id.

    Example:
        >>> SegmentPosition.start() < SegmentPosition.after_id(MessageId(1, 0))
        True
        >>> SegmentPosition.after_id(MessageId(9, 9)) < SegmentPosition.done()
        True
    """

    after: MessageId = field(default_factory=MessageId.earliest)
    complete: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "after", MessageId.earliest() if self.complete else _plain(self.after)
        )

    @staticmethod
    def start() -> SegmentPosition:
        """Nothing read yet: the segment's first message comes next."""
        return SegmentPosition()

    @staticmethod
    def after_id(mid: MessageId) -> SegmentPosition:
        """Resume strictly after ``mid``."""
        return SegmentPosition(_plain(mid))

    @staticmethod
    def done() -> SegmentPosition:
        """The (sealed) segment was read to its end."""
        return SegmentPosition(MessageId.earliest(), complete=True)

    def _key(self) -> tuple[bool, MessageId]:
        return (self.complete, MessageId.earliest() if self.complete else self.after)

    def __lt__(self, other: SegmentPosition) -> bool:
        return self._key() < other._key()

    def admits(self, mid: MessageId) -> bool:
        """True if a message at ``mid`` is still to be read from here.

        Example:
            >>> p = SegmentPosition.after_id(MessageId(3, 1))
            >>> (p.admits(MessageId(3, 1)), p.admits(MessageId(3, 2)))
            (False, True)
        """
        return not self.complete and _plain(mid) > self.after


@dataclass(frozen=True)
class Checkpoint:
    """Positions per segment plus the layout epoch (see the module docstring).

    Build with :meth:`earliest`, :meth:`latest` or :meth:`of`; a checkpoint consumer's
    ``checkpoint()`` returns one. Immutable and hashable by value.

    Example:
        >>> cp = Checkpoint.of(3, {0: SegmentPosition.done(), 2: SegmentPosition.start()})
        >>> (cp.epoch, sorted(cp.positions), cp.is_earliest, cp.is_latest)
        (3, [0, 2], False, False)
    """

    kind: CheckpointKind = CheckpointKind.POSITIONS
    epoch: int = -1
    positions: Mapping[int, SegmentPosition] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positions = {int(k): v for k, v in self.positions.items()}
        for seg, pos in positions.items():
            if seg < 0 or not isinstance(pos, SegmentPosition):
                raise InvalidArgument(f"bad checkpoint entry {seg!r}: {pos!r}")
        if self.kind is not CheckpointKind.POSITIONS and (positions or self.epoch != -1):
            raise InvalidArgument(f"a {self.kind.name.lower()} checkpoint holds no positions")
        object.__setattr__(self, "positions", MappingProxyType(positions))

    def __hash__(self) -> int:
        return hash((self.kind, self.epoch, frozenset(self.positions.items())))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Checkpoint):
            return NotImplemented
        return (self.kind, self.epoch, dict(self.positions)) == (
            other.kind,
            other.epoch,
            dict(other.positions),
        )

    def __repr__(self) -> str:
        if self.kind is not CheckpointKind.POSITIONS:
            return f"Checkpoint.{self.kind.name.lower()}()"
        parts = ", ".join(
            f"{seg}: {'complete' if p.complete else f'{p.after.ledger_id}:{p.after.entry_id}'}"
            + ("" if p.complete or p.after.batch_index < 0 else f":{p.after.batch_index}")
            for seg, p in sorted(self.positions.items())
        )
        return f"Checkpoint(epoch={self.epoch}, {{{parts}}})"

    # --- construction -----------------------------------------------------------------

    @staticmethod
    def earliest() -> Checkpoint:
        """Every segment from its first message."""
        return Checkpoint(CheckpointKind.EARLIEST)

    @staticmethod
    def latest() -> Checkpoint:
        """Only messages produced after the consumer starts."""
        return Checkpoint(CheckpointKind.LATEST)

    @staticmethod
    def of(epoch: int, positions: Mapping[int, SegmentPosition]) -> Checkpoint:
        """Concrete positions taken at layout ``epoch``."""
        return Checkpoint(CheckpointKind.POSITIONS, epoch, positions)

    @property
    def is_earliest(self) -> bool:
        """True for :meth:`earliest`."""
        return self.kind is CheckpointKind.EARLIEST

    @property
    def is_latest(self) -> bool:
        """True for :meth:`latest`."""
        return self.kind is CheckpointKind.LATEST

    def position(self, segment_id: int) -> SegmentPosition:
        """The listed position of a segment (``start()`` if not listed)."""
        return self.positions.get(segment_id, SegmentPosition.start())

    def _concrete(self) -> Checkpoint:
        if self.kind is CheckpointKind.LATEST:
            raise InvalidArgument("Checkpoint.latest() has no positions until a consumer starts")
        return self if self.kind is CheckpointKind.POSITIONS else Checkpoint.of(-1, {})

    def _with(self, segment_id: int, position: SegmentPosition) -> Checkpoint:
        base = self._concrete()
        return Checkpoint.of(base.epoch, {**base.positions, segment_id: position})

    def advanced(self, segment_id: int, mid: MessageId) -> Checkpoint:
        """This checkpoint with ``segment_id`` positioned after ``mid``."""
        return self._with(segment_id, SegmentPosition.after_id(mid))

    def completed(self, segment_id: int) -> Checkpoint:
        """This checkpoint with ``segment_id`` read to its end."""
        return self._with(segment_id, SegmentPosition.done())

    def with_epoch(self, epoch: int) -> Checkpoint:
        """This checkpoint recorded at layout ``epoch``."""
        return Checkpoint.of(epoch, self._concrete().positions)

    # --- order and merge --------------------------------------------------------------

    def merge(self, other: Checkpoint) -> Checkpoint:
        """Per segment the further position; the larger epoch (see the module docstring).

        ``latest()`` cannot be merged (it has no positions yet); ``earliest()`` is the
        identity.

        Example:
            >>> a = Checkpoint.of(1, {0: SegmentPosition.after_id(MessageId(1, 5))})
            >>> b = Checkpoint.of(2, {0: SegmentPosition.after_id(MessageId(1, 2))})
            >>> a.merge(b).position(0).after.entry_id, a.merge(b).epoch
            (5, 2)
        """
        mine, theirs = self._concrete(), other._concrete()
        merged = dict(mine.positions)
        for seg, pos in theirs.positions.items():
            if seg not in merged or merged[seg] < pos:
                merged[seg] = pos
        if self.is_earliest and other.is_earliest:
            return Checkpoint.earliest()
        return Checkpoint.of(max(mine.epoch, theirs.epoch), merged)

    def covers(self, other: Checkpoint) -> bool:
        """True if this checkpoint is at or past ``other`` in every segment and epoch.

        Example:
            >>> Checkpoint.earliest().completed(0).covers(Checkpoint.earliest())
            True
        """
        mine, theirs = self._concrete(), other._concrete()
        if mine.epoch < theirs.epoch:
            return False
        return all(pos <= mine.position(seg) for seg, pos in theirs.positions.items())

    # --- resuming ---------------------------------------------------------------------

    def start_positions(self, layout: SegmentLayout) -> dict[int, SegmentPosition | None]:
        """Where each segment of ``layout`` starts; ``None`` means "its current end"
        (an active segment under ``latest()``, resolved by the consumer).

        Example:
            >>> layout = SegmentLayout.initial(1, 0).split(0, 1)
            >>> cp = Checkpoint.of(0, {0: SegmentPosition.after_id(MessageId(1, 2))})
            >>> {k: (v.complete, v.after.entry_id) for k, v in cp.start_positions(layout).items()}
            {0: (False, 2), 1: (False, -1), 2: (False, -1)}
        """
        out: dict[int, SegmentPosition | None] = {}
        for seg in layout:
            out[seg.segment_id] = self._start_of(layout, seg)
        return out

    def _start_of(self, layout: SegmentLayout, seg: Segment) -> SegmentPosition | None:
        if self.kind is CheckpointKind.EARLIEST:
            return SegmentPosition.start()
        if self.kind is CheckpointKind.LATEST:
            return None if seg.is_active else SegmentPosition.done()
        listed = self.positions.get(seg.segment_id)
        if listed is not None:
            return listed
        if any(d in self.positions for d in layout.descendants(seg.segment_id)):
            return SegmentPosition.done()
        if self.epoch >= 0 and seg.created_at_epoch <= self.epoch:
            return SegmentPosition.done()
        return SegmentPosition.start()

    # --- bytes ------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The versioned binary form (see the module docstring)."""
        if self.kind is not CheckpointKind.POSITIONS:
            return _HEAD.pack(MAGIC, VERSION, int(self.kind))
        parts = [
            _HEAD.pack(MAGIC, VERSION, int(self.kind)),
            _EPOCH_COUNT.pack(self.epoch, len(self.positions)),
        ]
        for seg, pos in sorted(self.positions.items()):
            raw = b"" if pos.complete else pos.after.to_bytes()
            parts.append(_ENTRY.pack(seg, 1 if pos.complete else 0, len(raw)))
            parts.append(raw)
        return b"".join(parts)

    @staticmethod
    def from_bytes(data: bytes) -> Checkpoint:
        """Parse :meth:`to_bytes` output (or upstream's ``CheckpointV5`` bytes).

        Raises ``InvalidArgument`` on anything else.
        """
        data = bytes(data)
        try:
            if data[:1] == bytes([MAGIC]):
                return _parse_ours(data)
            return _parse_upstream(data)
        except struct.error as err:
            raise InvalidArgument(f"truncated checkpoint: {err}") from err


def _parse_ours(data: bytes) -> Checkpoint:
    _magic, version, kind = _HEAD.unpack_from(data)
    if version != VERSION:
        raise InvalidArgument(f"checkpoint version {version} is not supported")
    if kind in (CheckpointKind.EARLIEST, CheckpointKind.LATEST):
        if len(data) != _HEAD.size:
            raise InvalidArgument("trailing bytes after a symbolic checkpoint")
        return Checkpoint(CheckpointKind(kind))
    if kind != CheckpointKind.POSITIONS:
        raise InvalidArgument(f"unknown checkpoint kind {kind}")
    offset = _HEAD.size
    epoch, count = _EPOCH_COUNT.unpack_from(data, offset)
    offset += _EPOCH_COUNT.size
    positions: dict[int, SegmentPosition] = {}
    for _ in range(count):
        seg, state, size = _ENTRY.unpack_from(data, offset)
        offset += _ENTRY.size
        raw = data[offset : offset + size]
        offset += size
        if len(raw) != size or state not in (0, 1) or seg in positions:
            raise InvalidArgument("malformed checkpoint entry")
        if state == 1:
            if size:
                raise InvalidArgument("a complete segment carries no message id")
            positions[seg] = SegmentPosition.done()
        else:
            positions[seg] = SegmentPosition.after_id(MessageId.from_bytes(raw))
    if offset != len(data):
        raise InvalidArgument("trailing bytes after the checkpoint")
    return Checkpoint.of(epoch, positions)


def _parse_upstream(data: bytes) -> Checkpoint:
    if data == b"\x01":
        return Checkpoint.earliest()
    if data == b"\x02":
        return Checkpoint.latest()
    if data[:1] != b"\x00":
        raise InvalidArgument("not a checkpoint")
    _type, _millis, count = _UPSTREAM_HEAD.unpack_from(data)
    offset = _UPSTREAM_HEAD.size
    positions: dict[int, SegmentPosition] = {}
    for _ in range(count):
        seg, size = _UPSTREAM_ENTRY.unpack_from(data, offset)
        offset += _UPSTREAM_ENTRY.size
        raw = data[offset : offset + size]
        offset += size
        if len(raw) != size or seg < 0:
            raise InvalidArgument("malformed checkpoint entry")
        positions[seg] = SegmentPosition.after_id(MessageId.from_bytes(raw))
    if offset != len(data):
        raise InvalidArgument("trailing bytes after the checkpoint")
    return Checkpoint.of(-1, positions)


def readable_segments(
    layout: SegmentLayout, complete: Iterable[int], opened: Iterable[int] = ()
) -> tuple[Segment, ...]:
    """Segments a checkpoint consumer may open now: not complete, not already open, and
    every ancestor still in ``layout`` complete (parent-before-child). Sorted by range.

    Example:
        >>> layout = SegmentLayout.initial(1, 0).split(0, 1)
        >>> [s.segment_id for s in readable_segments(layout, complete=[])]
        [0]
        >>> [s.segment_id for s in readable_segments(layout, complete=[0])]
        [1, 2]
    """
    done = frozenset(complete)
    skip = done | frozenset(opened)
    ready = [
        seg
        for seg in layout
        if seg.segment_id not in skip and layout.ancestors(seg.segment_id) <= done
    ]
    return tuple(sorted(ready, key=lambda s: (s.hash_range.start, s.hash_range.end, s.segment_id)))
