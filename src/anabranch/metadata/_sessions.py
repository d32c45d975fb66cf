"""Session bookkeeping shared by the embedded backends (memory, SQLite).

Deadlines live in process memory and are read from the injected clock. A session
expires when a sweeper task (sleeping on the clock) or any operation that touches
the session sees its deadline pass; the backend's ``expire`` hook then deletes its
ephemeral keys. With a manual clock, ``clock.advance(ttl)`` followed by any store
call (or letting the loop run) expires it, deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from anabranch import limits
from anabranch.clock import Clock
from anabranch.errors import Closed, SessionExpired
from anabranch.supervisor import report_death

ExpireHook = Callable[[list[int]], Awaitable[None]]
"""Deletes the ephemeral keys of the given (already marked gone) sessions."""


class StoreSession:
    """A session handle of an embedded store (implements ``api.Session``).

    Example:
        >>> import asyncio
        >>> from anabranch.metadata.memory import MemoryMetadataStore
        >>> async def demo(store: MetadataStore) -> None:
        ...     session = await store.open_session(10.0)
        ...     await store.put("/live/me", b"", session=session)
        ...     await session.close()  # /live/me is deleted
        ...     print(await store.get("/live/me"))
        ...     await store.close()
        >>> asyncio.run(demo(MemoryMetadataStore()))
        None
    """

    def __init__(self, table: SessionTable, session_id: int, ttl_s: float) -> None:
        self._table = table
        self._id = session_id
        self._ttl_s = ttl_s
        self._gone = asyncio.Event()

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @property
    def expired(self) -> bool:
        return self._gone.is_set() or self._table.deadline_passed(self._id)

    async def keepalive(self) -> None:
        await self._table.keepalive(self._id)

    async def wait_expired(self) -> None:
        await self._gone.wait()

    async def close(self) -> None:
        await self._table.revoke(self._id)

    def _mark_gone(self) -> None:
        self._gone.set()


class SessionTable:
    """Live sessions, their deadlines, keepalive tasks and the expiry sweeper."""

    def __init__(self, clock: Clock, expire: ExpireHook) -> None:
        self._clock = clock
        self._expire = expire
        self._ttl_s: dict[int, float] = {}
        self._deadline_s: dict[int, float] = {}
        self._handles: dict[int, StoreSession] = {}
        self._keepalive_tasks: dict[int, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------

    def open(self, session_id: int, ttl_s: float, *, auto_keepalive: bool) -> StoreSession:
        """Start tracking a new session (its durable record, if any, exists already)."""
        handle = StoreSession(self, session_id, ttl_s)
        self._handles[session_id] = handle
        self.adopt(session_id, ttl_s)
        if auto_keepalive:
            task = asyncio.get_running_loop().create_task(
                self._keep_alive(session_id, ttl_s), name=f"session-keepalive-{session_id}"
            )
            task.add_done_callback(report_death)  # the session then expires by its deadline
            self._keepalive_tasks[session_id] = task
        return handle

    def adopt(self, session_id: int, ttl_s: float) -> None:
        """Track a session nobody holds a handle to (e.g. found on disk after a restart)."""
        self._ttl_s[session_id] = ttl_s
        self._deadline_s[session_id] = self._clock.monotonic() + ttl_s
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep(), name="session-sweeper"
            )
            # A dead sweeper is replaced by the next adopt; until then, log why it died.
            self._sweeper.add_done_callback(report_death)

    def close(self) -> None:
        """Forget every session without running the expire hook (the store is closing)."""
        self._closed = True
        for session_id in list(self._deadline_s):
            self._mark_gone(session_id)
        if self._sweeper is not None:
            self._sweeper.cancel()

    # --- queries and transitions ----------------------------------------------------------

    def deadline_passed(self, session_id: int) -> bool:
        deadline = self._deadline_s.get(session_id)
        return deadline is None or self._clock.monotonic() >= deadline

    def is_tracked(self, session_id: int) -> bool:
        return session_id in self._deadline_s

    async def require_alive(self, session_id: int) -> None:
        """Raise SessionExpired unless the session is live (expiring it if just due)."""
        if session_id not in self._deadline_s:
            raise SessionExpired(session_id)
        if self.deadline_passed(session_id):
            await self._expire_now([session_id])
            raise SessionExpired(session_id)

    async def keepalive(self, session_id: int) -> None:
        await self.require_alive(session_id)
        self._deadline_s[session_id] = self._clock.monotonic() + self._ttl_s[session_id]

    async def revoke(self, session_id: int) -> None:
        """Close a session now; idempotent."""
        if session_id in self._deadline_s:
            await self._expire_now([session_id])

    async def expire_due(self) -> None:
        """Expire every session whose deadline has passed."""
        now = self._clock.monotonic()
        due = [sid for sid, deadline in self._deadline_s.items() if now >= deadline]
        if due:
            await self._expire_now(due)

    # --- internals --------------------------------------------------------------------------

    async def _expire_now(self, session_ids: list[int]) -> None:
        # Untracked before the hook runs so nothing can refresh or re-expire them meanwhile;
        # handles are told only after the hook, so wait_expired() means "keys are gone".
        handles = [self._untrack(session_id) for session_id in session_ids]
        try:
            if not self._closed:
                await self._expire(session_ids)
        finally:
            for handle in handles:
                if handle is not None:
                    handle._mark_gone()

    def _mark_gone(self, session_id: int) -> None:
        handle = self._untrack(session_id)
        if handle is not None:
            handle._mark_gone()

    def _untrack(self, session_id: int) -> StoreSession | None:
        self._deadline_s.pop(session_id, None)
        self._ttl_s.pop(session_id, None)
        task = self._keepalive_tasks.pop(session_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        return self._handles.pop(session_id, None)

    async def _keep_alive(self, session_id: int, ttl_s: float) -> None:
        with contextlib.suppress(SessionExpired, Closed):
            while session_id in self._deadline_s:
                await self._clock.sleep(ttl_s / 3)
                await self.keepalive(session_id)

    async def _sweep(self) -> None:
        # Sleeping at most the minimum TTL means a session opened meanwhile can never have
        # a deadline before our next wake-up, so no wake-up signal is needed.
        with contextlib.suppress(Closed):
            while self._deadline_s and not self._closed:
                now = self._clock.monotonic()
                next_deadline = min(self._deadline_s.values())
                await self._clock.sleep(
                    max(0.0, min(next_deadline - now, limits.METADATA_SESSION_TTL_MIN_S))
                )
                await self.expire_due()
