"""The in-memory reference metadata store.

Every other backend must behave like this one (``tests/contract``). All state lives
in plain Python structures mutated synchronously on the event loop, so each
operation is atomic by construction; the ``async`` signatures only match the
protocol. Time comes from the injected clock: with
:class:`anabranch.testing.clock.ManualClock`, ``clock.advance(ttl)`` expires sessions
at the next store call (or when the loop runs the sweeper).

Example:
    >>> import asyncio
    >>> from anabranch.metadata.api import MUST_NOT_EXIST
    >>> async def demo() -> None:
    ...     store = MemoryMetadataStore()
    ...     stat = await store.put("/a", b"1", expected_version=MUST_NOT_EXIST)
    ...     assert (await store.get("/a")).stat == stat
    ...     print(stat)
    ...     await store.close()
    >>> asyncio.run(demo())
    Stat(version=1, create_revision=1, mod_revision=1, session_id=None)
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from anabranch import limits
from anabranch.clock import Clock, SystemClock
from anabranch.errors import Closed, Compacted, InvalidArgument
from anabranch.metadata._common import (
    check_condition,
    children_prefix,
    session_id_of,
    session_ids,
    validate_range,
    validate_revision,
    validate_sequential_prefix,
)
from anabranch.metadata._sessions import SessionTable, StoreSession
from anabranch.metadata._watch import QueueWatch, WatchHub
from anabranch.metadata.api import (
    Check,
    CommitResult,
    Delete,
    EventKind,
    Op,
    Page,
    Put,
    Record,
    Session,
    Stat,
    WatchEvent,
    prefix_end,
    sequential_name,
    validate_expected_version,
    validate_limit,
    validate_ops,
    validate_path,
    validate_prefix,
    validate_ttl,
    validate_value,
)

HISTORY_TRIM_REVISIONS = 1_024
"""History is trimmed in chunks this large so trimming a list stays amortised O(1)."""


@dataclass(slots=True)
class _Entry:
    value: bytes
    version: int
    create_revision: int
    mod_revision: int
    session_id: int | None

    def stat(self) -> Stat:
        return Stat(self.version, self.create_revision, self.mod_revision, self.session_id)


class MemoryMetadataStore:
    """The reference :class:`~anabranch.metadata.api.MetadataStore`, all in memory."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._entries: dict[str, _Entry] = {}
        self._keys: list[str] = []  # sorted: ordered listings by bisect
        self._revision = 0
        # History of committed revisions for watch replay: parallel lists, oldest first.
        self._history_revisions: list[int] = []
        self._history_events: list[list[WatchEvent]] = []
        self._compact_revision = 0  # history before this revision is gone
        self._ephemeral: dict[int, set[str]] = {}
        self._session_ids = itertools.count(1)
        self._sessions = SessionTable(self._clock, self._expire_sessions)
        self._hub = WatchHub()
        self._closed = False

    # --- reads ------------------------------------------------------------------------------

    async def get(self, path: str) -> Record | None:
        await self._enter()
        validate_path(path)
        entry = self._entries.get(path)
        return None if entry is None else Record(path, entry.value, entry.stat())

    async def list_range(self, start: str, end: str, *, limit: int | None = None) -> Page:
        await self._enter()
        validate_range(start, end)
        return self._page(start, end, validate_limit(limit))

    async def list_prefix(
        self, prefix: str, *, limit: int | None = None, start_after: str | None = None
    ) -> Page:
        await self._enter()
        validate_prefix(prefix)
        start = prefix if start_after is None else max(prefix, start_after + "\x00")
        return self._page(start, prefix_end(prefix), validate_limit(limit))

    async def list_children(self, path: str) -> list[str]:
        await self._enter()
        below = children_prefix(path)
        names: set[str] = set()
        index = bisect.bisect_left(self._keys, below)
        while index < len(self._keys) and self._keys[index].startswith(below):
            key = self._keys[index]
            name = key[len(below) :].split("/", 1)[0]
            names.add(name)
            # A child's own key is one step; its subtree is skipped in one jump. Siblings
            # like "b!" sort between "b" and "b/", so a name can come up twice: a set.
            if key == below + name:
                index += 1
            else:
                index = bisect.bisect_left(self._keys, prefix_end(below + name + "/"))
        return sorted(names)

    async def current_revision(self) -> int:
        await self._enter()
        return self._revision

    # --- writes -----------------------------------------------------------------------------

    async def put(
        self,
        path: str,
        value: bytes,
        expected_version: int | None = None,
        *,
        session: Session | None = None,
    ) -> Stat:
        validate_path(path)
        value = validate_value(value)
        validate_expected_version(expected_version)
        op = Put(path, value, expected_version, session_id_of(session))
        result = (await self._commit_checked([op])).results[0]
        assert isinstance(result, Stat)
        return result

    async def delete(self, path: str, expected_version: int | None = None) -> bool:
        validate_path(path)
        validate_expected_version(expected_version)
        result = (await self._commit_checked([Delete(path, expected_version)])).results[0]
        assert isinstance(result, bool)
        return result

    async def commit(self, ops: Sequence[Op]) -> CommitResult:
        await self._enter()
        return await self._commit_checked(validate_ops(ops))

    async def _commit_checked(self, checked: list[Op]) -> CommitResult:
        """Commit ops that were validated already (put/delete validate their own)."""
        await self._enter()
        for op in checked:
            entry = self._entries.get(op.path)
            check_condition(op, *(self._version_facts(entry)))
        for session_id in session_ids(checked):
            await self._sessions.require_alive(session_id)
        return self._apply(checked)

    async def create_sequential(
        self, prefix: str, value: bytes, *, session: Session | None = None
    ) -> str:
        validate_sequential_prefix(prefix)
        value = validate_value(value)
        # The number is the revision of the creating write: strictly increasing per prefix,
        # never reused after a delete, and what etcd would give too.
        await self._enter()
        path = sequential_name(prefix, self._revision + 1)
        await self._commit_checked([Put(path, value, 0, session_id_of(session))])
        return path

    async def compact(self, revision: int) -> None:
        """Forget history before ``revision``: watches from older revisions get Compacted."""
        await self._enter()
        validate_revision(revision, "compact revision")
        if revision > self._revision + 1:
            raise InvalidArgument(f"compact revision {revision} is past {self._revision}")
        self._compact_revision = max(self._compact_revision, revision)
        cut = bisect.bisect_left(self._history_revisions, self._compact_revision)
        del self._history_revisions[:cut]
        del self._history_events[:cut]

    # --- sessions and watches ---------------------------------------------------------------

    async def open_session(self, ttl_s: float, *, auto_keepalive: bool = True) -> StoreSession:
        await self._enter()
        ttl_s = validate_ttl(ttl_s)
        session_id = next(self._session_ids)
        self._ephemeral[session_id] = set()
        return self._sessions.open(session_id, ttl_s, auto_keepalive=auto_keepalive)

    def watch(
        self, path: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> QueueWatch:
        if self._closed:
            raise Closed("metadata store closed")
        if prefix:
            validate_prefix(path)
        else:
            validate_path(path)
        validate_revision(start_revision, "start_revision")
        return self._hub.open(
            path,
            prefix=prefix,
            start_revision=start_revision,
            published_revision=self._revision,
            replay=self._replay,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sessions.close()
        self._hub.close_all()

    # --- internals --------------------------------------------------------------------------

    async def _enter(self) -> None:
        """Every call starts here: refuse after close, expire sessions that are due."""
        if self._closed:
            raise Closed("metadata store closed")
        await self._sessions.expire_due()

    @staticmethod
    def _version_facts(entry: _Entry | None) -> tuple[int, int]:
        return (0, 0) if entry is None else (entry.version, entry.create_revision)

    def _page(self, start: str, end: str, limit: int) -> Page:
        low = bisect.bisect_left(self._keys, start)
        high = max(low, bisect.bisect_left(self._keys, end))
        keys = self._keys[low : min(high, low + limit)]
        records = [Record(k, self._entries[k].value, self._entries[k].stat()) for k in keys]
        return Page(records, more=high - low > limit, revision=self._revision)

    def _apply(self, ops: list[Op]) -> CommitResult:
        revision = self._revision + 1
        results: list[Stat | bool | None] = []
        events: list[WatchEvent] = []
        for op in ops:
            if isinstance(op, Put):
                stat = self._apply_put(op, revision)
                results.append(stat)
                events.append(WatchEvent(EventKind.PUT, op.path, op.value, stat.version, revision))
            elif isinstance(op, Delete):
                removed = self._remove(op.path)
                results.append(removed)
                if removed:
                    events.append(WatchEvent(EventKind.DELETE, op.path, b"", 0, revision))
            else:
                assert isinstance(op, Check)
                results.append(None)
        if events:
            self._record(revision, events)
        return CommitResult(self._revision, results)

    def _apply_put(self, op: Put, revision: int) -> Stat:
        old = self._entries.get(op.path)
        if old is None:
            bisect.insort(self._keys, op.path)
            entry = _Entry(op.value, 1, revision, revision, op.session_id)
        else:
            self._detach_ephemeral(op.path, old.session_id)
            entry = _Entry(op.value, old.version + 1, old.create_revision, revision, op.session_id)
        self._entries[op.path] = entry
        if op.session_id is not None:
            self._ephemeral.setdefault(op.session_id, set()).add(op.path)
        return entry.stat()

    def _remove(self, path: str) -> bool:
        entry = self._entries.pop(path, None)
        if entry is None:
            return False
        del self._keys[bisect.bisect_left(self._keys, path)]
        self._detach_ephemeral(path, entry.session_id)
        return True

    def _detach_ephemeral(self, path: str, session_id: int | None) -> None:
        if session_id is not None:
            self._ephemeral.get(session_id, set()).discard(path)

    def _record(self, revision: int, events: list[WatchEvent]) -> None:
        self._revision = revision
        self._history_revisions.append(revision)
        self._history_events.append(events)
        floor = revision - limits.METADATA_CHANGELOG_REVISIONS_MAX + 1
        if floor - self._compact_revision >= HISTORY_TRIM_REVISIONS:
            self._compact_revision = floor
            cut = bisect.bisect_left(self._history_revisions, floor)
            del self._history_revisions[:cut]
            del self._history_events[:cut]
        self._hub.publish(events)

    async def _expire_sessions(self, ids: list[int]) -> None:
        # All ephemeral keys of the expiring sessions go in one revision, like an etcd revoke.
        doomed = sorted(path for sid in ids for path in self._ephemeral.pop(sid, set()))
        if doomed and not self._closed:
            self._apply([Delete(path) for path in doomed])

    async def _replay(
        self, path: str, prefix: bool, from_rev: int, to_rev: int
    ) -> list[WatchEvent]:
        if from_rev < self._compact_revision:
            raise Compacted(from_rev, self._compact_revision)
        low = bisect.bisect_left(self._history_revisions, from_rev)
        high = bisect.bisect_right(self._history_revisions, to_rev)
        return [event for events in self._history_events[low:high] for event in events]
