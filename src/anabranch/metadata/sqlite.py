"""The embedded, durable metadata store: stdlib ``sqlite3`` in WAL mode.

Theory of operation:

* **One writer thread, group commit.** Writes go to a queue (callers wait for room
  past ``limits.METADATA_WRITE_QUEUE_MAX``). The writer takes everything queued, up
  to ``limits.METADATA_GROUP_COMMIT_OPS_MAX`` requests, and applies them in one
  ``BEGIN IMMEDIATE ... COMMIT``. A failed compare-and-set affects only itself: a
  commit checks every condition before it stages any write, and its staged writes join
  the batch only once it succeeded; the other writes (sessions, compaction) each run in
  their own SAVEPOINT. Each caller's future resolves only after the COMMIT (with
  ``synchronous=FULL``, after the fsync), so an acknowledged write survives a crash.
  Writes are staged and written with a few multi-row statements per batch: each
  statement step is a GIL hand-off between the writer and the loop (``executemany``
  steps once per row), the real cost in CPython (research
  measured 46k-61k CAS/s with group commit versus ~2k one at a time,
  ``research/ecosystem.md`` §2.3; ``benchmarks/metadata_cas.py`` measures ours).
* **Reads on a reader thread** with their own connection: WAL readers never block
  the writer, and nothing blocks the event loop. Listings read the revision and the
  rows in one read transaction, so ``Page.revision`` matches the records.
* **Revisions and watches.** ``meta.rev`` is the store revision; every changed key
  of a revision is a ``changelog(rev, idx)`` row. After a COMMIT the writer hands the
  batch to the loop, which resolves the callers and publishes the events to watchers
  in the same callback (so no one runs before both are done). A watch from a past
  revision replays the changelog. The changelog keeps
  ``limits.METADATA_CHANGELOG_REVISIONS_MAX`` revisions; older ones are compacted.
* **Sessions** are rows ``(id, ttl)``; deadlines live in this process. On restart,
  sessions left by the previous process get a fresh deadline of one TTL and expire
  (deleting their ephemeral keys) unless someone keeps them alive - nobody can,
  since their handles died with that process, so their keys outlive a crash by at
  most one TTL, like an etcd lease across a leader change.

Example:
    >>> import tempfile
    >>> from anabranch.metadata.api import MUST_NOT_EXIST
    >>> async def demo(tmp: Path) -> None:
    ...     store = await SqliteMetadataStore.open(tmp / "meta.db")
    ...     await store.put("/a", b"1", expected_version=MUST_NOT_EXIST)
    ...     await store.close()
    ...     store = await SqliteMetadataStore.open(tmp / "meta.db")   # it survived
    ...     print((await store.get("/a")).value)
    ...     await store.close()
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     asyncio.run(demo(Path(tmp)))
    b'1'
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from anabranch import limits
from anabranch.clock import Clock, SystemClock
from anabranch.errors import (
    Closed,
    Compacted,
    InvalidArgument,
    MetadataError,
    MetadataUnavailable,
    SessionExpired,
)
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

T = TypeVar("T")

SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")

AUTO_COMPACT_SLACK_REVISIONS = 1_024
"""The changelog is trimmed once it is this many revisions over its bound, not on every write."""

BUSY_TIMEOUT_MS = 5_000
"""Another process holding the database (e.g. a backup) is waited for this long."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv(
    key TEXT PRIMARY KEY, value BLOB NOT NULL, version INTEGER NOT NULL,
    create_rev INTEGER NOT NULL, mod_rev INTEGER NOT NULL, session INTEGER
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_session ON kv(session) WHERE session IS NOT NULL;
CREATE TABLE IF NOT EXISTS meta(
    id INTEGER PRIMARY KEY CHECK (id = 0), rev INTEGER NOT NULL, compact_rev INTEGER NOT NULL
);
INSERT OR IGNORE INTO meta VALUES (0, 0, 0);
CREATE TABLE IF NOT EXISTS changelog(
    rev INTEGER NOT NULL, idx INTEGER NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,
    kind INTEGER NOT NULL, version INTEGER NOT NULL, PRIMARY KEY (rev, idx)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sessions(id INTEGER PRIMARY KEY, ttl REAL NOT NULL);
"""

_PREFETCH_KEYS_MAX = 500
"""Keys per prefetch statement (well under SQLite's bound on parameters)."""

_ROWS_PER_STATEMENT = 100
"""Rows per multi-row INSERT (600 parameters) or DELETE: under SQLite's historical bound
of 999 parameters, so any build takes them."""

_ROW_MARKS = "(?, ?, ?, ?, ?, ?)"
"""One row of ``kv`` or ``changelog`` (both have six columns)."""

_KIND_CODES = {EventKind.PUT: 0, EventKind.DELETE: 1}
_CODE_KINDS = {code: kind for kind, code in _KIND_CODES.items()}
_RECORD_COLUMNS = "key, value, version, create_rev, mod_rev, session"


def _chunks(rows: Sequence[T]) -> Iterator[Sequence[T]]:
    """``rows`` in slices of at most ``_ROWS_PER_STATEMENT``."""
    for start in range(0, len(rows), _ROWS_PER_STATEMENT):
        yield rows[start : start + _ROWS_PER_STATEMENT]


def _connect(path: Path, synchronous: str) -> sqlite3.Connection:
    # Autocommit mode: transactions are explicit BEGIN/COMMIT, never implicit.
    # A multi-row statement's text depends on its row count: room for every count of
    # both tables and the deletes, so the writer never prepares one twice.
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, cached_statements=512
    )
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    except BaseException:
        conn.close()  # a file that is no database: do not leak the descriptor
        raise
    return conn


def _record(row: tuple[Any, ...]) -> Record:
    key, value, version, create_rev, mod_rev, session = row
    return Record(key, bytes(value), Stat(version, create_rev, mod_rev, session))


def _event(row: tuple[Any, ...]) -> WatchEvent:
    rev, key, value, kind, version = row
    return WatchEvent(_CODE_KINDS[kind], key, bytes(value), version, rev)


# --- the writer ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Request:
    """One write for the writer thread, applied there by ``apply(request)``.

    ``staged`` requests (commits) only read the database and stage their writes, which
    join the batch only if the whole request succeeded; others run in a SAVEPOINT.
    """

    apply: Callable[[_Request], object]
    future: asyncio.Future[object]
    staged: bool = True
    paths: tuple[str, ...] = ()
    """Keys whose facts ``apply`` will read: looked up with the batch's others at once."""
    events: list[WatchEvent] = field(default_factory=list)
    outcome: object = None
    error: BaseException | None = None


_STOP = object()

_Row = tuple[str, bytes, int, int, int, int | None]
"""A kv row: key, value, version, create_rev, mod_rev, session."""


class _Writer:
    """The writer thread: drains the queue, one transaction per batch.

    Writes of a batch are staged in memory (``_staged_rows``/``_staged_log``) and written
    with a multi-row statement per table (and 100 rows) just before COMMIT: every
    statement step is a GIL round trip between this thread and the event loop, so fewer
    steps is what makes group commit fast in CPython. Reads consult the staging first, so
    later requests of a batch see the writes of earlier ones.
    """

    def __init__(self, conn: sqlite3.Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self._loop = loop
        self._queue: queue.SimpleQueue[_Request | object] = queue.SimpleQueue()
        self.revision, self.compact_revision = conn.execute(
            "SELECT rev, compact_rev FROM meta"
        ).fetchone()
        self._staged_rows: dict[str, _Row | None] = {}  # None: deleted
        self._staged_log: list[tuple[int, int, str, bytes, int, int]] = []
        self._prefetched: dict[str, tuple[int, int]] = {}  # facts as of the last flush
        self._deliver: Callable[[list[_Request]], None] = lambda batch: None
        # A daemon: a process that exits without closing the store must not hang on this
        # thread's queue. Nothing is lost: a write is acknowledged only after its COMMIT,
        # and an unfinished one rolls back (WAL) when the database is opened next.
        self._thread = threading.Thread(
            target=self._run, name="metadata-sqlite-writer", daemon=True
        )

    def start(self, deliver: Callable[[list[_Request]], None]) -> None:
        self._deliver = deliver
        self._thread.start()

    def submit(self, request: _Request) -> None:
        self._queue.put(request)

    def stop(self) -> None:
        """Finish what is queued, then end the thread (blocking: call off the loop)."""
        self._queue.put(_STOP)
        self._thread.join()
        self._conn.close()

    # Everything below runs on the writer thread.

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch: list[_Request] = []
            while item is not _STOP:
                assert isinstance(item, _Request)
                batch.append(item)
                if len(batch) >= limits.METADATA_GROUP_COMMIT_OPS_MAX:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._commit_batch(batch)
                self._loop.call_soon_threadsafe(self._deliver, batch)
            if item is _STOP:
                return

    def _commit_batch(self, batch: list[_Request]) -> None:
        start_revision = self.revision
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            self._prefetch(batch)
            for request in batch:
                self._apply_one(request)
            self._flush()
            if self.revision != start_revision:
                self._auto_compact()
                self._conn.execute("UPDATE meta SET rev = ?", (self.revision,))
            self._conn.execute("COMMIT")
        except sqlite3.Error as err:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            self._staged_rows.clear()
            self._staged_log.clear()
            self._prefetched.clear()
            self.revision = start_revision
            for request in batch:
                request.events = []
                request.error = MetadataUnavailable(f"sqlite commit failed: {err}")

    def _apply_one(self, request: _Request) -> None:
        revision = self.revision
        if not request.staged:
            self._flush()
            self._conn.execute("SAVEPOINT request")
        try:
            request.outcome = request.apply(request)
            if not request.staged:
                self._conn.execute("RELEASE request")
        except sqlite3.Error:
            raise  # the database itself failed: the whole batch fails
        except Exception as err:
            # A failed condition (or a bug) undoes only this request, never its batch.
            if not request.staged:
                self._conn.execute("ROLLBACK TO request")
                self._conn.execute("RELEASE request")
            self.revision = revision
            request.events = []
            request.error = err

    def _flush(self) -> None:
        deleted = [key for key, row in self._staged_rows.items() if row is None]
        written = [row for row in self._staged_rows.values() if row is not None]
        for chunk in _chunks(deleted):
            self._conn.execute(f"DELETE FROM kv WHERE key IN ({','.join('?' * len(chunk))})", chunk)
        self._insert("INSERT OR REPLACE INTO kv", written)
        self._insert("INSERT INTO changelog", self._staged_log)
        self._staged_rows.clear()
        self._staged_log.clear()
        # What was prefetched is stale once staged rows reach the table.
        self._prefetched.clear()

    def _insert(self, head: str, rows: Sequence[tuple[object, ...]]) -> None:
        """``rows`` (six columns each) with one multi-row statement per chunk, not one
        ``executemany`` step per row: each step releases and retakes the GIL, and under
        load every retake waits for the event loop's next pause."""
        for chunk in _chunks(rows):
            marks = ",".join([_ROW_MARKS] * len(chunk))
            self._conn.execute(f"{head} VALUES {marks}", [v for row in chunk for v in row])

    def _prefetch(self, batch: list[_Request]) -> None:
        """The facts of every key the batch's commits name, in a few statements instead
        of one per key: each statement is a GIL round trip with the event loop."""
        paths = list(dict.fromkeys(path for request in batch for path in request.paths))
        found = self._prefetched
        for start in range(0, len(paths), _PREFETCH_KEYS_MAX):
            chunk = paths[start : start + _PREFETCH_KEYS_MAX]
            for path in chunk:
                found[path] = (0, 0)
            marks = ",".join("?" * len(chunk))
            # One row (one step, one GIL retake) however many keys are found.
            (rows,) = self._conn.execute(
                "SELECT json_group_array(json_array(key, version, create_rev)) FROM kv"
                f" WHERE key IN ({marks})",
                chunk,
            ).fetchone()
            for key, version, create_revision in json.loads(rows):
                found[key] = (version, create_revision)

    def _auto_compact(self) -> None:
        floor = self.revision - limits.METADATA_CHANGELOG_REVISIONS_MAX + 1
        if floor - self.compact_revision >= AUTO_COMPACT_SLACK_REVISIONS:
            self.compact(floor)

    def _facts(self, path: str) -> tuple[int, int]:
        """(version, create_revision) of ``path`` as of the batch so far; (0, 0) if absent."""
        if path in self._staged_rows:
            row = self._staged_rows[path]
            return (0, 0) if row is None else (row[2], row[3])
        prefetched = self._prefetched.get(path)
        if prefetched is not None:
            return prefetched
        found = self._conn.execute(
            "SELECT version, create_rev FROM kv WHERE key = ?", (path,)
        ).fetchone()
        return (found[0], found[1]) if found else (0, 0)

    # --- operations, called by request.apply on the writer thread --------------------------

    def commit(self, ops: list[Op], request: _Request) -> CommitResult:
        facts = {op.path: self._facts(op.path) for op in ops}
        for op in ops:
            check_condition(op, *facts[op.path])
        for session_id in session_ids(ops):
            if not self._conn.execute(
                "SELECT 1 FROM sessions WHERE id = ?", (session_id,)
            ).fetchone():
                raise SessionExpired(session_id)
        # Conditions hold: from here on nothing can fail, so staging is all or nothing.
        revision = self.revision + 1
        results: list[Stat | bool | None] = []
        for op in ops:
            if isinstance(op, Put):
                version, create_revision = facts[op.path]
                stat = Stat(version + 1, create_revision or revision, revision, op.session_id)
                self._stage(op.path, op.value, stat, request.events)
                results.append(stat)
            elif isinstance(op, Delete):
                exists = facts[op.path][0] > 0
                if exists:
                    self._stage(op.path, b"", None, request.events, revision)
                results.append(exists)
            else:
                results.append(None)
        if request.events:
            self.revision = revision
        return CommitResult(self.revision, results)

    def _stage(
        self,
        path: str,
        value: bytes,
        stat: Stat | None,
        events: list[WatchEvent],
        revision: int = 0,
    ) -> None:
        """Stage a put (``stat`` given) or a delete of ``path`` and its changelog row."""
        if stat is None:
            event = WatchEvent(EventKind.DELETE, path, b"", 0, revision)
            self._staged_rows[path] = None
        else:
            event = WatchEvent(EventKind.PUT, path, value, stat.version, stat.mod_revision)
            self._staged_rows[path] = (
                path,
                value,
                stat.version,
                stat.create_revision,
                stat.mod_revision,
                stat.session_id,
            )
        kind = _KIND_CODES[event.kind]
        self._staged_log.append((event.revision, len(events), path, value, kind, event.version))
        events.append(event)

    def sequential(
        self, prefix: str, value: bytes, session_id: int | None, request: _Request
    ) -> str:
        path = sequential_name(prefix, self.revision + 1)
        self.commit([Put(path, value, 0, session_id)], request)
        return path

    def open_session(self, session_id: int, ttl_s: float) -> None:
        self._conn.execute("INSERT INTO sessions VALUES (?, ?)", (session_id, ttl_s))

    def revoke(self, ids: list[int], request: _Request) -> None:
        marks = ",".join("?" * len(ids))
        keys = [
            row[0]
            for row in self._conn.execute(
                f"SELECT key FROM kv WHERE session IN ({marks}) ORDER BY key", ids
            )
        ]
        self._conn.execute(f"DELETE FROM sessions WHERE id IN ({marks})", ids)
        revision = self.revision + 1
        for key in keys:
            self._stage(key, b"", None, request.events, revision)
        if keys:
            self.revision = revision

    def compact(self, revision: int) -> None:
        if revision > self.revision + 1:
            raise InvalidArgument(f"compact revision {revision} is past {self.revision}")
        self.compact_revision = max(self.compact_revision, revision)
        self._conn.execute("DELETE FROM changelog WHERE rev < ?", (self.compact_revision,))
        self._conn.execute("UPDATE meta SET compact_rev = ?", (self.compact_revision,))


# --- the store ---------------------------------------------------------------------------------


class SqliteMetadataStore:
    """A durable :class:`~anabranch.metadata.api.MetadataStore` in one SQLite file."""

    def __init__(
        self,
        writer: _Writer,
        reader: sqlite3.Connection,
        clock: Clock,
        sessions_found: list[tuple[int, float]],
    ) -> None:
        self._writer = writer
        self._reader = reader
        self._reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metadata-sqlite-reader")
        self._revision: int = writer.revision  # published: every watcher has seen up to here
        self._room = asyncio.Semaphore(limits.METADATA_WRITE_QUEUE_MAX)
        self._sessions = SessionTable(clock, self._expire_sessions)
        self._hub = WatchHub()
        self._closed = False
        writer.start(self._on_committed)
        for session_id, ttl_s in sessions_found:
            self._sessions.adopt(session_id, ttl_s)

    @classmethod
    async def open(
        cls, path: str | Path, *, clock: Clock | None = None, synchronous: str = "FULL"
    ) -> SqliteMetadataStore:
        """Open (creating if needed) the store in the file ``path``.

        ``synchronous="FULL"`` fsyncs every group commit; ``"NORMAL"`` may lose the last
        commits on power loss (never on a process crash).
        """
        if synchronous.upper() not in SYNCHRONOUS_MODES:
            raise InvalidArgument(
                f"synchronous must be one of {SYNCHRONOUS_MODES}: {synchronous!r}"
            )
        db = Path(path)

        def setup() -> tuple[sqlite3.Connection, sqlite3.Connection, list[tuple[int, float]]]:
            writer = _connect(db, synchronous.upper())
            try:
                writer.executescript(_SCHEMA)
                found = writer.execute("SELECT id, ttl FROM sessions").fetchall()
                return writer, _connect(db, synchronous.upper()), found
            except BaseException:
                writer.close()
                raise

        try:
            writer_conn, reader_conn, found = await asyncio.to_thread(setup)
        except sqlite3.Error as err:
            # A damaged, truncated or read-only file: typed, so start-up reports it in a
            # line naming the file rather than as sqlite3's traceback.
            raise MetadataError(f"cannot open metadata store {db}: {err}") from err
        writer = _Writer(writer_conn, asyncio.get_running_loop())
        return cls(writer, reader_conn, clock or SystemClock(), found)

    # --- reads ------------------------------------------------------------------------------

    async def get(self, path: str) -> Record | None:
        validate_path(path)
        row = await self._read(
            lambda c: c.execute(
                f"SELECT {_RECORD_COLUMNS} FROM kv WHERE key = ?", (path,)
            ).fetchone()
        )
        return None if row is None else _record(row)

    async def list_range(self, start: str, end: str, *, limit: int | None = None) -> Page:
        validate_range(start, end)
        return await self._page(start, end, validate_limit(limit))

    async def list_prefix(
        self, prefix: str, *, limit: int | None = None, start_after: str | None = None
    ) -> Page:
        validate_prefix(prefix)
        start = prefix if start_after is None else max(prefix, start_after + "\x00")
        return await self._page(start, prefix_end(prefix), validate_limit(limit))

    async def list_children(self, path: str) -> list[str]:
        below = children_prefix(path)

        def scan(conn: sqlite3.Connection) -> list[str]:
            # Skip-scan: one indexed seek per child (and per child subtree), never the tree.
            names: set[str] = set()
            start, end = below, prefix_end(below)
            while row := conn.execute(
                "SELECT key FROM kv WHERE key >= ? AND key < ? ORDER BY key LIMIT 1", (start, end)
            ).fetchone():
                key: str = row[0]
                name = key[len(below) :].split("/", 1)[0]
                names.add(name)
                start = key + "\x00" if key == below + name else prefix_end(below + name + "/")
            return sorted(names)

        return await self._read(scan, snapshot=True)

    async def current_revision(self) -> int:
        self._check_open()
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
        result = await self._commit_checked(
            [Put(path, value, expected_version, session_id_of(session))]
        )
        stat = result.results[0]
        assert isinstance(stat, Stat)
        return stat

    async def delete(self, path: str, expected_version: int | None = None) -> bool:
        validate_path(path)
        validate_expected_version(expected_version)
        removed = (await self._commit_checked([Delete(path, expected_version)])).results[0]
        assert isinstance(removed, bool)
        return removed

    async def commit(self, ops: Sequence[Op]) -> CommitResult:
        self._check_open()
        return await self._commit_checked(validate_ops(ops))

    async def _commit_checked(self, checked: list[Op]) -> CommitResult:
        """Commit ops that were validated already (put/delete validate their own)."""
        self._check_open()
        for session_id in session_ids(checked):
            await self._sessions.require_alive(session_id)
        return await self._write(
            lambda request: self._writer.commit(checked, request),
            CommitResult,
            paths=tuple(op.path for op in checked),
        )

    async def create_sequential(
        self, prefix: str, value: bytes, *, session: Session | None = None
    ) -> str:
        self._check_open()
        validate_sequential_prefix(prefix)
        value = validate_value(value)
        session_id = session_id_of(session)
        if session_id is not None:
            await self._sessions.require_alive(session_id)
        return await self._write(
            lambda request: self._writer.sequential(prefix, value, session_id, request), str
        )

    async def compact(self, revision: int) -> None:
        """Forget history before ``revision``: watches from older revisions get Compacted."""
        self._check_open()
        validate_revision(revision, "compact revision")
        await self._write(lambda request: self._writer.compact(revision), type(None), staged=False)

    # --- sessions and watches ---------------------------------------------------------------

    async def open_session(self, ttl_s: float, *, auto_keepalive: bool = True) -> StoreSession:
        self._check_open()
        ttl_s = validate_ttl(ttl_s)
        session_id = secrets.randbits(62) + 1
        await self._write(
            lambda request: self._writer.open_session(session_id, ttl_s), type(None), staged=False
        )
        return self._sessions.open(session_id, ttl_s, auto_keepalive=auto_keepalive)

    def watch(
        self, path: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> QueueWatch:
        self._check_open()
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
        await asyncio.to_thread(self._writer.stop)
        await asyncio.get_running_loop().run_in_executor(self._reads, self._reader.close)
        self._reads.shutdown(wait=True)

    # --- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("metadata store closed")

    async def _read(self, query: Callable[[sqlite3.Connection], T], *, snapshot: bool = False) -> T:
        """Run ``query`` on the reader thread (in one read transaction when ``snapshot``)."""
        self._check_open()

        def run() -> T:
            if not snapshot:
                return query(self._reader)
            self._reader.execute("BEGIN")
            try:
                return query(self._reader)
            finally:
                self._reader.execute("COMMIT")

        return await asyncio.get_running_loop().run_in_executor(self._reads, run)

    async def _page(self, start: str, end: str, limit: int) -> Page:
        def scan(conn: sqlite3.Connection) -> Page:
            revision = conn.execute("SELECT rev FROM meta").fetchone()[0]
            rows = conn.execute(
                f"SELECT {_RECORD_COLUMNS} FROM kv WHERE key >= ? AND key < ? ORDER BY key LIMIT ?",
                (start, end, limit + 1),
            ).fetchall()
            return Page(
                [_record(r) for r in rows[:limit]], more=len(rows) > limit, revision=revision
            )

        return await self._read(scan, snapshot=True)

    async def _replay(
        self, path: str, prefix: bool, from_rev: int, to_rev: int
    ) -> list[WatchEvent]:
        low, high = (path, prefix_end(path)) if prefix else (path, path + "\x00")

        def scan(conn: sqlite3.Connection) -> list[WatchEvent]:
            compact_revision = conn.execute("SELECT compact_rev FROM meta").fetchone()[0]
            if from_rev < compact_revision:
                raise Compacted(from_rev, compact_revision)
            rows = conn.execute(
                "SELECT rev, key, value, kind, version FROM changelog"
                " WHERE rev >= ? AND rev <= ? AND key >= ? AND key < ? ORDER BY rev, idx",
                (from_rev, to_rev, low, high),
            )
            return [_event(row) for row in rows]

        return await self._read(scan, snapshot=True)

    async def _write(
        self,
        apply: Callable[[_Request], object],
        result_type: type[T],
        *,
        staged: bool = True,
        paths: tuple[str, ...] = (),
    ) -> T:
        """Queue one write for the writer; return its outcome once it is committed."""
        await self._room.acquire()
        if self._closed:
            self._room.release()
            raise Closed("metadata store closed")
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._writer.submit(_Request(apply, future, staged, paths))
        outcome = await future
        assert isinstance(outcome, result_type)
        return outcome

    def _on_committed(self, batch: list[_Request]) -> None:
        """On the loop, after a COMMIT: resolve the callers, then publish the events.

        Both only schedule callbacks, so whoever runs next finds the events queued at
        every watch either way; resolving first lets a waiting caller (a transaction's
        END_TXN answer) go out before the watchers' work instead of after it.
        """
        for request in batch:
            self._room.release()
            if request.events:
                self._revision = request.events[-1].revision
            if request.future.done():
                continue
            if request.error is not None:
                request.future.set_exception(request.error)
            else:
                request.future.set_result(request.outcome)
        for request in batch:
            if request.events:
                self._hub.publish(request.events)

    async def _expire_sessions(self, ids: list[int]) -> None:
        await self._write(
            lambda request: self._writer.revoke(ids, request), type(None), staged=False
        )
