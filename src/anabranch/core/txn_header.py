"""A transaction's header as the pure rules see it: its state and clock facts.

The metadata encoding is ``transactions/records.py``; this module holds only the values, so
``core/`` never imports from the layers above it (DESIGN.md §2).

Example:
    >>> TxnHeader(state=TxnState.OPEN, created_at=1000, timeout_ms=500).deadline
    1500
    >>> TxnState.COMMITTED.final
    True
    >>> h = TxnHeader(TxnState.COMMITTED, 0, 10, winners=frozenset({"0-a"}))
    >>> h.committed("0-a"), h.committed("0-b"), h.committed(None)
    (True, False, False)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

U64_MAX = 2**64 - 1
"""The largest TxnID half on the wire (uint64)."""


class TxnState(enum.Enum):
    """A transaction's state in its header: OPEN, then COMMITTED or ABORTED for good."""

    OPEN = "OPEN"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"

    @property
    def final(self) -> bool:
        return self is not TxnState.OPEN


@dataclass(frozen=True, slots=True)
class TxnHeader:
    """The header of one transaction: its state and clock facts (ms since the epoch)."""

    state: TxnState
    created_at: int
    timeout_ms: int
    finalized_at: int | None = None
    owner: str | None = None
    winners: frozenset[str] | None = None
    """Set by a batch commit (COMMITTED only): the branches whose entries are committed;
    every other entry of the transaction (another branch, or none) counts as aborted.
    None: every entry is committed (an ordinary transaction)."""

    def committed(self, branch: str | None) -> bool:
        """Whether an entry of this (final) transaction tagged with ``branch`` (None: no
        branch) is committed."""
        if self.state is not TxnState.COMMITTED:
            return False
        return self.winners is None or (branch is not None and branch in self.winners)

    @property
    def deadline(self) -> int:
        """When an OPEN transaction times out (ms since the epoch)."""
        return self.created_at + self.timeout_ms
