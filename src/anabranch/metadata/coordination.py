"""Leader election over any :class:`~anabranch.metadata.api.MetadataStore`.

Being elected is not proof of the right to write (see Pulsar's ``LeaderElection``):
a paused leader can wake up after its session expired and someone else was elected.
So the leader fences: the leader key's ``create_revision`` is its fencing token, and
the leader adds :meth:`Leadership.guard` (a Check on that create revision) to every
commit it makes. A deposed leader's commit then fails with BadVersion, because a
re-created leader key always has a new create revision.

Example:
    >>> import asyncio
    >>> from anabranch.metadata.api import Put
    >>> from anabranch.metadata.memory import MemoryMetadataStore
    >>> async def demo(store: MetadataStore) -> None:
    ...     session = await store.open_session(10.0)
    ...     election = LeaderElection(store, "/topics/t/ns/orders/controller", b"broker-1", session)
    ...     leadership = await election.campaign()
    ...     await store.commit([leadership.guard(), Put("/topics/t/ns/orders", b"{...}")])
    ...     print(await election.leader())
    ...     await leadership.resign()
    ...     print(await election.leader())
    ...     await session.close()
    ...     await store.close()
    >>> asyncio.run(demo(MemoryMetadataStore()))
    b'broker-1'
    None
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from anabranch.errors import BadVersion, Closed, Compacted, SessionExpired
from anabranch.metadata.api import (
    MUST_NOT_EXIST,
    Check,
    Delete,
    EventKind,
    MetadataStore,
    Record,
    Session,
    validate_path,
    validate_value,
)


class LeaderElection:
    """Contend for ``path`` with ``value``, holding the key with ``session``."""

    def __init__(self, store: MetadataStore, path: str, value: bytes, session: Session) -> None:
        self._store = store
        self._path = validate_path(path)
        self._value = validate_value(value)
        self._session = session

    @property
    def path(self) -> str:
        return self._path

    async def leader(self) -> bytes | None:
        """The current leader's value, or None when there is no leader."""
        record = await self._store.get(self._path)
        return None if record is None else record.value

    async def campaign(self) -> Leadership:
        """Wait until elected; raises SessionExpired if our session ends first."""
        while True:
            if self._session.expired:
                # Checked here too: while another leader holds the key, our put fails its
                # condition before the store ever looks at our session.
                raise SessionExpired(self._session.id)
            try:
                stat = await self._store.put(
                    self._path, self._value, MUST_NOT_EXIST, session=self._session
                )
            except BadVersion:
                record = await self._store.get(self._path)
                if record is not None:
                    await self._wait_deleted(record)
                continue
            return Leadership(self._store, self._path, self._session, stat.create_revision)

    async def _wait_deleted(self, record: Record) -> None:
        """Return once the leader key we saw is gone (or our session is)."""
        watch = self._store.watch(self._path, start_revision=record.stat.mod_revision + 1)
        session_gone = asyncio.ensure_future(self._session.wait_expired())
        next_event: asyncio.Future[Any] | None = None
        try:
            while True:
                next_event = asyncio.ensure_future(watch.__anext__())
                done, _ = await asyncio.wait(
                    {next_event, session_gone}, return_when=asyncio.FIRST_COMPLETED
                )
                if next_event not in done:
                    next_event.cancel()
                    return  # the put on retry raises SessionExpired
                try:
                    event = next_event.result()
                except (Compacted, StopAsyncIteration):
                    return  # history is gone: re-read the key instead
                if event.kind is EventKind.DELETE:
                    return
        finally:
            session_gone.cancel()
            # Cancelled while waiting (the broker stopping), the pending read would end
            # with the watch's close below and its StopAsyncIteration be logged as never
            # retrieved.
            if next_event is not None:
                next_event.cancel()
            await watch.close()
            if next_event is not None:
                await asyncio.gather(next_event, return_exceptions=True)


class Leadership:
    """Proof of having been elected, with its fencing token."""

    def __init__(self, store: MetadataStore, path: str, session: Session, token: int) -> None:
        self._store = store
        self._path = path
        self._session = session
        self.fencing_token = token
        """The leader key's create revision: unique to this term of leadership."""
        self._lost = asyncio.get_running_loop().create_future()
        self._monitor = asyncio.ensure_future(self._watch_for_loss())

    @property
    def is_lost(self) -> bool:
        return self._lost.done()

    def guard(self) -> Check:
        """The Check a leader adds to its commits: fails once it is no longer leader.

        >>> import asyncio
        >>> from anabranch.metadata.api import Put
        >>> from anabranch.metadata.memory import MemoryMetadataStore
        >>> async def demo(store: MetadataStore) -> None:
        ...     session = await store.open_session(10.0)
        ...     leadership = await LeaderElection(store, "/leader", b"me", session).campaign()
        ...     await store.commit([leadership.guard(), Put("/layout", b"v1")])
        ...     await store.delete("/leader")        # deposed (say, its session expired)
        ...     await leadership.lost()
        ...     try:
        ...         await store.commit([leadership.guard(), Put("/layout", b"v2")])
        ...     except BadVersion:
        ...         print((await store.get("/layout")).value)
        ...     await session.close()
        ...     await store.close()
        >>> asyncio.run(demo(MemoryMetadataStore()))
        b'v1'
        """
        return Check(self._path, expected_create_revision=self.fencing_token)

    async def lost(self) -> None:
        """Return once leadership is gone: key deleted or overwritten, or session expired."""
        await asyncio.shield(self._lost)

    async def resign(self) -> None:
        """Step down (deleting the leader key if it is still ours). Idempotent."""
        with contextlib.suppress(BadVersion):
            await self._store.commit([self.guard(), Delete(self._path)])
        self._mark_lost()

    async def _watch_for_loss(self) -> None:
        try:
            watch = self._store.watch(self._path, start_revision=self.fencing_token + 1)
        except Closed:
            # The store closed before this task first ran: the term is over.
            self._mark_lost()
            return
        session_gone = asyncio.ensure_future(self._session.wait_expired())
        next_event = asyncio.ensure_future(watch.__anext__())
        try:
            # Any change after our create is someone else's (we never rewrite the key):
            # a delete, an expiry, or an overwrite all end this term.
            await asyncio.wait({next_event, session_gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (next_event, session_gone):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await watch.close()
            self._mark_lost()

    def _mark_lost(self) -> None:
        if not self._lost.done():
            self._lost.set_result(None)
        if self._monitor is not asyncio.current_task():
            self._monitor.cancel()
