"""Checkpoint: pure value tests (round trip, merge/order laws, resuming across a changed DAG)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.client.checkpoint import (
    Checkpoint,
    SegmentPosition,
    readable_segments,
)
from anabranch.client.message_id import MessageId
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import AnabranchError, InvalidArgument

ids = st.builds(
    MessageId,
    ledger_id=st.integers(-1, 2**40),
    entry_id=st.integers(-1, 2**40),
    batch_index=st.integers(-1, 100),
)
positions = st.one_of(
    st.just(SegmentPosition.done()),
    st.just(SegmentPosition.start()),
    ids.map(SegmentPosition.after_id),
)
checkpoints = st.one_of(
    st.just(Checkpoint.earliest()),
    st.builds(
        Checkpoint.of,
        epoch=st.integers(-1, 1000),
        positions=st.dictionaries(st.integers(0, 40), positions, max_size=12),
    ),
)
concrete = st.builds(
    Checkpoint.of,
    epoch=st.integers(-1, 1000),
    positions=st.dictionaries(st.integers(0, 12), positions, max_size=8),
)


@given(st.one_of(checkpoints, st.just(Checkpoint.latest())))
def test_bytes_round_trip(cp: Checkpoint) -> None:
    data = cp.to_bytes()
    back = Checkpoint.from_bytes(data)
    assert back == cp
    assert back.to_bytes() == data
    assert hash(back) == hash(cp)


@given(st.binary(max_size=64))
def test_garbage_is_refused_cleanly(data: bytes) -> None:
    try:
        Checkpoint.from_bytes(data)
    except InvalidArgument:
        pass  # the only acceptable failure
    except AnabranchError as err:  # pragma: no cover - would be a bug
        raise AssertionError(f"wrong error {err!r}") from err


def test_truncations_of_a_valid_checkpoint_are_refused() -> None:
    cp = Checkpoint.of(4, {0: SegmentPosition.done(), 3: SegmentPosition.after_id(MessageId(7, 8))})
    data = cp.to_bytes()
    for cut in range(len(data)):
        with pytest.raises(InvalidArgument):
            Checkpoint.from_bytes(data[:cut])
    with pytest.raises(InvalidArgument):
        Checkpoint.from_bytes(data + b"\x00")
    with pytest.raises(InvalidArgument, match="version"):
        Checkpoint.from_bytes(bytes([0xAB, 9, 0]))


def test_upstream_checkpoint_bytes_parse() -> None:
    assert Checkpoint.from_bytes(b"\x01").is_earliest
    assert Checkpoint.from_bytes(b"\x02").is_latest
    raw = MessageId(12, 34).to_bytes()
    data = struct.pack(">BqI", 0, 1_700_000_000_000, 1) + struct.pack(">qI", 5, len(raw)) + raw
    cp = Checkpoint.from_bytes(data)
    assert cp.epoch == -1
    assert cp.position(5) == SegmentPosition.after_id(MessageId(12, 34))


def test_positions_are_ordered_with_complete_on_top() -> None:
    start, done = SegmentPosition.start(), SegmentPosition.done()
    a, b = SegmentPosition.after_id(MessageId(1, 1)), SegmentPosition.after_id(MessageId(1, 1, 0))
    assert start < a < b < done
    assert not done.admits(MessageId(9, 9))
    assert start.admits(MessageId(0, 0))
    assert not b.admits(MessageId(1, 1, 0)) and b.admits(MessageId(1, 1, 1))
    # A segment id or partition on the message id does not matter inside one segment.
    assert SegmentPosition.after_id(MessageId(1, 1, segment_id=4, partition=2)) == a


@given(concrete, concrete)
def test_merge_is_commutative_and_covers_both(a: Checkpoint, b: Checkpoint) -> None:
    m = a.merge(b)
    assert m == b.merge(a)
    assert m.covers(a) and m.covers(b)
    assert m.epoch == max(a.epoch, b.epoch)
    for seg in set(a.positions) | set(b.positions):
        assert m.position(seg) == max(a.position(seg), b.position(seg))


@given(concrete, concrete, concrete)
def test_merge_is_associative(a: Checkpoint, b: Checkpoint, c: Checkpoint) -> None:
    assert a.merge(b).merge(c) == a.merge(b.merge(c))


@given(checkpoints)
def test_merge_is_idempotent_and_earliest_is_identity(a: Checkpoint) -> None:
    assert a.merge(a) == a
    assert a.merge(Checkpoint.earliest()).positions == a.positions
    assert Checkpoint.earliest().merge(a).positions == a.positions


@given(concrete, concrete)
def test_covers_is_a_partial_order_matching_merge(a: Checkpoint, b: Checkpoint) -> None:
    if a.covers(b) and b.covers(a):
        assert all(a.position(s) == b.position(s) for s in set(a.positions) | set(b.positions))
    if a.covers(b):
        merged = a.merge(b)
        assert all(merged.position(s) == a.position(s) for s in merged.positions)


def test_latest_cannot_be_merged_or_advanced() -> None:
    with pytest.raises(InvalidArgument):
        Checkpoint.latest().merge(Checkpoint.earliest())
    with pytest.raises(InvalidArgument):
        Checkpoint.latest().advanced(0, MessageId(1, 1))
    with pytest.raises(InvalidArgument):
        Checkpoint(Checkpoint.earliest().kind, 3, {})


# --- resuming against a layout that changed since ------------------------------------------

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), max_size=8)


def _apply(layout: SegmentLayout, steps: list[tuple[bool, int]]) -> SegmentLayout:
    for is_split, i in steps:
        active = layout.active_segments()
        if is_split:
            seg = active[i % len(active)]
            if seg.hash_range.size >= 2:
                layout = layout.split(seg.segment_id, now_ms=0)
        elif len(active) >= 2:
            k = i % (len(active) - 1)  # active segments are sorted by range: k, k+1 adjacent
            layout = layout.merge(active[k].segment_id, active[k + 1].segment_id, now_ms=0)
    return layout


@settings(max_examples=150)
@given(
    st.integers(1, 4),
    ops,
    ops,
    st.lists(st.integers(0, 1000), max_size=20),
    st.data(),
)
def test_resume_after_layout_changes_keeps_parent_before_child(
    initial: int,
    before: list[tuple[bool, int]],
    after: list[tuple[bool, int]],
    picks: list[int],
    data: st.DataObject,
) -> None:
    layout = _apply(SegmentLayout.initial(initial, 0), before)
    # A simulated consumer: completes sealed readable segments, positions open ones.
    cp = Checkpoint.earliest().with_epoch(layout.epoch)
    for p in [s.segment_id for s in layout]:
        cp = cp.advanced(p, MessageId.earliest())
    complete: set[int] = set()
    for pick in picks:
        ready = [s for s in readable_segments(layout, complete) if not s.is_active]
        if not ready:
            break
        seg = ready[pick % len(ready)]
        complete.add(seg.segment_id)
        cp = cp.completed(seg.segment_id)
    for seg in readable_segments(layout, complete):
        cp = cp.advanced(seg.segment_id, data.draw(ids))
    cp = Checkpoint.from_bytes(cp.to_bytes())

    later = _apply(layout, after)
    starts = cp.start_positions(later)
    assert set(starts) == set(later.segments)
    for seg in later:
        start = starts[seg.segment_id]
        assert start is not None
        if seg.segment_id in layout.segments:
            assert start == cp.position(seg.segment_id)
        else:
            assert start == SegmentPosition.start(), "a segment born after the checkpoint"
        if start != SegmentPosition.start():
            # Progress in a segment implies every ancestor was read to its end.
            assert all(starts[a] == SegmentPosition.done() for a in later.ancestors(seg.segment_id))
    # What the resumed consumer may open first never has an unfinished ancestor.
    done = {s for s, p in starts.items() if p is not None and p.complete}
    for seg in readable_segments(later, done):
        assert later.ancestors(seg.segment_id) <= done


def test_start_positions_symbolic() -> None:
    layout = SegmentLayout.initial(2, 0).split(0, 1).merge(2, 3, 2)
    assert set(Checkpoint.earliest().start_positions(layout).values()) == {SegmentPosition.start()}
    latest = Checkpoint.latest().start_positions(layout)
    for seg in layout:
        assert latest[seg.segment_id] == (None if seg.is_active else SegmentPosition.done())


def test_absent_segment_with_a_listed_descendant_counts_as_complete() -> None:
    layout = SegmentLayout.initial(1, 0).split(0, 1)
    cp = Checkpoint.of(-1, {1: SegmentPosition.after_id(MessageId(3, 3))})
    starts = cp.start_positions(layout)
    assert starts[0] == SegmentPosition.done()
    assert starts[2] == SegmentPosition.start()


def test_readable_segments_gate_on_every_ancestor() -> None:
    # 0 -> (1, 2); 2 -> (3, 4); merge 3+4 -> 5. An empty middle generation still gates.
    layout = SegmentLayout.initial(1, 0).split(0, 1).split(2, 2).merge(3, 4, 3)
    assert [s.segment_id for s in readable_segments(layout, [])] == [0]
    assert [s.segment_id for s in readable_segments(layout, [0])] == [1, 2]
    assert [s.segment_id for s in readable_segments(layout, [0, 2], opened=[1])] == [3, 4]
    assert [s.segment_id for s in readable_segments(layout, [0, 2, 3])] == [1, 4]
    assert [s.segment_id for s in readable_segments(layout, [0, 1, 2, 3, 4])] == [5]
