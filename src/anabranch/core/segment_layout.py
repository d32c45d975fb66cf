"""The segment DAG of one scalable topic: an immutable layout, split and merge.

Theory of operation
-------------------
A scalable topic's keyspace ``[0x0000, 0xFFFF]`` is covered by its ACTIVE segments, which
tile it exactly: every hash value belongs to one active segment. A change never edits a
segment's range; it *seals* segments and creates new ones whose ranges cover exactly what
the sealed ones covered, so the layout is a DAG of generations (PIP-460):

    split(p)        p [s, e]            -> c1 [s, mid], c2 [mid+1, e]   mid = s + (e-s)//2
    merge(p1, p2)   p1, p2 adjacent     -> c  = p1 + p2                  parentIds = [p1, p2]

Every change bumps ``epoch`` by one; the sealed parents get ``sealedAtEpoch = epoch`` and
the children ``createdAtEpoch = epoch``. Children take ids ``nextSegmentId``, ``+1``.
Wall-clock ``*_ms`` values come in as ``now_ms`` (this module never reads a clock); they
serve retention and timestamp seek only, never ordering.

A :class:`SegmentLayout` is an immutable value: ``split`` and ``merge`` return a new layout
(and check it with :meth:`SegmentLayout.validate`) or raise and leave nothing changed. The
controller shell computes the new layout, writes it with a compare-and-set on the metadata
version, and on a CAS failure recomputes it from the re-read layout with the same
``now_ms``. The JSON form (:meth:`SegmentLayout.to_json`) is DESIGN.md §3.4's
``ScalableTopicMetadata`` shape; decoding validates the layout before returning it.

Legal changes (anything else raises and returns no layout):

    | operation    | preconditions                                   | error if not           |
    |--------------|-------------------------------------------------|------------------------|
    | split(id)    | id exists                                       | UnknownSegment         |
    |              | segment ACTIVE                                  | SegmentSealed          |
    |              | range at least 2 hashes wide                    | SegmentTooSmall        |
    | merge(a, b)  | a, b exist                                      | UnknownSegment         |
    |              | both ACTIVE                                     | SegmentSealed          |
    |              | a != b and ranges adjacent                      | SegmentsNotAdjacent    |

Example:
    >>> layout = SegmentLayout.initial(2, now_ms=1000)
    >>> [str(s.hash_range) for s in layout.active_segments()]
    ['[0000, 7fff]', '[8000, ffff]']
    >>> layout = layout.split(0, now_ms=2000)
    >>> [(s.segment_id, str(s.hash_range)) for s in layout.active_segments()]
    [(2, '[0000, 3fff]'), (3, '[4000, 7fff]'), (1, '[8000, ffff]')]
    >>> layout.epoch, layout.next_segment_id, layout.segments[0].child_ids
    (1, 4, (2, 3))
    >>> layout.merge(2, 3, now_ms=3000).find_active(0x1000).parent_ids
    (2, 3)
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from types import MappingProxyType
from typing import Any

import msgspec

from anabranch.core.hash_range import HASH_MAX, HASH_MIN, KEYSPACE_SIZE, HashRange
from anabranch.core.names import SegmentName, TopicDomain, TopicName
from anabranch.errors import (
    InvalidArgument,
    SegmentSealed,
    SegmentsNotAdjacent,
    SegmentTooSmall,
    UnknownSegment,
)

NOT_SEALED = -1
"""``sealed_at_epoch`` and ``sealed_at_ms`` of an ACTIVE segment (upstream's -1)."""


class SegmentState(StrEnum):
    """A segment is ACTIVE (accepts writes) or SEALED (terminated, read-only); no other state."""

    ACTIVE = "ACTIVE"
    SEALED = "SEALED"


@dataclass(frozen=True, slots=True)
class Segment:
    """One node of the DAG (upstream ``SegmentInfo``).

    Example:
        >>> s = Segment(0, HashRange.full(), SegmentState.ACTIVE, created_at_ms=5)
        >>> (s.is_active, s.sealed_at_epoch)
        (True, -1)
    """

    segment_id: int
    hash_range: HashRange
    state: SegmentState
    parent_ids: tuple[int, ...] = ()
    child_ids: tuple[int, ...] = ()
    created_at_epoch: int = 0
    sealed_at_epoch: int = NOT_SEALED
    created_at_ms: int = 0
    sealed_at_ms: int = NOT_SEALED

    @property
    def is_active(self) -> bool:
        """Whether the segment accepts writes."""
        return self.state is SegmentState.ACTIVE

    def _sealed(self, epoch: int, now_ms: int, child_ids: tuple[int, ...]) -> Segment:
        return dataclasses.replace(
            self,
            state=SegmentState.SEALED,
            child_ids=child_ids,
            sealed_at_epoch=epoch,
            sealed_at_ms=now_ms,
        )


def _range_sort_key(segment: Segment) -> tuple[int, int, int]:
    return (segment.hash_range.start, segment.hash_range.end, segment.segment_id)


@dataclass(frozen=True)
class SegmentLayout:
    """An immutable snapshot of a scalable topic's segment DAG (upstream ``SegmentLayout``).

    ``segments`` maps every segment id, active and sealed, to its :class:`Segment`;
    ``properties`` are the topic's user properties, carried through every change.

    Example:
        >>> layout = SegmentLayout.initial(4, now_ms=0)
        >>> [s.hash_range.to_hex() for s in layout.active_segments()]
        ['0000-3fff', '4000-7fff', '8000-bfff', 'c000-ffff']
    """

    epoch: int
    next_segment_id: int
    segments: Mapping[int, Segment]
    properties: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Copy into read-only views so a caller's dict cannot change a layout after the fact.
        object.__setattr__(self, "segments", MappingProxyType(dict(self.segments)))
        object.__setattr__(self, "properties", MappingProxyType(dict(self.properties)))

    # --- construction -----------------------------------------------------------------

    @classmethod
    def initial(
        cls, num_segments: int, now_ms: int, properties: Mapping[str, str] | None = None
    ) -> SegmentLayout:
        """``num_segments`` equal ranges of ``65536 // n`` hashes, the last ending at 0xFFFF.

        Ids are ``0..n-1``, epoch 0, ``next_segment_id = n``. ``n`` must be in [1, 65536].

        Example:
            >>> [s.hash_range.to_hex() for s in SegmentLayout.initial(3, 0).active_segments()]
            ['0000-5554', '5555-aaa9', 'aaaa-ffff']
        """
        if (
            not isinstance(num_segments, int)
            or isinstance(num_segments, bool)
            or not 1 <= num_segments <= KEYSPACE_SIZE
        ):
            raise InvalidArgument(
                f"number of initial segments {num_segments!r} is outside [1, {KEYSPACE_SIZE}]"
            )
        size = KEYSPACE_SIZE // num_segments
        segments = {}
        for i in range(num_segments):
            start = HASH_MIN + i * size
            end = HASH_MAX if i == num_segments - 1 else start + size - 1
            segments[i] = Segment(
                segment_id=i,
                hash_range=HashRange(start, end),
                state=SegmentState.ACTIVE,
                created_at_epoch=0,
                created_at_ms=now_ms,
            )
        layout = cls(0, num_segments, segments, dict(properties or {}))
        layout.validate()
        return layout

    # --- changes ------------------------------------------------------------------------

    def split(self, segment_id: int, now_ms: int) -> SegmentLayout:
        """Seal active segment ``segment_id`` and create its two midpoint children.

        Example:
            >>> layout = SegmentLayout.initial(2, 0).split(1, now_ms=7)
            >>> [(i, layout.segments[i].hash_range.to_hex()) for i in (2, 3)]
            [(2, '8000-bfff'), (3, 'c000-ffff')]
        """
        parent = self._active_segment(segment_id)
        if parent.hash_range.size < 2:
            raise SegmentTooSmall(segment_id, str(parent.hash_range))
        low, high = parent.hash_range.split()
        epoch = self.epoch + 1
        first, second = self.next_segment_id, self.next_segment_id + 1
        segments = dict(self.segments)
        segments[segment_id] = parent._sealed(epoch, now_ms, (first, second))
        for child_id, child_range in ((first, low), (second, high)):
            segments[child_id] = Segment(
                segment_id=child_id,
                hash_range=child_range,
                state=SegmentState.ACTIVE,
                parent_ids=(segment_id,),
                created_at_epoch=epoch,
                created_at_ms=now_ms,
            )
        return self._changed(epoch, second + 1, segments)

    def merge(self, first_id: int, second_id: int, now_ms: int) -> SegmentLayout:
        """Seal two adjacent active segments and create one child covering both.

        The child's ``parent_ids`` keep the argument order, as upstream does.

        Example:
            >>> layout = SegmentLayout.initial(2, 0).merge(1, 0, now_ms=7)
            >>> child = layout.segments[2]
            >>> (child.hash_range.to_hex(), child.parent_ids, layout.epoch)
            ('0000-ffff', (1, 0), 1)
        """
        first = self._active_segment(first_id)
        second = self._active_segment(second_id)
        if first_id == second_id or not first.hash_range.is_adjacent_to(second.hash_range):
            raise SegmentsNotAdjacent(
                first_id, second_id, str(first.hash_range), str(second.hash_range)
            )
        epoch = self.epoch + 1
        child_id = self.next_segment_id
        segments = dict(self.segments)
        segments[first_id] = first._sealed(epoch, now_ms, (child_id,))
        segments[second_id] = second._sealed(epoch, now_ms, (child_id,))
        segments[child_id] = Segment(
            segment_id=child_id,
            hash_range=first.hash_range.merge(second.hash_range),
            state=SegmentState.ACTIVE,
            parent_ids=(first_id, second_id),
            created_at_epoch=epoch,
            created_at_ms=now_ms,
        )
        return self._changed(epoch, child_id + 1, segments)

    def with_properties(self, properties: Mapping[str, str]) -> SegmentLayout:
        """The same layout with other user properties (the epoch is not bumped)."""
        return SegmentLayout(self.epoch, self.next_segment_id, self.segments, properties)

    def _changed(
        self, epoch: int, next_segment_id: int, segments: dict[int, Segment]
    ) -> SegmentLayout:
        layout = SegmentLayout(epoch, next_segment_id, segments, self.properties)
        # A change is rare (an admin or auto-scale decision) and the result is written to
        # metadata next: check it here, before it can be written (STYLE #4).
        layout.validate()
        return layout

    def _active_segment(self, segment_id: int) -> Segment:
        segment = self.segment(segment_id)
        if not segment.is_active:
            raise SegmentSealed(segment_id, segment.sealed_at_epoch)
        return segment

    # --- queries ------------------------------------------------------------------------

    def segment(self, segment_id: int) -> Segment:
        """The segment with this id, or :class:`~anabranch.errors.UnknownSegment`."""
        segment = self.segments.get(segment_id)
        if segment is None:
            raise UnknownSegment(segment_id, self.epoch)
        return segment

    @cached_property
    def _active(self) -> tuple[Segment, ...]:
        return tuple(
            sorted((s for s in self.segments.values() if s.is_active), key=_range_sort_key)
        )

    @cached_property
    def _active_starts(self) -> list[int]:
        return [s.hash_range.start for s in self._active]

    def active_segments(self) -> tuple[Segment, ...]:
        """The ACTIVE segments sorted by hash range (they tile the keyspace)."""
        return self._active

    def sealed_segments(self) -> tuple[Segment, ...]:
        """The SEALED segments sorted by hash range, then id."""
        return tuple(
            sorted((s for s in self.segments.values() if not s.is_active), key=_range_sort_key)
        )

    def find_active(self, hash_value: int) -> Segment:
        """The active segment whose range contains ``hash_value``.

        Example:
            >>> layout = SegmentLayout.initial(2, 0)
            >>> (layout.find_active(0x1000).segment_id, layout.find_active(0x9000).segment_id)
            (0, 1)
        """
        if not isinstance(hash_value, int) or not HASH_MIN <= hash_value <= HASH_MAX:
            raise InvalidArgument(f"hash {hash_value!r} is outside [0x0000, 0xffff]")
        index = bisect.bisect_right(self._active_starts, hash_value) - 1
        # A valid layout's active segments tile the keyspace, so index 0..n-1 always hits.
        segment = self._active[index]
        assert segment.hash_range.contains(hash_value), (hash_value, segment)
        return segment

    def parents(self, segment_id: int) -> tuple[Segment, ...]:
        """The segments this one was split or merged from (empty for a root)."""
        return tuple(self.segments[i] for i in self.segment(segment_id).parent_ids)

    def children(self, segment_id: int) -> tuple[Segment, ...]:
        """The segments this one was split or merged into (empty while active)."""
        return tuple(self.segments[i] for i in self.segment(segment_id).child_ids)

    def ancestors(self, segment_id: int) -> frozenset[int]:
        """Ids of every segment reachable through parent links (excluding itself).

        Example:
            >>> SegmentLayout.initial(1, 0).split(0, 1).split(1, 2).ancestors(3)
            frozenset({0, 1})
        """
        return self._walk(segment_id, lambda s: s.parent_ids)

    def descendants(self, segment_id: int) -> frozenset[int]:
        """Ids of every segment reachable through child links (excluding itself)."""
        return self._walk(segment_id, lambda s: s.child_ids)

    def _walk(self, segment_id: int, links: Callable[[Segment], tuple[int, ...]]) -> frozenset[int]:
        seen: set[int] = set()
        stack = list(links(self.segment(segment_id)))
        while stack:
            current = stack.pop()
            if current not in seen and current in self.segments:
                seen.add(current)
                stack.extend(links(self.segments[current]))
        return frozenset(seen)

    @property
    def roots(self) -> tuple[Segment, ...]:
        """Segments without parents (the initial generation), sorted by range."""
        return tuple(
            sorted((s for s in self.segments.values() if not s.parent_ids), key=_range_sort_key)
        )

    def __iter__(self) -> Iterator[Segment]:
        """Every segment in id order."""
        return (self.segments[i] for i in sorted(self.segments))

    # --- invariants ---------------------------------------------------------------------

    def validate(self) -> None:
        """Check every invariant of the DAG; raise InvalidArgument naming the first broken one.

        - ``epoch`` and ``next_segment_id`` are non-negative; every id is in
          ``[0, next_segment_id)`` and equals its key;
        - ACTIVE segments have no children and no seal stamps; SEALED ones have children
          and ``created_at_epoch < sealed_at_epoch <= epoch``;
        - parent/child links name existing segments, without duplicates, symmetrically;
          every child's parents are SEALED at the child's ``created_at_epoch`` (so epochs
          strictly increase along every path and the graph is acyclic);
        - each change is a complete block (each parent's children = the block's children)
          and its children's ranges union to exactly its parents' ranges, without overlap;
        - the ACTIVE ranges tile ``[0x0000, 0xFFFF]`` exactly.
        """
        _check(self.epoch >= 0, f"epoch {self.epoch} is negative")
        _check(self.next_segment_id >= 0, f"nextSegmentId {self.next_segment_id} is negative")
        for key, segment in self.segments.items():
            self._validate_segment(key, segment)
        for segment in self.segments.values():
            if not segment.is_active:
                self._validate_change(segment)
        self._validate_tiling()
        for name, value in self.properties.items():
            _check(
                isinstance(name, str) and isinstance(value, str),
                f"property {name!r}={value!r} is not str=str",
            )

    def _validate_segment(self, key: int, s: Segment) -> None:
        sid = s.segment_id
        _check(key == sid, f"segment {sid} is stored under key {key}")
        _check(0 <= sid < self.next_segment_id, f"segment id {sid} not in [0, nextSegmentId)")
        _check(
            0 <= s.created_at_epoch <= self.epoch,
            f"segment {sid} created at epoch {s.created_at_epoch}, layout epoch {self.epoch}",
        )
        for name, ids in (("parent", s.parent_ids), ("child", s.child_ids)):
            _check(len(set(ids)) == len(ids), f"segment {sid} repeats a {name} id: {ids}")
            _check(sid not in ids, f"segment {sid} is its own {name}")
            for other in ids:
                _check(other in self.segments, f"segment {sid} names missing {name} {other}")
        for parent_id in s.parent_ids:
            parent = self.segments[parent_id]
            _check(sid in parent.child_ids, f"parent {parent_id} does not list child {sid}")
            _check(not parent.is_active, f"segment {sid} has ACTIVE parent {parent_id}")
            _check(
                parent.sealed_at_epoch == s.created_at_epoch,
                f"parent {parent_id} sealed at epoch {parent.sealed_at_epoch}, "
                f"child {sid} created at {s.created_at_epoch}",
            )
        for child_id in s.child_ids:
            _check(
                sid in self.segments[child_id].parent_ids,
                f"child {child_id} does not list parent {sid}",
            )
        if s.is_active:
            _check(not s.child_ids, f"ACTIVE segment {sid} has children {s.child_ids}")
            _check(
                s.sealed_at_epoch == NOT_SEALED and s.sealed_at_ms == NOT_SEALED,
                f"ACTIVE segment {sid} has seal stamps",
            )
        else:
            _check(bool(s.child_ids), f"SEALED segment {sid} has no children")
            _check(
                s.created_at_epoch < s.sealed_at_epoch <= self.epoch,
                f"segment {sid} created at epoch {s.created_at_epoch}, "
                f"sealed at {s.sealed_at_epoch}, layout epoch {self.epoch}",
            )

    def _validate_change(self, parent: Segment) -> None:
        children = frozenset(parent.child_ids)
        block = frozenset(p for c in children for p in self.segments[c].parent_ids)
        for other in block:
            _check(
                frozenset(self.segments[other].child_ids) == children,
                f"segments {sorted(block)} were sealed together but have different children",
            )
        parent_ranges = [self.segments[i].hash_range for i in block]
        child_ranges = [self.segments[i].hash_range for i in children]
        parent_union = _disjoint_union(parent_ranges)
        _check(
            parent_union is not None and parent_union == _disjoint_union(child_ranges),
            f"children {sorted(children)} do not cover exactly their parents {sorted(block)}",
        )

    def _validate_tiling(self) -> None:
        expected_start = HASH_MIN
        for s in self._active:
            _check(
                s.hash_range.start == expected_start,
                f"active segments leave a gap or overlap at {expected_start:#06x} "
                f"(segment {s.segment_id} starts at {s.hash_range.start:#06x})",
            )
            expected_start = s.hash_range.end + 1
        _check(expected_start == HASH_MAX + 1, "active segments do not reach 0xffff")

    # --- JSON (DESIGN.md §3.4) ------------------------------------------------------------

    def to_json(self) -> bytes:
        """Encode as ``ScalableTopicMetadata`` JSON (validated first).

        Example:
            >>> SegmentLayout.from_json(SegmentLayout.initial(2, 0).to_json()).epoch
            0
        """
        self.validate()
        return msgspec.json.encode(self._to_doc())

    def to_dict(self) -> dict[str, Any]:
        """The JSON document as plain Python values."""
        result: dict[str, Any] = msgspec.to_builtins(self._to_doc())
        return result

    @classmethod
    def from_json(cls, data: bytes | str) -> SegmentLayout:
        """Decode and validate ``ScalableTopicMetadata`` JSON; bad input raises InvalidArgument.

        Unknown fields (upstream's ``autoScalePolicy``, ``legacyTopicName``...) are ignored.
        """
        try:
            doc = msgspec.json.decode(data, type=_LayoutDoc)
        except msgspec.DecodeError as err:
            raise InvalidArgument(f"scalable topic metadata is not valid: {err}") from None
        return cls._from_doc(doc)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> SegmentLayout:
        """Like :meth:`from_json` from an already-parsed JSON object."""
        try:
            doc = msgspec.convert(obj, type=_LayoutDoc)
        except msgspec.ValidationError as err:
            raise InvalidArgument(f"scalable topic metadata is not valid: {err}") from None
        return cls._from_doc(doc)

    def _to_doc(self) -> _LayoutDoc:
        return _LayoutDoc(
            epoch=self.epoch,
            next_segment_id=self.next_segment_id,
            segments={
                str(s.segment_id): _SegmentDoc(
                    segment_id=s.segment_id,
                    hash_range=_RangeDoc(s.hash_range.start, s.hash_range.end),
                    state=s.state.value,
                    parent_ids=list(s.parent_ids),
                    child_ids=list(s.child_ids),
                    created_at_epoch=s.created_at_epoch,
                    sealed_at_epoch=s.sealed_at_epoch,
                    created_at_ms=s.created_at_ms,
                    sealed_at_ms=s.sealed_at_ms,
                )
                for s in self
            },
            properties=dict(self.properties),
        )

    @classmethod
    def _from_doc(cls, doc: _LayoutDoc) -> SegmentLayout:
        segments: dict[int, Segment] = {}
        for key, s in doc.segments.items():
            if key != str(s.segment_id):
                raise InvalidArgument(f"segment {s.segment_id} is stored under key {key!r}")
            segments[s.segment_id] = Segment(
                segment_id=s.segment_id,
                hash_range=HashRange(s.hash_range.start, s.hash_range.end),
                state=SegmentState(s.state),
                parent_ids=tuple(s.parent_ids),
                child_ids=tuple(s.child_ids),
                created_at_epoch=s.created_at_epoch,
                sealed_at_epoch=s.sealed_at_epoch,
                created_at_ms=s.created_at_ms,
                sealed_at_ms=s.sealed_at_ms,
            )
        layout = cls(doc.epoch, doc.next_segment_id, segments, doc.properties)
        # Metadata read from the store is checked before anyone acts on it (STYLE #4).
        layout.validate()
        return layout


def segment_name(topic: TopicName, segment: Segment) -> SegmentName:
    """The ``segment://`` topic that stores ``segment`` of scalable topic ``topic``.

    Example:
        >>> topic = TopicName.parse("topic://public/default/orders")
        >>> str(segment_name(topic, SegmentLayout.initial(2, 0).segments[1]))
        'segment://public/default/orders/8000-ffff-1'
    """
    if topic.domain is not TopicDomain.TOPIC:
        raise InvalidArgument(f"{topic} is not a scalable topic:// name")
    return SegmentName(topic, segment.hash_range, segment.segment_id)


def segment_is_active(layout: SegmentLayout, segment: SegmentName) -> bool:
    """Whether ``segment`` is one of the layout's ACTIVE segments (same id and range); a
    destructive operation on such a segment would lose data clients were promised.

    Example:
        >>> layout = SegmentLayout.initial(1, 0)
        >>> s = SegmentName.parse("segment://public/default/orders/0000-ffff-0")
        >>> segment_is_active(layout, s), segment_is_active(layout.split(0, 1), s)
        (True, False)
    """
    active = {(s.segment_id, s.hash_range) for s in layout.active_segments()}
    return (segment.segment_id, segment.hash_range) in active


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgument(f"invalid segment layout: {message}")


def _disjoint_union(ranges: Iterable[HashRange]) -> tuple[tuple[int, int], ...] | None:
    """Merged intervals of ``ranges``, or None if any two overlap."""
    merged: list[list[int]] = []
    for r in sorted(ranges):
        if merged and r.start <= merged[-1][1]:
            return None
        if merged and r.start == merged[-1][1] + 1:
            merged[-1][1] = r.end
        else:
            merged.append([r.start, r.end])
    return tuple((a, b) for a, b in merged)


# --- wire documents -------------------------------------------------------------------------
# Field order here is the JSON field order; rename="camel" gives upstream's Java names.


class _RangeDoc(msgspec.Struct, forbid_unknown_fields=False):
    start: int
    end: int


class _SegmentDoc(msgspec.Struct, rename="camel", kw_only=True):
    segment_id: int
    hash_range: _RangeDoc
    state: str
    parent_ids: list[int] = []
    child_ids: list[int] = []
    created_at_epoch: int
    sealed_at_epoch: int = NOT_SEALED
    created_at_ms: int
    sealed_at_ms: int = NOT_SEALED

    def __post_init__(self) -> None:
        if self.state not in (SegmentState.ACTIVE.value, SegmentState.SEALED.value):
            raise ValueError(f"state {self.state!r} is not ACTIVE or SEALED")


class _LayoutDoc(msgspec.Struct, rename="camel", kw_only=True):
    epoch: int
    next_segment_id: int
    segments: dict[str, _SegmentDoc]
    properties: dict[str, str] = {}
