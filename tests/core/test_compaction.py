"""The compaction step against a dict model: latest value per key, tombstones delete."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from anabranch.core.compaction import CompactionPlan, Message, compact_model, removed_bits

KEYS = st.sampled_from([b"a", b"b", b"c", b"d", None])


@st.composite
def topics(draw: st.DrawFn) -> list[Message]:
    """Entries in order; some are batches of several messages."""
    out: list[Message] = []
    ledger = 1
    entry = 0
    for _ in range(draw(st.integers(0, 30))):
        if draw(st.booleans()):
            ledger += 1
            entry = 0
        size = draw(st.sampled_from([1, 1, 2, 4]))
        for i in range(size):
            out.append(
                Message((ledger, entry), i if size > 1 else -1, draw(KEYS), draw(st.booleans()))
            )
        entry += 1
    return out


def _dict_model(messages: list[Message]) -> dict[bytes, tuple[tuple[int, int], int]]:
    state: dict[bytes, tuple[tuple[int, int], int]] = {}
    for m in messages:
        if m.key is None:
            continue
        if m.tombstone:
            state.pop(m.key, None)
        else:
            state[m.key] = (m.position, max(m.batch_index, 0))
    return state


@given(topics())
def test_survivors_are_the_latest_value_of_each_live_key(messages: list[Message]) -> None:
    model = _dict_model(messages)
    kept = compact_model(messages)
    assert {m.key: (m.position, max(m.batch_index, 0)) for m in kept} == model
    assert len(kept) == len(model)  # one message per live key, keyless ones dropped
    assert [(m.position, m.batch_index) for m in kept] == sorted(
        (m.position, m.batch_index) for m in kept
    )


@given(topics())
def test_retain_null_key_keeps_keyless_messages(messages: list[Message]) -> None:
    kept = compact_model(messages, retain_null_key=True)
    keyless = [m for m in messages if m.key is None and not m.tombstone]
    assert [m for m in kept if m.key is None] == keyless
    assert len(kept) == len(keyless) + len(_dict_model(messages))


@given(topics(), st.integers(0, 40))
def test_compaction_is_idempotent_and_incremental(messages: list[Message], cut: int) -> None:
    """Compacting the compacted prefix plus the rest gives the same as compacting all:
    what a second compaction run over (old compacted view + new tail) relies on."""
    head, tail = messages[:cut], messages[cut:]
    assert compact_model(compact_model(messages)) == compact_model(messages)
    assert compact_model(compact_model(head) + tail) == compact_model(messages)


@given(topics())
def test_survivor_sets_match_the_model(messages: list[Message]) -> None:
    plan = CompactionPlan()
    plan.add_all(messages)
    kept = compact_model(messages)
    entries = plan.surviving_entries()
    assert entries == sorted({m.position for m in kept})
    for pos in entries:
        sizes = [m for m in messages if m.position == pos]
        got = plan.survivors(pos, len(sizes))
        assert got == {max(m.batch_index, 0) for m in kept if m.position == pos}
        bits = int.from_bytes(removed_bits(got, len(sizes)), "little")
        assert all(bool(bits >> i & 1) != (i in got) for i in range(len(sizes)))


def test_out_of_order_messages_are_refused() -> None:
    plan = CompactionPlan()
    plan.add(Message((2, 0), -1, b"a", False))
    with pytest.raises(ValueError):
        plan.add(Message((1, 5), -1, b"a", False))
    assert plan.keys == 1


def test_the_plan_holds_no_key_bytes() -> None:
    """A producer choosing 64 KiB keys: the plan's memory follows the number of keys,
    not their size (it held every key whole: 100 such keys, 6.4 MB)."""
    plan = CompactionPlan()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100):
            plan.add(Message((1, i), -1, i.to_bytes(4, "big") * (16 * 1024), False))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert plan.keys == 100
    assert held < 100 * 1024
    assert plan.surviving_entries() == [(1, i) for i in range(100)]
