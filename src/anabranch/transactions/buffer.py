"""The seam between a topic's dispatcher and transactions (DESIGN.md §5).

The dispatcher never reads past ``max_read_position()`` and skips entries for which
``is_aborted`` is true; producers append through ``append``. Until transactions land,
:class:`NoTransactionBuffer` makes every durable entry readable and nothing aborted, so
the dispatcher does not change when the metadata-driven buffer (PIP-473) replaces it.

Example:
    >>> import asyncio
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo() -> None:
    ...     ml = await MemoryManagedLedgerFactory().open("t")
    ...     buf = NoTransactionBuffer(ml)
    ...     pos = await buf.append(None, b"x")
    ...     assert buf.max_read_position() == pos and not buf.is_aborted(pos)
    ...     print(pos)
    >>> asyncio.run(demo())
    Position(ledger_id=1, entry_id=0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from anabranch.errors import TransactionCoordinatorNotFound
from anabranch.storage.api import ManagedLedger, Position
from anabranch.transactions.ids import TxnId


class TransactionBuffer(Protocol):
    """What a topic's readers and writers ask about transactional entries."""

    def max_read_position(self) -> Position:
        """The last position a dispatcher may deliver (before the oldest open txn)."""
        ...

    def is_aborted(self, position: Position) -> bool:
        """True when the entry at ``position`` belongs to an aborted transaction."""
        ...

    def open_count(self) -> int:
        """Transactions this topic takes part in that have not ended here yet."""
        ...

    async def append(self, txn_id: TxnId | None, data: bytes) -> Position:
        """Append an entry, transactional when ``txn_id`` is given."""
        ...

    async def append_many(self, txn_id: TxnId, entries: Sequence[bytes]) -> list[Position]:
        """Append entries of one transaction in order, with one group commit. After
        :meth:`prepare` of ``txn_id`` it calls the ledger before its first suspension (the
        topic relies on that to keep its appends in send order)."""
        ...

    async def prepare(self, txn_id: TxnId, role: str | None = None) -> None:
        """Join ``txn_id`` (whatever must be durable before its first entry); raises as
        ``append_many`` would, and TransactionNotFound when ``role`` may not write in it
        (``op_records.check_owner``; None: no check)."""
        ...

    async def prune_trimmed(self, first_valid: Position) -> int:
        """Forget the aborted transactions whose entries all lie before ``first_valid``
        (retention deleted their ledgers) and their durable records; returns how many."""
        ...

    async def close(self) -> None: ...


class NoTransactionBuffer:
    """Every durable entry is readable; transactional appends are refused."""

    def __init__(self, ledger: ManagedLedger) -> None:
        self._ledger = ledger

    def max_read_position(self) -> Position:
        return self._ledger.last_confirmed

    def is_aborted(self, position: Position) -> bool:
        return False

    def open_count(self) -> int:
        return 0

    async def append(self, txn_id: TxnId | None, data: bytes) -> Position:
        if txn_id is not None:
            raise TransactionCoordinatorNotFound("transactions are not enabled on this broker")
        return await self._ledger.append(data)

    async def append_many(self, txn_id: TxnId, entries: Sequence[bytes]) -> list[Position]:
        raise TransactionCoordinatorNotFound("transactions are not enabled on this broker")

    async def prepare(self, txn_id: TxnId, role: str | None = None) -> None:
        raise TransactionCoordinatorNotFound("transactions are not enabled on this broker")

    async def prune_trimmed(self, first_valid: Position) -> int:
        return 0

    async def close(self) -> None:
        return None
