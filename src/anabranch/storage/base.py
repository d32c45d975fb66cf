"""Ledger-list bookkeeping shared by the memory and file backends.

The base class owns what does not depend on where bytes live: the ordered ledger list
(:class:`LedgerInfo` per ledger), the last confirmed position, waking tailing readers,
position arithmetic across ledgers (``successor``, ``backlog``), reads that walk the
ledger list, cursors, trim selection (slowest cursor + retention) and the closed/fenced/
broken state. Backends supply appends, reading one ledger's entries, and persistence.

Example (what a backend implements):
    >>> class Backend(ManagedLedgerBase):
    ...     async def _read_ledger(self, info, first, count, max_bytes, at_least_one):
    ...         return []
"""

from __future__ import annotations

import asyncio
import dataclasses
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from anabranch import limits
from anabranch.clock import Clock
from anabranch.core.ack_state import AckState
from anabranch.core.retention import LedgerSpan, Retention, trimmable_ledgers
from anabranch.errors import Closed, InvalidArgument, StorageError
from anabranch.storage.api import (
    EARLIEST,
    LATEST,
    Entry,
    ManagedLedgerConfig,
    Position,
)
from anabranch.storage.cursor import ManagedCursor


@dataclass(slots=True)
class LedgerInfo:
    """One ledger of a managed ledger as the managed ledger sees it."""

    ledger_id: int
    entries: int = 0
    """Confirmed (durable) entries; ids 0..entries-1."""
    size: int = 0
    """Payload bytes of the confirmed entries."""
    closed_ms: int | None = None
    """Wall time the ledger was closed; None while it is the open, writable ledger."""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.ledger_id,
            "entries": self.entries,
            "size": self.size,
            "closedMs": self.closed_ms,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LedgerInfo:
        return cls(int(obj["id"]), int(obj["entries"]), int(obj["size"]), obj.get("closedMs"))


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 512:
        raise InvalidArgument(f"{kind} name must be a non-empty string of <= 512 chars: {name!r}")
    if any(ord(ch) < 0x20 for ch in name):
        raise InvalidArgument(f"{kind} name has a control character: {name!r}")
    return name


class ManagedLedgerBase:
    """Common state and logic; see the module docstring."""

    def __init__(self, name: str, config: ManagedLedgerConfig, clock: Clock) -> None:
        config.validate()
        self._name = check_name("managed ledger", name)
        self.config = config
        self.clock = clock
        self._ledgers: list[LedgerInfo] = []
        self._ids: list[int] = []
        self._last_confirmed = EARLIEST
        self._terminated_at: Position | None = None
        self._cursors: dict[str, ManagedCursor] = {}
        self._entries_event = asyncio.Event()
        self._closed = False
        self._failure: StorageError | None = None
        """Set once fenced or once the disk failed: every later append raises it."""
        self._meta_lock = asyncio.Lock()
        """Serialises metadata changes (rollover, trim, cursor persist, terminate)."""

    # --- ledger list --------------------------------------------------------------------------

    def _set_ledgers(self, ledgers: list[LedgerInfo]) -> None:
        self._ledgers = ledgers
        self._ids = [info.ledger_id for info in ledgers]
        self._last_confirmed = EARLIEST
        for info in reversed(ledgers):
            if info.entries:
                self._last_confirmed = Position(info.ledger_id, info.entries - 1)
                break

    def _entries_confirmed(self, info: LedgerInfo, count: int, size: int) -> None:
        """Record ``count`` new durable entries of ``info`` and wake readers."""
        info.entries += count
        info.size += size
        self._last_confirmed = Position(info.ledger_id, info.entries - 1)
        self._wake()

    def _wake(self) -> None:
        self._entries_event.set()
        self._entries_event = asyncio.Event()

    @property
    def name(self) -> str:
        return self._name

    @property
    def ledgers(self) -> list[LedgerInfo]:
        """A copy of the ledger list (for stats and tests)."""
        return [LedgerInfo(i.ledger_id, i.entries, i.size, i.closed_ms) for i in self._ledgers]

    @property
    def last_confirmed(self) -> Position:
        return self._last_confirmed

    @property
    def entry_count(self) -> int:
        return sum(info.entries for info in self._ledgers)

    @property
    def is_terminated(self) -> bool:
        return self._terminated_at is not None

    @property
    def terminated_at(self) -> Position | None:
        return self._terminated_at

    def check_open(self) -> None:
        if self._closed:
            raise Closed(f"managed ledger {self._name} is closed")
        if self._failure is not None:
            raise self._failure

    def successor(self, pos: tuple[int, int]) -> Position:
        """The position of the entry after ``pos`` (existing or next to be written)."""
        ledger_id, entry_id = pos
        i = bisect_left(self._ids, ledger_id)
        if i < len(self._ids) and self._ids[i] == ledger_id:
            if entry_id + 1 < self._ledgers[i].entries:
                return Position(ledger_id, entry_id + 1)
            if i == len(self._ids) - 1:
                return Position(ledger_id, max(entry_id + 1, 0))
            i += 1
        for info in self._ledgers[i:]:
            if info.entries:
                return Position(info.ledger_id, 0)
        if self._ledgers and self._ids[-1] > ledger_id:
            return Position(self._ids[-1], 0)
        return Position(ledger_id, entry_id + 1)

    def backlog(self, after: Position, upto: Position | None = None) -> int:
        upto = self._last_confirmed if upto is None else upto
        total = 0
        start = max(bisect_left(self._ids, after[0]), 0)
        for info in self._ledgers[start:]:
            lid = info.ledger_id
            if lid > upto[0]:
                break
            lo = after[1] + 1 if lid == after[0] else 0
            hi = info.entries - 1 if lid < upto[0] else min(info.entries - 1, upto[1])
            if hi >= lo:
                total += hi - lo + 1
        return total

    # --- reads ----------------------------------------------------------------------------------

    async def _read_ledger(
        self, info: LedgerInfo, first: int, count: int, max_bytes: int, at_least_one: bool
    ) -> list[bytes]:
        """Entries ``first..first+count-1`` of one ledger, stopping at ``max_bytes``."""
        raise NotImplementedError

    async def read(
        self,
        from_position: Position,
        max_entries: int = 100,
        max_bytes: int = limits.STORAGE_READ_BYTES_MAX,
    ) -> list[Entry]:
        self.check_readable()
        if max_entries <= 0 or max_bytes <= 0:
            raise InvalidArgument("max_entries and max_bytes must be positive")
        max_entries = min(max_entries, limits.STORAGE_READ_ENTRIES_MAX)
        max_bytes = min(max_bytes, limits.STORAGE_READ_BYTES_MAX)
        out: list[Entry] = []
        used = 0
        ledgers = list(self._ledgers)  # a rollover or trim during our awaits is harmless
        i = bisect_left([info.ledger_id for info in ledgers], from_position[0])
        first = max(from_position[1], 0)
        while i < len(ledgers) and len(out) < max_entries and used < max_bytes:
            info = ledgers[i]
            if info.ledger_id != from_position[0]:
                first = 0
            count = min(info.entries - first, max_entries - len(out))
            if count > 0:
                datas = await self._read_ledger(info, first, count, max_bytes - used, not out)
                for k, data in enumerate(datas):
                    out.append(Entry(Position(info.ledger_id, first + k), data))
                    used += len(data)
                if len(datas) < count:
                    break  # the byte budget ran out inside this ledger
            i += 1
        return out

    def check_readable(self) -> None:
        if self._closed:
            raise Closed(f"managed ledger {self._name} is closed")

    async def wait_for_entries(self, after: Position) -> None:
        while self._last_confirmed <= after and self._terminated_at is None:
            if self._closed or self._failure is not None:
                return
            await self._entries_event.wait()

    # --- cursors ----------------------------------------------------------------------------------

    def _restore_cursor(self, name: str, data: bytes) -> None:
        self._cursors[name] = ManagedCursor(self, name, AckState.from_bytes(data))

    async def open_cursor(self, name: str, initial_position: Position = LATEST) -> ManagedCursor:
        self.check_open()
        check_name("cursor", name)
        cursor = self._cursors.get(name)
        if cursor is not None:
            return cursor
        if initial_position == LATEST:
            md = self._last_confirmed
        elif initial_position == EARLIEST:
            md = EARLIEST
        else:
            md = Position(initial_position[0], initial_position[1] - 1)
        cursor = ManagedCursor(self, name, AckState(md))
        self._cursors[name] = cursor
        cursor._changed()
        await cursor.flush()  # a new subscription survives a restart from the start
        return cursor

    async def delete_cursor(self, name: str) -> None:
        self.check_open()
        cursor = self._cursors.pop(name, None)
        if cursor is not None:
            cursor.cancel_timers()
            await self._remove_cursor(name)

    def cursors(self) -> list[ManagedCursor]:
        return list(self._cursors.values())

    async def persist_cursor(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    async def _remove_cursor(self, name: str) -> None:
        raise NotImplementedError

    # --- trim ------------------------------------------------------------------------------------

    def set_retention(self, retention: Retention) -> None:
        """Apply a namespace's retention from now on (the broker's policy sweep calls it)."""
        self.config = dataclasses.replace(
            self.config, retention_ms=retention.time_ms, retention_bytes=retention.size_bytes
        )

    def _trimmable(self) -> list[LedgerInfo]:
        """Closed ledgers, oldest first, wholly below the slowest cursor and out of
        retention (the decision is :func:`anabranch.core.retention.trimmable_ledgers`)."""
        slowest = min((c.mark_delete_position for c in self._cursors.values()), default=None)
        spans = [LedgerSpan(i.ledger_id, i.entries, i.size, i.closed_ms) for i in self._ledgers]
        retention = Retention(self.config.retention_ms, self.config.retention_bytes)
        count = trimmable_ledgers(spans, slowest, retention, self.clock.wall_ms())
        return self._ledgers[:count]

    async def trim(self) -> int:
        self.check_open()
        async with self._meta_lock:
            doomed = self._trimmable()
            if not doomed:
                return 0
            remaining = self._ledgers[len(doomed) :]
            await self._commit_trim(doomed, remaining)
            self._set_ledgers(remaining)
            return len(doomed)

    async def _commit_trim(self, doomed: list[LedgerInfo], remaining: list[LedgerInfo]) -> None:
        raise NotImplementedError

    # --- lifecycle -------------------------------------------------------------------------------

    async def append(self, data: bytes) -> Position:
        raise NotImplementedError

    async def append_many(self, entries: Sequence[bytes]) -> list[Position]:
        raise NotImplementedError

    async def _flush_cursors(self) -> None:
        errors: list[BaseException] = []
        for cursor in list(self._cursors.values()):
            try:
                await cursor.close()
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]

    def _mark_closed(self) -> None:
        self._closed = True
        for cursor in self._cursors.values():
            cursor.cancel_timers()
        self._wake()
