"""The seam between a subscription's acks and transactions (DESIGN.md §5).

Every ack goes through a ``PendingAckStore``. A transactional ack is held pending until
its transaction commits (then applied to the cursor) or aborts (then dropped, and the
messages become redeliverable). :class:`NoPendingAckStore` applies plain acks to the
cursor directly and refuses transactional ones, so subscriptions do not change when the
metadata-driven store (PIP-473) replaces it.

Example:
    >>> import asyncio
    >>> from anabranch.storage.api import EARLIEST
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo() -> None:
    ...     ml = await MemoryManagedLedgerFactory().open("t")
    ...     pos = await ml.append(b"x")
    ...     cursor = await ml.open_cursor("sub", EARLIEST)
    ...     store = NoPendingAckStore(cursor)
    ...     await store.acknowledge(None, [pos], cumulative=False)
    ...     assert not store.is_pending(pos)
    ...     print(cursor.is_acknowledged(pos), cursor.backlog())
    >>> asyncio.run(demo())
    True 0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from anabranch.errors import TransactionConflict, TransactionCoordinatorNotFound
from anabranch.storage.api import Cursor, Position
from anabranch.transactions.ids import TxnId


class PendingAckStore(Protocol):
    """Where a subscription's acknowledgements go."""

    async def acknowledge(
        self,
        txn_id: TxnId | None,
        positions: Sequence[Position],
        *,
        cumulative: bool,
        role: str | None = None,
    ) -> None:
        """Ack now (``txn_id`` None) or hold the ack pending until ``txn_id`` ends;
        TransactionNotFound when ``role`` may not ack in it (``op_records.check_owner``;
        None: no check)."""
        ...

    def is_pending(self, position: Position) -> bool:
        """True when a transaction holds an ack of ``position`` (not redelivered)."""
        ...

    def open_count(self) -> int:
        """Transactions holding acks here that have not ended yet."""
        ...

    async def close(self) -> None: ...


class NoPendingAckStore:
    """Acks go straight to the cursor; transactional acks are refused."""

    def __init__(self, cursor: Cursor, *, durable: bool = True) -> None:
        self._cursor = cursor
        self._durable = durable

    async def acknowledge(
        self,
        txn_id: TxnId | None,
        positions: Sequence[Position],
        *,
        cumulative: bool,
        role: str | None = None,
    ) -> None:
        if txn_id is not None:
            if not self._durable:
                # A reader's position dies with its connection: nothing to commit to.
                raise TransactionConflict("a non-durable subscription cannot ack in a transaction")
            raise TransactionCoordinatorNotFound("transactions are not enabled on this broker")
        if cumulative:
            if positions:
                await self._cursor.acknowledge_cumulative(max(positions))
        else:
            await self._cursor.acknowledge(positions)

    def is_pending(self, position: Position) -> bool:
        return False

    def open_count(self) -> int:
        return 0

    async def close(self) -> None:
        return None
