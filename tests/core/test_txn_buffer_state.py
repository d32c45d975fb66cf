"""Visibility of transactional entries: hand-written cases, then a model check."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.core.txn_buffer_state import TxnBufferState, before
from anabranch.errors import InvalidArgument

A, B = (0, 1), (0, 2)


def test_open_txn_pins_before_its_first_entry_and_later_plain_entries() -> None:
    s = TxnBufferState()
    t = s.begin_append(A, (1, 4))
    assert s.max_read_position((1, 9)) == (1, 4)  # in flight: pinned at the LAC it saw
    s.end_append(t, (1, 5))
    # Plain entries 1:6..1:9 landed after it: still held back (read-committed).
    assert s.max_read_position((1, 9)) == (1, 4)
    assert s.apply_outcome(A, committed=True)
    assert s.max_read_position((1, 9)) == (1, 9)
    assert not s.is_aborted((1, 5))
    s.validate()


def test_concurrent_open_txns_pin_at_the_smallest_first_position() -> None:
    s = TxnBufferState()
    s.end_append(s.begin_append(A, (1, 0)), (1, 3))
    s.end_append(s.begin_append(B, (1, 0)), (1, 1))
    assert s.max_read_position((1, 5)) == (1, 0)
    s.apply_outcome(B, committed=True)
    assert s.max_read_position((1, 5)) == (1, 2)
    s.apply_outcome(A, committed=False)
    assert s.max_read_position((1, 5)) == (1, 5)
    assert s.is_aborted((1, 3)) and not s.is_aborted((1, 1))
    assert s.aborted_positions(A) == [(1, 3)] and s.aborted_txn_count == 1


def test_first_entry_of_a_ledger_pins_before_entry_zero() -> None:
    s = TxnBufferState()
    s.end_append(s.begin_append(A, (1, 7)), (2, 0))
    assert s.max_read_position((2, 3)) == (2, -1) == before((2, 0))
    assert (2, -1) > (1, 7)


def test_outcome_during_an_append_applies_to_its_position() -> None:
    s = TxnBufferState()
    t1 = s.begin_append(A, (1, 0))
    t2 = s.begin_append(B, (1, 0))
    assert s.apply_outcome(A, committed=False)
    assert s.apply_outcome(B, committed=True)
    assert s.in_flight(A) == 1 and s.max_read_position((1, 3)) == (1, 0)
    s.end_append(t1, (1, 1))
    s.end_append(t2, (1, 2))
    assert s.is_aborted((1, 1)) and not s.is_aborted((1, 2))
    assert s.max_read_position((1, 3)) == (1, 3)
    assert not s.apply_outcome(A, committed=False)  # idempotent
    s.validate()


def test_failed_append_releases_its_pin() -> None:
    s = TxnBufferState()
    s.fail_append(s.begin_append(A, (1, 0)))
    assert s.max_read_position((1, 2)) == (1, 2) and s.is_ongoing(A)


def test_recovered_txn_pins_at_first_after_until_scanned() -> None:
    s = TxnBufferState()
    s.recover_unfinished(A, (1, 2))
    assert s.max_read_position((3, 9)) == (1, 2) and s.recovered_count == 1
    s.found(A, (2, 4))
    s.found(A, (2, 4))
    s.found(A, (1, 8))
    s.end_scan(A)
    assert s.positions(A) == [(1, 8), (2, 4)]
    assert s.max_read_position((3, 9)) == (1, 7)
    s.apply_outcome(A, committed=False)
    assert s.aborted_positions(A) == [(1, 8), (2, 4)]


def test_recovered_txn_without_entries_stops_pinning_after_scan() -> None:
    s = TxnBufferState()
    s.recover_unfinished(A, (1, 2))
    s.end_scan(A)
    assert s.max_read_position((3, 9)) == (3, 9) and s.is_ongoing(A)


def test_prune_forgets_aborted_txns_below_the_first_valid_position() -> None:
    s = TxnBufferState()
    s.load_aborted(A, [(1, 0), (1, 1)])
    s.load_aborted(B, [(1, 3), (2, 0)])
    assert s.prune_aborted((2, 0)) == [A]
    assert not s.is_aborted((1, 0)) and s.is_aborted((2, 0))


def test_validate_catches_a_broken_state() -> None:
    s = TxnBufferState()
    s.end_append(s.begin_append(A, (1, 0)), (1, 1))
    s._aborted[(1, 1)] = A  # corrupt on purpose
    with pytest.raises(InvalidArgument):
        s.validate()


# --- model check ---------------------------------------------------------------------------


@dataclass
class Model:
    """A ledger and what each transaction is; the truth the state is checked against."""

    ledger: int = 1
    entries: list[tuple[tuple[int, int], tuple[int, int] | None]] = field(default_factory=list)
    status: dict[tuple[int, int], str] = field(default_factory=dict)
    in_flight: list[tuple[int, tuple[int, int]]] = field(default_factory=list)

    @property
    def lac(self) -> tuple[int, int]:
        return self.entries[-1][0] if self.entries else (0, -1)

    def land(self, txn: tuple[int, int] | None) -> tuple[int, int]:
        last = self.lac
        pos = (self.ledger, last[1] + 1 if last[0] == self.ledger else 0)
        self.entries.append((pos, txn))
        return pos


OPS = st.lists(
    st.tuples(
        st.sampled_from(["plain", "begin", "end", "fail", "commit", "abort", "roll"]),
        st.integers(0, 5),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_state_matches_the_model(ops: list[tuple[str, int]]) -> None:
    s, m = TxnBufferState(), Model()
    previous = s.max_read_position(m.lac)
    for op, n in ops:
        txn = (0, n)
        if op == "plain":
            m.land(None)
        elif op == "roll":
            m.ledger += 1
        elif op == "begin" and m.status.get(txn, "open") == "open":
            m.status[txn] = "open"
            m.in_flight.append((s.begin_append(txn, m.lac), txn))
        elif op in ("end", "fail") and m.in_flight:
            token, appender = m.in_flight.pop(n % len(m.in_flight))
            if op == "end":
                s.end_append(token, m.land(appender))
            else:
                s.fail_append(token)
        elif op in ("commit", "abort") and m.status.get(txn) == "open":
            m.status[txn] = "committed" if op == "commit" else "aborted"
            s.apply_outcome(txn, committed=op == "commit")
        s.validate()
        max_read = s.max_read_position(m.lac)
        assert previous <= max_read <= m.lac  # never moves back, never past the LAC
        previous = max_read
        for pos, owner in m.entries:
            if owner is not None and m.status[owner] == "open":
                assert max_read < pos  # nothing of an open txn, nor anything after it
            assert s.is_aborted(pos) == (owner is not None and m.status[owner] == "aborted")
        if not m.in_flight and not any(
            owner is not None and m.status[owner] == "open" for _, owner in m.entries
        ):
            assert max_read == m.lac  # committed and plain entries all readable


def test_a_commit_whose_winners_wrote_everything_leaves_no_aborted_transaction() -> None:
    """A winners commit with no losers, and an abort with no entry here, used to be kept
    (and counted) as aborted transactions with no positions."""
    s = TxnBufferState()
    s.end_append(s.begin_append((0, 1), (1, 0), "0-a"), (1, 1))
    s.apply_outcome((0, 1), committed=True, winners=frozenset({"0-a"}))
    s.open_txn((0, 2))
    s.apply_outcome((0, 2), committed=False)
    s.load_aborted((0, 3), [])
    assert s.aborted_txn_count == 0 and not s.is_aborted((1, 1))
    s.validate()
