"""Cursor and dedup state bounded in bytes (issue 15): whatever a client does, the value
written to the metadata store fits the budget, and what is dropped only costs redelivery
(cursor) or forgets the least recently persisted producers (dedup)."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch import limits
from anabranch.core.ack_state import AckState, Pos
from anabranch.core.dedup import DedupState

LEDGER = 5

acks = st.lists(st.integers(0, 5_000), max_size=400)
batches = st.dictionaries(st.integers(0, 5_000), st.binary(min_size=1, max_size=2_000), max_size=40)
budgets = st.integers(0, 20_000)


def state_of(entries: list[int], partial: dict[int, bytes]) -> AckState:
    state = AckState((LEDGER, -1))
    for e in entries:
        state.acknowledge((LEDGER, e))
    for e, bits in partial.items():
        if not state.is_acked((LEDGER, e)):
            state.set_batch_ack((LEDGER, e), bits)
    return state


@settings(max_examples=200, deadline=None)
@given(acks, batches, budgets)
def test_cursor_value_never_exceeds_its_budget_and_keeps_only_true_acks(
    entries: list[int], partial: dict[int, bytes], budget: int
) -> None:
    state = state_of(entries, partial)
    data = state.to_bytes(bytes_max=budget)
    assert len(data) <= max(budget, 25)  # the 25-byte header is always written
    restored = AckState.from_bytes(data)
    assert restored.mark_delete == state.mark_delete
    # Nothing is acked after a restart that was not acked before (no loss)...
    for start, end in restored.ranges:
        for e in range(start[1], end[1] + 1):
            assert state.is_acked((LEDGER, e))
    for pos, bits in restored.batch_acks.items():
        assert state.batch_acks[pos] == bits
    # ...and what is kept is the part nearest mark-delete (a prefix of the ranges).
    assert restored.ranges == state.ranges[: len(restored.ranges)]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 200))
def test_cursor_value_at_the_default_budget_fits_a_metadata_value(spread: int) -> None:
    state = AckState((LEDGER, -1))
    for e in range(0, 20_000 * spread, 2 * spread):  # 10,000 holes
        state.acknowledge((LEDGER, e + 1))
    for e in range(0, 2_000, 2):
        pos: Pos = (LEDGER + 1, e)
        state.set_batch_ack(pos, b"\x55" * 125)  # 1,000-message batches, half acked
    data = state.to_bytes(
        limits.CURSOR_ACK_RANGES_PERSIST_MAX,
        limits.CURSOR_BATCH_ACKS_PERSIST_MAX,
        limits.CURSOR_STATE_BYTES_MAX,
    )
    assert len(data) <= limits.CURSOR_STATE_BYTES_MAX < limits.METADATA_VALUE_BYTES_MAX
    assert len(AckState.from_bytes(data).ranges) == 10_000  # all ranges fit: 240 KB


producer_names = st.text(min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(producer_names, st.integers(0, 2**63 - 1)), max_size=200),
    st.integers(2, 20_000),
)
def test_dedup_snapshot_never_exceeds_its_budget_and_keeps_the_newest(
    sends: list[tuple[str, int]], budget: int
) -> None:
    state = DedupState()
    for producer, sequence_id in sends:
        state.on_persisted(producer, sequence_id)
    snapshot = state.snapshot(max_bytes=budget)
    encoded = json.dumps({"position": [2**62, 2**62], "producers": snapshot})
    assert len(json.dumps(snapshot)) <= budget
    assert len(encoded.encode()) <= budget + 80  # the topic's record: + its position
    assert len(msgspec.json.encode(snapshot)) <= budget  # the compact UTF-8 form is smaller
    # The kept producers are the most recently persisted ones, with their marks.
    order = list(dict.fromkeys(p for p, _ in reversed(sends)))
    assert set(snapshot) == set(order[: len(snapshot)])
    for producer, mark in snapshot.items():
        assert mark == state.last_persisted(producer)


def test_dedup_forgets_the_least_recently_persisted_producer_past_its_count() -> None:
    state = DedupState(producers_max=3)
    for name in ("a", "b", "c"):
        state.on_persisted(name, 1)
    state.on_persisted("a", 2)  # a is now the newest
    state.on_persisted("d", 1)  # evicts b, the oldest
    assert state.snapshot() == {"a": 2, "c": 1, "d": 1}
    state.admit("e", 0)  # a new producer counts too: evicts c
    assert len(state) == 3 and state.last_persisted("c") == -1
    state.validate()


def test_default_dedup_snapshot_of_many_long_names_fits_a_metadata_value() -> None:
    state = DedupState(producers_max=100_000)
    for i in range(20_000):
        state.on_persisted(f"producer-{i:06d}-" + "x" * 100, i)
    data = json.dumps({"position": [1, 2], "producers": state.snapshot()}).encode()
    assert len(data) <= limits.DEDUP_SNAPSHOT_BYTES_MAX + 80 < limits.METADATA_VALUE_BYTES_MAX
    assert state.snapshot()[f"producer-{19_999:06d}-" + "x" * 100] == 19_999
