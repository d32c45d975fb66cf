"""Transaction ids: (coordinator partition, per-partition counter), as on the wire.

Example:
    >>> TxnId(most_bits=0, least_bits=7)
    TxnId(most_bits=0, least_bits=7)
"""

from __future__ import annotations

from typing import NamedTuple


class TxnId(NamedTuple):
    """A transaction id; ``most_bits`` names the coordinator partition."""

    most_bits: int
    least_bits: int

    def __str__(self) -> str:
        return f"{self.most_bits}_{self.least_bits}"


BRANCH_PROPERTY = "__txn_branch"
"""The reserved message property naming a batch transaction's branch (the producer sets it,
the transaction buffer reads it)."""
