"""Pure planning of the Spark source: positions, frontier JSON, expansion at splits and merges,
batch ranges, read limits (hypothesis), and the package's docstring examples."""

from __future__ import annotations

import doctest
import importlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.core.segment_layout import SegmentLayout
from pyspark_anabranch import options as options_module
from pyspark_anabranch import planning
from pyspark_anabranch.planning import (
    DataLoss,
    Frontier,
    TopicFrontier,
    allocate,
    batch_ranges,
    cut_by_bytes,
    decode_position,
    earliest_frontier,
    encode_position,
    expand_topic,
    stream_ranges,
    timestamp_frontier,
    timestamp_start,
)

T = "public/default/t"


@pytest.mark.parametrize("module", ["pyspark_anabranch.planning", "pyspark_anabranch.options"])
def test_docstring_examples(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


ids = st.tuples(
    st.integers(0, (1 << 24) - 1), st.integers(0, (1 << 22) - 1), st.integers(-1, (1 << 17) - 2)
)


@given(ids, ids)
def test_positions_round_trip_and_order_like_message_ids(
    a: tuple[int, int, int], b: tuple[int, int, int]
) -> None:
    pa, pb = encode_position(*a), encode_position(*b)
    assert decode_position(pa) == a
    assert 0 <= pa < 1 << 63
    assert (pa < pb) == (a < b)


def test_position_overflow_is_refused() -> None:
    with pytest.raises(Exception, match="does not fit"):
        encode_position(1, 1 << 22, 0)


@given(st.dictionaries(st.integers(0, 50), st.integers(0, 1 << 62), min_size=1), st.integers(0, 99))
def test_frontier_json_round_trips_sorted(segs: dict[int, int], epoch: int) -> None:
    f = Frontier({T: TopicFrontier(epoch, segs)})
    text = f.to_json()
    assert Frontier.from_json(text) == f
    keys = list(f.to_dict()["topics"][T]["segs"])
    assert keys == [str(k) for k in sorted(segs)]


def test_malformed_offsets_are_refused() -> None:
    for bad in ('{"v":2,"topics":{}}', "nope", '{"v":1,"topics":{"t":{"epoch":1}}}'):
        with pytest.raises(Exception):  # noqa: B017 - InvalidArgument, checked by message below
            Frontier.from_json(bad)


# --- a simulated topic: random splits and merges, messages appended between them --------------


@st.composite
def histories(draw: st.DrawFn) -> tuple[SegmentLayout, dict[int, int]]:
    """A layout after random splits/merges, and how many messages each segment holds."""
    layout = SegmentLayout.initial(draw(st.integers(1, 3)), now_ms=0)
    for step in range(draw(st.integers(0, 8))):
        active = layout.active_segments()
        if draw(st.booleans()) or len(active) < 2:
            seg = draw(st.sampled_from(active))
            if seg.hash_range.end - seg.hash_range.start >= 2:
                layout = layout.split(seg.segment_id, now_ms=step + 1)
        else:
            i = draw(st.integers(0, len(active) - 2))
            layout = layout.merge(active[i].segment_id, active[i + 1].segment_id, now_ms=step + 1)
    counts = {sid: draw(st.integers(0, 4)) for sid in layout.segments}
    return layout, counts


def _pos(n: int) -> int:
    """The next position after ``n`` messages (message i sits at encode(1, i, -1))."""
    return 0 if n == 0 else encode_position(1, n - 1, -1) + 1


@settings(max_examples=200, deadline=None)
@given(histories(), st.integers(1, 5))
def test_micro_batches_read_every_message_once_parents_before_children(
    history: tuple[SegmentLayout, dict[int, int]], limit: int
) -> None:
    layout, counts = history
    finals = {
        s.segment_id: _pos(counts[s.segment_id])
        for s in layout.segments.values()
        if not s.is_active
    }
    ends = {sid: _pos(n) for sid, n in counts.items()}
    start = Frontier({T: earliest_frontier(layout)})
    batch_of: dict[int, list[int]] = {}  # segment -> batch numbers it was read in
    read: dict[int, int] = {}
    for batch in range(200):
        tf = expand_topic(T, start.topics[T], layout, finals)
        # The frontier tiles the keyspace.
        covered = sorted(
            (layout.segments[s].hash_range.start, layout.segments[s].hash_range.end)
            for s in tf.segs
        )
        assert covered[0][0] == 0 and covered[-1][1] == 0xFFFF
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(covered))
        # Read at most `limit` messages per segment (a crude read limit).
        segs = {}
        for sid, pos in tf.segs.items():
            done = 0 if pos == 0 else decode_position(pos - 1)[1] + 1
            segs[sid] = _pos(min(counts[sid], done + limit))
        end = Frontier({T: tf.with_segs(segs)})
        if end == start:
            break
        for r in stream_ranges(start, end):
            lo = 0 if r.start == 0 else decode_position(r.start - 1)[1] + 1
            hi = decode_position(r.end - 1)[1] + 1
            assert read.get(r.segment_id, 0) == lo  # contiguous, no gap, no repeat
            read[r.segment_id] = hi
            batch_of.setdefault(r.segment_id, []).append(batch)
        start = end
    assert read == {sid: n for sid, n in counts.items() if n}
    for sid, seg in layout.segments.items():
        for parent in seg.parent_ids:
            if batch_of.get(parent) and batch_of.get(sid):
                assert max(batch_of[parent]) < min(batch_of[sid])
    # Active segments stay in the final frontier at their ends.
    final = expand_topic(T, start.topics[T], layout, finals)
    for s in layout.active_segments():
        assert final.segs[s.segment_id] == ends[s.segment_id]


def test_merge_child_waits_for_both_parents() -> None:
    layout = SegmentLayout.initial(2, now_ms=0).merge(0, 1, now_ms=1)
    tf = TopicFrontier(0, {0: _pos(3), 1: _pos(1)})
    out = expand_topic(T, tf, layout, {0: _pos(3), 1: _pos(2)})
    assert out.segs == {0: _pos(3), 1: _pos(1)}  # segment 1 has one more message to go
    out = expand_topic(T, tf.with_segs({0: _pos(3), 1: _pos(2)}), layout, {0: _pos(3), 1: _pos(2)})
    assert out.segs == {2: 0} and out.epoch == 1


def test_pruned_segment_is_data_loss_unless_told_otherwise() -> None:
    layout = SegmentLayout.initial(1, now_ms=0)
    tf = TopicFrontier(0, {0: 0, 7: 5})
    with pytest.raises(DataLoss):
        expand_topic(T, tf, layout, {})
    assert expand_topic(T, tf, layout, {}, fail_on_data_loss=False).segs == {0: 0}


def test_layout_going_backwards_is_refused() -> None:
    with pytest.raises(DataLoss, match="older"):
        expand_topic(T, TopicFrontier(5, {0: 0}), SegmentLayout.initial(1, 0), {})


@given(histories())
def test_batch_ranges_earliest_to_latest_cover_every_message(
    history: tuple[SegmentLayout, dict[int, int]],
) -> None:
    layout, counts = history
    ends = {sid: _pos(n) for sid, n in counts.items()}
    start = earliest_frontier(layout)
    end = planning.latest_frontier(layout, ends)
    ranges = batch_ranges(T, layout, start, end, ends)
    assert {r.segment_id: r.end for r in ranges} == {sid: e for sid, e in ends.items() if e}
    assert all(r.start == 0 for r in ranges)


# --- startingTimestamp ----------------------------------------------------------------------


@st.composite
def timed_histories(draw: st.DrawFn) -> tuple[SegmentLayout, dict[int, list[int]]]:
    """A history whose messages carry publish times: non-decreasing per segment, and a child's
    messages are no older than its parents' (it was created when they were sealed)."""
    layout, counts = draw(histories())
    times: dict[int, list[int]] = {}
    for sid in sorted(layout.segments):  # parents have smaller ids
        now = max((t for a in layout.ancestors(sid) for t in times[a]), default=0)
        seg_times = []
        for _ in range(counts[sid]):
            now += draw(st.integers(0, 3))
            seg_times.append(now)
        times[sid] = seg_times
    return layout, times


def _read_all(
    layout: SegmentLayout, start: TopicFrontier, ends: dict[int, int]
) -> set[int | tuple[int, int]]:
    """Every (segment, message index) micro-batches read from ``start`` to the end, checking
    that a segment is read only once all its parents are done."""
    finals = {s.segment_id: ends[s.segment_id] for s in layout.segments.values() if not s.is_active}
    read: set[int | tuple[int, int]] = set()
    done_batch: dict[int, int] = {}
    current = Frontier({T: start})
    for batch in range(100):
        tf = expand_topic(T, current.topics[T], layout, finals)
        end = Frontier({T: tf.with_segs({sid: ends[sid] for sid in tf.segs})})
        if end == current:
            break
        for r in stream_ranges(current, end):
            for parent in layout.segments[r.segment_id].parent_ids:
                assert done_batch.get(parent, -1) < batch
            lo = 0 if r.start == 0 else decode_position(r.start - 1)[1] + 1
            hi = decode_position(r.end - 1)[1] + 1
            read |= {(r.segment_id, i) for i in range(lo, hi)}
            done_batch[r.segment_id] = batch
        current = end
    return read


@settings(max_examples=150, deadline=None)
@given(timed_histories(), st.integers(0, 40))
def test_timestamp_start_reads_exactly_the_messages_at_or_after_it(
    history: tuple[SegmentLayout, dict[int, list[int]]], ts: int
) -> None:
    layout, times = history
    ends = {sid: _pos(len(t)) for sid, t in times.items()}
    finals = {s.segment_id: ends[s.segment_id] for s in layout.segments.values() if not s.is_active}
    starts = {
        sid: timestamp_start(
            [(encode_position(1, i, -1), t) for i, t in enumerate(seg)], ts, ends[sid]
        )
        for sid, seg in times.items()
    }
    start = timestamp_frontier(T, layout, starts, finals)
    covered = sorted(
        (layout.segments[s].hash_range.start, layout.segments[s].hash_range.end) for s in start.segs
    )
    assert covered[0][0] == 0 and covered[-1][1] == 0xFFFF  # the start tiles the keyspace
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(covered))
    expected = {(sid, i) for sid, seg in times.items() for i, t in enumerate(seg) if t >= ts}
    assert _read_all(layout, start, ends) == expected
    # A batch read from the same start to the latest ends reads the same messages.
    latest = planning.latest_frontier(layout, ends)
    batch = set()
    for r in batch_ranges(T, layout, start, latest, ends):
        lo = 0 if r.start == 0 else decode_position(r.start - 1)[1] + 1
        batch |= {(r.segment_id, i) for i in range(lo, decode_position(r.end - 1)[1] + 1)}
    assert batch == expected


@given(st.lists(st.integers(0, 20), max_size=10).map(sorted), st.integers(0, 25))
def test_timestamp_start_is_the_first_message_at_or_after(times: list[int], ts: int) -> None:
    msgs = [(encode_position(2, i, -1), t) for i, t in enumerate(times)]
    end = _pos(len(times))
    start = timestamp_start(msgs, ts, end)
    first = next((i for i, t in enumerate(times) if t >= ts), None)
    if first is None:
        assert start == end  # all older: the segment counts as fully read
    else:  # resuming at `start` reads message `first` and nothing before it
        assert all(p >= start for p, _t in msgs[first:])
        assert all(p < start for p, _t in msgs[:first])


def test_timestamp_offsets_round_trip_and_plan_nothing() -> None:
    sym = Frontier.symbolic_timestamp(1_700_000_000_000)
    assert Frontier.from_json(sym.to_json()) == sym and sym.symbolic
    assert stream_ranges(sym, Frontier({T: TopicFrontier(0, {0: 5})})) == []
    with pytest.raises(Exception, match="integer ts"):
        Frontier.from_json('{"v":1,"init":"timestamp","ts":"x"}')


@given(st.integers(0, 1000), st.dictionaries(st.integers(0, 20), st.integers(0, 300)))
def test_allocate_water_fills(limit: int, available: dict[int, int]) -> None:
    grant = allocate(limit, available)
    assert sum(grant.values()) == min(limit, sum(available.values()))
    assert all(0 <= grant[k] <= available[k] for k in available)
    with_data = [k for k, v in available.items() if v > 0]
    if limit >= len(with_data):
        assert all(grant[k] >= 1 for k in with_data)
    # Fair: a segment short of another's grant got everything it had.
    for a, have in available.items():
        for b in available:
            if grant[a] + 1 < grant[b]:
                assert grant[a] == have


@given(st.lists(st.integers(1, 100)), st.integers(1, 500))
def test_cut_by_bytes(sizes: list[int], budget: int) -> None:
    n = cut_by_bytes(sizes, budget)
    assert (n >= 1) == bool(sizes)
    assert sum(sizes[:n]) <= budget or n == 1
    if n < len(sizes):
        assert sum(sizes[: n + 1]) > budget


def test_options() -> None:
    parse = options_module.SourceOptions.parse
    o = parse(
        {"serviceurl": "pulsar://h:1", "TOPICS": "a, topic://x/y/z", "maxRecordsPerTrigger": "5"}
    )
    assert o.topics == ("public/default/a", "x/y/z") and o.max_records == 5
    with pytest.raises(Exception, match="serviceUrl"):
        parse({"topic": "a"})
    base = {"serviceUrl": "pulsar://h:1", "topic": "a"}
    assert parse({**base, "startingtimestamp": "1700000000000"}).starting_timestamp == (
        1_700_000_000_000
    )
    for bad in ("-1", "soon"):
        with pytest.raises(Exception, match="startingTimestamp"):
            parse({**base, "startingTimestamp": bad})
    with pytest.raises(Exception, match="mutually exclusive"):
        parse({**base, "startingTimestamp": "5", "startingOffsets": "earliest"}, batch=True)
    sink = options_module.SinkOptions.parse
    assert sink({"serviceUrl": "pulsar://h:1"}).exactly_once  # the default
    with pytest.raises(Exception, match="deliveryGuarantee"):
        sink({"serviceUrl": "pulsar://h:1", "deliveryGuarantee": "twice"})
