"""Pure planning for the Spark source: positions, the offset frontier, expansion at splits and
merges, batch-read ranges and read limits. No Spark, no I/O, no clock: the I/O side
(:mod:`pyspark_anabranch._io`) feeds it layouts and positions.

**Positions.** A position is a non-negative ``int`` (a Spark long) that orders the messages of
one segment and from which a reader can resume. It packs the message's storage id::

    position = ledger_id << 39 | entry_id << 17 | (batch_index + 1)

(24 bits of ledger id, 22 of entry id, 17 of batch index + 1, where a non-batched message has
batch index -1). Ledger ids of one managed ledger grow, so the packing orders messages exactly
like their MessageIds. The offset JSON stores the *next* position to read, i.e. the last read
message's position + 1 (exclusive), or :func:`entry_end` of the last entry when a range ends
at a segment's end; ``0`` means "from the segment's first message". Resuming
at ``p > 0`` starts a reader at the entry of ``p - 1`` (inclusive) and skips positions below
``p``: that entry must still exist, so a trimmed entry is detected as data loss.

**Frontier.** ``{"v":1,"topics":{"t/ns/x":{"epoch":E,"segs":{"<id>":<next position>}}}}``
with sorted keys. The frontier's segments tile the keyspace and every ancestor of a frontier
segment is fully read. A sealed frontier segment read to its final position is replaced by its
children, but only once *all* of a child's parents are complete in the batch's start offset, so
a parent's tail and its children's head are never in the same micro-batch.

Example:
    >>> layout = SegmentLayout.initial(1, now_ms=0).split(0, now_ms=1)
    >>> start = Frontier({"public/default/t": TopicFrontier(0, {0: 5})})
    >>> end = expand(start, {"public/default/t": layout}, {"public/default/t": {0: 5}})
    >>> end.to_json()
    '{"topics":{"public/default/t":{"epoch":1,"segs":{"1":0,"2":0}}},"v":1}'
    >>> decode_position(encode_position(7, 3, -1) + 1)
    (7, 3, 0)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from anabranch.core.segment_layout import Segment, SegmentLayout
from anabranch.errors import AnabranchError, InvalidArgument

OFFSET_VERSION = 1
FIRST_POSITION = 0
"""The next position of a segment nothing was read from: its first message."""

_BATCH_BITS = 17
_ENTRY_BITS = 22
_LEDGER_BITS = 24
_BATCH_MASK = (1 << _BATCH_BITS) - 1
_ENTRY_MASK = (1 << _ENTRY_BITS) - 1


class DataLoss(AnabranchError):
    """Messages the query still needs are gone (trimmed entries, a pruned segment); raised
    unless ``failOnDataLoss=false``."""


def encode_position(ledger_id: int, entry_id: int, batch_index: int) -> int:
    """The position of the message stored at ``(ledger_id, entry_id, batch_index)``.

    Example:
        >>> encode_position(1, 0, -1), encode_position(1, 0, 0) < encode_position(1, 1, -1)
        (549755813888, True)
    """
    if not 0 <= ledger_id < 1 << _LEDGER_BITS:
        raise InvalidArgument(f"ledger id {ledger_id} does not fit a position")
    if not 0 <= entry_id <= _ENTRY_MASK:
        raise InvalidArgument(f"entry id {entry_id} does not fit a position")
    if not -1 <= batch_index < _BATCH_MASK:
        raise InvalidArgument(f"batch index {batch_index} does not fit a position")
    return ledger_id << (_ENTRY_BITS + _BATCH_BITS) | entry_id << _BATCH_BITS | (batch_index + 1)


def entry_end(ledger_id: int, entry_id: int) -> int:
    """The next position after every message of entry ``(ledger_id, entry_id)`` (segment ends
    are entry-granular; it sorts before the next entry's first message).

    Example:
        >>> encode_position(2, 5, 999) < entry_end(2, 5) <= encode_position(2, 6, -1)
        True
    """
    return encode_position(ledger_id, entry_id, _BATCH_MASK - 1) + 1


def decode_position(position: int) -> tuple[int, int, int]:
    """``(ledger_id, entry_id, batch_index)`` of a position (inverse of encode_position).

    Example:
        >>> decode_position(encode_position(3, 9, 41))
        (3, 9, 41)
    """
    if position < 0 or position >> (_ENTRY_BITS + _BATCH_BITS) >= 1 << _LEDGER_BITS:
        raise InvalidArgument(f"{position} is not a position")
    return (
        position >> (_ENTRY_BITS + _BATCH_BITS),
        (position >> _BATCH_BITS) & _ENTRY_MASK,
        (position & _BATCH_MASK) - 1,
    )


def resume_entry(next_position: int) -> tuple[int, int] | None:
    """The ``(ledger_id, entry_id)`` a reader starts at (inclusive) to read from
    ``next_position``; None for :data:`FIRST_POSITION` (read from the earliest message).

    Example:
        >>> resume_entry(encode_position(4, 2, 7) + 1), resume_entry(0)
        ((4, 2), None)
    """
    if next_position == FIRST_POSITION:
        return None
    ledger_id, entry_id, _ = decode_position(next_position - 1)
    return ledger_id, entry_id


# --- the offset frontier ----------------------------------------------------------------------


@dataclass(frozen=True)
class TopicFrontier:
    """One topic's part of an offset: the layout epoch seen and ``segment id -> next position``."""

    epoch: int
    segs: Mapping[int, int]

    def with_segs(self, segs: Mapping[int, int], epoch: int | None = None) -> TopicFrontier:
        return TopicFrontier(self.epoch if epoch is None else epoch, dict(segs))


@dataclass(frozen=True)
class Frontier:
    """A Spark offset: per topic (``t/ns/x``), a :class:`TopicFrontier`.

    ``latest=True`` is the symbolic initial offset ``{"init":"latest","v":1}`` that the first
    ``latestOffset`` resolves (so ``initialOffset`` stays deterministic).

    Example:
        >>> f = Frontier.from_json('{"v":1,"topics":{"a/b/c":{"epoch":2,"segs":{"10":3,"9":0}}}}')
        >>> f.to_json()
        '{"topics":{"a/b/c":{"epoch":2,"segs":{"10":3,"9":0}}},"v":1}'
        >>> Frontier.from_json(Frontier.symbolic_latest().to_json()).latest
        True
    """

    topics: Mapping[str, TopicFrontier] = field(default_factory=dict)
    latest: bool = False
    timestamp: int | None = None
    """Set on the symbolic initial offset ``{"init":"timestamp","ts":T,"v":1}`` of
    ``startingTimestamp=T``, which the first ``latestOffset`` resolves like ``latest``."""

    @staticmethod
    def symbolic_latest() -> Frontier:
        return Frontier({}, latest=True)

    @staticmethod
    def symbolic_timestamp(timestamp_ms: int) -> Frontier:
        """The unresolved start of ``startingTimestamp``.

        Example:
            >>> Frontier.symbolic_timestamp(1700000000000).to_json()
            '{"init":"timestamp","ts":1700000000000,"v":1}'
        """
        if timestamp_ms < 0:
            raise InvalidArgument(f"timestamp {timestamp_ms} is negative")
        return Frontier({}, timestamp=timestamp_ms)

    @property
    def symbolic(self) -> bool:
        """True for an unresolved initial offset (``latest`` or a timestamp)."""
        return self.latest or self.timestamp is not None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict Spark stores (json.dumps with sort_keys gives the canonical text)."""
        if self.latest:
            return {"v": OFFSET_VERSION, "init": "latest"}
        if self.timestamp is not None:
            return {"v": OFFSET_VERSION, "init": "timestamp", "ts": self.timestamp}
        return {
            "v": OFFSET_VERSION,
            "topics": {
                topic: {
                    "epoch": tf.epoch,
                    "segs": {str(sid): pos for sid, pos in sorted(tf.segs.items())},
                }
                for topic, tf in sorted(self.topics.items())
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_dict(obj: Mapping[str, Any]) -> Frontier:
        """Parse an offset dict; raises InvalidArgument on anything malformed."""
        if not isinstance(obj, Mapping) or obj.get("v") != OFFSET_VERSION:
            raise InvalidArgument(f"offset {obj!r} is not a version {OFFSET_VERSION} offset")
        if obj.get("init") == "latest":
            return Frontier.symbolic_latest()
        if obj.get("init") == "timestamp":
            ts = obj.get("ts")
            if not isinstance(ts, int) or isinstance(ts, bool):
                raise InvalidArgument(f"offset {obj!r} has no integer ts")
            return Frontier.symbolic_timestamp(ts)
        topics = obj.get("topics")
        if not isinstance(topics, Mapping):
            raise InvalidArgument(f"offset {obj!r} has no topics")
        parsed: dict[str, TopicFrontier] = {}
        for topic, tf in topics.items():
            try:
                segs = {int(sid): int(pos) for sid, pos in tf["segs"].items()}
                epoch = int(tf["epoch"])
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
                raise InvalidArgument(f"offset of {topic!r} is malformed: {tf!r}") from err
            if any(pos < 0 for pos in segs.values()) or not segs:
                raise InvalidArgument(f"offset of {topic!r} has no or negative positions")
            parsed[str(topic)] = TopicFrontier(epoch, segs)
        return Frontier(parsed)

    @staticmethod
    def from_json(text: str) -> Frontier:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidArgument(f"offset {text!r} is not JSON") from err
        return Frontier.from_dict(obj)


def earliest_frontier(layout: SegmentLayout) -> TopicFrontier:
    """Every root segment from its first message (the DAG's roots tile the keyspace).

    Example:
        >>> earliest_frontier(SegmentLayout.initial(2, 0).split(1, 1)).segs
        {0: 0, 1: 0}
    """
    return TopicFrontier(layout.epoch, {s.segment_id: FIRST_POSITION for s in layout.roots})


def latest_frontier(layout: SegmentLayout, ends: Mapping[int, int]) -> TopicFrontier:
    """Every active segment at its current end (``ends``: segment id -> next position)."""
    return TopicFrontier(layout.epoch, {s.segment_id: ends[s.segment_id] for s in _active(layout)})


def _active(layout: SegmentLayout) -> tuple[Segment, ...]:
    return layout.active_segments()


def check_epoch(topic: str, frontier: TopicFrontier, layout: SegmentLayout) -> None:
    """Raise if the metadata went backwards (a layout older than one an offset was built on)."""
    if layout.epoch < frontier.epoch:
        raise DataLoss(
            f"{topic}: layout epoch {layout.epoch} is older than the offset's {frontier.epoch}"
        )


def expand_topic(
    topic: str,
    start: TopicFrontier,
    layout: SegmentLayout,
    finals: Mapping[int, int],
    *,
    fail_on_data_loss: bool = True,
) -> TopicFrontier:
    """The frontier after replacing complete sealed segments by their ready children.

    ``finals`` holds the final position (next position after the last message) of sealed
    segments, at least of those in ``start``. A child is added (at its first position) only when
    every one of its parents is in the frontier and complete; a parent leaves the frontier once
    all its children are in. Runs to a fixpoint (an empty sealed child expands at once).
    A frontier segment missing from the layout raises :class:`DataLoss` unless
    ``fail_on_data_loss`` is false, in which case it counts as complete.
    """
    check_epoch(topic, start, layout)
    segs = dict(start.segs)
    missing = {sid for sid in segs if sid not in layout.segments}
    if missing and fail_on_data_loss:
        raise DataLoss(f"{topic}: segments {sorted(missing)} are gone from the layout")

    def complete(sid: int) -> bool:
        if sid in missing:
            return True
        seg = layout.segments[sid]
        return (not seg.is_active) and sid in finals and segs[sid] >= finals[sid]

    changed = True
    while changed:
        changed = False
        for sid in sorted(segs):
            if sid not in segs or not complete(sid):
                continue
            children = _children(layout, sid)
            for child in children:
                if child.segment_id in segs:
                    continue
                if all(p in segs and complete(p) for p in child.parent_ids):
                    segs[child.segment_id] = FIRST_POSITION
                    changed = True
            if children and all(c.segment_id in segs for c in children):
                del segs[sid]
                changed = True
    for sid in missing & segs.keys():
        if not _children(layout, sid):
            del segs[sid]  # pruned with no known children: nothing left to read from it
    return TopicFrontier(max(layout.epoch, start.epoch), segs)


def _children(layout: SegmentLayout, sid: int) -> list[Segment]:
    if sid in layout.segments:
        ids = layout.segments[sid].child_ids
    else:  # a pruned segment: find children that name it
        ids = tuple(s.segment_id for s in layout.segments.values() if sid in s.parent_ids)
    return [layout.segments[c] for c in ids if c in layout.segments]


def expand(
    start: Frontier,
    layouts: Mapping[str, SegmentLayout],
    finals: Mapping[str, Mapping[int, int]],
    *,
    fail_on_data_loss: bool = True,
) -> Frontier:
    """:func:`expand_topic` for every topic of ``start``."""
    return Frontier(
        {
            topic: expand_topic(
                topic,
                tf,
                layouts[topic],
                finals.get(topic, {}),
                fail_on_data_loss=fail_on_data_loss,
            )
            for topic, tf in start.topics.items()
        }
    )


# --- starting at a timestamp -----------------------------------------------------------------


def timestamp_start(messages: Iterable[tuple[int, int]], timestamp_ms: int, end: int) -> int:
    """Where one segment starts for ``startingTimestamp``: the next position after the last
    message before the first one published at or after ``timestamp_ms`` (Kafka's rule: from the
    first message whose time is >= the timestamp, everything after it included).

    ``messages`` are ``(position, publish time ms)`` in position order (only a prefix up to
    the first match is consumed); ``end`` is the segment's end, returned when every message is
    older, so a sealed segment entirely before the timestamp is complete. The result names the
    entry *before* the first match, so a resuming reader starts on an existing entry.

    Example:
        >>> msgs = [(10, 5), (11, 7), (20, 9)]
        >>> [timestamp_start(msgs, ts, 30) for ts in (7, 0, 10)]
        [11, 0, 30]
    """
    previous = FIRST_POSITION
    for position, publish_ms in messages:
        if publish_ms >= timestamp_ms:
            return previous
        previous = position + 1
    return end


def timestamp_frontier(
    topic: str,
    layout: SegmentLayout,
    starts: Mapping[int, int],
    finals: Mapping[int, int],
) -> TopicFrontier:
    """The start frontier of ``startingTimestamp`` over the whole DAG.

    ``starts`` maps a segment id to its :func:`timestamp_start` (at least for every segment
    the walk reaches; a missing one starts at its first message); ``finals`` as in
    :func:`expand_topic`. The roots start at their positions; a sealed segment whose start is
    its final end (all its messages are older) is complete and hands over to its children by
    the usual expansion rule (a child enters only once all its parents are complete), which
    then start at *their* positions, to a fixpoint.

    Example:
        >>> layout = SegmentLayout.initial(1, now_ms=0).split(0, now_ms=1)
        >>> timestamp_frontier("t", layout, {0: 9, 1: 0, 2: 4}, {0: 9}).segs
        {1: 0, 2: 4}
        >>> timestamp_frontier("t", layout, {0: 3, 1: 0, 2: 4}, {0: 9}).segs
        {0: 3}
    """
    segs = {s.segment_id: starts.get(s.segment_id, FIRST_POSITION) for s in layout.roots}
    while True:
        expanded = expand_topic(topic, TopicFrontier(layout.epoch, segs), layout, finals)
        added = {sid: starts.get(sid, FIRST_POSITION) for sid in expanded.segs if sid not in segs}
        if not added:
            return TopicFrontier(layout.epoch, dict(expanded.segs))
        segs = {**expanded.segs, **added}


# --- ranges ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """Positions ``[start, end)`` of one segment of one topic: one Spark partition."""

    topic: str
    segment_id: int
    start: int
    end: int


def stream_ranges(start: Frontier, end: Frontier) -> list[Range]:
    """One range per segment of ``end`` that has positions past ``start``.

    A segment of ``end`` absent from ``start`` was added by expansion and starts at its first
    position; a segment of ``start`` absent from ``end`` was complete. A symbolic ``start``
    (the unresolved ``latest`` or timestamp) plans nothing: batch 0 of such a query is empty
    by design.

    Example:
        >>> a = Frontier({"t": TopicFrontier(1, {1: 0, 2: 5})})
        >>> b = Frontier({"t": TopicFrontier(1, {1: 4, 2: 5, 3: 2})})
        >>> [(r.segment_id, r.start, r.end) for r in stream_ranges(a, b)]
        [(1, 0, 4), (3, 0, 2)]
    """
    if start.symbolic or end.symbolic:
        return []
    out: list[Range] = []
    for topic, etf in sorted(end.topics.items()):
        stf = start.topics.get(topic)
        for sid, epos in sorted(etf.segs.items()):
            spos = stf.segs.get(sid, FIRST_POSITION) if stf is not None else FIRST_POSITION
            if epos > spos:
                out.append(Range(topic, sid, spos, epos))
    return out


def batch_ranges(
    topic: str,
    layout: SegmentLayout,
    start: TopicFrontier,
    end: TopicFrontier,
    ends: Mapping[int, int],
) -> list[Range]:
    """Ranges of a batch read over the whole DAG between two frontiers.

    ``ends`` gives every segment's current end (final for sealed ones). A segment strictly
    before ``start`` (an ancestor of a start segment) or strictly after ``end`` (a descendant
    of an end segment) is skipped; otherwise it is read from its start-frontier position (or
    its first) to its end-frontier position (or its end).

    Example:
        >>> layout = SegmentLayout.initial(1, 0).split(0, 1)
        >>> s, e = TopicFrontier(0, {0: 0}), TopicFrontier(1, {1: 7, 2: 9})
        >>> [(r.segment_id, r.end) for r in batch_ranges("t", layout, s, e, {0: 3, 1: 7, 2: 9})]
        [(0, 3), (1, 7), (2, 9)]
    """
    before: set[int] = set()
    for sid in start.segs:
        if sid in layout.segments:
            before |= layout.ancestors(sid)
    after: set[int] = set()
    for sid in end.segs:
        if sid in layout.segments:
            after |= layout.descendants(sid)
    out: list[Range] = []
    for sid in sorted(layout.segments):
        if sid in before or sid in after:
            continue
        lo = start.segs.get(sid, FIRST_POSITION)
        hi = end.segs.get(sid, ends.get(sid, FIRST_POSITION))
        if hi > lo:
            out.append(Range(topic, sid, lo, hi))
    return out


# --- read limits ------------------------------------------------------------------------------


def allocate(limit: int, available: Mapping[Any, int]) -> dict[Any, int]:
    """Split ``limit`` units over segments by water-filling: every segment with data gets an
    equal share (at least 1 while the limit allows), a segment with less than its share gets
    all it has, and the rest goes to the others. The result never exceeds ``available`` per
    segment nor ``limit`` in total, and reaches ``min(limit, sum(available))``.

    Example:
        >>> allocate(10, {"a": 2, "b": 100, "c": 100})
        {'a': 2, 'b': 4, 'c': 4}
    """
    if limit < 0:
        raise InvalidArgument("a read limit must be >= 0")
    grant = {k: 0 for k in available}
    remaining = limit
    open_keys = sorted(
        (k for k, v in available.items() if v > 0), key=lambda k: (available[k], str(k))
    )
    while remaining > 0 and open_keys:
        share, extra = divmod(remaining, len(open_keys))
        if share == 0:
            for k in sorted(open_keys, key=str)[:extra]:
                grant[k] += 1
            remaining = 0
            break
        still: list[Any] = []
        for k in open_keys:
            take = min(share, available[k] - grant[k])
            grant[k] += take
            remaining -= take
            if grant[k] < available[k]:
                still.append(k)
        open_keys = still
    return grant


def cut_by_bytes(sizes: Iterable[int], budget: int) -> int:
    """How many leading messages (with these sizes) fit ``budget`` bytes; at least 1 if any,
    so one message larger than the budget still moves the query forward.

    Example:
        >>> cut_by_bytes([40, 40, 40], 100), cut_by_bytes([500], 100), cut_by_bytes([], 10)
        (2, 1, 0)
    """
    total = 0
    count = 0
    for size in sizes:
        if count and total + size > budget:
            break
        total += size
        count += 1
    return count


def should_wait(available: int, min_rows: int, waited_ms: int, max_delay_ms: int) -> bool:
    """``minRecordsPerTrigger``: hold the batch back while fewer than ``min_rows`` are
    available, but not longer than ``max_delay_ms`` since the last batch.

    Example:
        >>> should_wait(5, 10, 1000, 60_000), should_wait(5, 10, 61_000, 60_000)
        (True, False)
    """
    return available < min_rows and waited_ms < max_delay_ms


def parse_duration_ms(text: str) -> int:
    """``"15m"``, ``"30s"``, ``"500ms"``, ``"2h"`` or plain milliseconds, as milliseconds.

    Example:
        >>> parse_duration_ms("15m"), parse_duration_ms("250ms"), parse_duration_ms("42")
        (900000, 250, 42)
    """
    raw = text.strip().lower()
    units = (("ms", 1), ("s", 1000), ("m", 60_000), ("min", 60_000), ("h", 3_600_000))
    for suffix, factor in sorted(units, key=lambda u: -len(u[0])):
        if raw.endswith(suffix) and raw[: -len(suffix)].strip().isdigit():
            return int(raw[: -len(suffix)]) * factor
    if raw.isdigit():
        return int(raw)
    raise InvalidArgument(f"{text!r} is not a duration (e.g. 15m, 30s, 500ms)")
