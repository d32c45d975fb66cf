"""SegmentLayout: upstream SegmentLayoutTest scenarios, JSON shape, and random DAG histories."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.core.hash_range import HashRange, segment_hash
from anabranch.core.names import TopicName
from anabranch.core.segment_layout import (
    Segment,
    SegmentLayout,
    SegmentState,
    segment_name,
)
from anabranch.errors import (
    InvalidArgument,
    NotAllowed,
    SegmentSealed,
    SegmentsNotAdjacent,
    SegmentTooSmall,
    UnknownSegment,
)


def ranges(layout: SegmentLayout) -> list[tuple[int, str]]:
    return [(s.segment_id, s.hash_range.to_hex()) for s in layout.active_segments()]


# --- upstream scenarios -----------------------------------------------------------------


def test_initial_layout_two_segments() -> None:
    layout = SegmentLayout.initial(2, now_ms=10)
    assert ranges(layout) == [(0, "0000-7fff"), (1, "8000-ffff")]
    assert (layout.epoch, layout.next_segment_id) == (0, 2)
    assert all(s.created_at_ms == 10 and s.created_at_epoch == 0 for s in layout)


def test_four_segment_initial_layout() -> None:
    layout = SegmentLayout.initial(4, now_ms=0)
    assert ranges(layout) == [
        (0, "0000-3fff"),
        (1, "4000-7fff"),
        (2, "8000-bfff"),
        (3, "c000-ffff"),
    ]


@pytest.mark.parametrize("n", [1, 3, 7, 1000, 65535, 65536])
def test_initial_layout_tiles_with_last_ending_at_ffff(n: int) -> None:
    layout = SegmentLayout.initial(n, now_ms=0)
    active = layout.active_segments()
    assert len(active) == n
    assert active[-1].hash_range.end == 0xFFFF
    assert all(s.hash_range.size == 65536 // n for s in active[:-1])
    layout.validate()


@pytest.mark.parametrize("n", [0, -1, 65537])
def test_initial_layout_rejects_bad_count(n: int) -> None:
    with pytest.raises(InvalidArgument):
        SegmentLayout.initial(n, now_ms=0)


def test_find_active_segment() -> None:
    layout = SegmentLayout.initial(2, now_ms=0)
    assert layout.find_active(0x1000).segment_id == 0
    assert layout.find_active(0x9000).segment_id == 1
    assert layout.find_active(0x7FFF).segment_id == 0
    assert layout.find_active(0x8000).segment_id == 1
    with pytest.raises(InvalidArgument):
        layout.find_active(0x10000)


def test_split_segment() -> None:
    layout = SegmentLayout.initial(2, now_ms=0).split(0, now_ms=5)
    assert ranges(layout) == [(2, "0000-3fff"), (3, "4000-7fff"), (1, "8000-ffff")]
    assert layout.epoch == 1
    assert len(layout.segments) == 4 and len(layout.active_segments()) == 3
    parent = layout.segments[0]
    assert parent.state is SegmentState.SEALED
    assert (parent.child_ids, parent.sealed_at_epoch) == ((2, 3), 1)
    for child in (layout.segments[2], layout.segments[3]):
        assert (child.parent_ids, child.created_at_epoch) == ((0,), 1)


def test_split_non_active_segment_rejected() -> None:
    layout = SegmentLayout.initial(2, now_ms=0).split(0, now_ms=5)
    with pytest.raises(SegmentSealed) as info:
        layout.split(0, now_ms=6)
    assert (info.value.segment_id, info.value.sealed_at_epoch) == (0, 1)
    assert isinstance(info.value, NotAllowed)


def test_split_unknown_segment_rejected() -> None:
    with pytest.raises(UnknownSegment) as info:
        SegmentLayout.initial(2, now_ms=0).split(9, now_ms=5)
    assert (info.value.segment_id, info.value.epoch) == (9, 0)
    assert isinstance(info.value, InvalidArgument)


def test_split_one_hash_wide_segment_rejected() -> None:
    layout = SegmentLayout.initial(65536, now_ms=0)
    with pytest.raises(SegmentTooSmall) as info:
        layout.split(42, now_ms=1)
    assert info.value.segment_id == 42


def test_merge_segments() -> None:
    layout = SegmentLayout.initial(2, now_ms=0).split(0, now_ms=5).merge(2, 3, now_ms=9)
    child = layout.segments[4]
    assert child.hash_range == HashRange(0, 0x7FFF)
    assert child.parent_ids == (2, 3)
    assert layout.epoch == 2
    assert layout.segments[2].child_ids == layout.segments[3].child_ids == (4,)
    assert ranges(layout) == [(4, "0000-7fff"), (1, "8000-ffff")]


def test_merge_non_adjacent_segments_rejected() -> None:
    layout = SegmentLayout.initial(4, now_ms=0)
    with pytest.raises(SegmentsNotAdjacent) as info:
        layout.merge(0, 2, now_ms=1)
    assert (info.value.first_id, info.value.second_id) == (0, 2)
    with pytest.raises(SegmentsNotAdjacent):
        layout.merge(1, 1, now_ms=1)


def test_merge_sealed_or_unknown_rejected() -> None:
    layout = SegmentLayout.initial(2, now_ms=0).split(0, now_ms=1)
    with pytest.raises(SegmentSealed):
        layout.merge(0, 1, now_ms=2)
    with pytest.raises(UnknownSegment):
        layout.merge(1, 77, now_ms=2)


def test_split_and_merge_record_wall_clock() -> None:
    layout = SegmentLayout.initial(2, now_ms=100).split(0, now_ms=200)
    assert layout.segments[0].sealed_at_ms == 200
    assert layout.segments[2].created_at_ms == layout.segments[3].created_at_ms == 200
    assert layout.segments[1].sealed_at_ms == -1
    merged = layout.merge(3, 1, now_ms=300)
    assert merged.segments[3].sealed_at_ms == merged.segments[1].sealed_at_ms == 300
    assert merged.segments[4].created_at_ms == 300


def test_next_segment_id_advances() -> None:
    layout = SegmentLayout.initial(2, now_ms=0)
    assert layout.next_segment_id == 2
    layout = layout.split(0, now_ms=1)
    assert layout.next_segment_id == 4
    layout = layout.split(1, now_ms=2)
    assert layout.next_segment_id == 6


def test_changes_keep_properties_and_do_not_mutate_the_original() -> None:
    base = SegmentLayout.initial(2, now_ms=0, properties={"team": "billing"})
    after = base.split(0, now_ms=1).merge(3, 1, now_ms=2)
    assert dict(after.properties) == {"team": "billing"}
    assert base.epoch == 0 and base.segments[0].is_active and len(base.segments) == 2


def test_lineage_children_parents_ancestors_descendants() -> None:
    # 0 -> (1, 2); 2 -> (3, 4); 1 + 3 -> 5
    layout = SegmentLayout.initial(1, now_ms=0).split(0, 1).split(2, 2).merge(1, 3, 3)
    assert [s.segment_id for s in layout.children(0)] == [1, 2]
    assert [s.segment_id for s in layout.parents(5)] == [1, 3]
    assert layout.ancestors(5) == {0, 1, 2, 3}
    assert layout.ancestors(4) == {0, 2}
    assert layout.descendants(0) == {1, 2, 3, 4, 5}
    assert layout.descendants(2) == {3, 4, 5}
    assert layout.descendants(5) == frozenset()
    assert [s.segment_id for s in layout.roots] == [0]
    assert ranges(layout) == [(5, "0000-bfff"), (4, "c000-ffff")]


def test_segment_name_helper() -> None:
    topic = TopicName.parse("topic://public/default/orders")
    layout = SegmentLayout.initial(2, now_ms=0).split(0, now_ms=1)
    assert str(segment_name(topic, layout.segments[3])) == (
        "segment://public/default/orders/4000-7fff-3"
    )
    with pytest.raises(InvalidArgument):
        segment_name(TopicName.parse("persistent://public/default/orders"), layout.segments[3])


def test_layout_is_immutable() -> None:
    layout = SegmentLayout.initial(1, now_ms=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.epoch = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        layout.segments[5] = layout.segments[0]  # type: ignore[index]


# --- JSON ---------------------------------------------------------------------------------


def test_json_shape_matches_design() -> None:
    layout = SegmentLayout.initial(2, now_ms=7, properties={"k": "v"}).split(1, now_ms=9)
    doc = json.loads(layout.to_json())
    assert list(doc) == ["epoch", "nextSegmentId", "segments", "properties"]
    assert (doc["epoch"], doc["nextSegmentId"], doc["properties"]) == (1, 4, {"k": "v"})
    assert list(doc["segments"]) == ["0", "1", "2", "3"]
    assert doc["segments"]["1"] == {
        "segmentId": 1,
        "hashRange": {"start": 0x8000, "end": 0xFFFF},
        "state": "SEALED",
        "parentIds": [],
        "childIds": [2, 3],
        "createdAtEpoch": 0,
        "sealedAtEpoch": 1,
        "createdAtMs": 7,
        "sealedAtMs": 9,
    }
    assert doc["segments"]["3"]["sealedAtEpoch"] == -1
    assert doc["segments"]["3"]["state"] == "ACTIVE"
    assert layout.to_dict() == doc


def test_json_round_trip_and_unknown_fields_ignored() -> None:
    layout = SegmentLayout.initial(3, now_ms=1).split(1, 2).merge(0, 3, 3)
    assert SegmentLayout.from_json(layout.to_json()) == layout
    doc = layout.to_dict()
    doc["autoScalePolicy"] = {"enabled": False}
    doc["segments"]["0"]["legacyTopicName"] = None
    assert SegmentLayout.from_dict(doc) == layout
    assert SegmentLayout.from_json(json.dumps(doc)) == layout


def corrupt(layout: SegmentLayout, **changes: object) -> dict[str, object]:
    doc = layout.to_dict()
    for path, value in changes.items():
        target = doc
        *parents, leaf = path.split("__")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return doc


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"epoch": 0}, "epoch"),
        ({"nextSegmentId": 3}, "nextSegmentId"),
        ({"segments__1__state": "ACTIVE"}, "ACTIVE"),
        ({"segments__1__state": "GONE"}, "ACTIVE or SEALED"),
        ({"segments__2__hashRange": {"start": 0x8000, "end": 0xBFFE}}, "cover exactly"),
        ({"segments__2__parentIds": []}, "does not list parent"),
        ({"segments__3__createdAtEpoch": 0}, "sealed at epoch"),
        ({"segments__0__hashRange": {"start": 0, "end": 0x7FFE}}, "gap or overlap"),
        ({"segments__0__hashRange": {"start": 0, "end": 0x10000}}, "outside"),
        ({"segments__0__segmentId": 5}, "key"),
        ({"segments__2__childIds": [3]}, "does not list parent 2"),
        ({"segments__1__childIds": [2, 2]}, "repeats"),
        ({"segments__1__childIds": [2, 3, 9]}, "missing"),
        ({"epoch": "1"}, "not valid"),
        ({"properties": {"k": 1}}, "not valid"),
    ],
)
def test_decode_rejects_broken_layouts(changes: dict[str, object], reason: str) -> None:
    layout = SegmentLayout.initial(2, now_ms=0).split(1, now_ms=1)
    with pytest.raises(InvalidArgument, match=reason):
        SegmentLayout.from_dict(corrupt(layout, **changes))


def test_decode_rejects_garbage() -> None:
    for data in (b"", b"[]", b"{", b'{"epoch": 0}'):
        with pytest.raises(InvalidArgument):
            SegmentLayout.from_json(data)


def test_validate_rejects_active_parent() -> None:
    layout = SegmentLayout.initial(1, now_ms=0)
    bogus_child = Segment(1, HashRange.full(), SegmentState.ACTIVE, parent_ids=(0,))
    broken = SegmentLayout(1, 2, {**layout.segments, 1: bogus_child})
    with pytest.raises(InvalidArgument, match=r"ACTIVE parent|does not list child"):
        broken.validate()


# --- random histories -----------------------------------------------------------------------


@st.composite
def histories(draw: st.DrawFn) -> list[SegmentLayout]:
    layout = SegmentLayout.initial(draw(st.integers(1, 5)), now_ms=0)
    steps = [layout]
    for now in range(1, draw(st.integers(1, 25)) + 1):
        active = layout.active_segments()
        pairs = list(itertools.pairwise(active))
        merge = bool(pairs) and draw(st.booleans())
        if merge:
            a, b = draw(st.sampled_from(pairs))
            first, second = (a, b) if draw(st.booleans()) else (b, a)
            layout = layout.merge(first.segment_id, second.segment_id, now_ms=now)
        else:
            target = draw(st.sampled_from(active))
            if target.hash_range.size < 2:
                continue
            layout = layout.split(target.segment_id, now_ms=now)
        layout.validate()
        steps.append(layout)
    return steps


@settings(max_examples=60)
@given(histories())
def test_random_histories_keep_invariants(steps: list[SegmentLayout]) -> None:
    for before, after in itertools.pairwise(steps):
        after.validate()
        assert after.epoch == before.epoch + 1
        assert after.next_segment_id > before.next_segment_id
        # Sealed segments never change again, and no segment disappears.
        for sid, seg in before.segments.items():
            if not seg.is_active:
                assert after.segments[sid] == seg
        assert set(before.segments) <= set(after.segments)
    final = steps[-1]
    assert SegmentLayout.from_json(final.to_json()) == final
    for key in ("a", "hello", "key-0", "order-42"):
        h = segment_hash(key)
        owner = final.find_active(h)
        # The key's lineage is a chain back to a root that also contains the hash.
        chain = {s.segment_id for s in final if s.hash_range.contains(h)}
        assert chain - {owner.segment_id} == final.ancestors(owner.segment_id) & chain
        assert chain - {owner.segment_id} <= final.ancestors(owner.segment_id)
        assert sum(1 for i in chain if not final.segments[i].parent_ids) == 1


@settings(max_examples=40)
@given(histories(), st.integers(0, 10**6), st.integers(0, 10**6))
def test_illegal_changes_raise_typed_errors(
    steps: list[SegmentLayout], pick: int, other: int
) -> None:
    layout = steps[-1]
    ids = sorted(layout.segments)
    sid, oid = ids[pick % len(ids)], ids[other % len(ids)]
    seg, oseg = layout.segments[sid], layout.segments[oid]
    if not seg.is_active:
        with pytest.raises(SegmentSealed):
            layout.split(sid, now_ms=1)
    if seg.is_active and oseg.is_active and not seg.hash_range.is_adjacent_to(oseg.hash_range):
        with pytest.raises(SegmentsNotAdjacent):
            layout.merge(sid, oid, now_ms=1)
    with pytest.raises(UnknownSegment):
        layout.split(layout.next_segment_id, now_ms=1)
    assert layout == steps[-1]
