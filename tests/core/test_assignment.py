"""Subscription assignment: upstream SubscriptionCoordinatorTest/ConsumerSessionTest scenarios
and a stateful model of register/disconnect/tick/split/merge/drain."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from anabranch.core.assignment import (
    ConsumerDisconnected,
    ConsumerRegistered,
    ConsumerUnregistered,
    DeleteSession,
    Instruction,
    LayoutChanged,
    PersistSession,
    PollDrain,
    PushAssignment,
    ScheduleTick,
    SegmentDrained,
    SubscriptionAssignment,
    Tick,
)
from anabranch.core.hash_range import segment_hash
from anabranch.core.segment_layout import SegmentLayout
from anabranch.errors import InvalidArgument, NotAllowed

GRACE_MS = 200  # upstream's unit tests use 200 ms


def start(n: int = 4, ordered: bool = True) -> SubscriptionAssignment:
    state, out = SubscriptionAssignment.create(
        "sub", SegmentLayout.initial(n, 0), GRACE_MS, ordered
    )
    assert out == []
    return state


def feed(
    state: SubscriptionAssignment, *events: object
) -> tuple[SubscriptionAssignment, list[Instruction]]:
    out: list[Instruction] = []
    for event in events:
        state, more = state.handle(event)  # type: ignore[arg-type]
        state.validate()
        out.extend(more)
    return state, out


def register(state: SubscriptionAssignment, *names: str, now: int = 0) -> SubscriptionAssignment:
    for i, name in enumerate(names):
        state, _ = feed(state, ConsumerRegistered(name, now, consumer_id=100 + i))
    return state


def pushes(out: list[Instruction]) -> dict[str, tuple[int, ...]]:
    return {i.consumer: i.segments for i in out if isinstance(i, PushAssignment)}


# --- deterministic assignment -----------------------------------------------------------


def test_single_consumer_gets_all_segments() -> None:
    _, out = feed(start(), ConsumerRegistered("c1", 0, consumer_id=1))
    assert out == [
        PersistSession("sub", "c1"),
        PushAssignment("c1", 1, (0, 1, 2, 3), 0),
    ]


def test_two_consumers_balanced() -> None:
    state = register(start(), "c1", "c2")
    assert dict(state.assignment) == {"c1": (0, 2), "c2": (1, 3)}


def test_three_consumers_with_four_segments() -> None:
    state = register(start(), "c1", "c2", "c3")
    assert dict(state.assignment) == {"c1": (0, 3), "c2": (1,), "c3": (2,)}
    flat = [s for ids in state.assignment.values() for s in ids]
    assert sorted(flat) == [0, 1, 2, 3]


def test_new_consumer_rebalances_and_pushes_only_changes() -> None:
    state = register(start(), "a", "c")
    state, out = feed(state, ConsumerRegistered("b", 0, consumer_id=9))
    assert out[0] == PersistSession("sub", "b")
    # Dealing over a, b, c moves every share: a (0, 2) -> (0, 3), c (1, 3) -> (2,).
    assert pushes(out) == {"b": (1,), "c": (2,), "a": (0, 3)}


def test_newcomer_with_empty_share_still_gets_an_answer() -> None:
    state = register(start(1), "a")
    state, out = feed(state, ConsumerRegistered("b", 0, consumer_id=5))
    assert pushes(out) == {"b": ()}


def test_assignment_determinism() -> None:
    names = ["w3", "w1", "w2"]
    results = set()
    for order in itertools.permutations(names):
        state = register(start(5), *order)
        results.add(tuple(sorted(state.assignment.items())))
    assert len(results) == 1
    restored, _ = SubscriptionAssignment.restore(
        "sub", SegmentLayout.initial(5, 0), names, now_ms=0, grace_period_ms=GRACE_MS
    )
    assert tuple(sorted(restored.assignment.items())) in results


def test_unregister_rebalances_and_deletes_session() -> None:
    state = register(start(), "c1", "c2")
    state, out = feed(state, ConsumerUnregistered("c2", consumer_id=101))
    assert out == [DeleteSession("sub", "c2"), PushAssignment("c1", 100, (0, 1, 2, 3), 0)]


def test_empty_after_all_consumers_removed() -> None:
    state = register(start(), "c1", "c2")
    state, _ = feed(state, ConsumerUnregistered("c1"), ConsumerUnregistered("c2"))
    assert dict(state.assignment) == {} and dict(state.sessions) == {}


def test_unregister_with_stale_consumer_id_keeps_rejoined_session() -> None:
    state = register(start(), "c1")
    state, _ = feed(state, ConsumerRegistered("c1", 5, consumer_id=7))  # rejoined
    state, out = feed(state, ConsumerUnregistered("c1", consumer_id=100))  # old id
    assert out == []
    assert "c1" in state.sessions and state.sessions["c1"].consumer_id == 7


def test_invalid_consumer_name_rejected() -> None:
    with pytest.raises(InvalidArgument):
        start().handle(ConsumerRegistered("a/b", 0))


# --- layout changes and parent-before-child gating ---------------------------------------


def test_layout_change_rebalances_without_drain_ordering() -> None:
    state = register(start(ordered=False), "c1")
    state, out = feed(state, LayoutChanged(state.layout.split(0, now_ms=1)))
    # 5 active + the sealed parent that still has backlog (DAG replay) = 6.
    assert len(state.assignment["c1"]) == 6
    assert PollDrain("sub", (0,)) in out


def test_children_are_carried_to_the_consumer_of_their_sealed_parent() -> None:
    # The consumer holding sealed 0 gets its children at once (it orders them itself):
    # held back, they would stall a consumer that acknowledges every N messages.
    state = register(start(2), "c1")
    state, out = feed(state, LayoutChanged(state.layout.split(0, now_ms=1)))
    assert state.assignment["c1"] == (0, 1, 2, 3)
    assert state.assignable_segments() == tuple(state.layout.segments[i] for i in (0, 1))
    assert out == [PushAssignment("c1", 100, (0, 1, 2, 3), 1), PollDrain("sub", (0,))]
    state, out = feed(state, SegmentDrained(0))
    assert state.assignment["c1"] == (2, 3, 1)  # drained parent retires
    assert out == [PushAssignment("c1", 100, (2, 3, 1), 1), PollDrain("sub", ())]


def test_every_connected_consumer_hears_of_a_new_epoch() -> None:
    state = register(start(4), "a", "b", "c")
    state, _ = feed(state, ConsumerDisconnected("c", now_ms=1, consumer_id=102))
    before = dict(state.assignment)
    state, out = feed(state, LayoutChanged(state.layout.split(before["a"][0], now_ms=2)))
    # a's segment was sealed (still assigned until drained); b's share did not change at
    # all; c is disconnected and hears nothing until it registers again.
    assert [i for i in out if isinstance(i, PushAssignment)] == [
        PushAssignment("a", 100, state.assignment["a"], 1),
        PushAssignment("b", 101, before["b"], 1),
    ]
    assert state.handle(LayoutChanged(state.layout)) == (state, [])  # a repeat is no news


def test_gating_across_an_empty_middle_generation() -> None:
    # 0 -> (1, 2); 1 -> (3, 4). Middle segment 1 is empty and drains at once, but the
    # root 0 still has backlog: 3 and 4 are still carried with it, never dealt.
    state = register(start(1), "c1")
    layout = state.layout.split(0, 1).split(1, 2)
    state, _ = feed(state, LayoutChanged(layout), SegmentDrained(1))
    assert state.assignment["c1"] == (0, 2, 3, 4)
    assert [s.segment_id for s in state.assignable_segments()] == [0]
    assert state.pending_drains() == (0,)
    state, out = feed(state, SegmentDrained(0))
    assert state.assignment["c1"] == (3, 4, 2)
    assert pushes(out) == {"c1": (3, 4, 2)}


def test_merge_child_waits_for_both_parents() -> None:
    state = register(start(2), "c1", "c2")
    state, _ = feed(state, LayoutChanged(state.layout.merge(0, 1, now_ms=1)))
    assert dict(state.assignment) == {"c1": (0,), "c2": (1,)}
    state, out = feed(state, SegmentDrained(0))
    # Child 2 also holds 1's keys; now that one consumer holds 1, 2 is carried with it.
    assert dict(state.assignment) == {"c1": (1, 2), "c2": ()}
    state, out = feed(state, SegmentDrained(1))
    assert dict(state.assignment) == {"c1": (2,), "c2": ()}
    assert pushes(out) == {"c1": (2,)}


def test_children_of_parents_held_by_two_consumers_wait() -> None:
    state = register(start(2), "c1", "c2")
    state, _ = feed(state, LayoutChanged(state.layout.merge(0, 1, now_ms=1)))
    state, _ = feed(state, LayoutChanged(state.layout.split(2, now_ms=2)))  # 2 -> 3, 4
    assert dict(state.assignment) == {"c1": (0,), "c2": (1,)}
    state, _ = feed(state, SegmentDrained(0))
    assert dict(state.assignment) == {"c1": (1, 2, 3, 4), "c2": ()}


def test_per_key_order_across_two_splits() -> None:
    state = register(start(1), "c1", "c2")
    h = segment_hash("order-42")  # 0x4b11
    layout = state.layout.split(0, 1)
    layout = layout.split(layout.find_active(h).segment_id, 2)
    state, _ = feed(state, LayoutChanged(layout))
    owners = [s for s in state.assignable_segments() if s.hash_range.contains(h)]
    assert [s.segment_id for s in owners] == [0]
    state, _ = feed(state, SegmentDrained(0))
    owners = [s for s in state.assignable_segments() if s.hash_range.contains(h)]
    assert [s.segment_id for s in owners] == [1]
    state, _ = feed(state, SegmentDrained(1))
    owners = [s for s in state.assignable_segments() if s.hash_range.contains(h)]
    assert [s.segment_id for s in owners] == [layout.find_active(h).segment_id]


def test_drain_of_active_segment_rejected_and_state_unchanged() -> None:
    state = register(start(2), "c1")
    with pytest.raises(NotAllowed):
        state.handle(SegmentDrained(1))
    assert state.drained == frozenset()


def test_drain_unknown_or_repeated_is_a_no_op() -> None:
    state = register(start(2), "c1")
    state, _ = feed(state, LayoutChanged(state.layout.split(0, 1)), SegmentDrained(0))
    assert state.handle(SegmentDrained(0)) == (state, [])
    assert state.handle(SegmentDrained(99)) == (state, [])


def test_stale_layout_ignored() -> None:
    state = register(start(2), "c1")
    newer = state.layout.split(0, 1)
    state, _ = feed(state, LayoutChanged(newer))
    assert state.handle(LayoutChanged(SegmentLayout.initial(2, 0))) == (state, [])
    assert state.handle(LayoutChanged(newer)) == (state, [])


# --- sessions and the grace period --------------------------------------------------------


def test_reconnect_within_grace_period_preserves_assignment() -> None:
    state = register(start(), "c1", "c2")
    before = dict(state.assignment)
    state, out = feed(state, ConsumerDisconnected("c1", now_ms=1000, consumer_id=100))
    assert out == [ScheduleTick(1000 + GRACE_MS)]
    state, out = feed(state, Tick(1000 + GRACE_MS - 1))
    assert out == [] and "c1" in state.sessions
    state, out = feed(state, ConsumerRegistered("c1", 1100, consumer_id=300))
    assert out == [PushAssignment("c1", 300, before["c1"], 0)]  # only c1, no rebalance
    assert dict(state.assignment) == before
    state, out = feed(state, Tick(10_000))
    assert out == [] and state.sessions["c1"].connected


def test_expired_session_is_evicted_after_grace_period() -> None:
    state = register(start(), "c1", "c2")
    state, _ = feed(state, ConsumerDisconnected("c1", now_ms=1000))
    state, out = feed(state, Tick(1000 + GRACE_MS))
    assert out == [DeleteSession("sub", "c1"), PushAssignment("c2", 101, (0, 1, 2, 3), 0)]
    assert "c1" not in state.sessions


def test_reconnect_after_deadline_without_tick_is_a_new_session() -> None:
    state = register(start(), "c1", "c2")
    state, _ = feed(state, ConsumerDisconnected("c1", now_ms=1000))
    state, out = feed(state, ConsumerRegistered("c1", 1000 + GRACE_MS, consumer_id=9))
    assert out == [
        DeleteSession("sub", "c1"),
        PersistSession("sub", "c1"),
        PushAssignment("c1", 9, (0, 2), 0),  # c2's share is unchanged: c2 is not told
    ]
    assert state.sessions["c1"].connected and state.next_deadline_ms() is None


def test_no_assignment_pushed_while_disconnected() -> None:
    state = register(start(2), "c1", "c2")
    state, _ = feed(state, ConsumerDisconnected("c1", now_ms=0))
    state, out = feed(state, LayoutChanged(state.layout.split(1, 1)), SegmentDrained(1))
    assert "c1" not in pushes(out)
    assert state.assignment["c1"] == (0, 3)  # c1 keeps its share while in grace
    state, out = feed(state, ConsumerRegistered("c1", 50, consumer_id=8))
    assert out == [PushAssignment("c1", 8, (0, 3), 1)]


def test_stale_disconnect_ignored_and_second_disconnect_keeps_deadline() -> None:
    state = register(start(), "c1")
    state, _ = feed(state, ConsumerRegistered("c1", 0, consumer_id=2))
    state, out = feed(state, ConsumerDisconnected("c1", now_ms=10, consumer_id=100))
    assert out == [] and state.sessions["c1"].connected
    state, _ = feed(state, ConsumerDisconnected("c1", now_ms=10, consumer_id=2))
    state, out = feed(state, ConsumerDisconnected("c1", now_ms=150))
    assert out == [] and state.next_deadline_ms() == 10 + GRACE_MS


def test_late_events_for_unknown_consumer_are_no_ops() -> None:
    state = start()
    assert state.handle(ConsumerDisconnected("ghost", 0)) == (state, [])
    assert state.handle(ConsumerUnregistered("ghost")) == (state, [])
    assert state.handle(Tick(10**9)) == (state, [])


def test_restore_installs_disconnected_sessions_with_fresh_grace() -> None:
    layout = SegmentLayout.initial(2, 0).split(0, 1)
    state, out = SubscriptionAssignment.restore(
        "sub", layout, ["c2", "c1"], now_ms=5000, grace_period_ms=GRACE_MS
    )
    state.validate()
    assert out == [ScheduleTick(5000 + GRACE_MS), PollDrain("sub", (0,))]
    assert all(not s.connected for s in state.sessions.values())
    assert dict(state.assignment) == {"c1": (0, 2, 3), "c2": (1,)}
    # A restored consumer resumes its assignment on reconnect...
    state, out = feed(state, ConsumerRegistered("c1", 5100, consumer_id=1))
    assert out == [PushAssignment("c1", 1, (0, 2, 3), 1)]
    # ...and one that never comes back is evicted after the fresh grace period.
    state, out = feed(state, Tick(5000 + GRACE_MS))
    assert out[0] == DeleteSession("sub", "c2")
    assert dict(state.assignment) == {"c1": (0, 1, 2, 3)}


def test_validate_catches_a_hand_built_bad_assignment() -> None:
    state = register(start(2), "c1", "c2")
    broken = dataclasses.replace(state, assignment={"c1": (0, 1), "c2": (1,)})
    with pytest.raises(InvalidArgument, match="twice"):
        broken.validate()
    gated = dataclasses.replace(state, layout=state.layout.split(0, 1))
    gated = dataclasses.replace(gated, assignment={"c1": (2, 3), "c2": (1,)})
    with pytest.raises(InvalidArgument):
        gated.validate()


# --- stateful model -----------------------------------------------------------------------

NAMES = ["a", "b", "c", "d"]
PROBE_HASHES = [0, 0x3FFF, 0x4000, 0x7FFF, 0x8000, 0xBFFF, 0xFFFF] + [
    segment_hash(k) for k in ("a", "hello", "key-0", "order-42")
]


class AssignmentMachine(RuleBasedStateMachine):
    """Drives the state machine as a shell would, and checks what consumers are told."""

    def __init__(self) -> None:
        super().__init__()
        self.state, _ = SubscriptionAssignment.create("sub", SegmentLayout.initial(2, 0), GRACE_MS)
        self.now = 0
        self.ids = itertools.count(1)
        self.drained: set[int] = set()  # the model's own record of what drained
        self.connected: dict[str, int] = {}  # name -> consumer id
        self.deadlines: dict[str, int] = {}  # name -> grace deadline
        self.views: dict[str, tuple[int, ...]] = {}  # what each consumer was last told
        self.ever_assigned: set[int] = set()

    def apply(self, event: object) -> list[Instruction]:
        self.state, out = self.state.handle(event)  # type: ignore[arg-type]
        for instruction in out:
            if isinstance(instruction, PushAssignment):
                assert instruction.consumer in self.connected, "pushed to a dead connection"
                assert instruction.consumer_id == self.connected[instruction.consumer]
                self.views[instruction.consumer] = instruction.segments
        return out

    @rule(name=st.sampled_from(NAMES))
    def register(self, name: str) -> None:
        expired = {n for n, d in self.deadlines.items() if d <= self.now}
        for gone in expired:
            del self.deadlines[gone]
        known = name in self.state.sessions and name not in expired
        consumer_id = next(self.ids)
        before = dict(self.state.assignment)
        self.connected[name] = consumer_id
        self.deadlines.pop(name, None)
        out = self.apply(ConsumerRegistered(name, self.now, consumer_id))
        assert {i.consumer for i in out if isinstance(i, DeleteSession)} == expired
        if known and not expired:  # a reconnect within grace: no rebalance, same share
            assert dict(self.state.assignment) == before
            assert out == [PushAssignment(name, consumer_id, before[name], self.state.layout.epoch)]
        assert (PersistSession("sub", name) in out) == (not known)
        assert pushes(out)[name] == self.state.assignment[name]  # a new connection is told

    @rule(name=st.sampled_from(NAMES))
    def disconnect(self, name: str) -> None:
        consumer_id = self.connected.pop(name, None)
        self.views.pop(name, None)
        out = self.apply(ConsumerDisconnected(name, self.now, consumer_id))
        if consumer_id is not None:
            self.deadlines[name] = self.now + GRACE_MS
            assert out == [ScheduleTick(self.now + GRACE_MS)]

    @rule(name=st.sampled_from(NAMES))
    def unregister(self, name: str) -> None:
        existed = name in self.state.sessions
        self.connected.pop(name, None)
        self.deadlines.pop(name, None)
        self.views.pop(name, None)
        out = self.apply(ConsumerUnregistered(name))
        assert (DeleteSession("sub", name) in out) == existed

    @rule(ms=st.integers(0, 2 * GRACE_MS))
    def time_passes(self, ms: int) -> None:
        self.now += ms  # no Tick delivered yet: the shell's timer is late

    @rule(ms=st.integers(0, 2 * GRACE_MS))
    def tick(self, ms: int) -> None:
        self.now += ms
        out = self.apply(Tick(self.now))
        expired = {n for n, d in self.deadlines.items() if d <= self.now}
        assert {i.consumer for i in out if isinstance(i, DeleteSession)} == expired
        for name in expired:
            del self.deadlines[name]

    @rule(pick=st.integers(0, 10**6))
    def split(self, pick: int) -> None:
        active = [s for s in self.state.layout.active_segments() if s.hash_range.size > 1]
        target = active[pick % len(active)]
        out = self.apply(LayoutChanged(self.state.layout.split(target.segment_id, self.now)))
        self.every_connected_consumer_told_the_epoch(out)

    def every_connected_consumer_told_the_epoch(self, out: list[Instruction]) -> None:
        epochs = {i.consumer: i.epoch for i in out if isinstance(i, PushAssignment)}
        assert epochs == dict.fromkeys(self.connected, self.state.layout.epoch)

    @precondition(lambda self: len(self.state.layout.active_segments()) > 1)
    @rule(pick=st.integers(0, 10**6))
    def merge(self, pick: int) -> None:
        pairs = list(itertools.pairwise(self.state.layout.active_segments()))
        a, b = pairs[pick % len(pairs)]
        layout = self.state.layout.merge(a.segment_id, b.segment_id, self.now)
        self.every_connected_consumer_told_the_epoch(self.apply(LayoutChanged(layout)))

    @precondition(lambda self: bool(self.state.pending_drains()))
    @rule(pick=st.integers(0, 10**6))
    def drain(self, pick: int) -> None:
        # Only a segment that a consumer is reading (or one nobody can read yet because it
        # is empty) drains; either way the model records it.
        pending = self.state.pending_drains()
        segment_id = pending[pick % len(pending)]
        self.drained.add(segment_id)
        self.apply(SegmentDrained(segment_id))

    @invariant()
    def state_is_valid(self) -> None:
        self.state.validate()
        assert self.state.drained == self.drained
        assert set(self.state.sessions) == set(self.connected) | set(self.deadlines)
        for name, session in self.state.sessions.items():
            assert session.connected == (name in self.connected)

    @invariant()
    def connected_consumers_were_told_their_share(self) -> None:
        for name in self.connected:
            assert self.views.get(name) == self.state.assignment[name]

    @invariant()
    def parent_before_child_for_every_key(self) -> None:
        # A consumer is told a child before its ancestors drained only together with every
        # undrained ancestor (it subscribes to the child once those ended); a hash is never
        # readable by two consumers.
        layout = self.state.layout
        for name in self.connected:
            view = set(self.views.get(name, ()))
            for segment_id in view:
                assert segment_id not in self.drained
                assert layout.ancestors(segment_id) - self.drained <= view, (
                    f"{name} holds {segment_id} without its undrained ancestors"
                )
        for h in PROBE_HASHES:
            readers = {
                name
                for name in self.connected
                for s in self.views.get(name, ())
                if layout.segments[s].hash_range.contains(h)
            }
            assert len(readers) <= 1, f"hash {h:#06x} readable by {readers}"

    @invariant()
    def a_lone_consumer_holds_every_undrained_segment(self) -> None:
        # Nothing is held back from it: a consumer acknowledging every N messages, or
        # only in batches, never waits for a drain that only its own ack could bring.
        if list(self.state.sessions) == list(self.connected) and len(self.connected) == 1:
            (name,) = self.connected
            undrained = set(self.state.layout.segments) - self.drained
            assert set(self.views.get(name, ())) == undrained


AssignmentMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestAssignmentMachine = AssignmentMachine.TestCase
