"""The in-memory reference managed ledger: same contract as the file backend, no I/O.

The factory plays the role of the disk and the metadata store: reopening a name through
the same factory sees everything appended and every cursor persisted, and fences the
previous :class:`MemoryManagedLedger` of that name (its appends raise LedgerFenced).

Example:
    >>> import asyncio
    >>> async def demo() -> Position:
    ...     factory = MemoryManagedLedgerFactory()
    ...     ml = await factory.open("t")
    ...     return await ml.append(b"x")
    >>> asyncio.run(demo())
    Position(ledger_id=1, entry_id=0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from anabranch import limits
from anabranch.clock import Clock, SystemClock
from anabranch.errors import Closed, LedgerFenced, LedgerSealed, ValueTooLarge
from anabranch.storage.api import EARLIEST, ManagedLedgerConfig, Position
from anabranch.storage.base import LedgerInfo, ManagedLedgerBase


@dataclass
class _Stored:
    """What survives a reopen."""

    ledgers: list[LedgerInfo] = field(default_factory=list)
    data: dict[int, list[bytes]] = field(default_factory=dict)
    cursors: dict[str, bytes] = field(default_factory=dict)
    terminated_at: Position | None = None
    trimmed_to: Position | None = None
    owner: MemoryManagedLedger | None = None


class MemoryManagedLedger(ManagedLedgerBase):
    """One open managed ledger of a :class:`MemoryManagedLedgerFactory`."""

    def __init__(
        self, factory: MemoryManagedLedgerFactory, name: str, config: ManagedLedgerConfig
    ) -> None:
        super().__init__(name, config, factory.clock)
        self._factory = factory
        self._stored = factory._stored[name]
        self._ledger_created = factory.clock.monotonic()

    def _take_over(self) -> None:
        stored = self._stored
        previous = stored.owner
        if previous is not None and not previous._closed:
            previous._failure = LedgerFenced(f"{self.name} was opened by another owner")
        stored.owner = self
        if stored.ledgers and stored.ledgers[-1].closed_ms is None:
            last = stored.ledgers[-1]
            last.closed_ms = self.clock.wall_ms()
            if last.entries == 0:  # an empty ledger is dropped, as the file backend does
                stored.ledgers.pop()
                stored.data.pop(last.ledger_id, None)
        self._terminated_at = stored.terminated_at
        self._trimmed_to = stored.trimmed_to
        if stored.terminated_at is None:
            self._new_ledger()
        self._set_ledgers(stored.ledgers)
        for name, data in stored.cursors.items():
            self._restore_cursor(name, data)

    def _new_ledger(self) -> None:
        ledger_id = self._factory._allocate_ledger_id()
        self._stored.ledgers.append(LedgerInfo(ledger_id))
        self._stored.data[ledger_id] = []
        self._ids.append(ledger_id)
        self._ledger_created = self.clock.monotonic()

    def _check_appendable(self) -> None:
        self.check_open()
        if self._terminated_at is not None:
            raise LedgerSealed(f"managed ledger {self.name} is terminated")

    async def roll_over_if_due(self) -> bool:
        """Roll an idle, non-empty ledger over once it is older than ``ledger_age_ms``."""
        if self._closed or self._terminated_at is not None or not self._ledgers:
            return False
        current = self._ledgers[-1]
        self._maybe_rollover()
        return self._ledgers[-1] is not current

    def _maybe_rollover(self) -> None:
        current = self._ledgers[-1]
        age_ms = (self.clock.monotonic() - self._ledger_created) * 1000
        if (
            current.entries >= self.config.ledger_entries_max
            or current.size >= self.config.ledger_bytes_max
            or (current.entries and age_ms >= self.config.ledger_age_ms)
        ):
            current.closed_ms = self.clock.wall_ms()
            self._new_ledger()

    async def append(self, data: bytes) -> Position:
        [position] = await self.append_many([data])
        return position

    async def append_many(self, entries: Sequence[bytes]) -> list[Position]:
        self._check_appendable()
        out: list[Position] = []
        for data in entries:
            if len(data) > limits.STORAGE_RECORD_BYTES_MAX:
                raise ValueTooLarge("entry", len(data), limits.STORAGE_RECORD_BYTES_MAX)
        for data in entries:
            self._maybe_rollover()
            current = self._ledgers[-1]
            self._stored.data[current.ledger_id].append(bytes(data))
            self._entries_confirmed(current, 1, len(data))
            out.append(self._last_confirmed)
        return out

    async def _read_ledger(
        self, info: LedgerInfo, first: int, count: int, max_bytes: int, at_least_one: bool
    ) -> list[bytes]:
        stored = self._stored.data[info.ledger_id]
        out: list[bytes] = []
        used = 0
        for data in stored[first : first + count]:
            if (out or not at_least_one) and used + len(data) > max_bytes:
                break
            out.append(data)
            used += len(data)
        return out

    async def persist_cursor(self, name: str, data: bytes) -> None:
        self._check_owner()
        if name in self._cursors:
            self._stored.cursors[name] = data

    async def _remove_cursor(self, name: str) -> None:
        self._check_owner()
        self._stored.cursors.pop(name, None)

    def _check_owner(self) -> None:
        if self._stored.owner is not self or self._factory._stored.get(self.name) is not (
            self._stored
        ):
            raise LedgerFenced(f"{self.name} was opened by another owner")

    async def _commit_trim(self, doomed: list[LedgerInfo], remaining: list[LedgerInfo]) -> None:
        self._check_owner()
        self._stored.ledgers = remaining
        self._stored.trimmed_to = self._trimmed_to
        for info in doomed:
            self._stored.data.pop(info.ledger_id, None)

    async def terminate(self) -> Position:
        if self._terminated_at is not None:
            return self._terminated_at
        self.check_open()
        self._check_owner()
        async with self._meta_lock:
            if self._ledgers and self._ledgers[-1].closed_ms is None:
                self._ledgers[-1].closed_ms = self.clock.wall_ms()
            end = self._last_confirmed if self._last_confirmed != EARLIEST else EARLIEST
            self._stored.terminated_at = self._terminated_at = end
        self._wake()
        return end

    async def delete(self) -> None:
        self.check_open()
        self._check_owner()
        self._factory._stored.pop(self.name, None)
        self._mark_closed()

    async def close(self) -> None:
        if self._closed:
            return
        try:
            if self._failure is None:
                await self._flush_cursors()
        finally:
            self._mark_closed()


class MemoryManagedLedgerFactory:
    """Opens :class:`MemoryManagedLedger` instances; holds their "durable" state."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self._stored: dict[str, _Stored] = {}
        self._next_ledger_id = 1
        self._closed = False

    def _allocate_ledger_id(self) -> int:
        ledger_id = self._next_ledger_id
        self._next_ledger_id += 1
        return ledger_id

    async def open(
        self, name: str, config: ManagedLedgerConfig | None = None
    ) -> MemoryManagedLedger:
        if self._closed:
            raise Closed("managed ledger factory is closed")
        self._stored.setdefault(name, _Stored())
        ml = MemoryManagedLedger(self, name, config or ManagedLedgerConfig())
        ml._take_over()
        return ml

    async def close(self) -> None:
        for stored in self._stored.values():
            if stored.owner is not None:
                await stored.owner.close()
        self._closed = True
