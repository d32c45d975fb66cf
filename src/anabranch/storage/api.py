"""The managed-ledger interface (DESIGN.md §4): positions, entries, ledgers, cursors.

A managed ledger is an ordered list of ledgers; a ledger is an append-only sequence of
entries numbered from 0; a :class:`Position` is ``(ledger_id, entry_id)`` and positions
order as tuples. Ledger ids are allocated through the metadata store, so they are unique
cluster-wide and grow over time; a managed ledger opens a new ledger each time it is
opened (that is how a previous writer is fenced) and when the current one rolls over.

Three backends pass ``tests/contract/test_managed_ledger.py``: ``memory`` (the reference),
``ledger`` (local files + metadata store, group commit on a writer thread) and
``jetstream_ledger`` (NATS JetStream streams, R3, atomic batches; metadata store).

Example:
    >>> import asyncio
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo(factory: ManagedLedgerFactory) -> None:
    ...     ml = await factory.open("public/default/persistent/orders", ManagedLedgerConfig())
    ...     pos = await ml.append(b"hello")          # returns once durable
    ...     [entry] = await ml.read(pos, max_entries=10)
    ...     cursor = await ml.open_cursor("billing", EARLIEST)
    ...     await cursor.acknowledge_cumulative(entry.position)
    ...     assert cursor.backlog() == 0
    ...     print(entry)
    ...     await ml.close()
    ...     await factory.close()
    >>> asyncio.run(demo(MemoryManagedLedgerFactory()))
    Entry(position=Position(ledger_id=1, entry_id=0), data=b'hello')
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from anabranch import limits
from anabranch.core.retention import Retention
from anabranch.errors import InvalidArgument


class Position(NamedTuple):
    """Where an entry lives: ordered, hashable, and a plain tuple underneath.

    >>> Position(3, 0) > Position(2, 99)
    True
    >>> Position(3, 4).next()
    Position(ledger_id=3, entry_id=5)
    """

    ledger_id: int
    entry_id: int

    def next(self) -> Position:
        """The position just after this one in the same ledger (reads from it go on to
        the next ledger when this ledger has no such entry)."""
        return Position(self.ledger_id, self.entry_id + 1)


EARLIEST = Position(-1, -1)
"""Before every entry: a cursor opened here sees the whole retained ledger."""

LATEST = Position(2**63 - 1, 2**63 - 1)
"""After every entry: a cursor opened here sees only entries appended later."""


class Entry(NamedTuple):
    """One stored entry."""

    position: Position
    data: bytes


FsyncPolicy = Literal["always", "never"]


@dataclass(frozen=True, slots=True)
class ManagedLedgerConfig:
    """Per managed ledger settings; defaults follow Pulsar's broker.conf where it has one.

    ``retention_ms``/``retention_bytes``: consumed ledgers are kept while both are within
    bounds; -1 means unbounded (keep), 0 means delete once every cursor has passed.
    """

    fsync: FsyncPolicy = "always"
    ledger_entries_max: int = 50_000
    """Roll over to a new ledger after this many entries (managedLedgerMaxEntriesPerLedger)."""
    ledger_bytes_max: int = 256 * 1024 * 1024
    """Roll over after this many payload bytes (managedLedgerMaxSizePerLedgerMbytes)."""
    ledger_age_ms: int = 4 * 3600 * 1000
    """Roll over a non-empty ledger older than this (managedLedgerMaxLedgerRolloverTimeMinutes)."""
    retention_ms: int = 0
    retention_bytes: int = 0
    cursor_persist_interval_ms: int = 200
    """Cursor changes are persisted at most this often; ``Cursor.flush()`` forces."""

    def validate(self) -> None:
        if self.fsync not in ("always", "never"):
            raise InvalidArgument(f"fsync must be 'always' or 'never': {self.fsync!r}")
        if self.ledger_entries_max <= 0 or self.ledger_bytes_max <= 0 or self.ledger_age_ms <= 0:
            raise InvalidArgument("ledger rollover bounds must be positive")
        if self.retention_ms < -1 or self.retention_bytes < -1:
            raise InvalidArgument("retention must be -1 (unbounded) or >= 0")
        if self.cursor_persist_interval_ms < 0:
            raise InvalidArgument("cursor_persist_interval_ms must be >= 0")


class Cursor(Protocol):
    """A durable subscription position: mark-delete + individually acked ranges.

    Changes are applied in memory at once and persisted with throttling; ``flush()``
    persists now. A cursor of a fenced ledger fails ``flush`` with LedgerFenced.
    """

    @property
    def name(self) -> str: ...

    @property
    def mark_delete_position(self) -> Position:
        """Everything at or below this position is acknowledged."""
        ...

    @property
    def read_position(self) -> Position:
        """The first position after mark-delete (where a fresh dispatcher reads from)."""
        ...

    async def acknowledge_cumulative(self, position: Position) -> None: ...

    async def acknowledge(self, positions: Iterable[Position]) -> None:
        """Individual acks; positions at or below mark-delete are ignored."""
        ...

    def is_acknowledged(self, position: Position) -> bool: ...

    def backlog(self) -> int:
        """Unacknowledged entries from mark-delete up to the last confirmed entry."""
        ...

    async def reset(self, position: Position) -> None:
        """Seek: ``position`` and everything after it become unacknowledged."""
        ...

    def batch_ack_state(self, position: Position) -> bytes | None:
        """The partial batch-ack bitset of an entry (set bit = acked index), if any."""
        ...

    async def set_batch_ack_state(self, position: Position, bits: bytes) -> None:
        """Record a partial batch ack; persisted with the cursor."""
        ...

    async def flush(self) -> None:
        """Persist the current state now."""
        ...


class ManagedLedger(Protocol):
    """One topic's (or one segment's) durable log."""

    @property
    def name(self) -> str: ...

    @property
    def last_confirmed(self) -> Position:
        """The last durable entry, or ``EARLIEST`` when nothing was ever appended."""
        ...

    @property
    def entry_count(self) -> int:
        """Entries currently retained (all ledgers not trimmed)."""
        ...

    @property
    def first_stored(self) -> Position:
        """Where the oldest retained entry lies: retention deleted every entry before it
        (``EARLIEST`` when nothing is known to be gone)."""
        ...

    @property
    def is_terminated(self) -> bool: ...

    @property
    def terminated_at(self) -> Position | None:
        """The final position after ``terminate()`` (``EARLIEST`` if it sealed empty)."""
        ...

    async def append(self, data: bytes) -> Position:
        """Store one entry; returns once it is durable (group commit). Raises
        LedgerSealed, LedgerFenced, StorageIOError, Closed."""
        ...

    async def append_many(self, entries: Sequence[bytes]) -> list[Position]:
        """Store several entries in order, in one commit where possible."""
        ...

    async def read(
        self,
        from_position: Position,
        max_entries: int = 100,
        max_bytes: int = limits.STORAGE_READ_BYTES_MAX,
    ) -> list[Entry]:
        """Entries at or after ``from_position`` in order (at least one if any exists,
        even over ``max_bytes``); [] when there is nothing yet. CorruptRecord if a stored
        record fails its check."""
        ...

    async def wait_for_entries(self, after: Position) -> None:
        """Return once an entry past ``after`` exists, or the ledger is terminated/closed."""
        ...

    def backlog(self, after: Position, upto: Position | None = None) -> int:
        """Entries with ``after < position <= upto`` (``upto`` defaults to last confirmed)."""
        ...

    async def terminate(self) -> Position:
        """Seal: wait for in-flight appends, persist the end; later appends raise
        LedgerSealed. Returns the final position. Idempotent."""
        ...

    async def open_cursor(self, name: str, initial_position: Position = LATEST) -> Cursor:
        """The named cursor, created at EARLIEST or LATEST if new, else restored."""
        ...

    async def delete_cursor(self, name: str) -> None: ...

    def cursors(self) -> Sequence[Cursor]: ...

    async def roll_over_if_due(self) -> bool:
        """Close the current ledger and open a new one if it holds entries and is older
        than ``ledger_age_ms`` (an idle topic's data can then be trimmed); True if it
        rolled over."""
        ...

    def set_retention(self, retention: Retention) -> None:
        """Use these retention bounds from now on (a namespace policy changed)."""
        ...

    async def trim(self) -> int:
        """Delete closed ledgers wholly below the slowest cursor and out of retention;
        returns how many ledgers were deleted."""
        ...

    async def delete(self) -> None:
        """Remove the managed ledger, its ledgers, files, metadata and cursors."""
        ...

    async def close(self) -> None:
        """Flush cursors, wait for in-flight appends, release files. Idempotent."""
        ...


class ManagedLedgerFactory(Protocol):
    """Opens managed ledgers by name."""

    async def open(self, name: str, config: ManagedLedgerConfig | None = None) -> ManagedLedger:
        """Open for recovery: fences any previous writer of ``name``."""
        ...

    async def close(self) -> None: ...
