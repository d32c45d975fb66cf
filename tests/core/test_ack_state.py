"""AckState against a plain set model (hypothesis stateful), plus serialisation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from anabranch.core.ack_state import AckState, Pos

# Three ledgers with gaps between ids, as the storage layer produces them.
LEDGER_SIZES = {3: 6, 7: 1, 9: 8}
UNIVERSE: list[Pos] = [(lid, e) for lid, n in sorted(LEDGER_SIZES.items()) for e in range(n)]
BEFORE_ALL: Pos = (-1, -1)


def successor(pos: Pos) -> Pos:
    """Ledger-aware successor: after the last entry of a ledger comes the next ledger."""
    for p in UNIVERSE:
        if p > pos:
            return p
    return (pos[0], pos[1] + 1)


positions = st.sampled_from(UNIVERSE)


class AckMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = AckState(BEFORE_ALL)
        self.acked: set[Pos] = set()

    @rule(pos=positions)
    def ack_individual(self, pos: Pos) -> None:
        changed = self.state.acknowledge(pos, successor)
        assert changed == (pos not in self.acked)
        self.acked.add(pos)

    @rule(pos=positions)
    def ack_cumulative(self, pos: Pos) -> None:
        self.state.acknowledge_cumulative(pos, successor)
        self.acked |= {p for p in UNIVERSE if p <= pos}

    @rule(pos=positions)
    def reset(self, pos: Pos) -> None:
        before = BEFORE_ALL
        for p in UNIVERSE:
            if p < pos:
                before = p
        self.state.reset(before)
        self.acked = {p for p in UNIVERSE if p < pos}

    @precondition(lambda self: len(self.acked) < len(UNIVERSE))
    @rule(pos=positions, bits=st.binary(min_size=1, max_size=4))
    def batch_ack(self, pos: Pos, bits: bytes) -> None:
        self.state.set_batch_ack(pos, bits)
        assert (pos in self.state.batch_acks) == (pos not in self.acked)

    @rule(a=positions, b=positions)
    def count_span(self, a: Pos, b: Pos) -> None:
        first, last = min(a, b), max(a, b)
        expected = sum(1 for p in self.acked if first <= p <= last and p > self.state.mark_delete)
        assert self.state.acked_count(first, last) == expected

    @invariant()
    def matches_model(self) -> None:
        self.state.validate()
        for p in UNIVERSE:
            assert self.state.is_acked(p) == (p in self.acked), p
        # mark-delete is the end of the longest acknowledged prefix.
        prefix_end = BEFORE_ALL
        for p in UNIVERSE:
            if p not in self.acked:
                break
            prefix_end = p
        assert self.state.mark_delete == prefix_end
        assert self.state.individually_acked == len(
            [p for p in self.acked if p > self.state.mark_delete]
        )

    @invariant()
    def round_trips(self) -> None:
        assert AckState.from_bytes(self.state.to_bytes()) == self.state


AckMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAckMachine = AckMachine.TestCase


def test_cumulative_clips_straddling_range() -> None:
    state = AckState((1, -1))
    for e in (3, 4, 5):
        state.acknowledge((1, e))
    state.acknowledge_cumulative((1, 4))
    assert state.mark_delete == (1, 5)
    assert state.ranges == []


def test_bounded_serialisation_keeps_nearest_ranges() -> None:
    state = AckState((1, -1))
    for e in (2, 4, 6):
        state.acknowledge((1, e))
    restored = AckState.from_bytes(state.to_bytes(ranges_max=2))
    assert restored.ranges == [((1, 2), (1, 2)), ((1, 4), (1, 4))]
    assert not restored.is_acked((1, 6))


@pytest.mark.parametrize(
    "data",
    [b"", b"\x02" + bytes(24), AckState((1, 1)).to_bytes() + b"x"],
)
def test_malformed_bytes_rejected(data: bytes) -> None:
    with pytest.raises(ValueError):
        AckState.from_bytes(data)


def test_validate_catches_unmerged_ranges() -> None:
    state = AckState((1, -1))
    state._starts[:] = [(1, 2), (1, 3)]
    state._ends[:] = [(1, 2), (1, 3)]
    with pytest.raises(AssertionError):
        state.validate()
