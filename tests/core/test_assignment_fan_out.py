"""Fan-out assignment (PIP-460 "Scaling Reads beyond the Segment Count"): consumers beyond
the segment count share segments; the stateful model of ``test_assignment`` runs again in
fan-out mode with the sharing rules as invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from anabranch.core.assignment import (
    ConsumerRegistered,
    ConsumerUnregistered,
    LayoutChanged,
    SegmentDrained,
    SubscriptionAssignment,
)
from anabranch.core.segment_layout import SegmentLayout
from tests.core.test_assignment import GRACE_MS, AssignmentMachine, feed


def fan_out(n: int = 1) -> SubscriptionAssignment:
    state, _ = SubscriptionAssignment.create(
        "sub", SegmentLayout.initial(n, 0), GRACE_MS, fan_out=True
    )
    return state


def register(state: SubscriptionAssignment, *names: str) -> SubscriptionAssignment:
    for i, name in enumerate(names):
        state, _ = feed(state, ConsumerRegistered(name, 0, consumer_id=100 + i))
    return state


def test_four_consumers_share_one_segment() -> None:
    state = register(fan_out(1), "c1", "c2", "c3", "c4")
    assert dict(state.assignment) == {"c1": (0,), "c2": (0,), "c3": (0,), "c4": (0,)}
    assert state.owners_of(0) == ("c1", "c2", "c3", "c4")


def test_consumers_beyond_the_segment_count_are_spread_evenly() -> None:
    state = register(fan_out(2), "a", "b", "c", "d", "e")
    assert dict(state.assignment) == {"a": (0,), "b": (1,), "c": (0,), "d": (1,), "e": (0,)}


def test_with_enough_segments_the_deal_is_the_plain_one() -> None:
    plain, _ = SubscriptionAssignment.create("sub", SegmentLayout.initial(4, 0), GRACE_MS)
    names = ("a", "b", "c")
    assert register(fan_out(4), *names).assignment == register(plain, *names).assignment


def test_a_split_spreads_the_sharers_over_the_children_once_the_parent_drained() -> None:
    state = register(fan_out(1), "a", "b", "c", "d")
    state, _ = feed(state, LayoutChanged(state.layout.split(0, 1)))
    assert set(state.assignment.values()) == {(0,)}  # children wait for the parent
    state, _ = feed(state, SegmentDrained(0))
    assert dict(state.assignment) == {"a": (1,), "b": (2,), "c": (1,), "d": (2,)}


def test_a_leaving_sharer_leaves_the_others_in_place() -> None:
    state = register(fan_out(1), "a", "b", "c")
    state, out = feed(state, ConsumerUnregistered("b", consumer_id=101))
    assert dict(state.assignment) == {"a": (0,), "c": (0,)}
    assert not [i for i in out if getattr(i, "consumer", None) in ("a", "c")]


@given(st.integers(1, 6), st.lists(st.sampled_from("abcdefgh"), unique=True, max_size=8))
def test_restore_computes_the_same_fan_out(segments: int, names: list[str]) -> None:
    live = register(fan_out(segments), *names)
    restored, _ = SubscriptionAssignment.restore(
        "sub", live.layout, names, now_ms=0, grace_period_ms=GRACE_MS, fan_out=True
    )
    restored.validate()
    assert restored.assignment == live.assignment
    held = {s for ids in live.assignment.values() for s in ids}
    assert held == ({s.segment_id for s in live.assignable_segments()} if names else set())


class FanOutMachine(AssignmentMachine):
    """The register/drop/split/merge/drain model in fan-out mode: each consumer holds one
    segment once consumers outnumber segments, and no hash is readable from two
    generations (several consumers of one segment are fine: Key_Shared splits its keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.state, _ = SubscriptionAssignment.create(
            "sub", SegmentLayout.initial(1, 0), GRACE_MS, fan_out=True
        )

    @invariant()
    def parent_before_child_for_every_key(self) -> None:
        layout = self.state.layout
        told = {s for name in self.connected for s in self.views.get(name, ())}
        for segment_id in told:
            assert layout.ancestors(segment_id) <= self.drained, "child before ancestors drained"
        for h in (0, 0x7FFF, 0x8000, 0xFFFF):
            readable = [s for s in told if layout.segments[s].hash_range.contains(h)]
            assert len(readable) <= 1, f"hash {h:#06x} readable from {readable}"

    @invariant()
    def a_lone_consumer_holds_every_undrained_segment(self) -> None:  # overrides the base's
        # Fan-out mode carries nothing (individual acks drain a parent without a position
        # vector): a consumer holds exactly the segments whose ancestors drained.
        assignable = {s.segment_id for s in self.state.assignable_segments()}
        for name in self.connected:
            assert set(self.views.get(name, ())) <= assignable


FanOutMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestFanOutMachine = FanOutMachine.TestCase
