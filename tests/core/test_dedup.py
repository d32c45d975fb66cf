"""Producer deduplication state: verdicts, failures, snapshots, seeding across a split."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.core.dedup import DedupState, DedupVerdict
from anabranch.errors import InvalidArgument

NEW, DUP, IN_FLIGHT = DedupVerdict.NEW, DedupVerdict.DUPLICATE, DedupVerdict.IN_FLIGHT


def test_new_then_in_flight_then_duplicate() -> None:
    d = DedupState()
    assert d.admit("p", 0) is NEW
    assert d.admit("p", 0) is IN_FLIGHT
    d.on_persisted("p", 0)
    assert d.admit("p", 0) is DUP
    assert d.admit("p", 1) is NEW
    assert (d.last_persisted("p"), d.last_pushed("p")) == (0, 1)
    d.validate()


def test_gaps_are_allowed_and_lower_ids_are_duplicates() -> None:
    d = DedupState()
    assert d.admit("p", 5) is NEW
    d.on_persisted("p", 5)
    assert d.admit("p", 3) is DUP  # never seen, but lower than a persisted id
    assert d.admit("p", 9) is NEW


def test_producers_are_independent() -> None:
    d = DedupState()
    d.admit("a", 3)
    d.on_persisted("a", 3)
    assert d.check("b", 0) is NEW and d.check("a", 3) is DUP
    assert d.last_persisted("b") == -1


def test_check_does_not_change_state() -> None:
    d = DedupState()
    assert d.check("p", 0) is NEW
    assert d.check("p", 0) is NEW
    assert len(d) == 0


def test_batch_records_its_last_id() -> None:
    d = DedupState()
    assert d.admit("p", 10, last_sequence_id=14) is NEW
    assert d.check("p", 14) is IN_FLIGHT and d.check("p", 15) is NEW
    d.on_persisted("p", 14)
    assert d.check("p", 12) is DUP


def test_failure_resets_pushed_to_persisted() -> None:
    d = DedupState()
    d.admit("p", 0)
    d.on_persisted("p", 0)
    d.admit("p", 1)
    d.admit("q", 0)
    d.on_failed("p")
    assert d.check("p", 1) is NEW  # the retry of a failed write is written
    assert d.check("q", 0) is IN_FLIGHT
    d.on_failed()
    assert d.check("q", 0) is NEW
    d.validate()


@pytest.mark.parametrize(
    ("seq", "last"),
    [(-1, None), (2**63, None), (5, 4), (0, -1), (True, None)],
)
def test_bad_sequence_ids_rejected_without_advancing(seq: int, last: int | None) -> None:
    d = DedupState()
    with pytest.raises(InvalidArgument):
        d.admit("p", seq, last)
    assert len(d) == 0


def test_bad_producer_rejected() -> None:
    with pytest.raises(InvalidArgument):
        DedupState().admit("", 0)


def test_snapshot_restore_and_json_round_trip() -> None:
    d = DedupState()
    for producer, seq in (("b", 3), ("a", 7)):
        d.admit(producer, seq)
        d.on_persisted(producer, seq)
    d.admit("a", 8)  # in flight: not durable, not in the snapshot
    d.admit("c", 0)  # in flight only
    assert d.snapshot() == {"a": 7, "b": 3}
    restored = DedupState.restore(d.snapshot())
    assert restored.check("a", 7) is DUP and restored.check("a", 8) is NEW
    again = DedupState.from_json(d.to_json())
    assert again.snapshot() == d.snapshot()
    assert d.to_json() == b'{"a":7,"b":3}'


@pytest.mark.parametrize("data", [b"", b"[]", b'{"a": "x"}', b'{"a": -5}', b'{"": 1}'])
def test_from_json_rejects(data: bytes) -> None:
    with pytest.raises(InvalidArgument):
        DedupState.from_json(data)


def test_children_reject_what_the_sealed_parent_persisted() -> None:
    parent = DedupState()
    parent.admit("p", 41)
    parent.on_persisted("p", 41)
    parent.admit("p", 42)  # in flight when the parent was sealed: that write failed
    parent.on_failed()
    low, high = (DedupState.seeded_from([parent.snapshot()]) for _ in range(2))
    # The producer re-routes its retries of 41 and 42 to a child after the split.
    assert low.admit("p", 41) is DUP
    assert high.admit("p", 42) is NEW


def test_merge_child_takes_the_highest_mark_of_both_parents() -> None:
    child = DedupState.seeded_from([{"p": 3, "q": 9}, {"p": 8}])
    assert child.snapshot() == {"p": 8, "q": 9}
    assert child.check("p", 8) is DUP and child.check("p", 9) is NEW


def test_forget() -> None:
    d = DedupState.restore({"p": 3})
    d.forget("p")
    assert d.check("p", 0) is NEW and d.snapshot() == {}


# --- model-based ------------------------------------------------------------------------

actions = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.sampled_from("ab"), st.integers(0, 12)),
        st.tuples(st.just("persist"), st.sampled_from("ab"), st.just(0)),
        st.tuples(st.just("fail"), st.sampled_from("ab"), st.just(0)),
        st.tuples(st.just("restart"), st.just("a"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150)
@given(actions)
def test_never_writes_an_id_twice(steps: list[tuple[str, str, int]]) -> None:
    """A model broker: admitted sends queue per producer, complete in order or fail as a
    whole. No sequence id is ever written twice, and a DUPLICATE is always truly written."""
    d = DedupState()
    queued: dict[str, deque[int]] = {"a": deque(), "b": deque()}
    written: dict[str, set[int]] = {"a": set(), "b": set()}
    for action, producer, seq in steps:
        if action == "send":
            verdict = d.admit(producer, seq)
            if verdict is NEW:
                assert seq not in written[producer] and seq not in queued[producer]
                queued[producer].append(seq)
            elif verdict is DUP:
                assert seq <= max(written[producer])
            else:
                assert seq <= max(queued[producer], default=-1)
        elif action == "persist" and queued[producer]:
            done = queued[producer].popleft()
            written[producer].add(done)
            d.on_persisted(producer, done)
        elif action == "fail":
            for q in queued.values():
                q.clear()
            d.on_failed()
        elif action == "restart":
            for q in queued.values():
                q.clear()
            d = DedupState.from_json(d.to_json())
        d.validate()
        for name in "ab":
            assert d.last_persisted(name) == max(written[name], default=-1)
