"""The key slots of a mixed-key batch entry (``core/batch_keys``) and the admin view of an
assignment (``core/assignment_stats``): property tests of the pure parts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from anabranch.core.assignment import (
    ConsumerDisconnected,
    ConsumerRegistered,
    SubscriptionAssignment,
)
from anabranch.core.assignment_stats import assignment_stats
from anabranch.core.batch_keys import decode_key_slots, encode_key_slots, key_slot
from anabranch.core.segment_layout import SegmentLayout

keys = st.lists(st.binary(min_size=0, max_size=8), min_size=1, max_size=50)


@given(keys)
def test_slots_round_trip_in_batch_order(batch: list[bytes]) -> None:
    value = encode_key_slots(batch)
    slots = [key_slot(k) for k in batch]
    if len(set(slots)) == 1:
        assert value is None  # one slot: the outer key routes the entry
    else:
        assert value is not None
        assert decode_key_slots(value, len(batch)) == tuple(slots)
        assert decode_key_slots(value, len(batch) + 1) == ()  # another count: not trusted


@given(st.text(max_size=40), st.integers(0, 10))
def test_decoding_never_raises(value: str, count: int) -> None:
    slots = decode_key_slots(value, count)
    assert slots == () or (len(slots) == count and all(0 <= s < 65536 for s in slots))


@given(
    st.integers(1, 5),
    st.lists(st.sampled_from("abcdef"), unique=True, max_size=6),
    st.sets(st.sampled_from("abcdef")),
    st.booleans(),
)
def test_stats_show_every_share_and_grace(
    segments: int, names: list[str], dropped: set[str], fan_out: bool
) -> None:
    state, _ = SubscriptionAssignment.create(
        "s", SegmentLayout.initial(segments, 0), 1_000, fan_out=fan_out
    )
    for i, name in enumerate(names):
        state, _ = state.handle(ConsumerRegistered(name, 0, i))
    for name in dropped:
        state, _ = state.handle(ConsumerDisconnected(name, 10))
    out = assignment_stats(state, now_ms=400)
    assert set(out["consumers"]) == set(names)
    for name, consumer in out["consumers"].items():
        assert consumer["segments"] == list(state.assignment[name])
        assert consumer["connected"] == (name not in dropped)
        assert consumer.get("graceRemainingMs") == (610 if name in dropped else None)
    owners = {int(s): tuple(n) for s, n in out["segmentOwners"].items()}
    assert owners == {s: state.owners_of(s) for s in owners}
    assert all(len(n) > 1 for n in out["sharedSegments"].values())
    assert bool(out["sharedSegments"]) == (fan_out and len(names) > segments)
    held = set(owners) | set(out["unassignedSegments"])
    assert held == set(state.layout.segments)
