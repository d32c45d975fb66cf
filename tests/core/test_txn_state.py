"""The header rules (core/txn_state.py) against their tables, by example and by property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch import limits
from anabranch.core.txn_state import (
    TRANSITIONS,
    EndVerdict,
    IdBlock,
    JoinVerdict,
    can_transition,
    clamp_timeout,
    finalized,
    is_expired,
    judge_end,
    judge_join,
    reserve_block,
    target_state,
)
from anabranch.errors import InvalidArgument
from anabranch.transactions.records import U64_MAX, TxnHeader, TxnState

OPEN = TxnHeader(TxnState.OPEN, created_at=1_000, timeout_ms=500)
COMMITTED = TxnHeader(TxnState.COMMITTED, created_at=1_000, timeout_ms=500, finalized_at=1_100)
ABORTED = TxnHeader(TxnState.ABORTED, created_at=1_000, timeout_ms=500, finalized_at=1_100)

states = st.sampled_from(list(TxnState))
final_states = st.sampled_from([TxnState.COMMITTED, TxnState.ABORTED])
headers = st.builds(
    TxnHeader,
    state=states,
    created_at=st.integers(0, 10**13),
    timeout_ms=st.integers(1, limits.TXN_TIMEOUT_MAX_MS),
)


@pytest.mark.parametrize(
    ("header", "wanted", "now", "verdict"),
    [
        (None, TxnState.COMMITTED, 0, EndVerdict.NOT_FOUND),
        (None, TxnState.ABORTED, 0, EndVerdict.NOT_FOUND),
        (OPEN, TxnState.COMMITTED, 1_500, EndVerdict.APPLY),
        (OPEN, TxnState.COMMITTED, 1_501, EndVerdict.EXPIRED),
        (OPEN, TxnState.ABORTED, 1_200, EndVerdict.APPLY),
        (OPEN, TxnState.ABORTED, 9_999, EndVerdict.APPLY),
        (COMMITTED, TxnState.COMMITTED, 9_999, EndVerdict.ALREADY),
        (ABORTED, TxnState.ABORTED, 1_200, EndVerdict.ALREADY),
        (COMMITTED, TxnState.ABORTED, 1_200, EndVerdict.INVALID_STATUS),
        (ABORTED, TxnState.COMMITTED, 1_200, EndVerdict.INVALID_STATUS),
    ],
)
def test_judge_end_table(
    header: TxnHeader | None, wanted: TxnState, now: int, verdict: EndVerdict
) -> None:
    assert judge_end(header, wanted, now) is verdict


def test_end_must_ask_for_a_final_state() -> None:
    with pytest.raises(InvalidArgument):
        judge_end(OPEN, TxnState.OPEN, 0)


@pytest.mark.parametrize(
    ("header", "now", "verdict"),
    [
        (None, 0, JoinVerdict.NOT_FOUND),
        (OPEN, 1_000, JoinVerdict.OK),
        (OPEN, 1_500, JoinVerdict.OK),
        (OPEN, 1_501, JoinVerdict.EXPIRED),
        (COMMITTED, 1_200, JoinVerdict.CONFLICT),
        (ABORTED, 1_200, JoinVerdict.CONFLICT),
    ],
)
def test_judge_join_table(header: TxnHeader | None, now: int, verdict: JoinVerdict) -> None:
    assert judge_join(header, now) is verdict


@given(header=headers, wanted=final_states, now=st.integers(0, 10**13))
def test_end_never_commits_what_cannot_commit(
    header: TxnHeader, wanted: TxnState, now: int
) -> None:
    verdict = judge_end(header, wanted, now)
    if verdict in (EndVerdict.APPLY, EndVerdict.EXPIRED):
        target = target_state(verdict, wanted)
        assert header.state is TxnState.OPEN and can_transition(header.state, target)
        # A COMMITTED outcome only for a transaction that was still within its deadline.
        assert target is not TxnState.COMMITTED or not is_expired(header, now)
        assert finalized(header, target, now).state is target
    else:
        with pytest.raises(InvalidArgument):
            target_state(verdict, wanted)
    assert (verdict is EndVerdict.ALREADY) == (header.state is wanted)


@given(header=headers, now=st.integers(0, 10**13))
def test_join_ok_only_while_open_and_in_time(header: TxnHeader, now: int) -> None:
    ok = judge_join(header, now) is JoinVerdict.OK
    assert ok == (header.state is TxnState.OPEN and now <= header.deadline)


@given(current=states, target=states)
def test_final_states_are_terminal(current: TxnState, target: TxnState) -> None:
    if current.final:
        assert not can_transition(current, target)
        with pytest.raises(InvalidArgument):
            finalized(TxnHeader(current, 0, 1, finalized_at=0), target, 5)
    assert can_transition(current, target) == (target in TRANSITIONS[current])


@pytest.mark.parametrize(
    ("asked", "got"),
    [
        (None, limits.TXN_TIMEOUT_DEFAULT_MS),
        (0, limits.TXN_TIMEOUT_DEFAULT_MS),
        (1, 1),
        (limits.TXN_TIMEOUT_MAX_MS, limits.TXN_TIMEOUT_MAX_MS),
        (limits.TXN_TIMEOUT_MAX_MS + 1, limits.TXN_TIMEOUT_MAX_MS),
    ],
)
def test_clamp_timeout(asked: int | None, got: int) -> None:
    assert clamp_timeout(asked) == got


def test_negative_timeout_is_invalid() -> None:
    with pytest.raises(InvalidArgument):
        clamp_timeout(-1)


@given(counter=st.integers(0, 2**70), size=st.integers(1, 1_000))
@settings(max_examples=50)
def test_blocks_hand_out_each_id_once(counter: int, size: int) -> None:
    if counter > U64_MAX:
        with pytest.raises(InvalidArgument):
            reserve_block(counter, size)
        return
    block, after = reserve_block(counter, size)
    taken: list[int] = []
    while (next_id := block.take()) is not None:
        taken.append(next_id)
    assert taken == list(range(counter, after))
    assert after <= U64_MAX + 1 and block.remaining == 0
    assert block.take() is None


def test_block_validates_its_range() -> None:
    with pytest.raises(InvalidArgument):
        IdBlock(5, 4)
    with pytest.raises(InvalidArgument):
        reserve_block(0, 0)
