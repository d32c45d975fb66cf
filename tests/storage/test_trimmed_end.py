"""The end a trim leaves behind (``storage.base.trimmed_end``): the last entry of the
deleted ledgers, never below what an earlier trim recorded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from anabranch.storage.api import Position
from anabranch.storage.base import LedgerInfo, position_from_json, position_json, trimmed_end

entry_counts = st.lists(st.integers(min_value=0, max_value=5), max_size=8)
earlier = st.none() | st.builds(Position, st.integers(0, 3), st.integers(0, 9))


@given(entry_counts, earlier)
def test_the_end_is_the_last_deleted_entry_or_the_earlier_end(
    counts: list[int], before: Position | None
) -> None:
    # Ledger ids after any earlier trim's, oldest first, as the ledger list keeps them.
    doomed = [LedgerInfo(10 + i, n) for i, n in enumerate(counts)]
    end = trimmed_end(doomed, before)
    entries = [Position(i.ledger_id, e) for i in doomed for e in range(i.entries)]
    assert end == (max(entries) if entries else before)
    if before is not None:
        assert end is not None and end >= before
    assert position_from_json(position_json(end)) == end
