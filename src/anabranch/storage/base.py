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
import logging
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.clock import Clock
from anabranch.core.ack_state import AckState
from anabranch.core.retention import LedgerSpan, Retention, trimmable_ledgers
from anabranch.errors import (
    Closed,
    InvalidArgument,
    LedgerFenced,
    NotAllowed,
    StorageError,
    StorageIOError,
)
from anabranch.storage.api import (
    EARLIEST,
    LATEST,
    Entry,
    ManagedLedgerConfig,
    Position,
)
from anabranch.storage.cursor import ManagedCursor

if TYPE_CHECKING:
    from anabranch.storage.tiered import TieredStorage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OffloadState:
    """Where a sealed ledger's offloaded copy lives (Pulsar's ``OffloadContext``): the
    object ``key`` in ``bucket`` (unique per offload attempt), when it completed, from
    when the hot copy may be deleted and whether it has been.

    >>> OffloadState.from_json(OffloadState("k", "b", 5, 10).to_json())
    OffloadState(key='k', bucket='b', offloaded_ms=5, delete_hot_after_ms=10, hot_deleted=False)
    """

    key: str
    bucket: str
    offloaded_ms: int
    delete_hot_after_ms: int
    hot_deleted: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "complete": True,
            "key": self.key,
            "bucket": self.bucket,
            "offloadedMs": self.offloaded_ms,
            "deleteHotAfterMs": self.delete_hot_after_ms,
            "hotDeleted": self.hot_deleted,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> OffloadState:
        return cls(
            str(obj["key"]),
            str(obj["bucket"]),
            int(obj["offloadedMs"]),
            int(obj["deleteHotAfterMs"]),
            bool(obj.get("hotDeleted", False)),
        )


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
    offload: OffloadState | None = None
    """Set once a complete copy is in the object store (tiered storage)."""

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.ledger_id,
            "entries": self.entries,
            "size": self.size,
            "closedMs": self.closed_ms,
        }
        if self.offload is not None:
            obj["offload"] = self.offload.to_json()
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LedgerInfo:
        offload = obj.get("offload")
        return cls(
            int(obj["id"]),
            int(obj["entries"]),
            int(obj["size"]),
            obj.get("closedMs"),
            OffloadState.from_json(offload) if offload else None,
        )

    @property
    def hot(self) -> bool:
        """The entries are still in the hot tier (local files / JetStream)."""
        return self.offload is None or not self.offload.hot_deleted


class _Superseded(Exception):
    """The ledger changed while its copy was uploaded (trimmed or offloaded already)."""


def trimmed_end(doomed: Sequence[LedgerInfo], before: Position | None) -> Position | None:
    """The last entry of ``doomed`` ledgers (oldest first) with entries, else ``before``.

    Example:
        >>> trimmed_end([LedgerInfo(3, 10), LedgerInfo(4, 0)], None)
        Position(ledger_id=3, entry_id=9)
        >>> trimmed_end([LedgerInfo(5, 0)], Position(3, 9))
        Position(ledger_id=3, entry_id=9)
    """
    for info in reversed(doomed):
        if info.entries:
            return Position(info.ledger_id, info.entries - 1)
    return before


def position_json(position: Position | None) -> list[int] | None:
    """A position for a JSON metadata record (None stays None)."""
    return list(position) if position is not None else None


def position_from_json(value: Any) -> Position | None:
    """The inverse of :func:`position_json` (a missing field reads as None)."""
    return Position(int(value[0]), int(value[1])) if value else None


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
        self._trimmed_to: Position | None = None
        """The last entry of the ledgers retention deleted (persisted with the ledger list):
        the topic's end never falls below it, even with no entry left."""
        self._terminated_at: Position | None = None
        self._cursors: dict[str, ManagedCursor] = {}
        self._entries_event = asyncio.Event()
        self._closed = False
        self._failure: StorageError | None = None
        """Set once fenced or once the disk failed: every later append raises it."""
        self._meta_lock = asyncio.Lock()
        """Serialises metadata changes (rollover, trim, cursor persist, terminate)."""
        self.tiered: TieredStorage | None = None
        """The object store offloaded ledgers live in (set by the factory when an offload
        driver is configured)."""

    # --- ledger list --------------------------------------------------------------------------

    def _set_ledgers(self, ledgers: list[LedgerInfo]) -> None:
        self._ledgers = ledgers
        self._ids = [info.ledger_id for info in ledgers]
        self._last_confirmed = EARLIEST
        for info in reversed(ledgers):
            if info.entries:
                self._last_confirmed = Position(info.ledger_id, info.entries - 1)
                return
        if self._trimmed_to is not None:
            # Retention deleted every ledger with entries: (newest, -1) still sorts after
            # every id handed out and before the next one (upstream's initLastConfirmedEntry);
            # EARLIEST would move the topic's end backwards.
            self._last_confirmed = (
                Position(ledgers[-1].ledger_id, -1) if ledgers else self._trimmed_to
            )

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
    def first_stored(self) -> Position:
        if self._trimmed_to is None or not self._ledgers:
            return EARLIEST
        return Position(self._ledgers[0].ledger_id, 0)

    @property
    def ledgers(self) -> list[LedgerInfo]:
        """A copy of the ledger list (for stats and tests)."""
        return [
            LedgerInfo(
                i.ledger_id,
                i.entries,
                i.size,
                i.closed_ms,
                dataclasses.replace(i.offload) if i.offload else None,
            )
            for i in self._ledgers
        ]

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
                try:
                    datas = await self._read_either(info, first, count, max_bytes - used, not out)
                except StorageError:
                    if not out:
                        raise
                    # A damaged later ledger must not hide the good entries before it: the
                    # caller gets those, and its next read, starting here, the error.
                    break
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
            before = self._trimmed_to
            self._trimmed_to = trimmed_end(doomed, before)
            try:
                await self._commit_trim(doomed, remaining)
            except BaseException:
                self._trimmed_to = before
                raise
            self._set_ledgers(remaining)
        for info in doomed:
            if info.offload is not None:
                await self._delete_offloaded_object(info.offload)
        return len(doomed)

    async def _commit_trim(self, doomed: list[LedgerInfo], remaining: list[LedgerInfo]) -> None:
        raise NotImplementedError

    # --- tiered storage ----------------------------------------------------------------------

    def _tiered(self) -> TieredStorage:
        if self.tiered is None:
            raise StorageIOError(
                f"{self._name}: a ledger is offloaded but no offload driver is configured"
            )
        return self.tiered

    async def _read_offloaded(
        self, info: LedgerInfo, first: int, count: int, max_bytes: int, at_least_one: bool
    ) -> list[bytes]:
        assert info.offload is not None
        return await self._tiered().read(
            info.offload, info.ledger_id, info.entries, first, count, max_bytes, at_least_one
        )

    async def _read_either(
        self, info: LedgerInfo, first: int, count: int, max_bytes: int, at_least_one: bool
    ) -> list[bytes]:
        """From the hot tier while the ledger is there, else from the object store; a hot
        read that fails because the hot copy was deleted under it is served cold."""
        if not info.hot:
            return await self._read_offloaded(info, first, count, max_bytes, at_least_one)
        try:
            return await self._read_ledger(info, first, count, max_bytes, at_least_one)
        except StorageError:
            if info.hot:
                raise
        return await self._read_offloaded(info, first, count, max_bytes, at_least_one)

    def _find(self, ledger_id: int) -> LedgerInfo | None:
        i = bisect_left(self._ids, ledger_id)
        if i < len(self._ids) and self._ids[i] == ledger_id:
            return self._ledgers[i]
        return None

    async def offload_ledger(self, ledger_id: int, deletion_lag_ms: int) -> bool:
        """Copy sealed ledger ``ledger_id`` to the object store and record it in the
        metadata; the hot copy stays until :meth:`delete_offloaded_hot`. False when there
        is nothing to do (already offloaded, empty, open, or trimmed meanwhile). On an
        object store error nothing changes here and the error propagates."""
        self.check_open()
        tiered = self._tiered()
        info = self._find(ledger_id)
        if info is None or info.closed_ms is None or info.offload is not None or not info.entries:
            return False
        payloads: list[bytes] = []
        while len(payloads) < info.entries:  # a backend may answer a long read in parts
            got = await self._read_ledger(
                info, len(payloads), info.entries - len(payloads), 2**62, True
            )
            if not got:
                raise StorageIOError(f"{self._name}: ledger {ledger_id} read short for offload")
            payloads += got
        key = await tiered.offload(self._name, ledger_id, payloads)
        now = self.clock.wall_ms()
        state = OffloadState(key, tiered.bucket, now, now + max(deletion_lag_ms, 0))
        try:
            async with self._meta_lock:
                self.check_open()
                info = self._find(ledger_id)
                if info is None or info.offload is not None:
                    raise _Superseded()
                info.offload = state
                try:
                    await self._persist_ledger_list()
                except BaseException:
                    info.offload = None
                    raise
        except _Superseded:
            await self._delete_offloaded_object(state)
            return False
        except LedgerFenced:  # the commit surely failed: nothing will ever point at it
            await self._delete_offloaded_object(state)
            raise
        # Any other failure may have committed (an unanswered metadata write): the object
        # stays, as an orphan at worst, never deleted under a record that points at it.
        return True

    async def delete_offloaded_hot(self, ledger_id: int) -> bool:
        """Drop the hot copy of an offloaded ledger (reads go to the object store from
        now on); the metadata is committed first, so a crash in between leaves only
        unreferenced files. False when the ledger is not offloaded or already cold."""
        self.check_open()
        async with self._meta_lock:
            info = self._find(ledger_id)
            if info is None or info.offload is None or info.offload.hot_deleted:
                return False
            info.offload.hot_deleted = True
            try:
                await self._persist_ledger_list()
            except BaseException:
                info.offload.hot_deleted = False
                raise
        await self._delete_hot_ledger(ledger_id)
        return True

    async def _delete_offloaded_object(self, state: OffloadState) -> None:
        if self.tiered is None:
            return
        try:
            await self.tiered.delete(state.key)
        except StorageError as err:  # an orphan object costs space, not correctness
            log.warning("%s: offloaded object not deleted: %s", self._name, err)

    async def _persist_ledger_list(self) -> None:
        """Write the ledger list (with its offload states) to the metadata store."""
        raise NotAllowed(f"{self._name}: this storage backend cannot offload")

    async def _delete_hot_ledger(self, ledger_id: int) -> None:
        """Remove one ledger's entries from the hot tier."""
        raise NotAllowed(f"{self._name}: this storage backend cannot offload")

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
