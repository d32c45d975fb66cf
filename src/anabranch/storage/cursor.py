"""The cursor shell shared by every backend: AckState in memory, persisted with throttling.

The decisions (what is acknowledged, what mark-delete becomes) are
:class:`anabranch.core.ack_state.AckState`; this class validates positions against the
ledger, counts backlog with the ledger list, and persists through the owning ledger
(``_persist_cursor``) at most every ``cursor_persist_interval_ms``, or now on ``flush()``.

Example:
    >>> import asyncio
    >>> from anabranch.storage.memory import MemoryManagedLedgerFactory
    >>> async def demo() -> None:
    ...     ml = await MemoryManagedLedgerFactory().open("t")
    ...     first, second = await ml.append(b"a"), await ml.append(b"b")
    ...     cursor = await ml.open_cursor("sub", EARLIEST)
    ...     await cursor.acknowledge([second])   # individually: ``first`` is still due
    ...     await cursor.flush()     # durable now rather than within the interval
    ...     print(cursor.backlog(), cursor.is_acknowledged(first))
    ...     await ml.close()
    >>> asyncio.run(demo())
    1 False
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

from anabranch import limits
from anabranch.core.ack_state import AckState
from anabranch.errors import InvalidArgument
from anabranch.storage.api import EARLIEST, LATEST, Position

if TYPE_CHECKING:
    from anabranch.storage.base import ManagedLedgerBase


class ManagedCursor:
    """A named cursor of one open managed ledger."""

    def __init__(self, ledger: ManagedLedgerBase, name: str, state: AckState) -> None:
        self._ledger = ledger
        self._name = name
        self._state = state
        self._dirty = False
        self._persist_timer: asyncio.TimerHandle | None = None
        self._persist_task: asyncio.Task[None] | None = None
        self._persist_error: BaseException | None = None
        self._lock = asyncio.Lock()

    @property
    def name(self) -> str:
        return self._name

    @property
    def state(self) -> AckState:
        """The underlying pure state (read-only use)."""
        return self._state

    @property
    def mark_delete_position(self) -> Position:
        return Position(*self._state.mark_delete)

    @property
    def read_position(self) -> Position:
        return self._ledger.successor(self.mark_delete_position)

    def is_acknowledged(self, position: Position) -> bool:
        return self._state.is_acked(position)

    def backlog(self) -> int:
        md = self.mark_delete_position
        last = self._ledger.last_confirmed
        if last <= md:
            return 0
        acked = self._state.acked_count(self._ledger.successor(md), last)
        return self._ledger.backlog(md, last) - acked

    def batch_ack_state(self, position: Position) -> bytes | None:
        return self._state.batch_acks.get(position)

    # --- mutations --------------------------------------------------------------------------

    def _check(self, position: Position) -> Position:
        self._ledger.check_open()
        if position > self._ledger.last_confirmed:
            raise InvalidArgument(
                f"cursor {self._name}: {position} is past the last confirmed entry "
                f"{self._ledger.last_confirmed}"
            )
        return Position(int(position[0]), int(position[1]))

    async def acknowledge_cumulative(self, position: Position) -> None:
        position = self._check(position)
        if self._state.acknowledge_cumulative(position, self._ledger.successor):
            self._changed()

    async def acknowledge(self, positions: Iterable[Position]) -> None:
        changed = False
        for raw in positions:
            position = self._check(raw)
            changed |= self._state.acknowledge(position, self._ledger.successor)
        if changed:
            self._changed()

    async def set_batch_ack_state(self, position: Position, bits: bytes) -> None:
        position = self._check(position)
        self._state.set_batch_ack(position, bits)
        self._changed()

    async def reset(self, position: Position) -> None:
        self._ledger.check_open()
        if position == EARLIEST:
            md = EARLIEST
        elif position == LATEST:
            md = self._ledger.last_confirmed
        else:
            # (L, -1) sorts after every entry of earlier ledgers and before (L, 0).
            md = Position(position[0], position[1] - 1)
        self._state.reset(md)
        self._changed()

    # --- persistence --------------------------------------------------------------------------

    def _changed(self) -> None:
        self._dirty = True
        if self._persist_timer is None and self._persist_task is None:
            delay = self._ledger.config.cursor_persist_interval_ms / 1000
            loop = asyncio.get_running_loop()
            self._persist_timer = loop.call_later(delay, self._persist_in_background)

    def _persist_in_background(self) -> None:
        self._persist_timer = None
        self._persist_task = asyncio.get_running_loop().create_task(self._background_flush())

    async def _background_flush(self) -> None:
        try:
            await self.flush()
        except Exception as err:  # surfaced by the next flush()/close(); never lost
            self._persist_error = err
        finally:
            self._persist_task = None

    def serialize(self) -> bytes:
        """The persisted value: bounded in count and in bytes (``CURSOR_STATE_BYTES_MAX``,
        under a metadata value's limit); see ``AckState.to_bytes`` for what is dropped."""
        return self._state.to_bytes(
            limits.CURSOR_ACK_RANGES_PERSIST_MAX,
            limits.CURSOR_BATCH_ACKS_PERSIST_MAX,
            limits.CURSOR_STATE_BYTES_MAX,
        )

    async def flush(self) -> None:
        """Persist now if anything changed since the last persist."""
        if self._persist_error is not None:
            err, self._persist_error = self._persist_error, None
            raise err
        async with self._lock:
            if not self._dirty:
                return
            self._dirty = False
            try:
                await self._ledger.persist_cursor(self._name, self.serialize())
            except BaseException:
                self._dirty = True
                raise

    def cancel_timers(self) -> None:
        if self._persist_timer is not None:
            self._persist_timer.cancel()
            self._persist_timer = None

    async def close(self) -> None:
        """Stop background persistence after a final flush."""
        self.cancel_timers()
        task = self._persist_task
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        await self.flush()
