"""A subscription cursor's acknowledgement state: pure data, no I/O.

Theory of operation. Positions are ``(ledger_id, entry_id)`` tuples, ordered as tuples.
Everything at or below ``mark_delete`` is acknowledged. Above it, individually
acknowledged positions are kept as a sorted set of disjoint closed ranges, each inside one
ledger (``(L, a)..(L, b)`` means entries ``a..b`` of ledger ``L``). Whenever the first
range starts right after ``mark_delete`` it is absorbed, so ``mark_delete`` is always the
end of the longest acknowledged prefix that this state can see.

Which position follows which is a fact about the ledger list (the last entry of ledger
``L`` is followed by entry 0 of the next ledger), so the storage layer passes a
``successor`` function; without one, ``(L, e)`` is followed by ``(L, e + 1)``.

Partially acknowledged batch entries keep a bitset (``bytes``, bit set = acked index) in
``batch_acks``; it is dropped as soon as the whole entry is acknowledged.

Example:
    >>> state = AckState((1, -1))
    >>> state.acknowledge((1, 2)); state.acknowledge((1, 1))
    True
    True
    >>> state.mark_delete, state.ranges
    ((1, -1), [((1, 1), (1, 2))])
    >>> state.acknowledge((1, 0)); state.mark_delete, state.ranges
    True
    ((1, 2), [])
"""

from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right
from collections.abc import Callable

Pos = tuple[int, int]
Successor = Callable[[Pos], Pos]

_HEAD = struct.Struct(">BqqII")
_RANGE = struct.Struct(">qqq")
_BATCH = struct.Struct(">qqI")
_VERSION = 1


def next_in_ledger(pos: Pos) -> Pos:
    """The default successor: the next entry of the same ledger."""
    return (pos[0], pos[1] + 1)


class AckState:
    """Mark-delete position + individually acknowledged ranges (+ partial batch acks)."""

    __slots__ = ("_ends", "_starts", "batch_acks", "mark_delete")

    def __init__(self, mark_delete: Pos) -> None:
        self.mark_delete: Pos = (int(mark_delete[0]), int(mark_delete[1]))
        self._starts: list[Pos] = []
        self._ends: list[Pos] = []
        self.batch_acks: dict[Pos, bytes] = {}

    # --- queries --------------------------------------------------------------------------

    @property
    def ranges(self) -> list[tuple[Pos, Pos]]:
        """The individually acknowledged ranges, sorted, as (first, last) inclusive."""
        return list(zip(self._starts, self._ends, strict=True))

    def is_acked(self, pos: Pos) -> bool:
        """True when ``pos`` is at or below mark-delete or individually acknowledged."""
        if pos <= self.mark_delete:
            return True
        i = bisect_right(self._starts, pos) - 1
        return i >= 0 and pos <= self._ends[i]

    def acked_count(self, first: Pos, last: Pos) -> int:
        """Individually acknowledged positions within ``[first, last]`` (not counting the
        mark-delete prefix, whose size needs the ledger list)."""
        if last < first:
            return 0
        total = 0
        i = max(bisect_right(self._starts, first) - 1, 0)
        while i < len(self._starts) and self._starts[i] <= last:
            lo = max(self._starts[i], first)
            hi = min(self._ends[i], last)
            if lo <= hi:
                if lo[0] == hi[0]:
                    total += hi[1] - lo[1] + 1
                else:
                    # first/last fall in other ledgers; the range is inside one ledger.
                    start, end = self._starts[i], self._ends[i]
                    a = start[1] if lo[0] != start[0] else lo[1]
                    b = end[1] if hi[0] != end[0] else hi[1]
                    total += b - a + 1
            i += 1
        return total

    @property
    def individually_acked(self) -> int:
        """Number of positions in the individually acknowledged ranges."""
        return sum(e[1] - s[1] + 1 for s, e in zip(self._starts, self._ends, strict=True))

    # --- transitions ----------------------------------------------------------------------

    def acknowledge(self, pos: Pos, successor: Successor = next_in_ledger) -> bool:
        """Acknowledge one position; False when it was already acknowledged."""
        pos = (int(pos[0]), int(pos[1]))
        if self.is_acked(pos):
            return False
        self.batch_acks.pop(pos, None)
        i = bisect_left(self._starts, pos)
        left = i - 1
        joins_left = left >= 0 and next_in_ledger(self._ends[left]) == pos
        joins_right = i < len(self._starts) and self._starts[i] == next_in_ledger(pos)
        if joins_left and joins_right:
            self._ends[left] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif joins_left:
            self._ends[left] = pos
        elif joins_right:
            self._starts[i] = pos
        else:
            self._starts.insert(i, pos)
            self._ends.insert(i, pos)
        self._absorb(successor)
        return True

    def acknowledge_cumulative(self, pos: Pos, successor: Successor = next_in_ledger) -> bool:
        """Acknowledge everything up to and including ``pos``; False if nothing changed."""
        pos = (int(pos[0]), int(pos[1]))
        if pos <= self.mark_delete:
            return False
        self.mark_delete = pos
        # Ranges wholly at or below pos go; one straddling pos is clipped.
        cut = bisect_right(self._ends, pos)
        del self._starts[:cut], self._ends[:cut]
        if self._starts and self._starts[0] <= pos:
            self._starts[0] = next_in_ledger(pos)
        if self.batch_acks:
            self.batch_acks = {p: b for p, b in self.batch_acks.items() if p > pos}
        self._absorb(successor)
        return True

    def reset(self, mark_delete: Pos) -> None:
        """Seek: everything after ``mark_delete`` becomes unacknowledged."""
        self.mark_delete = (int(mark_delete[0]), int(mark_delete[1]))
        self._starts.clear()
        self._ends.clear()
        self.batch_acks.clear()

    def set_batch_ack(self, pos: Pos, bits: bytes) -> None:
        """Record which batch indexes of an entry are acknowledged (set bit = acked)."""
        pos = (int(pos[0]), int(pos[1]))
        if not self.is_acked(pos):
            self.batch_acks[pos] = bytes(bits)

    def _absorb(self, successor: Successor) -> None:
        while self._starts and self._starts[0] == successor(self.mark_delete):
            self.mark_delete = self._ends[0]
            del self._starts[0], self._ends[0]
        if self.batch_acks and min(self.batch_acks) <= self.mark_delete:
            self.batch_acks = {p: b for p, b in self.batch_acks.items() if p > self.mark_delete}

    # --- invariants and serialisation ------------------------------------------------------

    def validate(self) -> None:
        """Raise AssertionError unless the ranges are sorted, disjoint, merged, in one
        ledger each, all above mark-delete, and batch acks only for unacked positions."""
        prev_end: Pos = self.mark_delete
        assert len(self._starts) == len(self._ends)
        for start, end in zip(self._starts, self._ends, strict=True):
            assert start <= end, (start, end)
            assert start[0] == end[0], f"range {start}..{end} spans ledgers"
            assert start > prev_end, f"range {start}..{end} overlaps {prev_end}"
            assert start != next_in_ledger(prev_end), f"range at {start} not merged"
            prev_end = end
        for pos in self.batch_acks:
            assert not self.is_acked(pos), f"batch ack kept for acked {pos}"

    def to_bytes(
        self,
        ranges_max: int | None = None,
        batch_max: int | None = None,
        bytes_max: int | None = None,
    ) -> bytes:
        """Serialise within bounds, so the value always fits a metadata record.

        The rule (what is kept when something must go): mark-delete always; then the
        individually acked ranges nearest mark-delete, at most ``ranges_max`` of them and
        as many as fit in ``bytes_max``; then the partially acked batch entries nearest
        mark-delete, at most ``batch_max``, while they fit. What is left out was
        acknowledged but is not remembered after a restart: those messages are
        redelivered (never the reverse: nothing unacknowledged is ever marked acked).
        ``bytes_max`` below the fixed header (25 bytes) still yields the header.

        Example:
            >>> state = AckState((1, -1))
            >>> for e in range(1, 20, 2):
            ...     _ = state.acknowledge((1, e))
            >>> len(state.to_bytes()), len(state.to_bytes(bytes_max=100))
            (265, 97)
            >>> AckState.from_bytes(state.to_bytes(bytes_max=100)).ranges
            [((1, 1), (1, 1)), ((1, 3), (1, 3)), ((1, 5), (1, 5))]
        """
        n = len(self._starts) if ranges_max is None else min(ranges_max, len(self._starts))
        budget = None if bytes_max is None else bytes_max - _HEAD.size
        if budget is not None:
            n = max(0, min(n, budget // _RANGE.size))
            budget -= n * _RANGE.size
        batch = sorted(self.batch_acks.items())
        if batch_max is not None:
            batch = batch[:batch_max]
        if budget is not None:
            fitting = []
            for pos, bits in batch:
                size = _BATCH.size + len(bits)
                if size > budget:
                    break
                fitting.append((pos, bits))
                budget -= size
            batch = fitting
        parts = [_HEAD.pack(_VERSION, *self.mark_delete, n, len(batch))]
        parts += [
            _RANGE.pack(s[0], s[1], e[1])
            for s, e in zip(self._starts[:n], self._ends[:n], strict=True)
        ]
        for pos, bits in batch:
            parts.append(_BATCH.pack(pos[0], pos[1], len(bits)))
            parts.append(bits)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> AckState:
        """Inverse of :meth:`to_bytes`; raises ValueError on malformed input."""
        try:
            version, md_l, md_e, n, m = _HEAD.unpack_from(data, 0)
            if version != _VERSION:
                raise ValueError(f"unknown ack state version {version}")
            state = cls((md_l, md_e))
            off = _HEAD.size
            for _ in range(n):
                ledger, a, b = _RANGE.unpack_from(data, off)
                off += _RANGE.size
                state._starts.append((ledger, a))
                state._ends.append((ledger, b))
            for _ in range(m):
                ledger, entry, size = _BATCH.unpack_from(data, off)
                off += _BATCH.size
                bits = data[off : off + size]
                if len(bits) != size:
                    raise ValueError("truncated batch ack")
                state.batch_acks[(ledger, entry)] = bits
                off += size
        except struct.error as err:
            raise ValueError(f"malformed ack state: {err}") from err
        if off != len(data):
            raise ValueError("trailing bytes after ack state")
        try:
            state.validate()
        except AssertionError as err:
            raise ValueError(f"invalid ack state: {err}") from err
        return state

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AckState):
            return NotImplemented
        return (self.mark_delete, self._starts, self._ends, self.batch_acks) == (
            other.mark_delete,
            other._starts,
            other._ends,
            other.batch_acks,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"AckState(mark_delete={self.mark_delete}, ranges={self.ranges})"
